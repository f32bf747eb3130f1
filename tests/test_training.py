"""Training steps through ``torch.compile(model, backend="spacefusion")``: aot_autograd's forward and backward
ATen graphs, each fused (``frontend.training``), against eager on tiny ``transformers`` models (random weights,
no hub): three SGD steps, the losses and every parameter's gradient compared in float32."""

from __future__ import annotations

import copy
import operator
from collections import Counter
from collections.abc import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

from spacefusion.frontend.dynamo import SpaceFusionBackend  # noqa: E402
from spacefusion.frontend.training import read_aten  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _ids(b: int, s: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 100, (b, s), generator=torch.Generator().manual_seed(seed))


def _model(name: str, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(1)
    T = transformers
    if name == "bert":
        cfg = T.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                           vocab_size=100, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        return T.BertModel(cfg)
    if name == "llama":
        cfg = T.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=100)
        return T.LlamaModel(cfg)
    raise ValueError(name)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids)
    loss = out.last_hidden_state.pow(2).mean()
    pooled = getattr(out, "pooler_output", None)
    return loss + pooled.sum() * 0.1 if pooled is not None else loss  # every parameter gets a gradient


def _train(model: torch.nn.Module, run: Callable[..., object], steps: int = 3, seed: int | None = None,
           device: str = "cpu") -> list[tuple]:
    """``steps`` SGD steps of ``run`` (``model`` or its compiled form): each step's loss and gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for i in range(steps):
        opt.zero_grad()
        if seed is not None:
            torch.manual_seed(seed + i)
        loss = _loss(run, _ids(2, 16, seed=2 + i).to(device))
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return out


def _compare(got: list[tuple], want: list[tuple], rtol: float = 1e-4, atol: float = 1e-6) -> float:
    """Each step's loss (to ``rtol / 10``) and every gradient (to ``rtol``, ``atol``) against eager's; returns
    the largest gradient difference."""
    worst = 0.0
    for (gl, gg), (wl, wg) in zip(got, want, strict=True):
        torch.testing.assert_close(gl, wl, rtol=rtol / 10, atol=atol)
        assert gg.keys() == wg.keys()
        for name, w in wg.items():
            torch.testing.assert_close(gg[name], w, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
            worst = max(worst, (gg[name] - w).abs().max().item())
    return worst


def _kinds(report: object) -> Counter:
    return report.partition.counts() if report is not None and report.partition is not None else Counter()


@pytest.mark.parametrize("name,target", [("bert", "reference"), ("llama", "reference"), ("bert", "llvm"),
                                         ("llama", "llvm")])
def test_training_steps_match_eager(name: str, target: str) -> None:
    model = _model(name)
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend(target)
    got = _train(model, torch.compile(model, backend=backend, dynamic=False))
    _compare(got, _train(eager, eager))
    assert len(backend.graphs) == 1, str(backend)
    graph = backend.graphs[0]
    fw, bw = graph.forward, graph.backward
    assert fw is not None and bw is not None and not fw.skipped and not bw.skipped, str(backend)
    # the forward's GEMMs of weights fused (Q/K/V stacked), the backward's input gradients (grad @ W) too
    assert sum(n for k, n in _kinds(fw).items() if "gemm" in k) >= 3, str(backend)
    assert _kinds(fw)["stacked_gemm"] >= 1, str(backend)
    assert _kinds(bw)["gemm"] >= 4, str(backend)
    # every weight gradient grad.T @ x (7 linears: Q, K, V, O, up, down, and BERT's pooler or LLaMA's gate) is
    # one GEMM of two values, BERT's with its bias gradient grad.sum(0) as a second output
    wgrads = [s for s in bw.partition.subgraphs if s.kind == "weight_gradient"]
    assert len(wgrads) == 7, str(backend)
    assert sum("+ bias gradient" in s.label for s in wgrads) == (7 if name == "bert" else 0), str(backend)
    assert not bw.partition.left_codes()["left.value_gemm"], str(backend)
    # each SGD step wrote the weights in place: both graphs read them again, neither partitioned again
    assert fw.rebuilds == bw.rebuilds == 0, str(backend)
    assert fw.refreshes == bw.refreshes == 2 and fw.operands_refreshed and bw.operands_refreshed, str(backend)
    # torch's attention backward replaced by the kernels derived from the attention SMG, fed torch's O and LSE
    # (BERT's three LayerNorm backwards follow it: ``test_training_norm_backward``)
    assert sum("attention backward" in line for line in bw.derived) == 1, str(backend)
    assert "attention backward" in bw.derived[0], str(backend)
    assert "3 kernels (Delta, dQ, dK_dV)" in bw.derived[0] and ("causal" in bw.derived[0]) == (name == "llama")
    assert not any("attention" in op.op for op in bw.partition.left), str(backend)
    # the forward's attention fused too, saving its LSE for the derived backward (BERT's bidirectional, LLaMA's
    # causal on 4 query heads over 2 KV heads), on the split_heads memory torch's op reads
    (att,) = [s for s in fw.partition.subgraphs if s.kind == "attention"]
    assert "+ LSE saved" in att.label and "bshd" in att.label, att.label
    assert ("causal" in att.label, "h4/2" in att.label) == ((name == "llama",) * 2), att.label
    assert not any("attention" in op.op for op in fw.partition.left), str(backend)
    text = str(backend)
    assert "forward (" in text and "backward (" in text and "weight gradient grad.T @ x" in text, text
    assert "left.saved_lse" not in text and "left.backward_op" in text and "derived from the SMG" in text, text


def test_padded_bert_fuses_its_masked_attention_and_derives_its_backward() -> None:
    """BERT with a padding ``attention_mask`` (the second sequence's last 5 tokens): the forward's attention
    is fused with the mask as a score mod and saves its LSE; the backward is derived with the mask too
    (``derived_masks``: the row statistics recomputed in two parts), and every gradient is eager's."""
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0

    def masked(run: torch.nn.Module) -> Callable[..., object]:
        return lambda input_ids: run(input_ids=input_ids, attention_mask=mask)

    model = _model("bert")
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend("reference")
    got = _train(model, masked(torch.compile(model, backend=backend, dynamic=False)))
    _compare(got, _train(eager, masked(eager)))
    fw, bw = backend.graphs[0].forward, backend.graphs[0].backward
    (att,) = [s for s in fw.partition.subgraphs if s.kind == "attention"]
    assert "+ LSE saved" in att.label and "+ bias" in att.label, att.label
    assert sum("attention backward" in line for line in bw.derived) == 1, str(backend)
    assert " masked: the derived forward" in bw.derived[0], str(backend)
    assert not bw.partition.left_codes()["left.derived_backward"], str(backend)


def test_an_attention_backward_whose_kernels_cannot_be_built_is_torch_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the derived backward cannot be cut into kernels, torch's attention backward runs, with why."""
    import schedulers.passes

    def refuse(bw: object) -> None:
        raise ValueError("no pass for this test")

    monkeypatch.setattr(schedulers.passes, "backward_passes", refuse)
    model = _model("bert")
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend("reference")
    _compare(_train(model, torch.compile(model, backend=backend, dynamic=False), steps=1),
             _train(eager, eager, steps=1))
    bw = backend.graphs[0].backward
    assert not bw.derived, str(backend)
    left = [op for op in bw.partition.left if op.code == "left.derived_backward"]
    assert left and all("could not be built" in op.reason and "no pass for this test" in op.reason
                        for op in left), str(backend)


def test_saved_values_stay_outputs_of_the_forward() -> None:
    """LLaMA's RMSNorms: the backward reads each one's rsqrt, an intermediate of the norm pattern, so the fused
    norm outputs it (``Rstd``, bound to the rsqrt node: issue 58) and no fused subgraph swallows a saved value
    (``fused._closed`` would leave one to torch: "its internal values are read outside it")."""
    model = _model("llama")
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend("reference")
    _compare(_train(model, torch.compile(model, backend=backend, dynamic=False), steps=1),
             _train(eager, eager, steps=1))
    fw = backend.graphs[0].forward
    saved = [r.node for s in fw.partition.subgraphs for r in s.results if r.space == "Rstd"]
    assert len(saved) == 3 and all(n.startswith("rsqrt") for n in saved), str(backend)
    assert not any("internal values are read outside it" in op.reason for op in fw.partition.left), str(backend)


def train_beside_eager(model: torch.nn.Module, target: str) -> SpaceFusionBackend:
    """Three SGD steps (lr 0.5, loss mean(y^3)) of ``model`` compiled on ``target`` and of an eager copy, on one
    seeded [4, 8, 32] input; every parameter after them within rtol 1e-5 / atol 1e-6 of eager's.  Returns the
    backend, whose graphs' reports the caller checks."""
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend(target)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(4))
    for m, run in ((model, compiled), (eager, eager)):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        for _ in range(3):
            opt.zero_grad()
            run(x).pow(3).mean().backward()
            opt.step()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return backend


