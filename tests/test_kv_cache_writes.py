"""The KV-cache writes a RoPE kernel takes (``frontend.kv_cache``), on one attention layer's update as HF's
``StaticLayer.update`` writes it: taken where it is the same computation, left to torch with its reason
(``kv_cache.write`` / ``kv_cache.value``) where not, the caller's caches equal to eager's either way."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from smg.stores import stores_of
from spacefusion.frontend.fused import fuse

B, H, S, D, L = 2, 2, 3, 8, 7


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Update(nn.Module):
    """K = RoPE of a split_heads view of ``k_proj`` and V = a split_heads view of ``v_proj``, both written
    at ``pos``; ``v_layout``: "bshd" (HF's) or "bhsd" (V packed as [b, h, s, d]); ``read_k``: K also read
    by the output (a reader outside the write); ``counter``: the positions are HF's ``arange(S) + pos``, ``pos``
    a counter bumped in place before the writes (``cumulative_length``)."""

    def __init__(self, v_layout: str = "bshd", read_k: bool = False, counter: bool = False) -> None:
        super().__init__()
        self.v_layout, self.read_k, self.counter = v_layout, read_k, counter

    def forward(self, k_proj, v_proj, cos, sin, keys, values, pos):
        if self.counter:
            count = pos
            pos = torch.arange(S) + count
            count.add_(S)
        k = k_proj.view(B, S, H, D).transpose(1, 2)
        v = v_proj.view(B, S, H, D).transpose(1, 2) if self.v_layout == "bshd" else v_proj.view(B, H, S, D)
        k_embed = k * cos.unsqueeze(1) + _rotate_half(k) * sin.unsqueeze(1)
        keys.index_copy_(2, pos, k_embed)
        values.index_copy_(2, pos, v)
        out = keys.sum(2) + values.sum(2)
        return out + k_embed.sum(2) if self.read_k else out


def _inputs(seed: int = 0, counter: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, S, H * D, generator=g), torch.randn(B, S, H * D, generator=g)
    cos, sin = torch.randn(1, S, D, generator=g), torch.randn(1, S, D, generator=g)
    pos = torch.tensor(3) if counter else torch.tensor([4, 0, 6])
    return k, v, cos, sin, torch.zeros(B, H, L, D), torch.zeros(B, H, L, D), pos


def _run(module: nn.Module, target: str) -> tuple[object, list[torch.Tensor], list[torch.Tensor]]:
    """(the fused model's report, its outputs and caches, eager's outputs and caches) after one call each on
    fresh caches (the capture runs the graph once on copies: its shape propagation)."""
    counter = getattr(module, "counter", False)
    want_in = _inputs(counter=counter)
    want = module(*want_in)
    fused = fuse(module, *_inputs(counter=counter), backend=target)
    got_in = _inputs(counter=counter)
    got = fused(*got_in)
    return fused.partition, [got, *got_in[4:]], [want, *want_in[4:]]


@pytest.mark.parametrize("counter", [False, True])
@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_both_writes_are_the_rope_kernels_and_match_eager(target: str, counter: bool) -> None:
    """Both writes in the RoPE kernel; with HF's ``arange + counter`` positions, the add taken in too (the
    kernel reads the counter before the graph's ``add_`` bumps it: else every row would land one step on)."""
    part, got, want = _run(Update(counter=counter), target)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    (rope,) = [s for s in part.subgraphs if s.kind == "rope"]
    assert rope.label.endswith("-> K, V caches") and rope.writes == ("keys", "values") and rope.results == ()
    assert not [op for op in part.left if op.op.endswith("index_copy_")], part.summary()
    assert all(st.offset == counter for st in stores_of(rope.smg))  # the positions' add: taken with a counter


@pytest.mark.parametrize("module,code,why", [
    (Update(read_k=True), "kv_cache.write", "read outside the cache write"),
    (Update(v_layout="bhsd"), "kv_cache.value", "V lies as bhsd, RoPE's K as bshd"),
])
def test_a_write_the_kernel_cannot_take_stays_with_torch_and_says_why(module: nn.Module, code: str,
                                                                      why: str) -> None:
    part, got, want = _run(module, "reference")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    (left,) = [op for op in part.left if op.code == code]
    assert why in left.reason and left.reason.startswith(("a KV-cache write", "a V-cache write")), left.reason


def test_a_backend_that_keeps_the_writes_with_torch_gets_them_there() -> None:
    """The GPU backend names ``kv_cache_write`` in its ``library_first`` (its fused writes not yet run on a
    GPU): both writes stay torch's index_copy_ under ``library.first``, RoPE is still fused, the caches eager's."""
    from spacefusion.frontend.backends import CudaBackend, ReferenceBackend
    from spacefusion.frontend.kv_cache import LIBRARY_KEY

    be = ReferenceBackend()
    be.library_first = {LIBRARY_KEY: CudaBackend.library_first[LIBRARY_KEY]}
    module = Update()
    want_in = _inputs()
    want = module(*want_in)
    fused = fuse(module, *_inputs(), backend=be)
    got_in = _inputs()
    got = fused(*got_in)
    for g, w in zip([got, *got_in[4:]], [want, *want_in[4:]]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    part = fused.partition
    (rope,) = [s for s in part.subgraphs if s.kind == "rope"]
    assert rope.writes == () and not stores_of(rope.smg)
    left = [op for op in part.left if op.op.endswith("index_copy_")]
    assert len(left) == 2 and all(op.code in ("library.first", "left.no_pattern") for op in left), part.summary()
    assert any(op.code == "library.first" for op in left), part.summary()
