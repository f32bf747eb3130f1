"""One serial step of a warp-tile kernel, once its tiles have landed in ring slot ``st.slot``.

The score tile is an ``mma.sync`` (or ``wgmma``) GEMM, or a staged input read by ``ldmatrix``, held
in the accumulator layout; the score ops are evaluated on those registers (constant scalings folded
into their readers), then the plan's states update in plan order.  Under a killing mask the step is
emitted twice: as is, and without the mask for the tiles it keeps whole.
"""

from __future__ import annotations

import sympy as sp
from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedulers.warp_tile import swizzled_128b
from smg.expr import body_expr
from spacefusion.lower.exprs import F32
from spacefusion.lower.mma_overlap import Overlap
from spacefusion.lower.mma_rows import RowUpdate
from spacefusion.lower.mma_state import KernelState, f32
from spacefusion.lower.mma_sync import MmaSync
from spacefusion.lower.mma_values import Values
from spacefusion.lower.mma_wgmma import Wgmma


def tile_kept(bound: tuple[int, int, int, bool], l0, step: int, r_lo, r_hi):
    """Whether ``a*L + b*R + c <= 0`` (``< 0`` if strict) holds on all of the tile
    [l0, l0 + step) x [r_lo, r_hi]: at its worst L (the largest if a > 0) and its worst row (ints or TIR)."""
    a, b, c, strict = bound
    f = a * (l0 + step - 1 if a > 0 else l0) + b * (r_lo if b < 0 else r_hi) + c
    return f < 0 if strict else f <= 0


