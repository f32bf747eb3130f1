"""After the warp-tile step loop: partial states merged, outputs stored.

Warp groups (``split``) hand their partial states over through the arena and blocks slicing the
steps (``slices``) through a global workspace; either merges them with the derived carries.  The
outputs are then evaluated on the accumulator registers and stored, through the arena in whole
16-byte chunks of rows where ``staged_output`` allows; with a producer warpgroup each MMA warpgroup
stores its own rows a band at a time through its own staging area.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from schedulers.warp_tile import BAND, CHUNK, PAD, GemmState, carry_factor, staged_output
from spacefusion.lower.exprs import F32, subtracted_max
from spacefusion.lower.mma_state import I32, KernelState, tree
from spacefusion.lower.mma_values import Values
from spacefusion.lower.tir import ARRIVALS, PARTIALS


class Epilogue:
    """Merges and output stores over the registers and arena of :class:`KernelState` ``st``."""

    def __init__(self, st: KernelState, values: Values) -> None:
        self.st = st
        self.values = values

    def _parts(self) -> tuple[list[tuple[str, tirx.Buffer]], dict[str, int], int]:
        """The registers a partial result is made of: (name, buffer) pairs, offsets, total floats."""
        st = self.st
        regs = [(u.state, st.rs[u.state]) for u in st.p.row_states] + list(st.acc.items())
        offset, f = {}, 0
        for name, b in regs:
            offset[name], f = f, f + int(b.shape[0])
        return regs, offset, f

    def merge(self) -> None:
        """Fold the other warp groups' partial states into group 0's, which then stores the outputs."""
        st = self.st
        p, tg = st.p, 32 * st.p.warps
        regs, offset, nf = self._parts()
        xchg = T.alloc_buffer(((p.warp.split - 1) * nf * tg,), F32, scope="shared.dyn")
        with T.If(st.grp > 0), T.Then():  # hand over: element f of group g at ((g-1)*nf + f)*tg + tid
            for name, b in regs:
                for e in range(int(b.shape[0])):
                    T.buffer_store(xchg, b[e], [((st.grp - 1) * nf + offset[name] + e) * tg + st.gtid])
        T.evaluate(T.tvm_storage_sync("shared"))
        with T.If(st.grp == 0), T.Then():
            def src(g: int, name: str, e: int) -> tirx.PrimExpr:
                if g == 0:
                    return dict(regs)[name][e]
                return xchg[((g - 1) * nf + offset[name] + e) * tg + st.gtid]

            self._merged(p.warp.split, src)
            self.finalize()  # group 0 stores the outputs

    def merge_slices(self) -> None:
        """Blocks of one row tile: each leaves its partial states in the global workspace and counts
        itself done (atomicAdd after a fence); the last one reads all of them back (``__ldcg``: from
        L2, never a stale L1 line), merges them, resets the count for the next launch and stores.
        With warp groups (split) every group leaves its own part, and group 0 of the last block
        merges the blocks' and groups' parts alike (no barrier sits in a group's branch).
        With ``atomic_slices`` (states that are sums without a carry) every block and group adds its
        part into the row tile's first with atomicAdd instead, and the last block reads that one part
        and zeroes it for the next launch (the launcher zeroes the workspace once)."""
        st, p = self.st, self.st.p
        regs, offset, _ = self._parts()
        part, arrivals = st.glob[PARTIALS], st.glob[ARRIVALS]
        atomic = p.warp.atomic_slices
        parts = p.warp.slices * p.warp.split
        mine = st.tile * parts if atomic else (st.tile * p.warp.slices + st.slice) * p.warp.split + st.grp
        for name, b in regs:
            for e in range(int(b.shape[0])):
                at = [mine, offset[name] + e, st.gtid]
                if atomic:
                    T.evaluate(tirx.call_extern(F32, "atomicAdd", tirx.address_of(part[tuple(at)]), b[e]))
                else:
                    T.buffer_store(part, b[e], at)
        T.evaluate(tirx.call_extern("void", "__threadfence"))
        T.evaluate(T.tvm_storage_sync("shared"))
        done = T.alloc_buffer((1,), I32, scope="shared")
        with T.If(st.tid == 0), T.Then():
            T.buffer_store(done, tirx.call_extern(I32, "atomicAdd", tirx.address_of(arrivals[st.tile]), 1), [0])
        T.evaluate(T.tvm_storage_sync("shared"))
        last = T.alloc_buffer((1,), I32, scope="local")  # a branch condition may not read shared memory
        T.buffer_store(last, done[0], [0])
        with T.If(last[0] == p.warp.slices - 1), T.Then(), ExitStack() as group0:
            if p.warp.split > 1:
                group0.enter_context(T.If(st.grp == 0))
                group0.enter_context(T.Then())
            T.evaluate(tirx.call_extern("void", "__threadfence"))

            def src(g: int, name: str, e: int) -> tirx.PrimExpr:
                at = part[st.tile * parts + g, offset[name] + e, st.gtid]
                return tirx.call_extern(F32, "__ldcg", tirx.address_of(at))

            self._merged(1 if atomic else parts, src)
            if atomic:  # each thread zeroes the elements it read
                for name, b in regs:
                    for e in range(int(b.shape[0])):
                        T.buffer_store(part, tirx.const(0.0, F32), [mine, offset[name] + e, st.gtid])
            with T.If(st.tid == 0), T.Then():
                T.buffer_store(arrivals, tirx.const(0, I32), [st.tile])
            self.finalize()

    def _merged(self, parts: int, src: Callable[[int, str, int], tirx.PrimExpr]) -> None:
        """Merge ``parts`` partial states (``src(g, name, e)``) into this thread's registers.

        In plan order, a max state takes the max; a sum state is the sum over parts of its derived
        carry with ``__old`` bound to that part's values and the new values to the states merged
        so far: the carry rescales a partial result from its part's statistics to the final ones
        (e.g. ``l * exp(m_g - m)``), exactly as it does from one step to the next."""
        st, p = self.st, self.st.p
        regs = dict(self._parts()[0])
        merged: dict[str, tirx.Buffer] = {}
        maxima = {u.state for u in p.row_states if u.combiner == "max"}

        def loader(g: int, h: int) -> Callable[[str], tirx.PrimExpr]:
            """Row values for part g's carry: ``__old`` its own, new ones as merged so far."""
            def load(name: str) -> tirx.PrimExpr:
                base = name.removesuffix("__old").removesuffix("__new")
                if base in st.rs:
                    now = base in merged and not name.endswith("__old")
                    if not now:
                        return src(g, base, h)
                    return subtracted_max(merged[base][h]) if base in maxima else merged[base][h]
                return self.values.load_row(name, h)
            return load

        gemm_of = {gs.update.state: gs for gs in p.gemm_states}
        for u in st.s.plan.states:
            size = int(regs[u.state].shape[0])
            out = merged[u.state] = T.alloc_buffer((size,), F32, scope="local")
            gs = gemm_of.get(u.state)
            rescale = u.combiner == "sum" and bool(u.carry)
            if gs is not None:  # accumulators: one carry factor per part and row
                per = (gs.n_tile // 8) * 4
                if rescale:
                    fac = T.alloc_buffer((parts * 2 * st.mt,), F32, scope="local")
                    factor = carry_factor(u.carry, u.state)
                    for g in range(parts):
                        for h in range(2 * st.mt):
                            T.buffer_store(fac, self.values.expr(factor, loader(g, h)), [g * 2 * st.mt + h])
                for e in range(size):
                    h = st.slot_of(e, per)
                    terms = [src(g, u.state, e) * fac[g * 2 * st.mt + h] if rescale else src(g, u.state, e)
                             for g in range(parts)]
                    T.buffer_store(out, tree(terms, u.combiner), [e])
                continue
            old = f"{u.state}__old"
            for h in range(size):
                terms = []
                for g in range(parts):
                    ld = loader(g, h)
                    v = src(g, u.state, h)
                    terms.append(self.values.expr(u.carry, lambda n, ld=ld, v=v, old=old: v if n == old else ld(n))
                                 if rescale else v)
                T.buffer_store(out, tree(terms, u.combiner), [h])
        for u in p.row_states:
            st.rs[u.state] = merged[u.state]
        for name in st.acc:
            st.acc[name] = merged[name]

    def finalize(self) -> None:
        """Store every output: row outputs by one thread of each quad, accumulator outputs staged
        through the arena where ``staged_output`` allows, else by each thread.  Row maxima are read as they
        are there (``Values._guarded``)."""
        self.st.finalizing = True
        try:
            self._finalize()
        finally:
            self.st.finalizing = False

    def _finalize(self) -> None:
        st, p = self.st, self.st.p
        M = st.sizes[p.row]
        by_n = {gs.n: gs for gs in p.gemm_states}
        staged_before = False
        for out, text in p.outputs:
            dims = st.smg.space(out).dims
            buf = st.glob[out]
            n = next((d for d in dims if d in by_n), None)
            if n is None:  # a row output: one thread of each quad writes it
                for h in range(2 * st.mt):
                    pos = {p.row: st.row_of(h)}
                    with T.If(tirx.all(st.row_of(h) < M, st.t4 == 0)):
                        with T.Then():
                            v = self.values.expr(text, lambda nm, h=h: self.values.load_row(nm, h))
                            T.buffer_store(buf, _cast(v, buf.dtype), [pos.get(d, st.coord.get(d)) for d in dims])
                continue
            gs = by_n[n]
            staged = staged_output(st.s, p, out)
            if staged is not None and p.hopper.producer:  # by each MMA warpgroup alone, beside a producer
                self._store_bands(out, text, gs)
                continue
            if staged is not None:
                if staged_before:  # the previous tile's copy-out still reads the arena
                    T.evaluate(T.tvm_storage_sync("shared"))
                self._store_staged(out, text, gs, staged[1])
                staged_before = True
                continue
            per = (gs.n_tile // 8) * 4
            tail = st.sizes[n] % gs.n_tile != 0
            for h in range(2 * st.mt):
                with T.If(st.row_of(h) < M):
                    with T.Then():
                        for i in range(int(st.acc[gs.update.state].shape[0])):
                            if st.slot_of(i, per) != h:
                                continue
                            pos = {p.row: st.row_of(h), n: st.col0(n) + st.col_of(i, per)}
                            v = self.values.expr(text, self.values.load_acc(gs, i), buf.dtype)
                            with ExitStack() as guard:
                                if tail:
                                    guard.enter_context(T.If(pos[n] < st.sizes[n]))
                                    guard.enter_context(T.Then())
                                T.buffer_store(buf, _cast(v, buf.dtype), [pos.get(d, st.coord.get(d)) for d in dims])

    def _store_staged(self, out: str, text: str, gs: GemmState, stride: int) -> None:
        """Store output ``out`` through the arena (``staged_output``): each thread writes its column
        pairs of the tile as 4-byte vectors (rows ``stride`` apart: a quad's 8 rows hit distinct
        banks), then the block copies whole rows out in 16-byte chunks."""
        st = self.st
        p, n = st.p, gs.n
        per = (gs.n_tile // 8) * 4
        acc = st.acc[gs.update.state]
        for i in range(0, int(acc.shape[0]), 2):  # elements i, i + 1: columns 2t, 2t + 1 of one row
            h = st.slot_of(i, per)
            off = (st.row_of(h) - st.row0) * stride + st.col_of(i, per)
            self._stage_pair(gs, text, i, off)
        T.evaluate(T.tvm_storage_sync("shared"))
        per_row = gs.n_tile // CHUNK
        total, th = p.rows * per_row, p.threads
        with T.serial(0, -(-total // th)) as it:
            c = it * th + st.tid
            r, cc = c // per_row, (c % per_row) * CHUNK
            self._store_chunk(out, gs, st.row0 + r, st.col0(n) + cc, r * stride + cc,
                              [c < total] if total % th else [])

    def _stage_pair(self, gs: GemmState, text: str, i: int, off: tirx.PrimExpr) -> None:
        """Output ``text`` at accumulator elements ``i``, ``i + 1`` (a row's adjacent columns) into
        the arena at ``off`` as one 4-byte vector."""
        st = self.st
        pair = [_cast(self.values.expr(text, self.values.load_acc(gs, e), st.half), st.half) for e in (i, i + 1)]
        T.buffer_store(st.arena, tirx.Shuffle(pair, [tirx.const(0, I32), tirx.const(1, I32)]),
                       [tirx.Ramp(off, 1, 2)])

    def _store_chunk(self, out: str, gs: GemmState, row: tirx.PrimExpr, col: tirx.PrimExpr, src: tirx.PrimExpr,
                     conds: list[tirx.PrimExpr]) -> None:
        """One 16-byte chunk of output ``out`` at (``row``, ``col``) from arena element ``src``, unless
        ``conds`` fail or it lies past a tail of the rows or of the GEMM state's columns."""
        st = self.st
        p, n = st.p, gs.n
        if st.row_tail:
            conds = [*conds, row < st.sizes[p.row]]
        if st.sizes[n] % gs.n_tile:
            conds = [*conds, col < st.sizes[n]]
        buf, dims = st.glob[out], st.smg.space(out).dims
        with ExitStack() as guard:
            if conds:
                guard.enter_context(T.If(tirx.all(*conds)))
                guard.enter_context(T.Then())
            idx = [row if d == p.row else st.coord[d] for d in dims[:-1]] + [tirx.Ramp(col, 1, CHUNK)]
            T.buffer_store(buf, T.BufferLoad(st.arena, [tirx.Ramp(src, 1, CHUNK)]), idx)

    def _store_bands(self, out: str, text: str, gs: GemmState) -> None:
        """Store output ``out`` of this MMA warpgroup's rows one ``BAND``-column band at a time: its
        threads write their column pairs of the band into the warpgroup's staging area, then copy
        whole 16-byte chunks of its rows out; a named barrier of the warpgroup's 128 threads
        between (the producer warpgroup runs on meanwhile)."""
        st, p = self.st, self.st.p
        per = (gs.n_tile // 8) * 4
        acc = st.acc[gs.update.state]
        wg = st.warp // 4  # which rows of the tile
        wrows = 64 * p.warp_mtiles  # this warpgroup's rows: its 64-row halves
        stride = BAND + PAD
        mine = wg + st.mma_wg  # its staging area and named barrier (one of the two is 0)
        base = st.stage_base + mine * wrows * stride
        bar = tirx.Cast("uint32", 1 + mine)  # named barrier 0 is __syncthreads
        for band in range(-(-gs.n_tile // BAND)):  # the last band partial where N is not whole bands (d = 96)
            per_row = min(BAND, gs.n_tile - band * BAND) // CHUNK
            for i in range(0, int(acc.shape[0]), 2):  # elements i, i + 1: columns 2t, 2t + 1 of one row
                if ((i % per) // 4) * 8 // BAND != band:
                    continue
                h = st.slot_of(i, per)
                r = st.row_of(h) - st.row0 - wg * wrows
                off = base + r * stride + st.col_of(i, per) - band * BAND
                self._stage_pair(gs, text, i, off)
            T.evaluate(T.ptx.bar.sync(bar, T.uint32(128)))
            with T.serial(0, wrows * per_row // 128) as it:
                c = it * 128 + st.tid % 128
                r, cc = c // per_row, (c % per_row) * CHUNK
                self._store_chunk(out, gs, st.row0 + wg * wrows + r, st.col0(gs.n) + band * BAND + cc,
                                  base + r * stride + cc, [])
            T.evaluate(T.ptx.bar.sync(bar, T.uint32(128)))


def _cast(v: tirx.PrimExpr, dtype: str) -> tirx.PrimExpr:
    """``v`` (fp32) as ``dtype``."""
    return v if dtype == F32 else tirx.Cast(dtype, v)