def test_a_backward_nothing_matches_still_trains() -> None:
    """A model of norms and activations only: the backward has nothing the table fuses (torch's ATen graph,
    saying why) but its two LayerNorm backwards, derived (the first's input needs no gradient: ``output_mask``
    asks dW and dB only, one pass); the forward only its LayerNorms, with their statistics."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Tanh(), torch.nn.LayerNorm(32))
    backend = train_beside_eager(model, "reference")
    bw = backend.graphs[0].backward
    assert bw is not None and bw.partition is not None and not bw.partition.subgraphs, str(backend)
    assert bw.partition.left_codes()["left.backward_op"] == 1, str(backend)  # tanh's
    # the two norm backwards are the kernels derived from the LayerNorm SMG (``derived_norms``)
    assert [line.split(": ")[-1] for line in bw.derived] == ["2 kernels (dX, dW_dB)", "1 kernel (dW_dB)"], str(backend)
    assert all(line.startswith("layernorm backward 32x32 float32") for line in bw.derived), str(backend)
    # the forward's two LayerNorms are fused, saving the mean and rstd the norm backwards read (issue 58)
    fw = backend.graphs[0].forward
    assert [s.kind for s in fw.partition.subgraphs] == ["norm", "norm"], str(backend)
    assert not fw.partition.left_codes()["left.saved_stats"], str(backend)


def test_dropout_in_training_is_left_to_torch_and_matches_eager() -> None:
    """``model.train()`` with dropout: the random ops run in torch, drawn from torch's generator in eager's
    order, so with one seed the step is eager's; the rest is fused."""
    model = _model("bert", dropout=0.1).train()
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend("reference")
    got = _train(model, torch.compile(model, backend=backend, dynamic=False), steps=2, seed=7)
    _compare(got, _train(eager, eager, steps=2, seed=7))
    fw = backend.graphs[0].forward
    assert fw.partition.left_codes()["left.random"] >= 3, str(backend)
    assert any("dropout" in op.reason for op in fw.partition.left), str(backend)
    assert fw.partition.subgraphs, str(backend)


