"""Grouped-query attention behind ``repeat_kv`` (issue 57, ``frontend.repeat_kv``): SDPA on K/V repeated per
query head reads the un-repeated K/V per kv head, the repeat taken in, in every spelling a graph holds (fx's
``getitem`` + ``expand`` + ``reshape``, ``torch.export``'s ATen ``unsqueeze`` + ``expand`` + ``reshape``,
``make_fx``'s ``clone`` + ``_unsafe_view``, ``repeat_interleave``); a tiled repeat, or K and V repeated
differently, is refused with ``attention.kv_repeat``.  Every fused output is checked against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.shape_prop import ShapeProp

from spacefusion.frontend import capture, fuse, partition
from spacefusion.frontend.export import fuse_exported
from spacefusion.frontend.repeat_kv import repeat_of

B, H, HK, M, L, D = 2, 4, 2, 3, 8, 16


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """transformers' ``repeat_kv``, verbatim."""
    batch, num_key_value_heads, slen, head_dim = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return x.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class Sdpa(nn.Module):
    """SDPA with a padding mask over K/V repeated by ``rep_k`` / ``rep_v`` (functions of (x, group); the group
    a constant, as a model's ``num_key_value_groups``)."""

    def __init__(self, rep_k=repeat_kv, rep_v=repeat_kv, also_return_k: bool = False) -> None:
        super().__init__()
        self.rep_k, self.rep_v, self.also = rep_k, rep_v, also_return_k

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor):
        kk, vv = self.rep_k(k, H // HK), self.rep_v(v, H // HK)
        mask = keep[:, None, None, :].bool()
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=0.3)
        return (out, kk * 2) if self.also else out


def _inputs(kv_heads: int = HK, v_heads: int | None = None) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, M, D, generator=g)
    k = torch.randn(B, kv_heads, L, D, generator=g)
    v = torch.randn(B, v_heads or kv_heads, L, D, generator=g)
    keep = torch.ones(B, L)
    keep[1, :3] = 0  # a padded second row
    return q, k, v, keep


def _attention(p) -> list:
    return [s for s in p.subgraphs if s.kind == "attention"]


def _interleave(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.repeat_interleave(n, dim=1)


@pytest.mark.parametrize("rep", [repeat_kv, _interleave], ids=["repeat_kv", "repeat_interleave"])
def test_sdpa_on_repeated_kv_reads_each_kv_head_once(rep) -> None:
    model, x = Sdpa(rep, rep), _inputs()
    fused = fuse(model, *x, backend="reference")
    att = _attention(fused.partition)
    assert len(att) == 1 and f"h{H}/{HK}" in att[0].label, [s.label for s in fused.partition.subgraphs]
    k = next(op for op in att[0].operands if op.space == "K")
    assert k.shape == (B, HK, L, D) and k.ref == "k"  # the placeholder itself: no copy per query head
    repeats_left = [op for op in fused.partition.left if op.op.endswith(("expand", "reshape", "repeat_interleave"))]
    assert not repeats_left, fused.partition.left  # the repeats were taken in (the mask's getitem stays torch's)
    with torch.no_grad():
        torch.testing.assert_close(fused(*x), model(*x), rtol=1e-5, atol=1e-5)


def test_a_repeat_read_elsewhere_stays_torchs_and_the_kernel_still_reads_the_source() -> None:
    model, x = Sdpa(also_return_k=True), _inputs()
    fused = fuse(model, *x, backend="reference")
    att = _attention(fused.partition)
    assert len(att) == 1 and f"h{H}/{HK}" in att[0].label
    assert next(op for op in att[0].operands if op.space == "K").shape == (B, HK, L, D)
    left = {op.node for op in fused.partition.left}
    assert any(n not in left for n in att[0].nodes if n != "scaled_dot_product_attention")  # V's repeat taken
    with torch.no_grad():
        for g, w in zip(fused(*x), model(*x)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def _tiled(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.repeat(1, n, 1, 1)


@pytest.mark.parametrize("rep_k,rep_v,v_heads,why", [
    (_tiled, _tiled, HK, "tiled"),
    (repeat_kv, lambda v, n: v, H, "K 2 heads x 2, V not repeated"),
], ids=["tiled", "only_k"])
def test_repeats_the_pattern_cannot_read_per_kv_head_are_refused_with_a_code(rep_k, rep_v, v_heads: int,
                                                                            why: str) -> None:
    model, x = Sdpa(rep_k, rep_v), _inputs(v_heads=v_heads)
    p = partition(capture(model, *x).module)
    assert not _attention(p)
    refused = [op for op in p.left if op.code == "attention.kv_repeat"]
    assert len(refused) == 1 and why in refused[0].reason, p.left


def test_the_aten_spellings_of_repeat_kv_are_recognised() -> None:
    """``torch.export``'s pre-dispatch graph (``unsqueeze``, ``expand``, ``reshape``) fuses end to end; the
    decomposed spelling (``make_fx``: ``clone`` + ``_unsafe_view``) is the same repeat."""
    model, x = Sdpa(), _inputs()
    fused = fuse_exported(torch.export.export(model, x), *x, backend="reference")
    att = _attention(fused.partition)
    assert len(att) == 1 and f"h{H}/{HK}" in att[0].label, [s.label for s in fused.partition.subgraphs]
    assert not [op for op in fused.partition.left if op.op.endswith(("expand", "reshape"))], fused.partition.left
    with torch.no_grad():
        torch.testing.assert_close(fused(*x), model(*x), rtol=1e-5, atol=1e-5)

    k = x[1]
    gm = make_fx(lambda t: repeat_kv(t, 3))(k)
    ShapeProp(gm).propagate(k)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, tuple | list) else out
    ops = [n.target.overloadpacket.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    assert "expand" in ops and ("_unsafe_view" in ops or "view" in ops or "reshape" in ops), ops
    rep = repeat_of(out)
    assert rep is not None and rep.kv_heads == HK and rep.group == 3 and rep.source.op == "placeholder"


def test_a_reshape_that_is_no_repeat_is_not_one() -> None:
    """An expand over a new dim 1 (a tiled repeat) or of another dim, reshaped to 4-d, is no ``repeat_kv``."""
    graph = fx.Graph()
    k = graph.placeholder("k")
    tiled = graph.call_method("reshape", (graph.call_method("expand", (
        graph.call_function(lambda t: t[:, None], (k,)), B, 2, HK, L, D)), B, 2 * HK, L, D))
    graph.output(tiled)
    gm = fx.GraphModule(nn.Module(), graph)
    ShapeProp(gm).propagate(torch.randn(B, HK, L, D))
    assert repeat_of(tiled) is None
