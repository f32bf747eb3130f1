"""A warp-tile kernel's block set-up: thread and block coordinates, the shared arena and the
registers every phase shares, and the range of serial steps a block runs.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedulers.warp_tile import (
    SWIZZLE_ATOM,
    ColumnMask,
    IndexOps,
    mask_bound,
    mbarrier_bytes,
    staged_elements,
    step_range,
)
from spacefusion.lower.exprs import F32
from spacefusion.lower.mma_state import I32, KernelState

#: step_range's operations on TIR expressions
TIR_OPS = IndexOps(tirx.min, tirx.max, tirx.floordiv, tirx.Select, tirx.all)


def row_tile_order(i, count: int, heavy_last: bool):
    """The row tile that the ``i``-th block of a batch coordinate takes when a killing mask makes
    the row tiles' work monotone in their index (causal: tile ``count - 1`` has all the steps):
    the heaviest, the lightest, the next heaviest, ... (ints or TIR).  Blocks start in index order,
    so the grid's tail gets short blocks, and the blocks resident together mix long and short ones."""
    far = count - 1 - i // 2
    near = i // 2
    if isinstance(i, int):
        return (far if i % 2 == 0 else near) if heavy_last else (near if i % 2 == 0 else far)
    return tirx.Select(i % 2 == 0, far, near) if heavy_last else tirx.Select(i % 2 == 0, near, far)