def test_inference_under_no_grad_is_not_a_training_graph() -> None:
    """Parameters that require grad, called under no_grad: the inference path, one partition, no aot."""
    model = _model("bert").eval()
    backend = SpaceFusionBackend("reference")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=_ids(2, 16)).last_hidden_state,
                                   model(input_ids=_ids(2, 16)).last_hidden_state, rtol=1e-4, atol=1e-4)
    graph = backend.graphs[0]
    assert graph.forward is None and graph.backward is None and graph.partition is not None, str(backend)
    assert _kinds(graph)["attention"] == 1 and _kinds(graph)["residual_norm"] >= 2, str(backend)


def test_read_aten_rewrites_what_autograd_writes() -> None:
    """``addmm(b, x, t(W))`` becomes a linear, ``t(t(W))`` is W, a clone that is returned stays a copy."""
    aten = torch.ops.aten
    g = torch.fx.Graph()
    root = torch.nn.Module()
    root.register_parameter("w", torch.nn.Parameter(torch.randn(3, 4)))
    root.register_parameter("b", torch.nn.Parameter(torch.randn(3)))
    x = g.placeholder("x")
    w, b = g.get_attr("w"), g.get_attr("b")
    y = g.call_function(aten.addmm.default, (b, x, g.call_function(aten.t.default, (w,))))
    tt = g.call_function(aten.t.default, (g.call_function(aten.t.default, (w,)),))
    back = g.call_function(aten.mm.default, (y, tt))
    kept = g.call_function(aten.clone.default, (back,))
    g.output((kept, y))
    gm = torch.fx.GraphModule(root, g)
    xs = torch.randn(5, 4)
    want = gm(xs)
    read_aten(gm)
    targets = [n.target for n in gm.graph.nodes if n.op != "placeholder"]
    assert torch._C._nn.linear in targets and aten.addmm.default not in targets, gm.graph
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    assert mm.args[1].op == "get_attr", gm.graph  # t(t(W)) read as W: the linear matcher's x @ W
    assert aten.clone.default in targets, gm.graph  # returned: not made an alias
    for a, b_ in zip(gm(xs), want):
        torch.testing.assert_close(a, b_)


