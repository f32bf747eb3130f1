"""Expressions of the plan evaluated on a warp-tile kernel's registers.

Every value the kernel computes comes from the plan's sympy expressions, lowered to fp32 TIR with
loads that resolve names against the state: row states (rows ``g + 8h`` of the thread), score
fragments, staged input fragments, accumulator fragments, dims as indices and inputs read from
global memory.  Per-step values on the score tile are computed once and cached until a state they
read changes.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp
from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedulers.errors import ScheduleError
from schedulers.warp_tile import MMA_DTYPES, GemmState
from smg.expr import parse
from spacefusion.lower.exprs import F32, to_tir
from spacefusion.lower.mma_state import KernelState, f32


class Values:
    """Expression evaluation on the fragments of :class:`KernelState` ``st``."""

    def __init__(self, st: KernelState) -> None:
        self.st = st

    # -- global memory ---------------------------------------------------------------------------
    def element(self, name: str, pos: dict[str, tirx.PrimExpr]) -> tirx.PrimExpr:
        """One element from global memory (tail positions clamped; their results are not stored)."""
        st = self.st
        dims = st.smg.space(name).dims
        v = st.glob[name][[tirx.min(pos[d], st.sizes[d] - 1) if d in pos else st.coord[d] for d in dims]]
        return v if st.glob[name].dtype == F32 else tirx.Cast(F32, v)

    # -- expressions -----------------------------------------------------------------------------
    def expr(self, text_or_expr, load: Callable[[str], tirx.PrimExpr], stored: str = F32) -> tirx.PrimExpr:
        """``text`` as fp32 TIR; ``stored``: the dtype its value is stored in (a 2-byte one allows
        the fast division)."""
        st = self.st
        e = parse(text_or_expr) if isinstance(text_or_expr, str) else text_or_expr
        return to_tir(e, load, exp2=True, fold_log2e=st.fold_log2e or (st.unmasked and st.fold_unmasked),
                      fast_div=stored in MMA_DTYPES,
                      tanh=_tanh_approx if st.p.warp.fast_math and stored in MMA_DTYPES else None,
                      branch_free=stored in MMA_DTYPES, sums=st.sums)

    def inlined(self, text_or_expr) -> sp.Expr:
        """``text`` with the inlined score ops (constant scalings) substituted by their bodies."""
        e = parse(text_or_expr) if isinstance(text_or_expr, str) else text_or_expr
        subs = {x: self.st.inline[x.name] for x in e.free_symbols if x.name in self.st.inline}
        return e.xreplace(subs) if subs else e

    def values(self, text_or_expr) -> tirx.Buffer:
        """Per-element values of an expression on the score tile this step (computed once)."""
        st = self.st
        e = self.inlined(text_or_expr)
        key = str(e)
        if key not in st.cache:
            buf = T.alloc_buffer((st.ns,), F32, scope="local")
            for i in range(st.ns):
                T.buffer_store(buf, self.expr(e, self.load_score(i)), [i])
            st.cache[key] = (frozenset(x.name for x in e.free_symbols), buf)
        return st.cache[key][1]

    def updated(self, state: str) -> None:
        """``state`` changed: cached values reading it are stale."""
        self.st.cache = {k: v for k, v in self.st.cache.items() if state not in v[0]}

    def valid(self, i: int) -> tirx.PrimExpr | None:
        """Whether score element ``i`` lies before the end of the serial dim (None: always)."""
        st = self.st
        L = st.sizes[st.p.serial]
        if L % st.p.step == 0:
            return None
        return st.t0 + st.col_of(i, st.nt * 4) < L

    # -- loads -----------------------------------------------------------------------------------
    def load_common(self, name: str, h: int, pos: dict[str, tirx.PrimExpr]) -> tirx.PrimExpr | None:
        """Row states (rows g + 8h), dims as indices, inputs from global memory."""
        st = self.st
        base = name.removesuffix("__old").removesuffix("__new")
        if base in st.rs:
            if name.endswith("__old"):
                return st.rs_old[base][h]
            return st.rs_safe[base][h] if self._guarded(base) else st.rs[base][h]
        if name in st.sizes:
            return tirx.Cast(F32, pos[name] if name in pos else st.coord[name])
        if name in st.glob:
            if st.unmasked and any(m[1] == name for m in st.col_masks.values()):
                return f32(1.0)  # a padding mask inside the block's dense run of kept keys: kept
            return self.element(name, pos)
        return None

    def _guarded(self, state: str) -> bool:
        """Whether ``state`` is a running max read through ``exprs.subtracted_max`` here (``rs_safe``): by the
        updates, not by the finalize (an LSE ``m + log(l)`` of a row of -inf is -inf, which its own guard,
        ``smg.autodiff.backward.empty_row_guard``, stores as +inf)."""
        return not self.st.finalizing and state in self.st.rs_safe

    def load_score(self, i: int) -> Callable[[str], tirx.PrimExpr]:
        """Loads at score element ``i``: score ops, staged inputs, then :meth:`load_common`."""
        st = self.st
        r = st.slot_of(i, st.nt * 4)
        pos = {st.p.row: st.row_of(r), st.p.serial: st.t0 + st.col_of(i, st.nt * 4)}

        def load(name: str) -> tirx.PrimExpr:
            if name in st.score:
                return st.score[name][i]
            if name in st.tin:
                return tirx.Cast(F32, st.tin[name][i])
            v = self.load_common(name, r, pos)
            if v is None:
                raise ScheduleError(f"the warp-tile lowering cannot read {name!r} on the score tile",
                                    code="lower.mma_read")
            return v

        return load

    def load_row(self, name: str, h: int) -> tirx.PrimExpr:
        """``name`` at this thread's row slot ``h`` (row states, dims, inputs)."""
        v = self.load_common(name, h, {self.st.p.row: self.st.row_of(h)})
        if v is None:
            raise ScheduleError(f"the warp-tile lowering cannot read {name!r} in a row update", code="lower.mma_read")
        return v

    def load_acc(self, gs: GemmState, i: int) -> Callable[[str], tirx.PrimExpr]:
        """Loads at element ``i`` of a GEMM state's accumulator: accumulators, then :meth:`load_common`."""
        st = self.st
        per = (gs.n_tile // 8) * 4
        h = st.slot_of(i, per)
        pos = {st.p.row: st.row_of(h), gs.n: st.col0(gs.n) + st.col_of(i, per)}

        def load(name: str) -> tirx.PrimExpr:
            base = name.removesuffix("__old").removesuffix("__new")
            if base in st.acc:
                return st.acc[base][i]
            v = self.load_common(name, h, pos)
            if v is None:
                raise ScheduleError(f"the warp-tile lowering cannot read {name!r} on an accumulator",
                                    code="lower.mma_read")
            return v

        return load


def _tanh_approx(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``tanh.approx.f32`` of ``x``, through a register (the instruction writes its operand)."""
    t = T.alloc_buffer((1,), F32, scope="local")
    T.evaluate(T.ptx.tanh.approx.f32(t[0], x))
    return t[0]
