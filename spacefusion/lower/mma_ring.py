"""The ring loader of a warp-tile kernel: the streamed tiles of each serial step copied into a
``stages``-deep ring of shared tiles, ahead of the step that reads them.

A copy is cp.async in 16-byte chunks by the MMA threads (rows padded by 8 elements, or 128 B-swizzled
where wgmma reads the tile through descriptors), or a TMA load by thread 0 (:mod:`mma_tma`).  Warp
groups (``split``) interleave the steps, each group its own ``stages`` slots.
"""

from __future__ import annotations

from contextlib import ExitStack

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedulers.warp_tile import swizzled_128b
from spacefusion.lower.exprs import to_tir_int
from spacefusion.lower.mma_state import I32, KernelState
from spacefusion.lower.mma_tma import TmaRing


class Ring:
    """Loads into and waits on the ring slots of :class:`KernelState` ``st``."""

    def __init__(self, st: KernelState, tma: TmaRing) -> None:
        self.st = st
        self.tma = tma

    def copy_tile(self, name: str, slot: tirx.PrimExpr, rdim: str, r0: tirx.PrimExpr,
                  cdim: str, c0: tirx.PrimExpr, pred: tirx.PrimExpr | None = None, block: bool = False) -> None:
        """Copy a [rows, cols] tile (cols = ``cdim``, contiguous) of ``name`` into copy ``slot``
        of its shared buffer in 16-byte cp.async chunks, by this warp group's threads (the whole
        block's with ``block``); rows/chunks past the end are clamped (their values are masked or
        multiplied by zero downstream)."""
        st = self.st
        rows = st.layout[name][1]
        per_row = st.cols[name] // 8  # the columns that exist (a swizzled tile's last band may be partial)
        total = rows * per_row
        th = st.p.threads if block else 32 * st.p.warps
        with T.serial(0, -(-total // th)) as it:
            c = it * th + (st.tid if block else st.gtid)
            r, cc = c // per_row, (c % per_row) * 8
            grow = tirx.min(r0 + r, st.sizes[rdim] - 1)
            gcol = tirx.min(c0 + cc, st.sizes[cdim] - 8)
            conds = [c < total] if total % th else []
            if pred is not None:
                conds.append(pred)
            src = self._flat(name, {rdim: grow, cdim: gcol})
            dst = self._in_slot(name, slot, r, cc)
            with ExitStack() as guard:
                if conds:
                    guard.enter_context(T.If(tirx.all(*conds)))
                    guard.enter_context(T.Then())
                T.evaluate(_cp_async(st.half, st.smem[name], st.sbase[name] + dst, st.glob[name], src))

    def gather_tile(self, name: str, slot: tirx.PrimExpr, t0: tirx.PrimExpr, pred: tirx.PrimExpr | None) -> None:
        """Stage the [rows, step] tile of the gathered view ``name`` (an implicit GEMM's im2col tile) at rows
        ``row0..``, columns ``t0..``: each 16-byte chunk's address in the viewed input comes from the view's
        index expressions (``schedulers.gather_tile``: a chunk is 8 consecutive elements there), and a chunk
        outside the input (the convolution's padding), past the rows or past the serial dim is zeros, so a
        partial last step adds nothing to the GEMM."""
        st, p = self.st, self.st.p
        g = p.gather(name)
        if g.scalar:
            self._gather_scalar(name, slot, t0, pred)
            return
        src = st.smg.space(g.src)
        rows = st.layout[name][1]
        per_row = st.cols[name] // 8
        total = rows * per_row
        th = 32 * st.p.warps
        with T.serial(0, -(-total // th)) as it:
            c = it * th + st.gtid
            r, cc = c // per_row, (c % per_row) * 8
            row, col = st.row0 + r, t0 + cc
            comps, ok = self._view_at(g, row, col)
            off = tirx.const(0, I32)
            for e, d in zip(comps, src.dims):
                off = off * st.sizes[d] + e
            dst = self._in_slot(name, slot, r, cc)
            with ExitStack() as guard:
                self._only(guard, c, total, th, pred)
                # ok false: src-size 0, cp.async writes the 16 bytes as zeros, reading nothing
                T.evaluate(T.ptx.cp.async_.cg.shared.global_(
                    st.smem[name].access_ptr("w", offset=st.sbase[name] + dst),
                    st.glob[g.src].access_ptr("r", offset=tirx.Select(ok, off, 0)), 16,
                    tirx.Select(ok, tirx.const(16, "uint32"), tirx.const(0, "uint32"))))

    def _gather_scalar(self, name: str, slot: tirx.PrimExpr, t0: tirx.PrimExpr, pred: tirx.PrimExpr | None) -> None:
        """``gather_tile`` for a view whose 8 columns are not 8 neighbours in the image (NCHW): each thread loads
        its chunk's 8 elements one by one (0 outside the image, past the rows or past the serial dim) and
        stores them as one 16-byte chunk.  The threads walk the rows first, so a warp's load of one column
        reads 32 neighbouring output pixels, in NCHW neighbouring input pixels of one channel.  Plain loads,
        not cp.async: each thread waits for its own before storing, and the slot's barrier publishes them."""
        st, p = self.st, self.st.p
        g = p.gather(name)
        buf = st.glob[g.src]
        rows = st.layout[name][1]
        total = rows * (st.cols[name] // 8)
        th = 32 * p.warps
        with T.serial(0, -(-total // th)) as it:
            c = it * th + st.gtid
            r, cc = c % rows, (c // rows) * 8
            row = st.row0 + r
            dst = self._in_slot(name, slot, r, cc)
            with ExitStack() as guard:
                self._only(guard, c, total, th, pred)
                vals = T.alloc_buffer((8,), st.half, scope="local")
                for e in range(8):
                    comps, ok = self._view_at(g, row, t0 + cc + e)
                    at = [tirx.Select(ok, x, 0) for x in comps]
                    T.buffer_store(vals, tirx.Select(ok, buf[at], tirx.const(0, st.half)), [e])
                T.buffer_store(st.smem[name], vals[tirx.Ramp(0, 1, 8)],
                               [tirx.Ramp(st.sbase[name] + dst, 1, 8)])

    def _view_at(self, g, row: tirx.PrimExpr, col: tirx.PrimExpr) -> tuple[list[tirx.PrimExpr], tirx.PrimExpr]:
        """The gathered view ``g``'s element (row, col) as its source's indices, and whether it lies inside the
        source, the rows and the serial dim (else it reads as the padding's zero)."""
        st, p = self.st, self.st.p
        env = {p.row: row, p.serial: col}

        def value(d: str) -> tirx.PrimExpr:
            return env[d] if d in env else st.coord[d]

        comps = [to_tir_int(text, value) for text in g.index]
        inside = [row < st.sizes[p.row], col < st.sizes[p.serial]]
        inside += [b for e, d in zip(comps, st.smg.space(g.src).dims) for b in (e >= 0, e < st.sizes[d])]
        return comps, tirx.all(*inside)

    @staticmethod
    def _only(guard: ExitStack, c: tirx.PrimExpr, total: int, th: int, pred: tirx.PrimExpr | None) -> None:
        """Enter the guard of a cooperative loop's chunk ``c``: inside the tile, and the step's ``pred``."""
        conds = ([c < total] if total % th else []) + ([pred] if pred is not None else [])
        if conds:
            guard.enter_context(T.If(tirx.all(*conds)))
            guard.enter_context(T.Then())

    def zero_columns(self, name: str, c_from: int, c_to: int, block: bool = True) -> None:
        """Zero columns [c_from, c_to) (whole 16-byte chunks) of every row of every copy of the shared tile
        ``name``, by the whole block (else by the MMA threads): the contraction's padding to the MMAs' k of
        16 (a head dim of 40 run as 48), which no cp.async load writes, so once before the loop serves
        every step.  Both operands' pads are zeroed: uninitialised shared memory may hold NaNs, and
        NaN x 0 is NaN.  (TMA's boxes fill whole bands, zeros past the tensor's end.)"""
        st = self.st
        copies, rows, _ = st.layout[name]
        per_row = (c_to - c_from) // 8
        total = copies * rows * per_row
        th = st.p.threads if block else 32 * st.p.warps
        with T.serial(0, -(-total // th)) as it:
            c = it * th + (st.tid if block else st.gtid)
            slot, rest = c // (rows * per_row), c % (rows * per_row)
            r, cc = rest // per_row, c_from + (rest % per_row) * 8
            dst = self._in_slot(name, slot, r, cc)
            with ExitStack() as guard:
                if total % th:
                    guard.enter_context(T.If(c < total))
                    guard.enter_context(T.Then())
                T.buffer_store(st.smem[name], tirx.Broadcast(tirx.const(0, st.half), 8),
                               [tirx.Ramp(st.sbase[name] + dst, 1, 8)])

    def _in_slot(self, name: str, slot: tirx.PrimExpr, r: tirx.PrimExpr, cc: tirx.PrimExpr) -> tirx.PrimExpr:
        """Offset in ``name``'s shared buffer of row ``r``, column ``cc`` (a 16-byte chunk's first) of copy
        ``slot``: 128 B-swizzled where wgmma reads the tile, else rows padded by 8."""
        _, rows, stride = self.st.layout[name]
        inner = (swizzled_128b(r, cc // 8, rows, tirx.bitwise_xor) if name in self.st.swizzled
                 else r * stride + cc)
        return slot * (rows * stride) + inner

    def _flat(self, name: str, pos: dict[str, tirx.PrimExpr]) -> tirx.PrimExpr:
        """Row-major element offset of ``name`` at ``pos`` (batch coordinates filled in)."""
        st = self.st
        off = tirx.const(0, I32)
        for d in st.smg.space(name).dims:
            off = off * st.sizes[d] + (pos[d] if d in pos else st.coord[d])
        return off

    def step_of(self, j: tirx.PrimExpr) -> tirx.PrimExpr:
        """The serial step of this warp group's ``j``-th iteration (groups interleave steps; a
        slice's block starts at its first step)."""
        st = self.st
        if st.p.warp.split > 1:
            return st.first + j * st.p.warp.split + st.grp
        return st.first + j

    def slot_for(self, j: tirx.PrimExpr) -> tirx.PrimExpr:
        """Ring slot of iteration ``j``: the group's own ``stages`` copies."""
        st, p = self.st, self.st.p
        local = j % p.warp.stages if p.warp.stages > 1 else tirx.const(0, I32)
        return st.grp * p.warp.stages + local if p.warp.split > 1 else local

    def issue_step(self, j: tirx.PrimExpr, pred: tirx.PrimExpr | None) -> None:
        """cp.async the streamed tiles of this group's iteration ``j`` into its ring slot."""
        st, p = self.st, self.st.p
        L = p.serial
        slot = self.slot_for(j)
        t0 = self.step_of(j) * p.step
        if p.hopper.tma:
            self.tma.step(slot, t0, pred)
            return
        if p.gemm is not None:
            g = p.gemm
            if g.b_trans:
                self.copy_tile(g.b, slot, g.k, tirx.const(0, I32), L, t0, pred)
            else:
                self.copy_tile(g.b, slot, L, t0, g.k, tirx.const(0, I32), pred)
        for n in p.tiles_in:
            if p.gather(n) is not None:
                self.gather_tile(n, slot, t0, pred)
            else:
                self.copy_tile(n, slot, p.row, st.row0, L, t0, pred)
        if st.groups == 2:  # the score tile's operands land first: it starts while the rest arrive
            T.evaluate(T.ptx.cp.async_.commit_group())
        for x in dict.fromkeys(gs.x for gs in p.gemm_states):
            gs = next(gs for gs in p.gemm_states if gs.x == x)
            if gs.k_major:  # [n_tile, step]: rows along N, 16-byte chunks along L
                self.copy_tile(x, slot, gs.n, st.col0(gs.n), L, t0, pred)
            else:
                self.copy_tile(x, slot, L, t0, gs.n, st.col0(gs.n), pred)
        T.evaluate(T.ptx.cp.async_.commit_group())

    def wait_tiles(self, j: tirx.PrimExpr, pending: int) -> None:
        """Wait for iteration ``j``'s tiles: its slot's mbarrier phase (TMA), or this thread's
        cp.async groups but ``pending``, then (wgmma) a proxy fence, since wgmma reads through the async
        proxy what cp.async wrote through the generic one."""
        p = self.st.p
        if p.hopper.tma:
            T.evaluate(T.cuda.mbarrier_wait(self.tma.full(self.slot_for(j)), tirx.floordiv(j, p.warp.stages) % 2))
            return
        T.evaluate(T.ptx.cp.async_.wait_group(pending))
        if p.hopper.wgmma:
            T.evaluate(T.ptx.fence.proxy.async_.shared__cta())


def _cp_async(dtype: str, dst: tirx.Buffer, doff: tirx.PrimExpr, src: tirx.Buffer, soff: tirx.PrimExpr):
    from tvm.backend.cuda.op import ptx_cp_async_legacy

    return ptx_cp_async_legacy(dtype, dst.data, doff, src.data, soff, 16)