class Step:
    """The body of one serial step over :class:`KernelState` ``st``."""

    def __init__(self, st: KernelState, values: Values, sync: MmaSync, wgmma: Wgmma, overlap: Overlap,
                 rows: RowUpdate) -> None:
        self.st = st
        self.values = values
        self.sync = sync
        self.wgmma = wgmma
        self.overlap = overlap
        self.rows = rows

    def masked(self, qf: tirx.Buffer | None) -> None:
        """This step, and under a killing mask a copy of it without the mask for the tiles it keeps whole."""
        kept = self._tile_kept()
        if kept is None:
            self.run(qf)
            return
        with T.If(kept):
            with T.Then():
                self.st.unmasked = True
                self.run(qf)
                self.st.unmasked = False
            with T.Else():
                self.run(qf)

    def _tile_kept(self) -> tirx.PrimExpr | None:
        """Whether the killing masks keep every element of this step's tile (None: no such mask):
        each ``a*L + b*R + c <= 0`` at the tile's worst L and worst row; or whether the step lies inside
        the block's one dense run of keys that its padding masks keep (``Block.step_range``)."""
        st = self.st
        if st.col_kept is not None:
            first, last, dense = st.col_kept
            return tirx.all(dense, st.t0 >= first, st.t0 + st.p.step - 1 <= last)
        if not st.masks:
            return None
        r_hi = tirx.min(st.row0 + st.p.rows, st.sizes[st.p.row]) - 1
        return tirx.all(*[tile_kept(b, st.t0, st.p.step, st.row0, r_hi) for b in st.masks.values()])

    def _score_body(self, name: str) -> sp.Expr:
        """The body of score op ``name``; on a kept tile the killing mask is its kept branch."""
        e = body_expr(self.st.smg.producer(name))
        if self.st.unmasked and (name in self.st.masks or name in self.st.col_masks):
            return e.args[0][0]
        return e

    def run(self, qf: tirx.Buffer | None) -> None:
        """The step: its score tile (``qf``: A's fragments when held in registers), score ops, updates."""
        st, p = self.st, self.st.p
        if p.wgmma_ss:  # both operands from shared memory; row states read A's tile while the wgmmas run
            self.wgmma.step(wait=not st.lag and not p.row_states)
            if p.row_states:
                self.row_statistics()
                if not st.lag:  # the slot's wgmmas done before the next step's barrier frees it
                    T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
            return
        self._score_tile(qf)
        gemm_of = {gs.update.state: gs for gs in p.gemm_states}
        waited = st.groups == 1
        for u in st.s.plan.states:
            if u.state in gemm_of:
                if not waited:  # this step's second-GEMM operands: all groups but the next step's
                    T.evaluate(T.ptx.cp.async_.wait_group(st.groups * (p.warp.stages - 1)))
                    T.evaluate(T.tvm_storage_sync("shared"))
                    waited = True
                self.rows.gemm_state(gemm_of[u.state])
            else:
                self.rows.row_state(u)

    def row_statistics(self) -> None:
        """The row states of wgmma's ss form from the step's staged A tile (its GEMM states need nothing
        but the tile: ``warp_tile.staged_factors``), issued after the step's wgmmas, which run meanwhile."""
        self._score_tile(None)
        for u in self.st.p.row_states:
            self.rows.row_state(u)

    def _score_tile(self, qf: tirx.Buffer | None) -> None:
        """The step's score tile, staged inputs' fragments and score ops, and the row states' old values."""
        st, p = self.st, self.st.p
        st.cache = {}
        st.score = {}
        st.tin = {}
        if p.gemm is not None:
            st.score[p.gemm.out] = self._scores(qf)
        self._staged_inputs()
        st.inline = {}
        for name in p.score_ops:
            e = self.values.inlined(self._score_body(name))
            c, rest = e.as_coeff_Mul()
            if c.is_Number and rest.is_Symbol:  # c * s: folded into its readers (exp's FFMA, max's scale)
                st.inline[name] = e
                continue
            buf = T.alloc_buffer((st.ns,), F32, scope="local")
            for i in range(st.ns):
                T.buffer_store(buf, self.values.expr(e, self.values.load_score(i)), [i])
            st.score[name] = buf
        for u in p.row_states:
            for h in range(2 * st.mt):
                T.buffer_store(st.rs_old[u.state], st.rs[u.state][h], [h])

    def _scores(self, qf: tirx.Buffer | None) -> tirx.Buffer:
        """The score GEMM ``A @ B^T`` of this step into fresh fp32 fragments."""
        st, p, sync = self.st, self.st.p, self.sync
        g = p.gemm
        n4, ns = st.nt * 4, st.ns
        sacc = T.alloc_buffer((ns,), F32, scope="local")
        for i in range(ns):
            T.buffer_store(sacc, f32(0.0), [i])
        copies, rows, stride = st.layout[g.b]
        base = st.slot * (rows * stride)
        kd = g.kp  # the MMAs run K padded to 16 (zero columns in shared memory)

        nb = st.nt // 2 * 8  # B fragment halves per k slice; A's (when reloaded) follow them

        def load_k(kt: int, kf: tirx.Buffer) -> None:
            for n2 in range(st.nt // 2):
                sync.ldsm(kf, n2 * 8, g.b, base + sync.b_offset(stride, n2 * 16, kt * 16, g.b_trans), g.b_trans)
            if p.warp.reload_a:
                astride = st.layout[g.a][2]
                for mi in range(st.mt):
                    r0 = st.mtile_row(mi)
                    sync.ldsm(kf, nb + mi * 8, g.a, sync.a_offset(astride, r0, kt * 16), False)

        def mma_k(kt: int, kf: tirx.Buffer) -> None:
            for n2 in range(st.nt // 2):
                for mi in range(st.mt):  # one B fragment feeds every row tile of the warp
                    af, a = (kf, nb + mi * 8) if p.warp.reload_a else (qf, mi * kd // 2 + kt * 8)
                    sync.mma(sacc, mi * n4 + (2 * n2) * 4, af, a, kf, n2 * 8)
                    sync.mma(sacc, mi * n4 + (2 * n2 + 1) * 4, af, a, kf, n2 * 8 + 4)

        if p.hopper.wgmma:
            if st.overlap:  # two MMA warpgroups take turns issuing their GEMMs (mma_overlap)
                self.overlap.await_turn()
            self.wgmma.scores(sacc, qf, base, wait=not st.overlap)
            if st.overlap:  # the previous step's P @ V joins the tensor pipe behind the scores
                self.overlap.issue_previous_pv()
        else:
            sync.pipelined(kd // 16, nb + (st.mt * 8 if p.warp.reload_a else 0), load_k, mma_k)
        return sacc

    def _staged_inputs(self) -> None:
        """Inputs staged on the score plane (a plain GEMM's A, Softmax-GEMM's S) read from their ring
        slot into fragments of the accumulator layout."""
        st = self.st
        n4 = st.nt * 4
        for n in st.p.tiles_in:
            copies, rows, stride = st.layout[n]
            buf = T.alloc_buffer((st.ns,), st.half, scope="local")
            for mi in range(st.mt):
                for ct in range(st.nt // 2):
                    r0 = st.mtile_row(mi)
                    if n in st.swizzled:  # landed by TMA in 64-column swizzled bands: the lane's row, its chunk
                        within = swizzled_128b(r0 + st.lane % 16, ct * 2 + st.lane // 16, rows, tirx.bitwise_xor)
                        soff = st.slot * (rows * stride) + within
                    else:
                        soff = st.slot * (rows * stride) + self.sync.a_offset(stride, r0, ct * 16)
                    self.sync.ldsm(buf, mi * n4 + ct * 8, n, soff, False)
            st.tin[n] = buf
