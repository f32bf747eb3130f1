"""The per-step update of a warp-tile kernel's running states, in plan order.

A row state (a running max or sum) reduces its body over the thread's score elements of each row,
then over the 4 threads of a quad with shuffles, and combines with its carry; a lazy max keeps the
warp's reference unless a row outgrew it.  A GEMM state rescales its accumulator by its carry
(one factor per row where the carry is ``X__old * factor``) and adds ``factor-tile @ x`` on the
tensor cores; a sum state of the same factor tile may ride along as ``P @ 1``.
"""

from __future__ import annotations

from contextlib import ExitStack

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedulers.temporal import UpdateFunction
from schedulers.warp_tile import GemmState, carry_factor
from smg.expr import parse
from spacefusion.lower.exprs import F32, subtracted_max
from spacefusion.lower.mma_overlap import Overlap
from spacefusion.lower.mma_state import I32, NEG_INF, KernelState, f32, tree
from spacefusion.lower.mma_sync import MmaSync
from spacefusion.lower.mma_values import Values
from spacefusion.lower.mma_wgmma import Wgmma


class RowUpdate:
    """Running-state updates on the registers of :class:`KernelState` ``st``."""

    def __init__(self, st: KernelState, values: Values, sync: MmaSync, wgmma: Wgmma, overlap: Overlap) -> None:
        self.st = st
        self.values = values
        self.sync = sync
        self.wgmma = wgmma
        self.overlap = overlap

    def init_states(self) -> None:
        """Row states at their combiners' identities, accumulators at zero."""
        st = self.st
        for u in st.p.row_states:
            for h in range(2 * st.mt):
                T.buffer_store(st.rs[u.state], f32(NEG_INF if u.combiner == "max" else 0.0), [h])
                if u.state in st.rs_safe:
                    T.buffer_store(st.rs_safe[u.state], f32(0.0), [h])
        for buf in st.acc.values():
            for i in range(int(buf.shape[0])):
                T.buffer_store(buf, f32(0.0), [i])

    def quad(self, part: tirx.Buffer, h: int, combiner: str) -> None:
        """Combine ``part[h]`` over the 4 threads of a quad (they share the row): 2 shuffles."""
        for off in (1, 2):
            v = part[h]
            other = T.tvm_warp_shuffle_xor(tirx.const(0xFFFFFFFF, "uint32"), v, off, 32, 32)
            T.buffer_store(part, tirx.max(v, other) if combiner == "max" else v + other, [h])

    def row_state(self, u: UpdateFunction) -> None:
        """Update row state ``u`` with this step's score tile (unless summed on the tensor cores)."""
        st, vals_of = self.st, self.values
        if u.state in st.row_sums:  # summed on the tensor cores with the GEMM that multiplies the same tile
            return
        body = vals_of.inlined(u.body)
        # a constant factor leaves the reduction: max(c*x) = c*max(x) for c > 0, sum(c*x) = c*sum(x)
        c, rest = body.as_coeff_Mul()
        scale = c.is_Number and c != 1 and not rest.is_Number and (u.combiner == "sum" or c > 0)
        vals = vals_of.values(rest if scale else body)
        ident = f32(NEG_INF if u.combiner == "max" else 0.0)
        part = T.alloc_buffer((2 * st.mt,), F32, scope="local")
        for h in range(2 * st.mt):
            terms = []
            for i in range(st.ns):
                if st.slot_of(i, st.nt * 4) == h:
                    ok = vals_of.valid(i)
                    terms.append(vals[i] if ok is None else tirx.if_then_else(ok, vals[i], ident))
            T.buffer_store(part, tree(terms, u.combiner), [h])
            self.quad(part, h, u.combiner)
            if scale:
                T.buffer_store(part, part[h] * f32(float(c)), [h])
        buf = st.rs[u.state]
        moved = None
        if u.state in st.lazy:  # the warp keeps its reference unless a row's max outgrew it by the lag
            need = tirx.any(*[part[h] > buf[h] + f32(st.lazy[u.state]) for h in range(2 * st.mt)])
            moved = T.alloc_buffer((1,), I32, scope="local")
            T.buffer_store(moved, tirx.call_extern(I32, "__any_sync", tirx.const(0xFFFFFFFF, "uint32"),
                                                   tirx.Cast(I32, need)), [0])
            st.moved[u.state] = moved
        for h in range(2 * st.mt):
            if u.combiner == "max":
                new = tirx.max(buf[h], part[h])
                T.buffer_store(buf, new if moved is None else tirx.Select(moved[0] != 0, new, buf[h]), [h])
                T.buffer_store(st.rs_safe[u.state], subtracted_max(buf[h]), [h])
            else:
                carry = buf[h] if not u.carry else vals_of.expr(u.carry, lambda n, h=h: vals_of.load_row(n, h))
                T.buffer_store(buf, carry + part[h], [h])
        vals_of.updated(u.state)

    def gemm_state(self, gs: GemmState) -> None:
        """Rescale GEMM state ``gs``'s accumulator by its carry, then add this step's ``factor @ x``."""
        st, vals_of, p, u = self.st, self.values, self.st.p, gs.update
        acc = st.acc[u.state]
        if st.overlap:  # the previous step's P @ V is done: its slot goes back, the accumulator may change
            self.overlap.await_previous_pv()
        if u.carry:
            factor = carry_factor(u.carry, u.state)
            per = (gs.n_tile // 8) * 4
            # a kept reference leaves the factor 1 for the whole warp: the rescale is skipped
            refs = {x.name.removesuffix("__old").removesuffix("__new") for x in parse(u.carry).free_symbols}
            moved = next((st.moved[r] for r in refs if r in st.moved), None) if factor is not None else None
            with ExitStack() as guard:
                if moved is not None:
                    guard.enter_context(T.If(moved[0] != 0))
                    guard.enter_context(T.Then())
                if factor is not None:  # carry = X__old * (a per-row factor): one evaluation per row
                    rows = T.alloc_buffer((2 * st.mt,), F32, scope="local")
                    for h in range(2 * st.mt):
                        T.buffer_store(rows, vals_of.expr(factor, lambda n, h=h: vals_of.load_row(n, h)), [h])
                for i in range(int(acc.shape[0])):
                    v = acc[i] * rows[st.slot_of(i, per)] if factor is not None else \
                        vals_of.expr(u.carry, vals_of.load_acc(gs, i))
                    T.buffer_store(acc, v, [i])
        if gs.factor in st.tin and vals_of.valid(0) is None:
            pf = st.tin[gs.factor]  # a plain GEMM operand: its ldmatrix fragments are the A operand
        else:
            vals = vals_of.values(gs.factor)
            pf = st.pf_keep if st.overlap else T.alloc_buffer((st.ns,), st.half, scope="local")
            for i in range(st.ns):
                ok = vals_of.valid(i)
                v = vals[i] if ok is None else tirx.if_then_else(ok, vals[i], f32(0.0))
                T.buffer_store(pf, tirx.Cast(st.half, v), [i])
        copies, rows, stride = st.layout[gs.x]
        base = st.slot * (rows * stride)
        per = (gs.n_tile // 8) * 4
        sync = self.sync

        trans = not gs.k_major  # x [step, n_tile] is transposed by ldmatrix; a K-major [n_tile, step] is not

        def load_v(kt: int, vf: tirx.Buffer) -> None:
            for n2 in range(gs.n_tile // 16):
                sync.ldsm(vf, n2 * 8, gs.x, base + sync.b_offset(stride, n2 * 16, kt * 16, trans), trans)

        def mma_v(kt: int, vf: tirx.Buffer) -> None:
            for n2 in range(gs.n_tile // 16):
                for mi in range(st.mt):
                    a = mi * st.nt * 4 + kt * 8
                    sync.mma(acc, mi * per + (2 * n2) * 4, pf, a, vf, n2 * 8)
                    sync.mma(acc, mi * per + (2 * n2 + 1) * 4, pf, a, vf, n2 * 8 + 4)

        if st.overlap:
            pass  # issued at the next step, behind its scores (or after the loop)
        elif p.hopper.wgmma:
            self.wgmma.rs(acc, pf, gs)
        else:
            sync.pipelined(p.step // 16, gs.n_tile // 16 * 8, load_v, mma_v)
        vals_of.updated(u.state)
        for state, of in st.row_sums.items():
            if of == u.state:
                self.row_sum_mma(state, pf)

    def row_sum_mma(self, state: str, pf: tirx.Buffer) -> None:
        """Row sums of the fp16 factor tile ``pf`` (the values the GEMM multiplies) as ``pf @ 1`` on
        the tensor cores: every column of the n8 result holds its row's sum, nothing to shuffle."""
        st, vals_of = self.st, self.values
        u = next(x for x in st.p.row_states if x.state == state)
        ones = T.alloc_buffer((4,), st.half, scope="local")
        for i in range(4):
            T.buffer_store(ones, tirx.Cast(st.half, f32(1.0)), [i])
        part = T.alloc_buffer((4 * st.mt,), F32, scope="local")
        for i in range(4 * st.mt):
            T.buffer_store(part, f32(0.0), [i])
        for kt in range(st.p.step // 16):
            for mi in range(st.mt):
                self.sync.mma(part, mi * 4, pf, mi * st.nt * 4 + kt * 8, ones, 0)
        buf = st.rs[state]
        for h in range(2 * st.mt):
            carry = buf[h] if not u.carry else vals_of.expr(u.carry, lambda n, h=h: vals_of.load_row(n, h))
            T.buffer_store(buf, carry + part[(h // 2) * 4 + 2 * (h % 2)], [h])
        vals_of.updated(state)
