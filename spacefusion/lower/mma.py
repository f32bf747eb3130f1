"""Warp-tile program -> TensorIR on tensor cores (mma.sync, ldmatrix, cp.async).

The kernel is FlashAttention-2's shape, read off the schedule: one thread block per
(batch coordinates, row tile), 16 rows per warp; per serial step the streamed input
tiles arrive by cp.async into a ``stages``-deep ring of padded shared buffers; the
score tile is an ``mma.sync.m16n8k16`` GEMM (or a staged input read by ``ldmatrix``)
held in the accumulator layout, where each thread owns rows ``g`` and ``g + 8`` of
its warp's 16 and two adjacent columns per 8-column tile.  Element-wise ops and the
derived update functions are evaluated on those registers; row statistics combine
over the 4 threads of a quad with shuffles; the second GEMM takes the factor tile as
fp16 A fragments straight from the accumulator layout (the two layouts agree) and
the other operand through ``ldmatrix.trans``.  Every value comes from the plan's
sympy expressions: nothing here names attention or softmax.

Fragment loops are unrolled in Python, so every register index is a constant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack

import sympy as sp
from tvm import tirx
from tvm.script import ir_builder as IB
from tvm.script.ir_builder import tirx as T

from schedulers.errors import ScheduleError
from schedulers.schedule import Schedule
from schedulers.temporal import parse
from schedulers.warp_tile import (
    MMA_DTYPES,
    SWIZZLE_ATOM,
    GemmState,
    IndexOps,
    WarpTileProgram,
    carry_factor,
    killing_masks,
    mask_bound,
    mbarrier_bytes,
    smem_layout,
    split_ring,
    staged_elements,
    step_range,
    swizzled_128b,
    tile_columns,
    warp_tile_program,
    wgmma_swizzled,
)
from smg.expr import body_expr
from spacefusion.lower.exprs import F32, to_tir
from spacefusion.lower.mma_out import I32, NEG_INF, _f, _Outputs, _tree
from spacefusion.lower.mma_tma import _TmaRing
from spacefusion.lower.mma_ws import _WarpSpecialized
from spacefusion.lower.tir import signature

#: step_range's operations on TIR expressions
TIR_OPS = IndexOps(tirx.min, tirx.max, tirx.floordiv, tirx.Select, tirx.all)


class _Gen(_Outputs, _TmaRing, _WarpSpecialized):
    def __init__(self, s: Schedule, p: WarpTileProgram) -> None:
        self.s, self.p, self.smg = s, p, s.smg
        self.sizes = self.smg.dim_sizes
        self.ab = "fp16" if self.smg.space(self.smg.inputs[0]).dtype == "float16" else "bf16"
        self.half = "float16" if self.ab == "fp16" else "bfloat16"
        self.layout = smem_layout(s, p)
        self.cols = tile_columns(s, p)
        self.glob: dict[str, tirx.Buffer] = {}
        self.smem: dict[str, tirx.Buffer] = {}  # name -> the shared arena holding its tile(s)
        self.sbase: dict[str, int] = {}  # name -> element offset of its tile(s) in the arena
        self.coord: dict[str, tirx.PrimExpr] = {}  # batch dim -> block coordinate
        self.nt = p.step // 8  # 8-column tiles of the score tile
        self.mt = p.warp_mtiles  # 16-row mma tiles per warp
        self.ns = self.mt * self.nt * 4  # score-tile elements per thread
        # log2 e folds into exp's operands unless a mask can fill a whole row slice with a sentinel:
        # then m and s are both -1e30 and only s - m computed first is exactly 0
        piecewise = {n for n in p.score_ops if body_expr(self.smg.producer(n)).has(sp.Piecewise)}
        self.fold_log2e = not piecewise
        # steps whose whole tile the killing mask keeps (below a causal diagonal) run a copy of the
        # step without it: no per-element select, and the scalings fold into exp2 again
        self.masks = dict(killing_masks(self.smg, p))
        self.unmasked = False
        self.fold_unmasked = bool(self.masks) and piecewise <= set(self.masks)
        self.cache: dict[str, tuple[frozenset[str], tirx.Buffer]] = {}  # per-step values by expression
        # max states that are only references (lazy_references): kept while the new max is within
        # the lag; ``moved`` holds this step's warp-uniform flag of each (0: kept, nothing to rescale)
        self.lazy = dict(p.lazy)
        self.moved: dict[str, tirx.Buffer] = {}
        self.inline: dict[str, sp.Expr] = {}  # score ops that are constant scalings: folded into readers
        self.row_sums = dict(p.row_sums)  # sum states computed with a GEMM on tensor cores (mma_row_sums)
        self.swizzled = set(wgmma_swizzled(p))  # tiles wgmma reads through descriptors
        # a producer-fed score GEMM overlaps each step's softmax with the previous step's P @ V (mma_ws)
        self.overlap = split_ring(p)

    # -- addressing -----------------------------------------------------------------
    def flat(self, name: str, pos: dict[str, tirx.PrimExpr]) -> tirx.PrimExpr:
        """Row-major element offset of ``name`` at ``pos`` (batch coordinates filled in)."""
        dims = self.smg.space(name).dims
        off = tirx.const(0, I32)
        for d in dims:
            off = off * self.sizes[d] + (pos[d] if d in pos else self.coord[d])
        return off

    def element(self, name: str, pos: dict[str, tirx.PrimExpr]) -> tirx.PrimExpr:
        """One element from global memory (tail positions clamped; their results are not stored)."""
        dims = self.smg.space(name).dims
        v = self.glob[name][[tirx.min(pos[d], self.sizes[d] - 1) if d in pos else self.coord[d] for d in dims]]
        return v if self.glob[name].dtype == F32 else tirx.Cast(F32, v)

    # -- cp.async tile copies ----------------------------------------------------------
    def copy_tile(self, name: str, slot: tirx.PrimExpr, rdim: str, r0: tirx.PrimExpr,
                  cdim: str, c0: tirx.PrimExpr, pred: tirx.PrimExpr | None = None, block: bool = False) -> None:
        """Copy a [rows, cols] tile (cols = ``cdim``, contiguous) of ``name`` into copy ``slot``
        of its shared buffer in 16-byte cp.async chunks, by this warp group's threads (the whole
        block's with ``block``); rows/chunks past the end are clamped (their values are masked or
        multiplied by zero downstream)."""
        copies, rows, stride = self.layout[name]
        swz = name in self.swizzled  # read by wgmma: 128 B-swizzled in whole bands; else rows padded by 8
        per_row = self.cols[name] // 8  # the columns that exist (a swizzled tile's last band may be partial)
        total = rows * per_row
        th = self.p.threads if block else 32 * self.p.warps
        with T.serial(0, -(-total // th)) as it:
            c = it * th + (self.tid if block else self.gtid)
            r, cc = c // per_row, (c % per_row) * 8
            grow = tirx.min(r0 + r, self.sizes[rdim] - 1)
            gcol = tirx.min(c0 + cc, self.sizes[cdim] - 8)
            conds = [c < total] if total % th else []
            if pred is not None:
                conds.append(pred)
            src = self.flat(name, {rdim: grow, cdim: gcol})
            dst = slot * (rows * stride) + (swizzled_128b(r, cc // 8, rows, tirx.bitwise_xor) if swz
                                           else r * stride + cc)
            with ExitStack() as guard:
                if conds:
                    guard.enter_context(T.If(tirx.all(*conds)))
                    guard.enter_context(T.Then())
                T.evaluate(_cp_async(self.half, self.smem[name], self.sbase[name] + dst, self.glob[name], src))

    def step_of(self, j: tirx.PrimExpr) -> tirx.PrimExpr:
        """The serial step of this warp group's ``j``-th iteration (groups interleave steps; a
        slice's block starts at its first step)."""
        if self.p.split > 1:
            return self.first + j * self.p.split + self.grp
        return self.first + j

    def slot_for(self, j: tirx.PrimExpr) -> tirx.PrimExpr:
        """Ring slot of iteration ``j``: the group's own ``stages`` copies."""
        p = self.p
        local = j % p.stages if p.stages > 1 else tirx.const(0, I32)
        return self.grp * p.stages + local if p.split > 1 else local

    def issue_step(self, j: tirx.PrimExpr, pred: tirx.PrimExpr | None) -> None:
        """cp.async the streamed tiles of this group's iteration ``j`` into its ring slot."""
        p, L = self.p, self.p.serial
        slot = self.slot_for(j)
        t0 = self.step_of(j) * p.step
        if p.tma:
            self._tma_step(slot, t0, pred)
            return
        if p.gemm is not None:
            g = p.gemm
            if g.b_trans:
                self.copy_tile(g.b, slot, g.k, tirx.const(0, I32), L, t0, pred)
            else:
                self.copy_tile(g.b, slot, L, t0, g.k, tirx.const(0, I32), pred)
        for n in p.tiles_in:
            self.copy_tile(n, slot, p.row, self.row0, L, t0, pred)
        if self.groups == 2:  # the score tile's operands land first: it starts while the rest arrive
            T.evaluate(T.ptx.cp.async_.commit_group())
        for x in dict.fromkeys(gs.x for gs in p.gemm_states):
            n = next(gs.n for gs in p.gemm_states if gs.x == x)
            self.copy_tile(x, slot, L, t0, n, self.col0(n), pred)
        T.evaluate(T.ptx.cp.async_.commit_group())

    def _wait_tiles(self, j: tirx.PrimExpr, pending: int) -> None:
        """Wait for iteration ``j``'s tiles: its slot's mbarrier phase (TMA), or this thread's
        cp.async groups but ``pending``, then (wgmma) a proxy fence, since wgmma reads through the async
        proxy what cp.async wrote through the generic one."""
        p = self.p
        if p.tma:
            T.evaluate(T.cuda.mbarrier_wait(self._mbar(self.slot_for(j)), tirx.floordiv(j, p.stages) % 2))
            return
        T.evaluate(T.ptx.cp.async_.wait_group(pending))
        if p.wgmma:
            T.evaluate(T.ptx.fence.proxy.async_.shared__cta())

    def _slot_tile(self, name: str, slot: tirx.PrimExpr) -> tirx.PrimExpr:
        """Arena element where ring slot ``slot`` of the shared tile ``name`` starts."""
        _, rows, stride = self.layout[name]
        return self.sbase[name] + slot * (rows * stride)

    def col0(self, n: str) -> tirx.PrimExpr:
        """First column of this block along a GEMM state's column dim (0 unless it is cut)."""
        return self.coord[n] * self.s.tiles[n] if n in self.s.tiles else tirx.const(0, I32)

    # -- fragments -------------------------------------------------------------------
    def ldsm(self, frag: tirx.Buffer, off: int, name: str, soff: tirx.PrimExpr, trans: bool) -> None:
        T.evaluate(T.ptx_legacy.ldmatrix(trans, 4, ".b16", frag.data, off, self.smem[name].access_ptr("r"),
                                         self.sbase[name] + soff, dtype=self.half))

    def mma(self, c: tirx.Buffer, coff: int, a: tirx.Buffer, aoff: int, b: tirx.Buffer, boff: int) -> None:
        T.evaluate(T.ptx_legacy.mma("m16n8k16", "row", "col", self.ab, self.ab, "fp32", a.data, aoff, b.data,
                                    boff, c.data, coff, False, dtype=F32))

    def a_offset(self, stride: int, r0: tirx.PrimExpr, c0: int) -> tirx.PrimExpr:
        """ldmatrix.x4 row address of a 16x16 A-layout block at (r0, c0)."""
        return (r0 + self.lane % 16) * stride + c0 + (self.lane // 16) * 8

    def b_offset(self, stride: int, nrow0: int, kcol0: int, trans: bool) -> tirx.PrimExpr:
        """ldmatrix.x4 row address for two 8-column B tiles (k 16) from [n, k] (or [k, n] with trans)."""
        j, r = self.lane // 8, self.lane % 8
        if trans:
            return (kcol0 + (j % 2) * 8 + r) * stride + nrow0 + (j // 2) * 8
        return (nrow0 + (j // 2) * 8 + r) * stride + kcol0 + (j % 2) * 8

    # -- element positions -------------------------------------------------------------
    # a thread owns 2 rows per 16-row mma tile: row slot r = 2 * tile + (0 for g, 1 for g + 8);
    # in a fragment array of `per` elements per tile, element E is tile E // per, column tile
    # (E % per) // 4, and within it c0..c3 = (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
    def mtile_row(self, mi: int) -> tirx.PrimExpr:
        """First row (in the block's tile) of this warp's 16-row mma tile ``mi``: the warp's own
        16 * mt rows, or with warpgroup MMA the warp's 16 rows of each of its warpgroup's 64-row halves."""
        if self.p.wgmma:
            return self._half(mi) * 64 + (self.warp % 4) * 16
        return self.warp * (16 * self.mt) + mi * 16

    def row_of(self, r: int) -> tirx.PrimExpr:
        return self.row0 + self.mtile_row(r // 2) + self.g + 8 * (r % 2)

    @staticmethod
    def slot_of(e: int, per: int) -> int:
        return (e // per) * 2 + (e % 4) // 2

    def col_of(self, e: int, per: int) -> tirx.PrimExpr:
        return ((e % per) // 4) * 8 + 2 * self.t4 + e % 2

    # -- expressions -------------------------------------------------------------------
    def expr(self, text_or_expr, load: Callable[[str], tirx.PrimExpr], stored: str = F32) -> tirx.PrimExpr:
        """``text`` as fp32 TIR; ``stored``: the dtype its value is stored in (a 2-byte one allows
        the fast division)."""
        e = parse(text_or_expr) if isinstance(text_or_expr, str) else text_or_expr
        return to_tir(e, load, exp2=True, fold_log2e=self.fold_log2e or (self.unmasked and self.fold_unmasked),
                      fast_div=stored in MMA_DTYPES,
                      tanh=_tanh_approx if self.p.fast_math and stored in MMA_DTYPES else None)

    def load_common(self, name: str, h: int, pos: dict[str, tirx.PrimExpr]) -> tirx.PrimExpr | None:
        """Row states (rows g + 8h), dims as indices, inputs from global memory."""
        base = name.removesuffix("__old").removesuffix("__new")
        if base in self.rs:
            return (self.rs_old if name.endswith("__old") else self.rs)[base][h]
        if name in self.sizes:
            return tirx.Cast(F32, pos[name] if name in pos else self.coord[name])
        if name in self.glob:
            return self.element(name, pos)
        return None

    def load_score(self, i: int) -> Callable[[str], tirx.PrimExpr]:
        r = self.slot_of(i, self.nt * 4)
        pos = {self.p.row: self.row_of(r), self.p.serial: self.t0 + self.col_of(i, self.nt * 4)}

        def load(name: str) -> tirx.PrimExpr:
            if name in self.score:
                return self.score[name][i]
            if name in self.tin:
                return tirx.Cast(F32, self.tin[name][i])
            v = self.load_common(name, r, pos)
            if v is None:
                raise ScheduleError(f"the warp-tile lowering cannot read {name!r} on the score tile")
            return v

        return load

    def valid(self, i: int) -> tirx.PrimExpr | None:
        L = self.sizes[self.p.serial]
        if L % self.p.step == 0:
            return None
        return self.t0 + self.col_of(i, self.nt * 4) < L

    def inlined(self, text_or_expr) -> sp.Expr:
        """``text`` with the inlined score ops (constant scalings) substituted by their bodies."""
        e = parse(text_or_expr) if isinstance(text_or_expr, str) else text_or_expr
        subs = {x: self.inline[x.name] for x in e.free_symbols if x.name in self.inline}
        return e.xreplace(subs) if subs else e

    def values(self, text_or_expr) -> tirx.Buffer:
        """Per-element values of an expression on the score tile this step (computed once)."""
        e = self.inlined(text_or_expr)
        key = str(e)
        if key not in self.cache:
            buf = T.alloc_buffer((self.ns,), F32, scope="local")
            for i in range(self.ns):
                T.buffer_store(buf, self.expr(e, self.load_score(i)), [i])
            self.cache[key] = (frozenset(x.name for x in e.free_symbols), buf)
        return self.cache[key][1]

    def updated(self, state: str) -> None:
        """``state`` changed: cached values reading it are stale."""
        self.cache = {k: v for k, v in self.cache.items() if state not in v[0]}

    # -- the kernel ----------------------------------------------------------------------
    def build(self) -> tirx.PrimFunc:
        s, p = self.s, self.p
        with IB.IRBuilder() as ib:
            with T.prim_func():
                T.func_name("main")
                for name, shape, dtype, _ in signature(s).params:
                    self.glob[name] = T.arg(name, T.buffer(shape, dtype))
                T.func_attr({"global_symbol": "main", "tirx.noalias": True})
                with T.thread_binding(0, s.num_blocks, thread="blockIdx.x") as bid:
                    with T.thread_binding(0, p.threads, thread="threadIdx.x") as tid:
                        self.tid = tid
                        if p.producer:
                            self._ws_kernel(bid)
                        else:
                            self._threads(tid)
                            self._coords(bid)
                            self._body()
        return ib.get()

    def _threads(self, t: tirx.PrimExpr) -> None:
        """This thread's warp group, warp, lane and quad coordinates from its index ``t`` among the
        threads that run the MMA (all of them, or those after a producer warpgroup)."""
        p = self.p
        group_threads = 32 * p.warps
        self.gtid = t % group_threads if p.split > 1 else t
        self.grp = t // group_threads if p.split > 1 else tirx.const(0, I32)
        self.warp, self.lane = self.gtid // 32, t % 32
        self.g, self.t4 = self.lane // 4, self.lane % 4

    def _coords(self, t: tirx.PrimExpr) -> None:
        """The block coordinates of work tile ``t``: its row tile, slice and batch coordinates."""
        s, p = self.s, self.p
        grid = s.grid()
        rest = t  # row tile fastest: blocks of one batch coordinate share K/V in L2
        rb = rest % grid[p.row]
        bound = mask_bound(self.smg, p)
        if bound is not None:  # the killing mask makes the work grow (or shrink) with the row
            rb = row_tile_order(rb, grid[p.row], heavy_last=bound[1] < 0)
        rest = rest // grid[p.row]
        # then the slice: the row tiles of one slice read the same K/V steps together
        self.slice = rest % p.slices
        rest = rest // p.slices
        self.tile = rest * grid[p.row] + rb  # the row tile's index among all tiles
        outer = [d for d, _ in s.block if d != p.row]
        for d in reversed(outer):
            self.coord[d] = rest % grid[d] if d != outer[0] else rest
            rest = rest // grid[d]
        self.row0 = rb * p.rows

    def _alloc(self) -> None:
        p = self.p
        # one arena with explicit offsets: the ring tiles side by side, then the A tile, so that its load
        # overlaps the ring's first tiles' (a block of a few steps waited for them one after the other).
        # TVM's allocation merging is left out: it overlapped live ring tiles whose reads sit under a
        # warp group's branch.
        sizes = {n: math.prod(v) for n, v in self.layout.items()}
        a_tile = p.gemm.a if p.gemm is not None else None
        offs, end = {}, 0
        for n in sorted(sizes, key=lambda n: n == a_tile):  # stable: the ring in layout order, A last
            if n in self.swizzled:  # the 128 B swizzle XORs address bits: its atoms start on 1 KB
                end = -(-end // SWIZZLE_ATOM) * SWIZZLE_ATOM
            offs[n], end = end, end + sizes[n]
        if p.producer:  # the output bands are staged beside the ring, which the loads refill meanwhile
            self.stage_base, end = end, end + staged_elements(self.s, p)
        else:  # the output tiles reuse the ring after the loop
            self.stage_base, end = 0, max(end, staged_elements(self.s, p))
        # the slices' arrival flag is static shared memory, which puts the dynamic arena after it: then
        # the swizzled tiles move up to the next 1 KB of the shared window, found at run time
        skewed = p.wgmma and p.slices > 1
        end += SWIZZLE_ATOM if skewed else 0
        if p.tma:  # the ring's mbarriers (mbarrier_bytes), 8-byte aligned, past everything else (the skew too)
            self.mbar_base = -(-end // 4) * 4
            end = self.mbar_base + mbarrier_bytes(p) // 2
        arena = T.alloc_buffer((end,), self.half, scope="shared.dyn")
        self.arena = arena
        skew = tirx.const(0, I32)
        if p.wgmma:  # the arena's shared-window address, for the wgmma descriptors
            self.arena_addr = T.alloc_buffer((1,), "uint32", scope="local")
            T.buffer_store(self.arena_addr, tirx.call_extern("uint32", "__cvta_generic_to_shared",
                                                             arena.access_ptr("r")), [0])
            if skewed:
                atom = SWIZZLE_ATOM * 2  # bytes
                skew = tirx.Cast(I32, ((atom - (self.arena_addr[0] & (atom - 1))) & (atom - 1)) >> 1)
        for n in sizes:
            self.smem[n], self.sbase[n] = arena, offs[n] + (skew if n in self.swizzled else 0)
        self.rs = {u.state: T.alloc_buffer((2 * self.mt,), F32, scope="local") for u in p.row_states}
        self.rs_old = {u.state: T.alloc_buffer((2 * self.mt,), F32, scope="local") for u in p.row_states}
        self.acc = {gs.update.state: T.alloc_buffer((self.mt * (gs.n_tile // 8) * 4,), F32, scope="local")
                    for gs in p.gemm_states}

    def _step_range(self) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
        """The steps [lo, hi) this block needs: all of them, unless killing masks (fill <= -1e30, affine
        in L and the row: causal, a sliding window) leave whole leading or trailing steps masked for every
        row of its tile (``warp_tile.step_range``)."""
        p = self.p
        if not self.masks:
            return tirx.const(0, I32), tirx.const(self.s.num_steps, I32)
        r_hi = tirx.min(self.row0 + p.rows, self.sizes[p.row]) - 1
        lo, hi = step_range(list(self.masks.values()), self.row0, r_hi, p.step, self.sizes[p.serial], TIR_OPS)
        return tirx.const(0, I32) + lo, tirx.const(0, I32) + hi

    def _body(self) -> None:
        p = self.p
        # cp.async groups per step: with early_scores the score tile's operands and the second GEMM's,
        # waited for one after the other (FlashAttention-2's order)
        self.groups = 2 if p.early_scores else 1
        self._alloc()
        if p.tma:
            self._tma_init()
        zero = tirx.const(0, I32)
        self._init_states()
        qf = None
        held = p.gemm is not None and not self.p.reload_a
        if p.gemm is not None:  # its load overlaps the ring's first tiles' (read into registers after
            g = p.gemm  # them or, with reload_a, every step)
            self.copy_tile(g.a, zero, p.row, self.row0, g.k, zero, block=True)
            T.evaluate(T.ptx.cp.async_.commit_group())
        self.first, nsteps = self._step_range()
        if p.slices > 1:  # this block's contiguous range of steps (empty outside a mask's bounds), which
            per = self.s.steps_per_block  # its warp groups (split) interleave
            nsteps = tirx.min(nsteps, self.slice * per + per)
            self.first = tirx.max(self.first, self.slice * per)
        iters = tirx.max(nsteps - self.first, 0)
        if p.split > 1:  # every group runs the same iteration count (the block-wide barriers), idle past the end
            iters = tirx.floordiv(iters + (p.split - 1), p.split)
        # warpgroup MMA in a ring of 3+ leaves one step's wgmma group in flight while the next step
        # waits and loads: the load then reuses the slot of two steps back, one step less ahead
        self.lag = 1 if p.wgmma_ss and p.stages >= 3 else 0
        dist = p.stages - 1 - self.lag
        for pre in range(dist):
            self.issue_step(tirx.const(pre, I32), self.step_of(tirx.const(pre, I32)) < nsteps)
        if p.tma and p.gemm is not None and not held:  # the ring commits no cp.async group: wait for the A
            T.evaluate(T.ptx.cp.async_.wait_group(0))  # tile here, for the async proxy (wgmma) to read
            T.evaluate(T.ptx.fence.proxy.async_.shared__cta())
            T.evaluate(T.tvm_storage_sync("shared"))
        if held:  # the A operand stays in registers for the whole loop; its group is the oldest
            T.evaluate(T.ptx.cp.async_.wait_group(0 if p.tma else self.groups * (p.stages - 1)))
            T.evaluate(T.tvm_storage_sync("shared"))
            qf = self._a_fragments()
        with T.serial(0, iters) as j:
            ahead = j + dist
            pred = self.step_of(ahead) < nsteps if p.stages > 1 or p.split > 1 else None
            if p.stages == 1:  # no ring: load, wait, compute, and every warp done before the next load
                self.issue_step(ahead, pred)
                self._wait_tiles(j, 0)
                T.evaluate(T.tvm_storage_sync("shared"))
            else:  # one barrier per step: it publishes tile j to every warp and frees the slot of
                # tile j - 1 (all warps are past its compute), which the load of tile j + stages - 1 reuses
                self._wait_tiles(j, self.groups * dist - 1)
                if self.lag:  # the wgmma of two steps back is done (its slot is reloaded below)
                    T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(self.lag))
                T.evaluate(T.tvm_storage_sync("shared"))
                self.issue_step(ahead, pred)
            self.t0 = self.step_of(j) * p.step
            self.slot = self.slot_for(j)
            with ExitStack() as busy:
                if p.split > 1:
                    busy.enter_context(T.If(self.step_of(j) < nsteps))
                    busy.enter_context(T.Then())
                self._step_masked(qf)
            if p.stages == 1:
                T.evaluate(T.tvm_storage_sync("shared"))
        if self.lag:  # the last steps' accumulators
            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
        T.evaluate(T.tvm_storage_sync("shared"))  # the merge's hand-over lies over the ring
        if p.slices > 1:  # warp groups too (split) leave their parts in the workspace
            self._merge_slices()
        elif p.split > 1:
            self._merge()
        else:
            self._finalize()

    def _init_states(self) -> None:
        """Row states at their combiners' identities, accumulators at zero."""
        for st in self.p.row_states:
            for h in range(2 * self.mt):
                T.buffer_store(self.rs[st.state], _f(NEG_INF if st.combiner == "max" else 0.0), [h])
        for buf in self.acc.values():
            for i in range(int(buf.shape[0])):
                T.buffer_store(buf, _f(0.0), [i])

    def _a_fragments(self) -> tirx.Buffer:
        """The score GEMM's A (Q) read from its landed tile into registers, held for the whole loop."""
        g = self.p.gemm
        kd = self.sizes[g.k]
        qf = T.alloc_buffer((self.mt * kd // 2,), self.half, scope="local")
        stride = self.layout[g.a][2]
        for mi in range(self.mt):
            for kt in range(kd // 16):
                self.ldsm(qf, mi * kd // 2 + kt * 8, g.a, self.a_offset(stride, self.mtile_row(mi), kt * 16), False)
        return qf

    def _step_masked(self, qf: tirx.Buffer | None) -> None:
        """This step, and under a killing mask a copy of it without the mask for the tiles it keeps whole."""
        kept = self._tile_kept()
        if kept is None:
            self._step(qf)
            return
        with T.If(kept):
            with T.Then():
                self.unmasked = True
                self._step(qf)
                self.unmasked = False
            with T.Else():
                self._step(qf)

    def _tile_kept(self) -> tirx.PrimExpr | None:
        """Whether the killing masks keep every element of this step's tile (None: no such mask):
        each ``a*L + b*R + c <= 0`` at the tile's worst L and worst row."""
        if not self.masks:
            return None
        r_hi = tirx.min(self.row0 + self.p.rows, self.sizes[self.p.row]) - 1
        return tirx.all(*[tile_kept(b, self.t0, self.p.step, self.row0, r_hi) for b in self.masks.values()])

    def _score_body(self, name: str) -> sp.Expr:
        """The body of score op ``name``; on a kept tile the killing mask is its kept branch."""
        e = body_expr(self.smg.producer(name))
        if self.unmasked and name in self.masks:
            return e.args[0][0]
        return e

    def _step(self, qf: tirx.Buffer | None) -> None:
        p = self.p
        if p.wgmma_ss:
            self._wgmma_step()
            return
        self.cache = {}
        self.score: dict[str, tirx.Buffer] = {}
        self.tin: dict[str, tirx.Buffer] = {}
        n4, ns = self.nt * 4, self.ns
        if p.gemm is not None:
            g = p.gemm
            sacc = T.alloc_buffer((ns,), F32, scope="local")
            for i in range(ns):
                T.buffer_store(sacc, _f(0.0), [i])
            copies, rows, stride = self.layout[g.b]
            base = self.slot * (rows * stride)
            kd = self.sizes[g.k]

            nb = self.nt // 2 * 8  # B fragment halves per k slice; A's (when reloaded) follow them

            def load_k(kt: int, kf: tirx.Buffer) -> None:
                for n2 in range(self.nt // 2):
                    self.ldsm(kf, n2 * 8, g.b, base + self.b_offset(stride, n2 * 16, kt * 16, g.b_trans), g.b_trans)
                if self.p.reload_a:
                    astride = self.layout[g.a][2]
                    for mi in range(self.mt):
                        r0 = self.mtile_row(mi)
                        self.ldsm(kf, nb + mi * 8, g.a, self.a_offset(astride, r0, kt * 16), False)

            def mma_k(kt: int, kf: tirx.Buffer) -> None:
                for n2 in range(self.nt // 2):
                    for mi in range(self.mt):  # one B fragment feeds every row tile of the warp
                        af, a = (kf, nb + mi * 8) if self.p.reload_a else (qf, mi * kd // 2 + kt * 8)
                        self.mma(sacc, mi * n4 + (2 * n2) * 4, af, a, kf, n2 * 8)
                        self.mma(sacc, mi * n4 + (2 * n2 + 1) * 4, af, a, kf, n2 * 8 + 4)

            if p.wgmma:
                if self.overlap:  # two MMA warpgroups take turns issuing their GEMMs (mma_ws)
                    self._await_turn()
                self._wgmma_scores(sacc, qf, base, wait=not self.overlap)
                if self.overlap:  # the previous step's P @ V joins the tensor pipe behind the scores
                    self._issue_previous_pv()
            else:
                self._pipelined(kd // 16, nb + (self.mt * 8 if self.p.reload_a else 0), load_k, mma_k)
            self.score[g.out] = sacc
        for n in p.tiles_in:
            copies, rows, stride = self.layout[n]
            buf = T.alloc_buffer((ns,), self.half, scope="local")
            for mi in range(self.mt):
                for ct in range(self.nt // 2):
                    r0 = self.mtile_row(mi)
                    if n in self.swizzled:  # landed by TMA in 64-column swizzled bands: the lane's row, its chunk
                        within = swizzled_128b(r0 + self.lane % 16, ct * 2 + self.lane // 16, rows, tirx.bitwise_xor)
                        soff = self.slot * (rows * stride) + within
                    else:
                        soff = self.slot * (rows * stride) + self.a_offset(stride, r0, ct * 16)
                    self.ldsm(buf, mi * n4 + ct * 8, n, soff, False)
            self.tin[n] = buf
        self.inline = {}
        for name in p.score_ops:
            e = self.inlined(self._score_body(name))
            c, rest = e.as_coeff_Mul()
            if c.is_Number and rest.is_Symbol:  # c * s: folded into its readers (exp's FFMA, max's scale)
                self.inline[name] = e
                continue
            buf = T.alloc_buffer((ns,), F32, scope="local")
            for i in range(ns):
                T.buffer_store(buf, self.expr(e, self.load_score(i)), [i])
            self.score[name] = buf
        for u in p.row_states:
            for h in range(2 * self.mt):
                T.buffer_store(self.rs_old[u.state], self.rs[u.state][h], [h])
        gemm_of = {gs.update.state: gs for gs in p.gemm_states}
        waited = self.groups == 1
        for u in self.s.plan.states:
            if u.state in gemm_of:
                if not waited:  # this step's second-GEMM operands: all groups but the next step's
                    T.evaluate(T.ptx.cp.async_.wait_group(self.groups * (p.stages - 1)))
                    T.evaluate(T.tvm_storage_sync("shared"))
                    waited = True
                self._gemm_update(gemm_of[u.state])
            else:
                self._row_update(u)

    def _wgmma_step(self) -> None:
        """``acc += A @ B`` of every GEMM state for this step on warpgroup MMA: per k16 slice, GEMM
        state and 64-row half one ``wgmma.mma_async.m64nNk16`` reading both tiles from their 128 B-swizzled
        layouts in shared memory (A K-major, B N-contiguous and transposed by the instruction), then one
        commit and a wait, so the ring slot is free when the next step's barrier lets its copy in.  GEMM
        states sharing A (a gated GEMM's G and U) read the same A slice, each its own B into its own
        accumulator: the slice's wgmmas of both are in flight together."""
        p = self.p
        a = p.tiles_in[0]
        a_tile = self._slot_tile(a, self.slot)
        T.evaluate(T.ptx.wgmma.fence.sync.aligned())
        for kt in range(p.step // 16):
            for gs in p.gemm_states:
                per = (gs.n_tile // 8) * 4  # accumulator floats per 64-row half: N / 2
                acc = self.acc[gs.update.state]
                op = self._wgmma(gs.n_tile)
                bdesc = self._mn_desc(gs, kt)
                for h in range(self.mt):  # this warpgroup's 64-row halves
                    # A [r, 64 k] K-major: a 64-row half is 8 atoms on; the k16 slice 32 B into the rows
                    adesc = self._k_desc(a_tile + self._half(h) * 8 * SWIZZLE_ATOM + kt * 16)
                    T.evaluate(op(*[acc[h * per + i] for i in range(per)], adesc, bdesc, T.ptx.pred(1), 1, 1, 0, 1))
        # with a lag, waited for at the top of the step after next, before its slot is reloaded
        self._wgmma_commit(wait=not self.lag)

    def _wgmma_rs(self, acc: tirx.Buffer, pf: tirx.Buffer, gs: GemmState, wait: bool = True) -> None:
        """``acc += P @ x`` on warpgroup MMA with P in registers: per k16 slice and 64-row half of
        this warpgroup one ``wgmma.mma_async.m64nNk16`` whose A operand is the 4 registers of P that
        mma.sync would take (the layouts agree) and whose B is the swizzled ``x`` tile (N-contiguous,
        transposed by the instruction); then a wait, before P's registers change."""
        per = (gs.n_tile // 8) * 4
        n4 = self.nt * 4
        words = self._words(pf, self.ns)  # P as packed pairs
        op = self._wgmma(gs.n_tile)
        T.evaluate(T.ptx.wgmma.fence.sync.aligned())
        for kt in range(self.p.step // 16):
            bdesc = self._mn_desc(gs, kt)
            for mi in range(self.mt):
                a = (mi * n4 + kt * 8) // 2
                T.evaluate(op(*[acc[mi * per + i] for i in range(per)], *[words[a + w] for w in range(4)], bdesc,
                              T.ptx.pred(1), 1, 1, 1))
        self._wgmma_commit(wait=wait)

    def _wgmma_scores(self, sacc: tirx.Buffer, qf: tirx.Buffer | None, base: tirx.PrimExpr,
                      wait: bool = True) -> None:
        """The score tile ``A @ B^T`` on warpgroup MMA: B (K, [L, d] with d contiguous) from its
        swizzled ring slot, K-major, d in 64-wide bands of atoms; A (Q) from its swizzled tile
        (``reload_a``) or from the fragments held in registers (the rs form)."""
        p, g = self.p, self.p.gemm
        kd, n4 = self.sizes[g.k], self.nt * 4
        op = self._wgmma(p.step)
        words = None if p.reload_a else self._words(qf, self.mt * kd // 2)
        T.evaluate(T.ptx.wgmma.fence.sync.aligned())
        for kt in range(kd // 16):
            band, within = kt // 4, (kt % 4) * 16  # a 64-wide band of d, then 16 elements (32 B) into it
            bdesc = self._k_desc(self.sbase[g.b] + base + band * (p.step // 8) * SWIZZLE_ATOM + within)
            for mi in range(self.mt):
                acc = [sacc[mi * n4 + i] for i in range(n4)]
                if words is None:
                    atom = band * (p.rows // 8) + self._half(mi) * 8
                    adesc = self._k_desc(self.sbase[g.a] + atom * SWIZZLE_ATOM + within)
                    T.evaluate(op(*acc, adesc, bdesc, T.ptx.pred(1), 1, 1, 0, 0))
                else:
                    a = (mi * kd // 2 + kt * 8) // 2
                    T.evaluate(op(*acc, *[words[a + w] for w in range(4)], bdesc, T.ptx.pred(1), 1, 1, 0))
        self._wgmma_commit(wait=wait)

    def _wgmma(self, n: int):
        """``wgmma.mma_async.sync.aligned.m64n{n}k16.f32`` with this kernel's input type (ss or rs
        form by the operands given)."""
        ab = "f16" if self.ab == "fp16" else "bf16"
        return getattr(getattr(getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{n}k16").f32, ab), ab)

    def _wgmma_commit(self, wait: bool) -> None:
        T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())
        if wait:
            T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))

    def _words(self, frag: tirx.Buffer, halves: int) -> tirx.Buffer:
        """An fp16/bf16 fragment as packed 32-bit pairs: the registers of a wgmma rs-form A operand."""
        words = T.alloc_buffer((halves // 2,), "uint32", scope="local")
        pack = "__pack_half2" if self.ab == "fp16" else "__pack_nv_bfloat162"  # TVM's CUDA header defines both
        for i in range(halves // 2):
            T.buffer_store(words, tirx.call_extern("uint32", pack, frag[2 * i], frag[2 * i + 1]), [i])
        return words

    def _half(self, mi: int) -> tirx.PrimExpr:
        """The block's 64-row half that this warp's 16-row tile ``mi`` lies in (its warpgroup's)."""
        return (self.warp // 4) * self.mt + mi

    def _mn_desc(self, gs: GemmState, kt: int) -> tirx.PrimExpr:
        """Descriptor of k16 slice ``kt`` of a GEMM state's swizzled ``x`` tile [k, n], N-contiguous
        (transposed by the instruction): 2 atoms down per slice, 64-column bands step * 128 B apart
        (LBO), 8-row atoms 1 KB apart (SBO)."""
        tile = self._slot_tile(gs.x, self.slot)
        return self._desc(tile + kt * 2 * SWIZZLE_ATOM, lbo=self.p.step * 128, sbo=2 * SWIZZLE_ATOM)

    def _k_desc(self, elem: tirx.PrimExpr) -> tirx.PrimExpr:
        """Descriptor of a K-major swizzled operand (K within one 128 B atom row: LBO unused)."""
        return self._desc(elem, lbo=16, sbo=2 * SWIZZLE_ATOM)

    def _desc(self, elem: tirx.PrimExpr, lbo: int, sbo: int) -> tirx.PrimExpr:
        """The 64-bit wgmma matrix descriptor of a 128-byte-swizzled tile at arena element ``elem``:
        start address, leading and stride byte offsets (16 B units), layout type 1 (128 B swizzle)."""
        addr = tirx.Cast("uint64", ((self.arena_addr[0] + elem * 2) >> 4) & 0x3FFF)
        return addr | tirx.const(((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (1 << 62), "uint64")

    def _pipelined(self, kts: int, size: int, load, mma) -> None:
        """Register double buffering over the k slices of a GEMM: the B fragments of slice kt+1
        are requested (ldmatrix) before the mma.sync of slice kt, so shared-memory latency overlaps
        the tensor cores instead of stalling each mma on its operands."""
        bufs = [T.alloc_buffer((size,), self.half, scope="local") for _ in range(min(2, kts))]
        load(0, bufs[0])
        for kt in range(kts):
            if kt + 1 < kts:
                load(kt + 1, bufs[(kt + 1) % 2])
            mma(kt, bufs[kt % 2])

    def _quad(self, part: tirx.Buffer, h: int, combiner: str) -> None:
        """Combine ``part[h]`` over the 4 threads of a quad (they share the row): 2 shuffles."""
        for off in (1, 2):
            v = part[h]
            other = T.tvm_warp_shuffle_xor(tirx.const(0xFFFFFFFF, "uint32"), v, off, 32, 32)
            T.buffer_store(part, tirx.max(v, other) if combiner == "max" else v + other, [h])

    def _row_update(self, u) -> None:
        if u.state in self.row_sums:  # summed on the tensor cores with the GEMM that multiplies the same tile
            return
        body = self.inlined(u.body)
        # a constant factor leaves the reduction: max(c*x) = c*max(x) for c > 0, sum(c*x) = c*sum(x)
        c, rest = body.as_coeff_Mul()
        scale = c.is_Number and c != 1 and not rest.is_Number and (u.combiner == "sum" or c > 0)
        vals = self.values(rest if scale else body)
        ident = _f(NEG_INF if u.combiner == "max" else 0.0)
        part = T.alloc_buffer((2 * self.mt,), F32, scope="local")
        for h in range(2 * self.mt):
            terms = []
            for i in range(self.ns):
                if self.slot_of(i, self.nt * 4) == h:
                    ok = self.valid(i)
                    terms.append(vals[i] if ok is None else tirx.if_then_else(ok, vals[i], ident))
            T.buffer_store(part, _tree(terms, u.combiner), [h])
            self._quad(part, h, u.combiner)
            if scale:
                T.buffer_store(part, part[h] * _f(float(c)), [h])
        buf = self.rs[u.state]
        moved = None
        if u.state in self.lazy:  # the warp keeps its reference unless a row's max outgrew it by the lag
            need = tirx.any(*[part[h] > buf[h] + _f(self.lazy[u.state]) for h in range(2 * self.mt)])
            moved = T.alloc_buffer((1,), I32, scope="local")
            T.buffer_store(moved, tirx.call_extern(I32, "__any_sync", tirx.const(0xFFFFFFFF, "uint32"),
                                                   tirx.Cast(I32, need)), [0])
            self.moved[u.state] = moved
        for h in range(2 * self.mt):
            if u.combiner == "max":
                new = tirx.max(buf[h], part[h])
                T.buffer_store(buf, new if moved is None else tirx.Select(moved[0] != 0, new, buf[h]), [h])
            else:
                carry = buf[h] if not u.carry else self.expr(u.carry, lambda n, h=h: self._load_row(n, h))
                T.buffer_store(buf, carry + part[h], [h])
        self.updated(u.state)

    def _load_row(self, name: str, h: int) -> tirx.PrimExpr:
        v = self.load_common(name, h, {self.p.row: self.row_of(h)})
        if v is None:
            raise ScheduleError(f"the warp-tile lowering cannot read {name!r} in a row update")
        return v

    def _load_acc(self, gs: GemmState, i: int, own: tirx.PrimExpr | None = None) -> Callable[[str], tirx.PrimExpr]:
        per = (gs.n_tile // 8) * 4
        h = self.slot_of(i, per)
        pos = {self.p.row: self.row_of(h), gs.n: self.col0(gs.n) + self.col_of(i, per)}

        def load(name: str) -> tirx.PrimExpr:
            base = name.removesuffix("__old").removesuffix("__new")
            if base in self.acc:
                return self.acc[base][i]
            v = self.load_common(name, h, pos)
            if v is None:
                raise ScheduleError(f"the warp-tile lowering cannot read {name!r} on an accumulator")
            return v

        return load

    def _gemm_update(self, gs: GemmState) -> None:
        p, u = self.p, gs.update
        acc = self.acc[u.state]
        if self.overlap:  # the previous step's P @ V is done: its slot goes back, the accumulator may change
            self._await_previous_pv()
        if u.carry:
            factor = carry_factor(u.carry, u.state)
            per = (gs.n_tile // 8) * 4
            # a kept reference leaves the factor 1 for the whole warp: the rescale is skipped
            refs = {x.name.removesuffix("__old").removesuffix("__new") for x in parse(u.carry).free_symbols}
            moved = next((self.moved[r] for r in refs if r in self.moved), None) if factor is not None else None
            with ExitStack() as guard:
                if moved is not None:
                    guard.enter_context(T.If(moved[0] != 0))
                    guard.enter_context(T.Then())
                if factor is not None:  # carry = X__old * (a per-row factor): one evaluation per row
                    rows = T.alloc_buffer((2 * self.mt,), F32, scope="local")
                    for h in range(2 * self.mt):
                        T.buffer_store(rows, self.expr(factor, lambda n, h=h: self._load_row(n, h)), [h])
                for i in range(int(acc.shape[0])):
                    v = acc[i] * rows[self.slot_of(i, per)] if factor is not None else \
                        self.expr(u.carry, self._load_acc(gs, i))
                    T.buffer_store(acc, v, [i])
        if gs.factor in self.tin and self.valid(0) is None:
            pf = self.tin[gs.factor]  # a plain GEMM operand: its ldmatrix fragments are the A operand
        else:
            vals = self.values(gs.factor)
            pf = self.pf_keep if self.overlap else T.alloc_buffer((self.ns,), self.half, scope="local")
            for i in range(self.ns):
                ok = self.valid(i)
                v = vals[i] if ok is None else tirx.if_then_else(ok, vals[i], _f(0.0))
                T.buffer_store(pf, tirx.Cast(self.half, v), [i])
        copies, rows, stride = self.layout[gs.x]
        base = self.slot * (rows * stride)
        per = (gs.n_tile // 8) * 4

        def load_v(kt: int, vf: tirx.Buffer) -> None:
            for n2 in range(gs.n_tile // 16):
                self.ldsm(vf, n2 * 8, gs.x, base + self.b_offset(stride, n2 * 16, kt * 16, True), True)

        def mma_v(kt: int, vf: tirx.Buffer) -> None:
            for n2 in range(gs.n_tile // 16):
                for mi in range(self.mt):
                    a = mi * self.nt * 4 + kt * 8
                    self.mma(acc, mi * per + (2 * n2) * 4, pf, a, vf, n2 * 8)
                    self.mma(acc, mi * per + (2 * n2 + 1) * 4, pf, a, vf, n2 * 8 + 4)

        if self.overlap:
            pass  # issued at the next step, behind its scores (or after the loop)
        elif p.wgmma:
            self._wgmma_rs(acc, pf, gs)
        else:
            self._pipelined(p.step // 16, gs.n_tile // 16 * 8, load_v, mma_v)
        self.updated(u.state)
        for st, of in self.row_sums.items():
            if of == u.state:
                self._row_sum_mma(st, pf)

    def _row_sum_mma(self, state: str, pf: tirx.Buffer) -> None:
        """Row sums of the fp16 factor tile ``pf`` (the values the GEMM multiplies) as ``pf @ 1`` on
        the tensor cores: every column of the n8 result holds its row's sum, nothing to shuffle."""
        u = next(x for x in self.p.row_states if x.state == state)
        ones = T.alloc_buffer((4,), self.half, scope="local")
        for i in range(4):
            T.buffer_store(ones, tirx.Cast(self.half, _f(1.0)), [i])
        part = T.alloc_buffer((4 * self.mt,), F32, scope="local")
        for i in range(4 * self.mt):
            T.buffer_store(part, _f(0.0), [i])
        for kt in range(self.p.step // 16):
            for mi in range(self.mt):
                self.mma(part, mi * 4, pf, mi * self.nt * 4 + kt * 8, ones, 0)
        buf = self.rs[state]
        for h in range(2 * self.mt):
            carry = buf[h] if not u.carry else self.expr(u.carry, lambda n, h=h: self._load_row(n, h))
            T.buffer_store(buf, carry + part[(h // 2) * 4 + 2 * (h % 2)], [h])
        self.updated(state)

def _tanh_approx(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``tanh.approx.f32`` of ``x``, through a register (the instruction writes its operand)."""
    t = T.alloc_buffer((1,), F32, scope="local")
    T.evaluate(T.ptx.tanh.approx.f32(t[0], x))
    return t[0]


def _cp_async(dtype: str, dst: tirx.Buffer, doff: tirx.PrimExpr, src: tirx.Buffer, soff: tirx.PrimExpr):
    from tvm.backend.cuda.op import ptx_cp_async_legacy

    return ptx_cp_async_legacy(dtype, dst.data, doff, src.data, soff, 16)


def tile_kept(bound: tuple[int, int, int, bool], l0, step: int, r_lo, r_hi):
    """Whether ``a*L + b*R + c <= 0`` (``< 0`` if strict) holds on all of the tile
    [l0, l0 + step) x [r_lo, r_hi]: at its worst L (the largest if a > 0) and its worst row (ints or TIR)."""
    a, b, c, strict = bound
    f = a * (l0 + step - 1 if a > 0 else l0) + b * (r_lo if b < 0 else r_hi) + c
    return f < 0 if strict else f <= 0


def row_tile_order(i, count: int, heavy_last: bool):
    """The row tile that the ``i``-th block of a batch coordinate takes when a killing mask makes
    the row tiles' work monotone in their index (causal: tile ``count - 1`` has all the steps):
    the heaviest, the lightest, the next heaviest, ... (ints or TIR).  Blocks start in index order,
    so the grid's tail gets short blocks, and the blocks resident together mix long and short ones.
    H100, causal (4, 32, 2048, 2048, 128): 489.5 against 499.2 us in index order."""
    far = count - 1 - i // 2
    near = i // 2
    if isinstance(i, int):
        return (far if i % 2 == 0 else near) if heavy_last else (near if i % 2 == 0 else far)
    return tirx.Select(i % 2 == 0, far, near) if heavy_last else tirx.Select(i % 2 == 0, near, far)


def build_warp_tile(s: Schedule) -> tirx.PrimFunc:
    """The PrimFunc of the warp-tile program of ``s`` (CUDA only)."""
    return _Gen(s, warp_tile_program(s)).build()


__all__ = ["build_warp_tile"]
