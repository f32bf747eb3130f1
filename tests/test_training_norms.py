"""A training forward's LayerNorm whose mean and rstd the backward reads (issue 58): ``native_layer_norm`` as
``patterns.layernorm_stats`` (``norm_stats.match_norm_stats``), its out, mean and rstd the kernel's outputs,
which torch's ``native_layer_norm_backward`` then reads; checked against the unfused op and eager training."""

from __future__ import annotations

import copy
import operator
import shutil

import pytest
import torch

from smg import patterns
from spacefusion.frontend.refusals import META
from spacefusion.frontend.training import read_aten

aten = torch.ops.aten


def _norm_graph(n: int, with_backward: bool) -> torch.fx.GraphModule:
    """``native_layer_norm(x, [n], W, B)`` on parameters as a training forward holds it, its three getitems
    returned; ``with_backward``: also ``native_layer_norm_backward(g, x, [n], mean, rstd, W, B)`` reading them
    (what the backward graph does with the saved statistics), its three gradients returned."""
    root = torch.nn.Module()
    gen = torch.Generator().manual_seed(5)
    root.register_parameter("w", torch.nn.Parameter(1 + 0.1 * torch.randn(n, generator=gen)))
    root.register_parameter("b", torch.nn.Parameter(0.1 * torch.randn(n, generator=gen)))
    g = torch.fx.Graph()
    x, grad = g.placeholder("x"), g.placeholder("g") if with_backward else None
    w, b = g.get_attr("w"), g.get_attr("b")
    ln = g.call_function(aten.native_layer_norm.default, (x, [n], w, b, 1e-5))
    out, mean, rstd = (g.call_function(operator.getitem, (ln, i)) for i in range(3))
    outs = [out, mean, rstd]
    if with_backward:
        bw = g.call_function(aten.native_layer_norm_backward.default,
                             (grad, x, [n], mean, rstd, w, b, [True, True, True]))
        outs += [g.call_function(operator.getitem, (bw, i)) for i in range(3)]
    g.output(tuple(outs))
    return torch.fx.GraphModule(root, g)


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_the_fused_norm_s_statistics_feed_torch_s_backward(target: str) -> None:
    """The ``norm_stats`` row's kernel against the unfused graph: out, mean and rstd equal torch's values and
    strides ([b, s, 1]), and ``native_layer_norm_backward``, left to torch, reading the kernel's mean and rstd
    (the norm op itself gone from what torch runs) gives torch's gradients."""
    from spacefusion.frontend.capture import Captured
    from spacefusion.frontend.compiled import propagate_shapes
    from spacefusion.frontend.fused import fuse_captured

    gen = torch.Generator().manual_seed(6)
    args = (3 + 2 * torch.randn(2, 12, 48, generator=gen), torch.randn(2, 12, 48, generator=gen))
    gm = _norm_graph(48, with_backward=True)
    want = gm(*args)
    read_aten(gm)
    assert any(n.target is aten.native_layer_norm.default for n in gm.graph.nodes)  # left whole, for the row
    propagate_shapes(gm, args)
    fused = fuse_captured(Captured(gm, args), target)
    (sub,) = fused.partition.subgraphs
    assert sub.kind == "norm" and "mean/rstd saved" in sub.label and "24x48" in sub.label, sub.label
    assert [r.space for r in sub.results] == ["Y", "Mean", "Rstd"]
    left = [op.op for op in fused.partition.left]
    assert not any(op.endswith("native_layer_norm.default") for op in left), left
    assert any("native_layer_norm_backward" in op for op in left), left
    got = fused(*args)
    names = ("out", "mean", "rstd", "grad_x", "grad_w", "grad_b")
    for name, g_, w in zip(names, got, want, strict=True):
        assert g_.shape == w.shape and g_.stride() == w.stride(), (name, g_.stride(), w.stride())
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-5, msg=lambda s, n=name: f"{n}: {s}")
    assert want[1].shape == (2, 12, 1) and want[1].dtype == torch.float32


def test_stats_forms_the_pattern_does_not_take_are_marked_with_why() -> None:
    """A weight that is not a parameter: ``read_aten`` marks the op ``left.saved_stats``; float32 and fp16 on
    parameters are left unmarked, for the row (which checks the dtypes together: ``norm_stats.saved_stats_dtypes``)."""
    for dt in (torch.float32, torch.float16):
        gm = _norm_graph(16, with_backward=False)
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        x.meta["val"] = torch.empty(2, 16, dtype=dt)
        read_aten(gm)
        (ln,) = [n for n in gm.graph.nodes if n.target is aten.native_layer_norm.default]
        assert META not in ln.meta, dt
    loose = _norm_graph(16, with_backward=False)
    (ln,) = [n for n in loose.graph.nodes if n.target is aten.native_layer_norm.default]
    with loose.graph.inserting_before(ln):
        w = loose.graph.placeholder("w_value")
    ln.args = (ln.args[0], ln.args[1], w, *ln.args[3:])
    read_aten(loose)
    assert ln.meta[META].code == "left.saved_stats", ln.meta[META]


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_bert_training_fuses_its_layernorms_with_their_statistics(target: str) -> None:
    """Tiny BERT, three SGD steps: losses and every gradient equal eager's (``test_training``'s tolerances);
    the forward's three LayerNorms (embeddings, attention output, output) each one kernel saving mean and rstd,
    none left to torch, the GEMMs beside them as before, and the backward's three ``native_layer_norm_backward``
    reading them, each the kernels derived from the LayerNorm SMG (``derived_norms``)."""
    pytest.importorskip("transformers")
    from test_training import _compare, _kinds, _model, _train

    from spacefusion.frontend.dynamo import SpaceFusionBackend

    torch._dynamo.reset()
    try:
        model = _model("bert")
        eager = copy.deepcopy(model)
        backend = SpaceFusionBackend(target)
        got = _train(model, torch.compile(model, backend=backend, dynamic=False))
        _compare(got, _train(eager, eager))
    finally:
        torch._dynamo.reset()
    fw, bw = backend.graphs[0].forward, backend.graphs[0].backward
    norms = [s for s in fw.partition.subgraphs if s.kind == "norm"]
    assert len(norms) == 3 and all("layernorm + mean/rstd saved 32x64" in s.label for s in norms), str(backend)
    assert not any("native_layer_norm" in op.op for op in fw.partition.left), str(backend)
    assert not fw.partition.left_codes()["left.saved_stats"], str(backend)
    assert _kinds(fw)["stacked_gemm"] == 1 and sum(n for k, n in _kinds(fw).items() if "gemm" in k) == 5, str(backend)
    assert not any("native_layer_norm_backward" in op.op for op in bw.partition.left), str(backend)
    assert sum("layernorm backward 32x64" in line for line in bw.derived) == 3, str(backend)


def test_the_statistics_norm_lowers_to_cuda(tmp_path) -> None:
    """``layernorm_stats`` (three outputs, two of them per row) lowers for sm_90a; nvcc builds its cubin where
    it exists (compile only: no GPU here)."""
    from spacefusion.api import build, schedule

    art = build(schedule(patterns.layernorm_stats(256, 768)), "cuda:sm_90a")
    assert "__global__" in art.source
    if shutil.which("nvcc"):
        assert (art.save(tmp_path / "layernorm_stats", cache=None) / "kernel.cubin").stat().st_size > 0