class Block:
    """Binds the coordinates, arena and registers of :class:`KernelState` ``st``."""

    def __init__(self, st: KernelState) -> None:
        self.st = st

    def threads(self, t: tirx.PrimExpr) -> None:
        """This thread's warp group, warp, lane and quad coordinates from its index ``t`` among the
        threads that run the MMA (all of them, or those after a producer warpgroup)."""
        st, p = self.st, self.st.p
        group_threads = 32 * p.warps
        st.gtid = t % group_threads if p.warp.split > 1 else t
        st.grp = t // group_threads if p.warp.split > 1 else tirx.const(0, I32)
        st.warp, st.lane = st.gtid // 32, t % 32
        st.g, st.t4 = st.lane // 4, st.lane % 4

    def coords(self, t: tirx.PrimExpr) -> None:
        """The block coordinates of work tile ``t``: its row tile, slice and batch coordinates."""
        st, s, p = self.st, self.st.s, self.st.p
        grid = st.grid()  # the row tiles' count: the run-time one where the rows are symbolic
        rest = t  # row tile fastest: blocks of one batch coordinate share K/V in L2
        rows = grid[p.row]
        if isinstance(rows, int):
            rb, rest = rest % rows, rest // rows
        else:  # a run-time count: the tile index and the count are never negative, so C's division is the
            rb, rest = tirx.truncmod(rest, rows), tirx.truncdiv(rest, rows)  # floor one without sign fix-ups
        bound = mask_bound(st.smg, p)
        if bound is not None:  # the killing mask makes the work grow (or shrink) with the row
            rb = row_tile_order(rb, rows, heavy_last=bound[1] < 0)
        # then the slice: the row tiles of one slice read the same K/V steps together
        st.slice = rest % p.warp.slices
        rest = rest // p.warp.slices
        st.tile = rest * grid[p.row] + rb  # the row tile's index among all tiles
        outer = [d for d, _ in s.block if d != p.row]
        for d in reversed(outer):
            st.coord[d] = rest % grid[d] if d != outer[0] else rest
            rest = rest // grid[d]
        st.row0 = rb * p.rows

    def alloc(self) -> None:
        """The arena (ring tiles, A tile, staged outputs, mbarriers) and the state registers."""
        st, p = self.st, self.st.p
        # one arena with explicit offsets: the ring tiles side by side, then the A tile, so that its load
        # overlaps the ring's first tiles' (a block of a few steps waited for them one after the other).
        # TVM's allocation merging is left out: it overlapped live ring tiles whose reads sit under a
        # warp group's branch.
        sizes = {n: math.prod(v) for n, v in st.layout.items()}
        a_tile = p.gemm.a if p.gemm is not None else None
        offs, end = {}, 0
        for n in sorted(sizes, key=lambda n: n == a_tile):  # stable: the ring in layout order, A last
            if n in st.swizzled:  # the 128 B swizzle XORs address bits: its atoms start on 1 KB
                end = -(-end // SWIZZLE_ATOM) * SWIZZLE_ATOM
            offs[n], end = end, end + sizes[n]
        if p.hopper.producer:  # the output bands are staged beside the ring, which the loads refill meanwhile
            st.stage_base, end = end, end + staged_elements(st.s, p)
        else:  # the output tiles reuse the ring after the loop
            st.stage_base, end = 0, max(end, staged_elements(st.s, p))
        # the slices' arrival flag is static shared memory, which puts the dynamic arena after it: then
        # the swizzled tiles move up to the next 1 KB of the shared window, found at run time
        skewed = p.hopper.wgmma and p.warp.slices > 1
        end += SWIZZLE_ATOM if skewed else 0
        if p.hopper.tma:  # the ring's mbarriers (mbarrier_bytes), 8-byte aligned, past everything else (the skew too)
            st.mbar_base = -(-end // 4) * 4
            end = st.mbar_base + mbarrier_bytes(p) // 2
        arena = T.alloc_buffer((end,), st.half, scope="shared.dyn")
        st.arena = arena
        skew = tirx.const(0, I32)
        if p.hopper.wgmma:  # the arena's shared-window address, for the wgmma descriptors
            st.arena_addr = T.alloc_buffer((1,), "uint32", scope="local")
            T.buffer_store(st.arena_addr, tirx.call_extern("uint32", "__cvta_generic_to_shared",
                                                           arena.access_ptr("r")), [0])
            if skewed:
                atom = SWIZZLE_ATOM * 2  # bytes
                skew = tirx.Cast(I32, ((atom - (st.arena_addr[0] & (atom - 1))) & (atom - 1)) >> 1)
        for n in sizes:
            st.smem[n], st.sbase[n] = arena, offs[n] + (skew if n in st.swizzled else 0)
        st.rs = {u.state: T.alloc_buffer((2 * st.mt,), F32, scope="local") for u in p.row_states}
        st.rs_old = {u.state: T.alloc_buffer((2 * st.mt,), F32, scope="local") for u in p.row_states}
        st.rs_safe = {u.state: T.alloc_buffer((2 * st.mt,), F32, scope="local") for u in p.row_states
                      if u.combiner == "max"}
        st.acc = {gs.update.state: T.alloc_buffer((st.mt * (gs.n_tile // 8) * 4,), F32, scope="local")
                  for gs in p.gemm_states}

    def step_range(self, scan: bool = True) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
        """The steps [lo, hi) this block needs: all of them, unless killing masks (fill <= -1e30, affine
        in L and the row: causal, a sliding window) leave whole leading or trailing steps masked for every
        row of its tile (``warp_tile.step_range``), or (``scan``: every thread of each warp calls this)
        a padding mask read from an input keeps no key of them (``warp_tile.column_masks``)."""
        st, p = self.st, self.st.p
        cms = list(st.col_masks.values()) if scan else []
        if cms:
            first, last, count = self._kept_keys(cms)
            some = last >= 0  # a block whose keys are all masked runs every step (its rows give 0)
            st.col_kept = (first, last, tirx.all(some, count == last - first + 1))
            return (tirx.Select(some, tirx.floordiv(first, p.step), 0),
                    tirx.Select(some, tirx.floordiv(last, p.step) + 1, st.s.num_steps))
        if not st.masks:
            return tirx.const(0, I32), tirx.const(st.s.num_steps, I32)
        r_hi = tirx.min(st.row0 + p.rows, st.sizes[p.row]) - 1
        lo, hi = step_range(list(st.masks.values()), st.row0, r_hi, p.step, st.sizes[p.serial], TIR_OPS)
        return tirx.const(0, I32) + lo, tirx.const(0, I32) + hi

    def _kept_keys(self, cms: list[ColumnMask]) -> tuple[tirx.PrimExpr, tirx.PrimExpr, tirx.PrimExpr]:
        """The first and last key (-1: none) that the padding masks ``cms`` keep at this block's batch
        coordinates, and how many they keep: each warp scans the mask's row, 32 keys at a time, and
        combines its lanes' finds with shuffles (no block barrier: the warps agree without one)."""
        st, p = self.st, self.st.p
        L = p.serial
        n = st.sizes[L]
        lo = T.alloc_buffer((1,), I32, scope="local")
        hi = T.alloc_buffer((1,), I32, scope="local")
        cnt = T.alloc_buffer((1,), I32, scope="local")
        T.buffer_store(lo, tirx.const(n, I32), [0])
        T.buffer_store(hi, tirx.const(-1, I32), [0])
        T.buffer_store(cnt, tirx.const(0, I32), [0])
        with T.serial(0, -(-n // 32)) as it:
            key = it * 32 + st.lane
            with T.If(key < n):
                with T.Then():
                    kept = []
                    for _, name, threshold, strict in cms:
                        v = tirx.Cast(F32, T.BufferLoad(st.glob[name], [key if d == L else st.coord[d]
                                                                        for d in st.smg.space(name).dims]))
                        kept.append(v > threshold if strict else v >= threshold)
                    with T.If(tirx.all(*kept)):
                        with T.Then():
                            T.buffer_store(lo, tirx.min(lo[0], key), [0])
                            T.buffer_store(hi, tirx.max(hi[0], key), [0])
                            T.buffer_store(cnt, cnt[0] + 1, [0])
        full = tirx.const(0xFFFFFFFF, "uint32")
        for off in (16, 8, 4, 2, 1):
            T.buffer_store(lo, tirx.min(lo[0], T.tvm_warp_shuffle_xor(full, lo[0], off, 32, 32)), [0])
            T.buffer_store(hi, tirx.max(hi[0], T.tvm_warp_shuffle_xor(full, hi[0], off, 32, 32)), [0])
            T.buffer_store(cnt, cnt[0] + T.tvm_warp_shuffle_xor(full, cnt[0], off, 32, 32), [0])
        return lo[0], hi[0], cnt[0]
