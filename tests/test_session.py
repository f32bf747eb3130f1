"""A user's session through the Dynamo backend (issue 55): torch.compile's defaults across input shapes,
weights written every way torch allows, buffers written in ``forward``, several models in one process, and
graphs where nothing fuses.  Each checked against eager on the CPU targets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spacefusion
from spacefusion.frontend.dynamo import SpaceFusionBackend

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _bert(layers: int = 2, hidden: int = 64) -> torch.nn.Module:
    torch.manual_seed(1)
    cfg = transformers.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                                  intermediate_size=2 * hidden, vocab_size=100)
    return transformers.BertModel(cfg).eval()


def _ids(b: int, s: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 100, (b, s), generator=torch.Generator().manual_seed(seed))


def _check(model: torch.nn.Module, compiled, **kw) -> None:
    with torch.no_grad():
        torch.testing.assert_close(compiled(**kw).last_hidden_state, model(**kw).last_hidden_state,
                                   rtol=1e-4, atol=1e-4)


def _gemms(partition) -> int:
    return sum(n for kind, n in partition.counts().items() if "gemm" in kind)


def test_every_length_stays_fused_under_torch_defaults() -> None:
    """The issue's loop in small: the second length makes Dynamo recompile with symbolic sizes; every call,
    the first length's again included, runs fused kernels of its own sizes."""
    model = _bert()
    backend = SpaceFusionBackend("reference")
    compiled = torch.compile(model, backend=backend)  # torch's defaults: automatic dynamic shapes
    for s in (16, 24, 16, 32, 24, 16, 32):
        _check(model, compiled, input_ids=_ids(2, s))
    # the graphs share the weights: building one must not make the others derive their constants again
    # (a ping-pong of rebuilds on every call, each as slow as a compile)
    built = [r for g in backend.graphs for r in (g.shapes.values() if g.shapes else [g])]
    assert len(built) == 4 and not any(r.rebuilds for r in built), str(backend)
    dynamic = [g for g in backend.graphs if g.shapes]
    assert len(dynamic) == 1, str(backend)
    sizes = dynamic[0].shapes
    assert len(sizes) == 3 and all("s" in k for k in sizes), str(backend)  # 24, 16, 32: each once
    for report in sizes.values():
        counts = report.partition.counts()
        assert counts["attention"] == 2 and _gemms(report.partition) >= 9 and not report.skipped, str(report)
    # the kernels are those of each call's sizes: the attention of 32 tokens has its own SMG
    labels = [s.label for r in sizes.values() for s in r.partition.subgraphs if s.kind == "attention"]
    assert any("32x32" in label for label in labels) and any("24x24" in label for label in labels), labels


def test_dynamic_true_is_fused_per_shape() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU()).eval()
    backend = SpaceFusionBackend("reference")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for rows in (8, 12, 8):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(compiled(x), model(x))
    (graph,) = backend.graphs
    assert len(graph.shapes) == 2 and all(r.partition.counts()["gemm"] == 1 for r in graph.shapes.values()), \
        str(backend)
    assert "symbolic sizes, specialised to 2" in str(backend)


