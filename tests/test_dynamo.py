"""TorchDynamo capture of real ``transformers`` models (tiny configs, random weights, no hub) against eager.

``spacefusion.compile`` / ``torch.compile(backend="spacefusion")`` on the CPU backends: the reference
backend evaluates each fused SMG in float64 numpy (a check of the partition and of every mapping), llvm
builds the kernels with TVM.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import spacefusion  # noqa: E402
from spacefusion.frontend.dynamo import SpaceFusionBackend  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _ids(b: int, s: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 100, (b, s), generator=torch.Generator().manual_seed(seed))


def _model(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    T = transformers
    if name == "bert_padding":
        cfg = T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                           vocab_size=100)
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 11:] = 0
        return T.BertModel(cfg), {"input_ids": _ids(2, 16), "attention_mask": mask}
    if name == "albert":
        cfg = T.AlbertConfig(hidden_size=64, embedding_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=128, vocab_size=100)
        return T.AlbertModel(cfg), {"input_ids": _ids(2, 16)}
    if name == "t5_encoder":
        cfg = T.T5Config(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2, vocab_size=100)
        return T.T5EncoderModel(cfg), {"input_ids": _ids(2, 16)}
    if name == "vit":
        cfg = T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                          image_size=32, patch_size=8)
        return T.ViTModel(cfg), {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))}
    if name == "gpt2":
        cfg = T.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0,
                           eos_token_id=0)
        return T.GPT2Model(cfg), {"input_ids": _ids(2, 16)}
    if name == "llama_gqa":
        cfg = T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=100)
        return T.LlamaModel(cfg), {"input_ids": _ids(1, 16)}
    if name == "mistral_window":
        cfg = T.MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128, vocab_size=100, sliding_window=8)
        return T.MistralModel(cfg), {"input_ids": _ids(1, 16)}
    if name == "gemma2_softcap":  # HF runs Gemma-2 through eager attention: SDPA takes no soft-cap
        cfg = T.Gemma2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, intermediate_size=128, vocab_size=100, sliding_window=8,
                             attn_logit_softcapping=30.0, final_logit_softcapping=None, query_pre_attn_scalar=16)
        return T.Gemma2Model(cfg), {"input_ids": _ids(1, 16)}
    raise ValueError(name)


#: what each model must get fused at least (kind: count), and a reason that must name what is left.  A pre-norm
#: model's RMSNorms read only by linears are those GEMMs' prologues (``norm_*``: T5's q/k/v and FFN input, LLaMA's
#: and Mistral's q, k/v and gate/up; Gemma-2's first only: its others follow a norm's output, not a linear's)
EXPECT = {
    # the embeddings' norm takes their gathers (``frontend.embeddings``): BERT's and GPT-2's first norm
    "bert_padding": ({"attention": 2, "stacked_gemm": 2, "gemm": 7, "residual_norm": 4, "embedding_norm": 1}, None),
    "albert": ({"attention": 2, "stacked_gemm": 2, "gemm": 7, "residual_norm": 4}, None),
    "t5_encoder": ({"attention": 2, "norm_stacked_gemm": 2, "norm_gemm": 2, "gemm": 4, "residual_norm": 1}, None),
    "vit": ({"attention": 2, "stacked_gemm": 2, "gemm": 8, "residual_norm": 4, "norm": 1}, None),
    "gpt2": ({"attention": 2, "stacked_gemm": 2, "gemm": 6, "residual_norm": 4, "embedding_norm": 1}, None),
    "llama_gqa": ({"attention": 2, "rope": 4, "gated_gemm": 2, "norm_stacked_gemm": 2, "norm_gemm": 2,
                   "residual_norm": 3}, None),
    "mistral_window": ({"attention": 2, "rope": 4, "gated_gemm": 2, "norm_stacked_gemm": 2, "norm_gemm": 2,
                        "residual_norm": 3}, None),
    "gemma2_softcap": ({"attention": 2, "rope": 4, "gated_gemm": 2, "residual_norm": 4, "norm": 4,
                        "norm_stacked_gemm": 1}, None),
}


def _check(want: object, got: object) -> None:
    want = want.to_tuple() if hasattr(want, "to_tuple") else want
    got = got.to_tuple() if hasattr(got, "to_tuple") else got
    assert len(want) == len(got)
    for w, g in zip(want, got):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def _compiled_matches_eager(name: str, target: str) -> torch.nn.Module:
    model, kw = _model(name)
    model.eval()
    compiled = spacefusion.compile(model, target=target)
    with torch.no_grad():
        _check(model(**kw), compiled(**kw))
    return compiled


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_transformers_model_through_dynamo_matches_eager(name: str) -> None:
    report = _compiled_matches_eager(name, "reference").spacefusion
    assert report.graphs and all(g.skipped is None for g in report.graphs), str(report)
    counts = sum((p.counts() for p in report.partitions), start=type(report.partitions[0].counts())())
    kinds, reason = EXPECT[name]
    for kind, n in kinds.items():
        assert counts[kind] >= n, f"{name}: {kind} fused {counts[kind]} times, want {n}\n{report}"
    if reason is not None:
        assert any(reason in op.reason for p in report.partitions for op in p.left), str(report)


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_a_kv_caches_first_append_copies_nothing(name: str) -> None:
    """HF's DynamicCache appends a prefill's K and V to empty tensors (``torch.cat([empty, k])``): the graph
    reads K and V in place, no cat is left to torch, and the returned cache still equals eager's."""
    model, kw = _model(name)
    model.eval()
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        want, got = model(**kw), compiled(**kw)
    report = str(compiled.spacefusion)
    assert "concatenation/stack" not in report, report  # (LLaMA's RoPE tables keep a cat of their own)
    assert _cache(want) is not None
    for layer in range(len(model.layers if hasattr(model, "layers") else model.h)):
        for w, g in zip(_cache_layer(_cache(want), layer), _cache_layer(_cache(got), layer)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_one_projection_split_into_q_k_v_becomes_a_stacked_gemm() -> None:
    """GPT-2's ``c_attn(x).split(n, dim=2)``: the split's chunks are strided views of one output, which the
    attention would copy; as three projections on the weight's column slices they stack into one GEMM whose
    slices the attention reads as they lie ([b, s, h, d]: bshd), and the model still matches eager."""
    compiled = _compiled_matches_eager("gpt2", "reference")
    labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
    assert sum("3 stacked gemms + bias" in lab for lab in labels) == 2, labels
    assert all(lab.endswith("bshd") for lab in labels if lab.startswith("attention")), labels
    assert "split" not in str(compiled.spacefusion)


def _cache(out: object) -> object:
    """A model output's KV cache: its ``cache`` field in recent ``transformers`` (reading the deprecated
    ``past_key_values`` alias logs a deprecation), else ``past_key_values``."""
    return out["cache"] if "cache" in getattr(out, "__dataclass_fields__", {}) else out.past_key_values


def _cache_layer(cache: object, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    layer = cache.layers[i]
    return layer.keys, layer.values


@pytest.mark.parametrize("name", ["albert", "gpt2", "bert_padding", "gemma2_softcap"])
def test_transformers_model_on_llvm_kernels(name: str) -> None:
    """The same capture with TVM's llvm kernels: GELU's tanh form (ALBERT), Conv1D's addmm (GPT-2), the
    padding mask as a score mod of the attention (BERT), and Gemma-2's attention written in ops (soft-cap,
    sliding-window mask, GQA through repeat_kv) as one attention, built and run."""
    compiled = _compiled_matches_eager(name, "llvm")
    labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
    want = {"bert_padding": "+ mask", "gemma2_softcap": "h4/2 16x16 d16 softcap 30 + mask"}.get(name, "gelu_tanh")
    assert any(want in lab for lab in labels), labels


def test_masks_read_their_own_dims() -> None:
    """BERT's boolean [b, 1, m, l] mask is built from index grids and the padding row (``maskexpr``), so the
    attention reads the [b, l] padding row as ``Keep`` (cast to the scores' dtype), not an [m, l] tensor;
    T5's float position bias [1, h, m, l] is an input ``Mask`` [h, m, l], added as it lies."""
    labels, masks = {}, {}
    for name, space in (("bert_padding", "Keep"), ("t5_encoder", "Mask")):
        report = _compiled_matches_eager(name, "reference").spacefusion
        att = [s for p in report.partitions for s in p.subgraphs if s.kind == "attention"]
        labels[name] = att[0].label
        masks[name] = next(op for op in att[0].operands if op.space == space)
    assert "+ mask (index)" in labels["bert_padding"] and "+ bias" in labels["t5_encoder"]
    assert masks["bert_padding"].shape == (2, 16) and masks["bert_padding"].cast == "float32"
    assert masks["t5_encoder"].shape == (2, 16, 16) and masks["t5_encoder"].cast is None


def test_a_mask_every_layer_casts_is_cast_once() -> None:
    """BERT's padding row is bound to each layer's attention as 0/1 in the scores' dtype (a copy): one
    ``_Bind`` makes it before the first layer and both attentions read that tensor, with the output exact."""
    compiled = _compiled_matches_eager("bert_padding", "reference")
    gm = compiled.spacefusion.compiled[0].fused.graph_module
    binds = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("bind_")]
    assert len(binds) == 1 and gm.get_submodule(binds[0].target).op.cast == "float32", gm.code
    readers = [u for u in binds[0].users if u.op == "call_module" and u.target.startswith("fused_")]
    assert len(readers) == 2, gm.code


def test_masked_attention_exports_a_cuda_artefact(tmp_path) -> None:
    """The cuda backend builds an attention with score mods like any other SMG (its tensor-core kernel is
    checked on the GPU by test_mma's mask cases); without a GPU, ``load=False`` exports it and refuses to run."""
    from smg import patterns
    from spacefusion.frontend import CudaBackend, FrontendError

    mod = patterns.ScoreMod("Piecewise(({s}, Mask > 0.5), (-1e30, True))", (("Mask", ("b", "l")),))
    g = patterns.attention(2, 2, 16, 16, 16, dtype="float16", mods=(mod,))
    backend = CudaBackend(tmp_path, build_missing=True, load=False)
    kernel = backend.compile(g)
    meta = json.loads((backend.artefact_dir(g) / "kernel.json").read_text())
    assert {"name": "Mask", "shape": [2, 16], "dtype": "float16", "role": "input"} in meta["params"]
    with pytest.raises(FrontendError, match="exported to"):
        kernel({})


def test_registered_backend_by_name() -> None:
    """``torch.compile(model, backend="spacefusion")`` finds the backend through its entry point."""
    assert "spacefusion" in torch._dynamo.list_backends()
    model, kw = _model("vit")
    model.eval()
    compiled = torch.compile(model, backend="spacefusion", options={"target": "reference"})
    with torch.no_grad():
        _check(model(**kw), compiled(**kw))


def test_unknown_backend_option_is_named() -> None:
    model, kw = _model("vit")
    compiled = torch.compile(model.eval(), backend="spacefusion", options={"tile": 3})
    with torch.no_grad(), pytest.raises(Exception, match="unknown spacefusion backend options"):
        compiled(**kw)


def test_weights_changed_in_place_are_not_stale() -> None:
    """Kernels bake the weights (W transposed once); an in-place update is seen on the next call."""
    model, kw = _model("gpt2")
    model.eval()
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        _check(model(**kw), compiled(**kw))
        model.h[0].mlp.c_fc.weight.mul_(-2.0)
        _check(model(**kw), compiled(**kw))


def test_second_model_instance_runs_its_own_weights() -> None:
    a, kw = _model("albert")
    b, _ = _model("albert")
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    backend = SpaceFusionBackend("reference")
    ca, cb = torch.compile(a.eval(), backend=backend, dynamic=False), torch.compile(b.eval(), backend=backend,
                                                                                   dynamic=False)
    with torch.no_grad():
        _check(a(**kw), ca(**kw))
        _check(b(**kw), cb(**kw))
        assert not torch.allclose(a(**kw)[0], b(**kw)[0])


class _Breaks(torch.nn.Module):
    """Two linears with a data-dependent branch between them: Dynamo breaks the graph there."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.a(x))
        if y.sum() > 0:  # data-dependent control flow
            y = y * 2
        return self.b(y)


def test_graph_break_splits_into_fused_graphs_with_reasons() -> None:
    torch.manual_seed(0)
    model = _Breaks().eval()
    x = torch.randn(4, 32)
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    report = compiled.spacefusion
    assert len(report.graphs) >= 2
    assert sum(p.counts()["gemm"] for p in report.partitions) == 2  # one linear on each side of the break
    assert report.graph_breaks(), str(report)
    assert "graph breaks" in str(report)


def test_autograd_graphs_train_through_aot_autograd() -> None:
    """A graph whose inputs require grad is a training step (``frontend.training``, ``tests/test_training.py``):
    its forward fused, its gradients eager's."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU())
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend("reference")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    x = torch.randn(8, 32)
    compiled(x).sum().backward()
    eager(x).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    graph = backend.graphs[0]
    assert graph.skipped is None and graph.forward is not None and graph.backward is not None, str(backend)
    assert graph.forward.partition.counts()["gemm"] == 1, str(backend)  # linear + bias + relu: one kernel


def test_each_compile_keeps_its_own_report() -> None:
    """Two compiles of one model (say, with and without graphs) report apart; the model is untouched."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    a = spacefusion.compile(model, target="reference")
    b = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        a(torch.randn(2, 8))
    assert a.spacefusion is not b.spacefusion and not hasattr(model, "spacefusion")
    assert len(a.spacefusion.graphs) == 1 and not b.spacefusion.graphs


def test_unknown_target_and_mode_are_named() -> None:
    with pytest.raises(spacefusion.frontend.FrontendError, match="unknown spacefusion target 'cuda:sm_75'"):
        spacefusion.compile(torch.nn.Linear(4, 4), target="cuda:sm_75")
    with pytest.raises(spacefusion.frontend.FrontendError, match="unknown mode 'fastest'"):
        spacefusion.compile(torch.nn.Linear(4, 4), mode="fastest")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_target_without_a_gpu_says_so() -> None:
    compiled = spacefusion.compile(torch.nn.Linear(8, 8).eval(), target="cuda")
    with torch.no_grad(), pytest.raises(Exception, match="needs a CUDA GPU"):
        compiled(torch.randn(2, 8))


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "vit", "gemma2_softcap", "t5_encoder"])
@pytest.mark.parametrize("mode", [None, "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_transformers_model_on_gpu_kernels(name: str, mode: str | None, tmp_path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 on the GPU with the "cuda" target (TVM builds each first pick, the runtime launches it), as one
    CUDA graph replay or launch by launch: against eager fp16, within what eager fp16 itself is off from
    float32 (a few times that: the fused kernels round differently, not worse), on two inputs in a row."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    model, kw = _model(name)
    model = model.eval().cuda()
    second = {k: (v.flip(0) if v.dim() else v).cuda() for k, v in kw.items()}
    kw = {k: v.cuda() for k, v in kw.items()}
    with torch.no_grad():
        exact = [model(**x)[0] for x in (kw, second)]  # float32
        model.half()
        kw, second = ({k: v.half() if v.is_floating_point() else v for k, v in x.items()} for x in (kw, second))
        eager = [model(**x)[0] for x in (kw, second)]
        compiled = spacefusion.compile(model, mode=mode, measure=False)
        got = [compiled(**x)[0].clone() for x in (kw, second)]
    report = compiled.spacefusion
    assert report.target == "cuda" and all(g.skipped is None for g in report.graphs), str(report)
    if name == "gemma2_softcap" and mode != "max-autotune-no-cudagraphs":  # its graph copies a host tensor in
        assert all(g.replayed or "capture failed" in (g.not_replayed or "") for g in report.graphs), str(report)
    else:
        assert all(g.replayed == (mode != "max-autotune-no-cudagraphs") for g in report.graphs), str(report)
    assert sum(len(p.subgraphs) for p in report.partitions) >= 6, str(report)
    if name == "t5_encoder":  # fp16: HF's overflow guard after every sub-layer, fused into the next norm
        assert "inf guard + rmsnorm" in str(report) and "torch.isinf" not in str(report), str(report)
    for e, g, x in zip(eager, got, exact):
        eager_err = (e.float() - x).abs().max().item()
        ours = (g.float() - x).abs().max().item()
        assert ours <= 4 * eager_err + 1e-3, f"{name}: fused fp16 off by {ours}, eager fp16 by {eager_err}\n{report}"


def test_a_broadcast_mask_is_read_without_its_stride_0_dims() -> None:
    """A [b, 1, m, l] mask expanded from [b, 1, 1, l] (stride 0 along m) is bound as the [b, l] it is."""

    class Padded(torch.nn.Module):
        def forward(self, q, k, v, keep):
            mask = keep[:, None, None, :].expand(-1, 1, q.shape[2], -1)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=g) for _ in range(3))
    keep = torch.arange(8)[None, :] < torch.tensor([[8], [3]])
    compiled = spacefusion.compile(Padded(), target="reference")
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v, keep), Padded()(q, k, v, keep), rtol=1e-5, atol=1e-5)
    (att,) = [s for p in compiled.spacefusion.partitions for s in p.subgraphs]
    mask = next(op for op in att.operands if op.space == "Mask")
    assert mask.shape == (2, 8) and mask.select == (2,) and att.smg.shape("Mask") == (2, 8)


def test_padding_that_can_empty_a_query_row_is_exact_or_left_to_torch() -> None:
    """BERT with an all-padding sequence: fused, and its output is torch's (0 from the attention there).
    LLaMA with left padding: causal + padding masks every key of the first query rows; fused with -inf fills
    (issue 57, ``attention._padded_index_mask``), those rows 0 as SDPA's, the model's output eager's."""
    T = transformers
    torch.manual_seed(1)
    bert = T.BertModel(T.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                                    vocab_size=100)).eval()
    llama = T.LlamaModel(T.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=128, vocab_size=100)).eval()
    ids = _ids(2, 16)
    for model, mask, fused in ((bert, [[1] * 16, [0] * 16], True), (llama, [[1] * 16, [0] * 4 + [1] * 12], True)):
        compiled = spacefusion.compile(model, target="reference")
        kw = {"input_ids": ids, "attention_mask": torch.tensor(mask)}
        with torch.no_grad():
            _check(model(**kw), compiled(**kw))
        kinds = [s.kind for p in compiled.spacefusion.partitions for s in p.subgraphs]
        assert ("attention" in kinds) == fused, str(compiled.spacefusion)
        assert "attention.mask" not in str(compiled.spacefusion), str(compiled.spacefusion)