def _flash_graph(args: tuple[torch.Tensor, ...], dropout: float, causal: bool, scale: float) -> torch.fx.GraphModule:
    """torch's CPU flash attention of ``args`` (q, k, v[, an additive mask]) as a training forward holds it:
    the op, its two ``getitem``s, both returned."""
    g = torch.fx.Graph()
    q, k, v, *mask = (g.placeholder(n) for n in ("q", "k", "v", "mask")[:len(args)])
    kwargs = {"scale": scale} | ({"attn_mask": mask[0]} if mask else {})
    att = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                          (q, k, v, dropout, causal), kwargs)
    g.output(tuple(g.call_function(operator.getitem, (att, i)) for i in (0, 1)))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("form,target", [("bshd causal gqa", "reference"), ("bhsd", "reference"),
                                         ("bshd mask", "reference"), ("bshd causal gqa", "llvm")])
def test_the_fused_forward_s_lse_is_torch_s_logsumexp(form: str, target: str) -> None:
    """The ``attention_lse`` row's kernel against torch's op on the same inputs: O, and the LSE the backward
    reads, equal torch's values and strides (torch's logsumexp lies as [b, m, heads]; its out as q lies).
    Forms: split_heads operands ([b, s, h, d] memory) with a causal mask on 4 query heads over 2 KV heads,
    packed [b, h, s, d] operands (the LSE copied into torch's strides), and an additive padding mask."""
    from spacefusion.frontend.capture import Captured
    from spacefusion.frontend.compiled import propagate_shapes
    from spacefusion.frontend.fused import fuse_captured

    gen = torch.Generator().manual_seed(11)
    b, h, hk, m, d = 2, 4, 2 if "gqa" in form else 4, 12, 16

    def operand(heads: int) -> torch.Tensor:
        if "bshd" in form:  # HF's split_heads view of a projection
            return torch.randn(b, m, heads, d, generator=gen).transpose(1, 2)
        return torch.randn(b, heads, m, d, generator=gen)

    args = (operand(h), operand(hk), operand(hk))
    if "mask" in form:
        mask = torch.zeros(b, 1, m, m)
        mask[1, ..., 8:] = torch.finfo(torch.float32).min
        args += (mask,)
    gm = _flash_graph(args, 0.0, "causal" in form, 0.3)
    want = gm(*args)
    assert read_aten(gm) == 0  # its logsumexp is read: left whole, for the row
    propagate_shapes(gm, args)
    fused = fuse_captured(Captured(gm, args), target)
    (sub,) = fused.partition.subgraphs
    assert sub.kind == "attention" and "+ LSE saved" in sub.label, fused.partition
    assert ("bshd" in sub.label) == ("bshd" in form), sub.label
    got = fused(*args)
    for name, g_, w in zip(("out", "logsumexp"), got, want, strict=True):
        assert g_.shape == w.shape and g_.stride() == w.stride(), (name, g_.stride(), w.stride())
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-5, msg=lambda s, n=name: f"{n}: {s}")
    assert want[1].stride() == (m * h, 1, h)  # what the copy (bhsd) or the bshd view must match


def test_attention_with_dropout_whose_lse_is_saved_is_left_to_torch_with_why() -> None:
    """The row refuses what the pattern cannot express (here dropout: random), with its code."""
    from spacefusion.frontend.compiled import propagate_shapes
    from spacefusion.frontend.partition import partition

    args = tuple(torch.randn(1, 2, 8, 8) for _ in range(3))
    gm = _flash_graph(args, 0.1, False, 0.5)
    propagate_shapes(gm, args)
    part = partition(gm)
    assert not part.subgraphs, part
    (op,) = [op for op in part.left if op.code == "attention.dropout"]
    assert "dropout" in op.reason and "flash_attention_for_cpu" in op.op, part


class _Counting:
    """Counts the calls of ``fused.partition`` and of ``FusedKernel`` builds (each partition of a graph, each
    kernel operand set derived from scratch), so a test can say none happened over some steps."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import spacefusion.frontend.fused as fused

        self.partitions = self.kernels = 0
        partition, init = fused.partition, fused.FusedKernel.__init__

        def counted_partition(*args: object, **kwargs: object) -> object:
            self.partitions += 1
            return partition(*args, **kwargs)

        def counted_init(kernel: object, *args: object, **kwargs: object) -> None:
            self.kernels += 1
            init(kernel, *args, **kwargs)

        monkeypatch.setattr(fused, "partition", counted_partition)
        monkeypatch.setattr(fused.FusedKernel, "__init__", counted_init)

    def now(self) -> tuple[int, int]:
        return self.partitions, self.kernels


@pytest.mark.parametrize("name,target", [("bert", "llvm"), ("llama", "reference")])
def test_optimiser_steps_after_warm_up_do_not_partition_again(name: str, target: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first step built both graphs, N SGD steps (each writing every weight in place) partition
    nothing and build no kernel: each call reads its weights again (``CompiledGraph._refresh``); losses and
    gradients stay eager's over every step."""
    counts = _Counting(monkeypatch)
    model = _model(name)
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend(target)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    opt, opt_e = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    got, want, warm = [], [], None
    steps = 5
    for i in range(steps):
        for m, run, o, out in ((model, compiled, opt, got), (eager, eager, opt_e, want)):
            o.zero_grad()
            loss = _loss(run, _ids(2, 16, seed=2 + i))
            loss.backward()
            out.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
            o.step()
        if i == 0:
            warm = counts.now()
            assert warm[0] == 2 and warm[1] > 0, warm  # the forward's and the backward's partition, built once
    _compare(got, want)
    assert counts.now() == warm, f"{steps - 1} steps after warm-up: (partitions, kernels) {warm} -> {counts.now()}"
    fw, bw = backend.graphs[0].forward, backend.graphs[0].backward
    assert fw.rebuilds == bw.rebuilds == 0, str(backend)
    assert fw.refreshes == bw.refreshes == steps - 1, str(backend)
    assert "written in place" in fw.refreshed and "without a new partition" in str(backend), str(backend)