class _Scaled(torch.nn.Module):
    """Sizes used as values: ``x.view(b, s, h, -1)`` and a scale from ``x.size(-1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = torch.relu(self.lin(x)).view(b, s, 4, -1)
        return y * (1.0 / y.size(-1)) + s


@settings(max_examples=5, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 9)), min_size=2, max_size=4))
def test_symbolic_sizes_used_as_values_are_specialised(shapes: list[tuple[int, int]]) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Scaled().eval()
    backend = SpaceFusionBackend("reference")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for b, s in shapes:
            x = torch.randn(b, s, 16, generator=torch.Generator().manual_seed(b * 10 + s))
            torch.testing.assert_close(compiled(x), model(x))
    # Dynamo specialises sizes 0 and 1 even with dynamic=True (a graph of their own): across the graphs,
    # each distinct shape was built once, and every build fused the linear
    built = [r for g in backend.graphs for r in (g.shapes.values() if g.shapes else [g])]
    assert len(built) == len(set(shapes)), str(backend)
    assert all(r.partition.counts().get("gemm", 0) == 1 for r in built), str(backend)


def test_several_models_in_one_process_are_all_fused() -> None:
    """``transformers`` sends every model's forward through one wrapper: the second and third model make
    Dynamo recompile it with dynamic sizes; each stays fused."""
    backends = []
    for hidden, seq in ((64, 16), (32, 12), (64, 20)):
        model = _bert(layers=1, hidden=hidden)
        backend = SpaceFusionBackend("reference")
        backends.append(backend)
        _check(model, torch.compile(model, backend=backend), input_ids=_ids(2, seq))
    for backend in backends:
        assert backend.partitions and all(p.counts()["attention"] == 1 for p in backend.partitions), str(backend)


def _fused_gemms(compiled) -> int:
    return _gemms(compiled.spacefusion.partitions[-1])


@pytest.mark.parametrize("write", [".data.mul_", ".data.copy_", ".data =", "load_state_dict", "new Parameter",
                                   "no_grad mul_"])
def test_no_weight_write_leaves_a_stale_result(write: str) -> None:
    """Every way of writing a weight is seen on the next call, and the rebuild bakes as much as the first
    build (the placeholders' sources are kept from the first compile)."""
    model = _bert()
    compiled = spacefusion.compile(model, target="reference")
    kw = {"input_ids": _ids(2, 16)}
    _check(model, compiled, **kw)
    first = _fused_gemms(compiled)
    w = model.encoder.layer[0].intermediate.dense.weight
    if write == ".data.mul_":
        w.data.mul_(-2.0)
    elif write == ".data.copy_":
        w.data.copy_(torch.randn(w.shape))
    elif write == ".data =":
        w.data = torch.randn(w.shape)
    elif write == "load_state_dict":
        model.load_state_dict({k: v + 0.05 for k, v in model.state_dict().items()})
    elif write == "new Parameter":
        model.encoder.layer[0].intermediate.dense.weight = torch.nn.Parameter(torch.randn(w.shape))
    else:
        with torch.no_grad():
            w.mul_(3.0)
    _check(model, compiled, **kw)
    assert _fused_gemms(compiled) == first
    (graph,) = compiled.spacefusion.graphs
    assert graph.rebuilds == 1, str(graph)


class _Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return torch.relu(self.lin(x)) + self.steps


def test_a_buffer_written_in_forward_is_written_as_eager_writes_it() -> None:
    model, twin = _Counter().eval(), _Counter().eval()
    twin.load_state_dict(model.state_dict())
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            torch.testing.assert_close(compiled(x), twin(x))
    assert model.steps.item() == twin.steps.item() == 3
    assert compiled.spacefusion.partitions[0].counts()["gemm"] == 1


def test_train_mode_batchnorm_counts_each_call_once() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).train()
    twin = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).train()
    twin.load_state_dict(model.state_dict())
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        for i in range(2):
            x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(compiled(x), twin(x))
    assert model[1].num_batches_tracked.item() == twin[1].num_batches_tracked.item() == 2
    torch.testing.assert_close(model[1].running_mean, twin[1].running_mean)