@pytest.mark.cuda
def test_the_lean_call_keeps_a_tensor_maps_shape(tmp_path) -> None:
    """After its checked first call, a fused kernel takes its inputs as they come (flat here) and allocates
    its outputs in the caller's shapes; an input that a TMA tensor map reads is still given the kernel's
    shape (the map is encoded from it).  The first pick of this GEMM loads A and B by TMA."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from smg import patterns
    from spacefusion.frontend import CudaBackend, FrontendError
    from spacefusion.frontend.dynamo import first_pick

    g = patterns.gemm_epilogue(1024, 768, 768, act="relu", dtype="float16")
    schedule = first_pick(g)
    assert schedule.tma, schedule
    run = CudaBackend(tmp_path, schedule_for=first_pick, build_missing=True).compile(g)
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(s, generator=gen, device="cuda", dtype=torch.float16) for s in run.input_shapes]
    (want,) = run.positional(*xs)
    lean = run.lean(0, [(1024 * 768,)])
    (got,) = lean(*[x.flatten() for x in xs])
    assert got.shape == (1024 * 768,)
    torch.testing.assert_close(got, want.flatten(), rtol=0, atol=0)
    with pytest.raises(FrontendError, match="elements where the kernel was built for"):
        lean(*[x[:-1] for x in xs])


@pytest.mark.cuda
def test_a_replayed_graph_copies_no_tensor_map(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A map encoded while the graph is captured (the capture's memory pool moves every activation, so each
    activation's map is new there) is filled once when the capture ends (``runtime.tensormap.deferred_copies``),
    not by a host-to-device copy node that every replay ran again, each cutting the programmatic dependent
    launch of the kernel after it (the SD 1.5 UNet's graph idled 798 us between its kernels).  Three layers of
    small activations (768 KB, torch's small-block pool): a map slot taken from the capture's own pool could
    be an earlier layer's freed output, which that layer overwrites at every replay (an illegal instruction
    on the UNet); the slots come from a slab allocated before the capture."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    torch.manual_seed(0)
    layers = [m for _ in range(3) for m in (torch.nn.Linear(768, 768), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers).cuda().half()
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(512, 768, generator=gen, device="cuda", dtype=torch.float16) for _ in range(2)]
    compiled = spacefusion.compile(model, mode="reduce-overhead", measure=False)
    with torch.no_grad():
        want = [model(x) for x in xs]
        got = [compiled(x).clone() for x in xs]
        assert any(g.replayed for g in compiled.spacefusion.graphs), str(compiled.spacefusion)
        # the GEMMs' first picks load by TMA (512 rows and more): there are maps
        assert any('"tensor_map"' in j.read_text() for j in tmp_path.rglob("kernel.json"))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            compiled(xs[0])
            torch.cuda.synchronize()
    assert not [e.name for e in prof.events() if "HtoD" in e.name]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("kind", "residual", "keep_sum"), [("rmsnorm", False, False), ("rmsnorm", True, True),
                                                            ("layernorm", True, False)])
def test_a_norm_with_its_weight_offset_schedules_and_matches_numpy(kind: str, residual: bool, keep_sum: bool) -> None:
    """Gemma's ``(1 + w)`` weight: ``y * (W + 1)`` as one op, so the rows still cut spatially (``W + 1`` alone
    was an intermediate over n that every block recomputes: its CUDA build was refused on the H100), and the
    LLVM kernel of the default schedule matches the norm written in numpy."""
    import numpy as np

    from smg.reference import random_inputs
    from spacefusion.api import build, schedule
    from spacefusion.frontend import builders

    g = builders.norm(kind, 64, 96, residual, keep_sum, "float32", 1e-5, 1.0)
    s = schedule(g)
    assert dict(s.block)["m"] > 1
    x = random_inputs(g, seed=0)
    out = build(s, "llvm")(x)
    t = (x["X"] + x["R"] if residual else x["X"]).astype(np.float64)
    if kind == "rmsnorm":
        y = t / np.sqrt((t ** 2).mean(-1, keepdims=True) + 1e-5) * (x["W"] + 1.0)
    else:
        mu = t.mean(-1, keepdims=True)
        y = (t - mu) / np.sqrt(((t - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * (x["W"] + 1.0) + x["B"]
    np.testing.assert_allclose(out["Y"], y, rtol=1e-5, atol=1e-5)
    if keep_sum:
        np.testing.assert_allclose(out["T"], t, rtol=1e-6, atol=1e-6)


def test_each_convolution_left_to_torch_says_what_the_smg_cannot_express() -> None:
    """Issue 28's bad input: a grouped or dilated conv goes to torch naming what the SMG's convolution lacks;
    the plain and the strided ones are fused (implicit GEMMs); the compiled model still equals eager."""
    from torch import nn

    class Convs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.plain = nn.Conv2d(8, 8, 3, padding=1)
            self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=4)
            self.dilated = nn.Conv2d(8, 8, 3, padding=2, dilation=2)
            self.strided = nn.Conv2d(8, 16, 3, stride=2, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.strided(torch.relu(self.dilated(self.grouped(self.plain(x)))))

    model = Convs().eval()
    x = torch.randn(2, 8, 16, 16, generator=torch.Generator().manual_seed(0))
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    reasons = [op.reason for p in compiled.spacefusion.partitions for op in p.left if "conv" in op.op]
    assert len(reasons) == 2, reasons
    for want in ("groups 4", "dilation (2, 2)"):
        assert sum(want in r for r in reasons) == 1, (want, reasons)
    # the first reads the NCHW input in the layout the cost model picks (test_conv_layouts): either is fused
    fused = sorted(s.label.removesuffix(" (NCHW image)") for p in compiled.spacefusion.partitions for s in p.subgraphs)
    assert fused == ["conv 3x3/s1 2x8x16x16 -> 8 float32", "conv 3x3/s2 2x8x16x16 -> 16 float32"], fused


def test_t5_position_bias_under_a_padding_mask_is_read_by_the_attention() -> None:
    """HF's ``create_position_bias_mask``, ``where(keep, bias, finfo.min).contiguous()`` in every layer: the
    attention reads the bias [h, m, l] and the padding row [b, l] themselves (the [b, h, m, l] sum is never
    made), and the position buckets, arithmetic on aranges alone, are evaluated once at compile time."""
    model, kw = _model("t5_encoder")
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    kw = {**kw, "attention_mask": mask}
    model.eval()
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        _check(model(**kw), compiled(**kw))
    report = compiled.spacefusion
    att = [s for p in report.partitions for s in p.subgraphs if s.kind == "attention"]
    assert len(att) == 2, str(report)
    for sub in att:
        spaces = {op.space: op.shape for op in sub.operands}
        assert spaces["Mask"] == (2, 16, 16) and spaces["Keep"] == (2, 16), spaces
    left = [op for p in report.partitions for op in p.left]
    assert not [op for op in left if op.op == "torch.where" and "evaluated once" not in op.reason], str(report)
    assert sum("evaluated once" in op.reason for op in left) >= 15, str(report)