def test_weights_edited_through_data_between_steps_give_eager_s_gradients() -> None:
    """Weights written through ``.data`` between steps (no optimiser: nothing moves their version): a stacked
    Q/K/V operand's, a GEMM's whose buffer is a copy, an embedding torch runs, and one whose storage is
    replaced (``.data = t``).  Each following step's loss and gradients are eager's on the edited weights."""
    model = _model("bert")
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend("reference")
    compiled = torch.compile(model, backend=backend, dynamic=False)

    def edit(m: torch.nn.Module, i: int) -> None:
        layer = m.encoder.layer[0]
        layer.attention.self.value.weight.data.mul_(0.5 + 0.1 * i)
        layer.output.dense.weight.data.add_(0.05)
        m.embeddings.word_embeddings.weight.data.mul_(1.5)
        w = layer.intermediate.dense.weight
        w.data = w.data.flip(0).contiguous()  # other storage, other values

    got, want = [], []
    for i in range(3):
        for m, run, out in ((model, compiled, got), (eager, eager, want)):
            m.zero_grad()
            loss = _loss(run, _ids(2, 16, seed=5 + i))
            loss.backward()
            out.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
            edit(m, i)
    _compare(got, want)
    fw, bw = backend.graphs[0].forward, backend.graphs[0].backward
    assert fw.rebuilds == bw.rebuilds == 0 and fw.refreshes == bw.refreshes == 2, str(backend)
    assert ".data was read or set" in fw.refreshed, str(backend)


@pytest.mark.cuda
def test_training_steps_on_gpu_kernels(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny BERT trained on the GPU in float32 with the "cuda" target (TVM builds each first pick, the runtime
    launches it): three SGD steps, losses and every gradient against eager on the GPU.  Fused: the forward's
    GEMMs (Q/K/V stacked) and the backward's input gradients ``grad @ W``.  cuBLAS's: the weight gradients
    ``grad.T @ x`` (``CudaBackend.library_first``).  torch's: the GPU attention
    forward and backward (efficient / flash SDPA: their saved statistics are not the derived backward's),
    the norms' backward (their float32 forward is fused with its mean and rstd: row ``norm_stats``), GELU's
    backward, embeddings."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # eager in float32, as the kernels
    model = _model("bert").cuda()
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend("cuda", measure=False)
    got = _train(model, torch.compile(model, backend=backend, dynamic=False), device="cuda")
    # float32 sums in another order than cuBLAS's: a few ulps of the gradients' scale apart
    worst = _compare(got, _train(eager, eager, device="cuda"), rtol=1e-3, atol=1e-5)
    assert len(backend.graphs) == 1, str(backend)
    fw, bw = backend.graphs[0].forward, backend.graphs[0].backward
    assert fw is not None and bw is not None and not fw.skipped and not bw.skipped, str(backend)
    assert _kinds(fw)["stacked_gemm"] >= 1 and _kinds(bw)["gemm"] >= 4, str(backend)
    # the weight gradients stay with cuBLAS on the GPU (``CudaBackend.library_first``), each said so
    assert not [s for s in bw.partition.subgraphs if s.kind == "weight_gradient"], str(backend)
    assert bw.partition.left_codes()["library.first"] >= 7, str(backend)
    assert fw.rebuilds == bw.rebuilds == 0 and fw.refreshes == bw.refreshes == 2, str(backend)
    print(f"worst gradient difference {worst:.3g}\n{backend}")  # what ran where, for the GPU round's notes