def test_a_graph_with_nothing_fused_is_torchs_own() -> None:
    """Nothing fusable (grouped convs, neither one group nor depthwise): the backend returns Dynamo's graph
    itself, so it costs what torch costs; the report says why each op was left."""
    model = torch.nn.Sequential(*[torch.nn.Conv2d(8, 8, 3, padding=1, groups=2) for _ in range(3)]).eval()
    backend = SpaceFusionBackend("llvm")
    returned = []

    def spy(gm, example_inputs):
        fn = backend(gm, example_inputs)
        returned.append((fn, gm))
        return fn

    compiled = torch.compile(model, backend=spy, dynamic=False)
    x = torch.randn(1, 8, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    ((fn, gm),) = returned
    assert getattr(fn, "__self__", None) is gm and backend.compiled[0].plain
    assert "a grouped convolution" in str(backend)


def test_t5_with_an_all_padding_row_gives_eagers_mean_of_v() -> None:
    """T5's mask is a float bias: a row of all padding gets a uniform softmax in eager (the mean of V), not
    SDPA's boolean rule (0)."""
    torch.manual_seed(1)
    cfg = transformers.T5Config(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2, vocab_size=100)
    model = transformers.T5EncoderModel(cfg).eval()
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1] = 0
    compiled = spacefusion.compile(model, target="reference")
    _check(model, compiled, input_ids=_ids(2, 16), attention_mask=mask)
    assert compiled.spacefusion.partitions[0].counts()["attention"] == 2, str(compiled.spacefusion)


class _UpChain(torch.nn.Module):
    """The source documents' neural renderer block: nearest upsample, 3x3 conv, GroupNorm, SiLU."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.up = torch.nn.Upsample(scale_factor=2, mode="nearest")
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1)
        self.norm = torch.nn.GroupNorm(8, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(self.norm(self.conv(self.up(x))))


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_upsample_conv_groupnorm_chain_compiles_and_matches(target: str) -> None:
    """The conv fused with its upsampling, read channels-last by the GroupNorm: no copy put inside it."""
    from spacefusion.frontend.fused import fuse

    torch.manual_seed(0)
    model = _UpChain().eval()
    x = torch.randn(2, 32, 12, 12)
    with torch.no_grad():
        compiled = spacefusion.compile(model, target=target)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fuse(model, x, backend=target)(x), model(x), rtol=1e-4, atol=1e-4)
    labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
    assert any("upsample x2" in label for label in labels) and any("group_norm" in label for label in labels), labels


@pytest.mark.parametrize("batch,h,w", [(1, 24, 24), (2, 16, 24)])
def test_unet_at_latents_whose_upsampling_is_fused(batch: int, h: int, w: int) -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=8, out_channels=8, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8).eval()
    x, t, text = torch.randn(batch, 8, h, w), torch.tensor([10] * batch), torch.randn(batch, 7, 32)
    with torch.no_grad():
        ref = unet(x, t, encoder_hidden_states=text).sample
        compiled = spacefusion.compile(unet, target="reference")
        got = compiled(x, t, encoder_hidden_states=text).sample
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
    assert any("upsample x2" in label for label in labels), labels


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_lengths_on_gpu_kernels_are_fused_and_replayed(mode: str | None, tmp_path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 on the GPU, torch's defaults: each length's specialisation is built, fused and replayed as one CUDA
    graph; the outputs are eager fp16's within what eager itself is off from float32 (a few times that)."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    model = _bert().cuda()
    lengths = (16, 24, 16, 40)
    inputs = [_ids(2, s).cuda() for s in lengths]
    with torch.no_grad():
        exact = [model(input_ids=x).last_hidden_state for x in inputs]
        model.half()
        eager = [model(input_ids=x).last_hidden_state for x in inputs]
        compiled = spacefusion.compile(model, mode=mode, measure=False)
        got = [compiled(input_ids=x).last_hidden_state.clone() for x in inputs]
    report = compiled.spacefusion
    (dynamic,) = [g for g in report.graphs if g.shapes]
    assert len(dynamic.shapes) == 3, str(report)  # 24, 16 (Dynamo tries the newest graph first), 40
    built = [r for g in report.graphs for r in (g.shapes.values() if g.shapes else [g])]
    assert all(r.replayed and not r.skipped and not r.rebuilds for r in built), str(report)
    assert all(r.partition.counts()["attention"] == 2 for r in built), str(report)
    for e, g, x in zip(eager, got, exact):
        err, base = (g.float() - x).abs().max().item(), (e.float() - x).abs().max().item()
        assert err <= 4 * base + 1e-3, (err, base)


class _BrokenLayer(torch.nn.Module):
    """A graph break inside the layer: Dynamo compiles each half once and calls it with every layer's weights."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return torch.relu(self.b(y)) + x


def test_one_graph_serving_every_layers_weights_keeps_a_build_per_layer() -> None:
    torch.manual_seed(0)
    layers = 4
    model = torch.nn.Sequential(*[_BrokenLayer() for _ in range(layers)]).eval()
    compiled = spacefusion.compile(model, target="reference")
    x = torch.randn(8, 32)
    rebuilds = []
    with torch.no_grad():
        for _ in range(5):
            torch.testing.assert_close(compiled(x), model(x))
            rebuilds.append(sum(g.rebuilds for g in compiled.spacefusion.graphs))
    # each half: the other layers built on the first call, every layer once more on the second (its weights
    # came back), then found: no rebuild from the third call on
    halves = [g for g in compiled.spacefusion.graphs if g.partition and g.partition.counts().get("gemm")]
    assert len(halves) == 2, str(compiled.spacefusion)
    assert rebuilds[2:] == [rebuilds[1]] * 3 and rebuilds[1] == len(halves) * (2 * layers - 1), rebuilds


def test_weights_replaced_for_good_are_not_kept_alive() -> None:
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).eval()
    compiled = spacefusion.compile(model, target="reference")
    x = torch.randn(4, 16)
    old = []
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(compiled(x), model(x))
            old.append(weakref.ref(model[0].weight))
            model[0].weight = torch.nn.Parameter(torch.randn(16, 16))
        torch.testing.assert_close(compiled(x), model(x))
    gc.collect()
    assert all(r() is None for r in old[:-1]), "a replaced weight is still held"
    assert not compiled.spacefusion.compiled[0].builds


def test_a_rebuild_that_fails_leaves_the_graph_to_torch_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight change whose rebuild cannot be fused (a failure injected into the partition) runs Dynamo's
    graph from then on: the output is eager's and the report says why, no exception reaches the caller."""
    import spacefusion.frontend.compiled as compiled_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).eval()
    compiled = spacefusion.compile(model, target="reference")
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))

        def broken(*_a, **_k):
            raise RuntimeError("injected")

        monkeypatch.setattr(compiled_module, "fuse_captured", broken)
        model[0].weight.mul_(-1.0)
        torch.testing.assert_close(compiled(x), model(x))
        model[0].weight.mul_(3.0)  # read as an input by torch's graph: never stale
        torch.testing.assert_close(compiled(x), model(x))
    (graph,) = compiled.spacefusion.graphs
    assert "rebuild after a weight change failed" in graph.skipped and "injected" in graph.skipped, str(graph)


def test_the_string_backend_reports_through_spacefusion_report_and_logging(caplog: pytest.LogCaptureFixture) -> None:
    """``torch.compile(model, backend="spacefusion")`` gives no handle on its backend: ``spacefusion.report()``
    prints what every backend of the process fused (each set of sizes too), and each graph's report goes to
    the ``spacefusion`` logger as it is compiled."""
    import logging

    model = _bert(layers=1)
    compiled = torch.compile(model, backend="spacefusion", options={"target": "reference"})
    with caplog.at_level(logging.INFO, logger="spacefusion"):
        for s in (16, 24):
            _check(model, compiled, input_ids=_ids(2, s))
    text = spacefusion.report()
    assert "attention b2 h2/2 16x16" in text and "attention b2 h2/2 24x24" in text, text
    assert "symbolic sizes, specialised to 1 set(s) of sizes" in text
    logged = [r.getMessage() for r in caplog.records if r.name == "spacefusion"]
    assert len(logged) == 2 and "16x16" in logged[0] and "sizes [" in logged[1] and "24x24" in logged[1], logged
    del compiled
    torch._dynamo.reset()
    import gc

    gc.collect()  # the backends are held weakly: with their compiled graphs gone, nothing is reported
    assert "attention b2 h2/2 16x16" not in spacefusion.report()
