"""Schedule -> TensorIR PrimFunc, built programmatically with TVM's IRBuilder.

The kernel shape follows the Schedule and nothing else: one thread block per
spatial block (fused over all cut dims), one thread per element of the thread
dim, a serial loop over the temporal steps in which the streamed ops are
materialised in registers, inputs of level ``shared`` are staged cooperatively,
and each state is advanced by its derived update function; after the loop the
finalize expressions (postponed broadcasts) are stored.  Tails are predicated:
cut dims are clamped on load and masked on store; serial-dim elements past the
end are skipped by every reduction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from tvm import tirx
from tvm.script import ir_builder as IB
from tvm.script.ir_builder import tirx as T

from schedulers.errors import ScheduleError
from schedulers.halo import halo_shape, window_box
from schedulers.options import MAX_UNROLL
from schedulers.schedule import Schedule, lane_spread
from schedulers.temporal import exp_sums
from smg.expr import body_expr, index_symbol, parse
from smg.ir import Access, Op
from spacefusion.lower import cluster, loads, stores
from spacefusion.lower.exprs import F32, MAX_IDENTITY, subtracted_max, to_tir, to_tir_int
from spacefusion.lower.mma_state import tree
from spacefusion.lower.symbolic import SymbolicDim, param_dims
from spacefusion.lower.symbolic import check as check_symbolic

#: the storage dtypes whose rounding is coarse enough for the fast exp and division (``_Kernel.expr``)
SIXTEEN_BIT = ("float16", "bfloat16")
LANE_IT = "__lane_it"  # env key: a lane's position among its own serial elements
GUARDED = "__guarded"  # env key: the serial-tail guard was already emitted around a run
VEC_I = "__vec_i"  # env key: position within the current run (index into the register copies)


@dataclass(frozen=True)
class KernelSignature:
    """Parameters of the PrimFunc in PrimFunc order (inputs, then outputs; an output stored at run-time
    positions, ``lower.stores``, is replaced by its store's tensor and positions; an input read at run-time
    rows, ``lower.loads``, by its table and ids)."""

    params: tuple[tuple[str, tuple[int, ...], str, str], ...]  # name, shape, dtype, role


#: workspace params of a sliced warp-tile kernel: the blocks' partial states, and per row tile the
#: number of its blocks done (the launcher zeroes it once; the merging block resets it)
PARTIALS, ARRIVALS = "sf_partials", "sf_arrivals"


def signature(s: Schedule) -> KernelSignature:
    smg = s.smg
    ps = [p for n in smg.inputs for p in loads.params(smg, n)]
    held = stores.stored(smg)
    ps += [(n, smg.shape(n), smg.space(n).dtype, "output") for n in smg.outputs if n not in held]
    ps += stores.params(smg)
    if s.tma:  # the launcher encodes them from the tensors it binds
        from schedulers.warp_tile import tma_maps

        ps += [(name, (128,), "uint8", "tensormap") for name in tma_maps(s, s.warp_tile)]
    if s.slices > 1:
        p = s.warp_tile
        tiles = s.num_tiles // s.slices
        # one part per block of a row tile and warp group of the block (split x slices)
        ps += [(PARTIALS, (tiles * s.slices * p.warp.split, p.merge_floats(), 32 * p.warps), "float32", "scratch"),
               (ARRIVALS, (tiles,), "int32", "scratch")]
    return KernelSignature(tuple(ps))


class _Kernel:
    """State of one lowering: buffers, loop indices, and the emit helpers."""

    def __init__(self, s: Schedule, target: str, symbolic: SymbolicDim | None = None) -> None:
        self.s, self.target, self.smg = s, target, s.smg
        self.cut = {d for d, _ in s.block}
        # a symbolic dim's size is the kernel's argument (``lower.symbolic``): every use of it below (the
        # tails' clamps and masks, the grid) is then an expression of that argument
        self.sizes: dict[str, int | tirx.PrimExpr] = dict(self.smg.dim_sizes)
        if symbolic is not None:
            self.sizes[symbolic.dim] = tirx.Var(symbolic.var, "int32")
        self.glob: dict[str, tirx.Buffer] = {}
        self.stored = stores.stored(self.smg)  # outputs stored at run-time positions (``lower.stores``)
        self.local: dict[str, tirx.Buffer] = {}
        self.shared: dict[str, tirx.Buffer] = {}
        self.origin: dict[str, tirx.PrimExpr] = {}
        self.t0: tirx.PrimExpr | None = None
        self.tid: tirx.PrimExpr | None = None
        # lanes exist on CUDA only (warp shuffles); on the CPU one thread does a lane group's work.  With a
        # cluster a row's lanes are those of all its blocks: ``lanes`` counts them, ``block_lanes`` one block's
        self.cluster = s.cluster if target == "cuda" else 1
        self.block_lanes = s.lanes if target == "cuda" else 1
        self.lanes = self.block_lanes * self.cluster
        self.exchange: tirx.Buffer | None = None  # the block's result the cluster's blocks read (cluster > 1)
        self.lane: tirx.PrimExpr = tirx.const(0, "int32")
        self.vec = s.vector  # a lane's serial elements come in runs of vec consecutive ones
        self.regs: dict[str, tirx.Buffer] = {}  # global inputs copied into registers for the current run
        self.outs: dict[str, tirx.Buffer] = {}  # outputs collected in registers for the current run
        self.base: dict[str, tirx.PrimExpr] = {}  # first index of the block's tile per cut dim
        self.abs: dict[str, tirx.PrimExpr] = {}  # absolute index overrides (evaluating a gathered element)
        self.op: Op | None = None  # the op whose body is being emitted (its accesses give index expressions)
        self.within: dict[str, tirx.PrimExpr] = {}  # this thread's position in the tile
        # running maxima, read through ``subtracted_max`` by the updates and second passes (their ``__old``
        # copies and the finalize read them as they are: an LSE ``m + log(l)`` is -inf there, stored as +inf by its
        # own guard, ``smg.autodiff.backward.empty_row_guard``); row sums of
        # exponentials, divided by as ``nonzero_sum``
        self.maxima = {u.state for u in s.plan.states if u.combiner == "max"}
        self.sums = exp_sums(s.plan.states)
        self.finalizing = False  # emitting the finalize (after the loop): maxima read as they are

    @contextmanager
    def emitting(self, op: Op):
        """Bodies emitted inside read ``op``'s accesses (index expressions)."""
        saved, self.op = self.op, op
        try:
            yield
        finally:
            self.op = saved

    @contextmanager
    def at(self, pos: dict[str, tirx.PrimExpr]):
        """Emit code for the tile element ``pos`` instead of this thread's own
        (cooperative staging and computation of block-shared buffers)."""
        saved = dict(self.origin), dict(self.within)
        for d, e in pos.items():
            self.origin[d], self.within[d] = self.base[d] + e, e
        try:
            yield
        finally:
            self.origin, self.within = saved

    # -- indices ------------------------------------------------------------------
    def local_dims(self, space: str) -> tuple[str, ...]:
        space = space.split("__")[0]  # X, X__old, X__d1 (auxiliary accumulator) share X's dims
        return tuple(d for d in self.smg.space(space).dims if d not in self.cut)

    @property
    def lane_step(self) -> int:
        """Elements of one step a lane handles (every lanes-th)."""
        return -(-self.s.step // self.lanes)

    def local_shape(self, space: str) -> tuple[int, ...]:
        shape = tuple(self.lane_step if d == self.s.serial else self.sizes[d] for d in self.local_dims(space))
        return shape or (1,)

    def local_index(self, space: str, env: dict[str, tirx.PrimExpr]) -> list[tirx.PrimExpr]:
        # a lane keeps only its own serial elements: position it -> element it * lanes + lane
        return [env.get(LANE_IT, env[d]) if d == self.s.serial else env[d] for d in self.local_dims(space)] or [0]

    def shared_shape(self, space: str) -> tuple[int, ...]:
        """A block-shared buffer holds the block's whole tile (all threads' elements); a window's input, the
        box the block's taps read (``schedulers.halo``)."""
        if window_box(self.smg, space) is not None:
            return halo_shape(self.smg, space, self.s.tiles, self.s.serial, self.s.step)
        dims = self.smg.space(space).dims
        return tuple(self.s.tiles[d] if d in self.cut else self.s.step if d == self.s.serial else self.sizes[d]
                     for d in dims) or (1,)

    def shared_index(self, space: str, env: dict[str, tirx.PrimExpr]) -> list[tirx.PrimExpr]:
        return [self.within[d] if d in self.cut else env[d] for d in self.smg.space(space).dims] or [0]

    def global_index(self, space: str, env: dict[str, tirx.PrimExpr]) -> list[tirx.PrimExpr]:
        idx = []
        for d in self.smg.space(space).dims:
            if d in self.abs:
                idx.append(self.abs[d])
            elif d in self.cut:
                idx.append(tirx.min(self.origin[d], self.sizes[d] - 1))  # clamp tails
            elif d == self.s.serial:
                idx.append(self.t0 + env[d])
            else:
                idx.append(env[d])
        return idx

    def halo_position(self, space: str, at: Callable[[str], tirx.PrimExpr]) -> list[tirx.PrimExpr]:
        """Per component of ``space``'s window, ``sum a_d * at(d) (+ b)``: with ``at`` the block's and step's
        first indices and ``b`` the halo box's origin; with ``at`` a thread's position within them and no
        ``b``, the tap's place in the box."""
        box = window_box(self.smg, space)
        return [sum((a * at(d) for d, a in coeffs), tirx.const(0, "int32")) for coeffs, _ in box]

    def halo_origin(self, space: str) -> list[tirx.PrimExpr]:
        def start(d: str) -> tirx.PrimExpr:
            if d in self.cut:
                return self.base[d]
            return self.t0 if d == self.s.serial else tirx.const(0, "int32")

        box = window_box(self.smg, space)
        return [p + b for p, (_, b) in zip(self.halo_position(space, start), box)]

    # -- loads --------------------------------------------------------------------
    def dim_value(self, dim: str, env: dict[str, tirx.PrimExpr]) -> tirx.PrimExpr:
        """Absolute (global) index along ``dim`` at the current element."""
        if dim in self.abs:
            return self.abs[dim]
        if dim in self.cut:
            return self.origin[dim]
        if dim == self.s.serial:
            return self.t0 + env[dim]
        return env[dim]

    def index_value(self, dim: str, env: dict[str, tirx.PrimExpr]) -> tirx.PrimExpr:
        """Global index along ``dim`` as fp32 (for index-dependent bodies, e.g. masks)."""
        return tirx.Cast(F32, self.dim_value(dim, env))

    def gathered(self, acc: Access, env: dict[str, tirx.PrimExpr]) -> tirx.PrimExpr:
        """``acc.space`` read at index expressions (windows, upsampling); 0 outside (padding).

        An intermediate read this way is recomputed at the gathered position from its
        producer's body (its halo is not in any tile), so it must read only inputs.
        """
        space = self.smg.space(acc.space)
        if acc.space in self.shared and window_box(self.smg, acc.space) is not None:
            # its halo box, zeros staged where the window reads past the edges
            val = self.shared[acc.space][self.halo_position(
                acc.space, lambda d: self.within[d] if d in self.cut else env[d])]
            return val if self.shared[acc.space].dtype == F32 else tirx.Cast(F32, val)
        if VEC_I in env and acc.space in self.smg.inputs:
            off = _serial_offset(acc, space.dims, self.s.serial)
            copy = self.regs.get(_shift_key(acc.space, off)) if off is not None else None
            if copy is not None:  # the run's wide copy (``shift_reads``): zeros already where outside
                val = copy[env[VEC_I]]
                return val if copy.dtype == F32 else tirx.Cast(F32, val)
        pos = [to_tir_int(c, lambda d: self.dim_value(d, env)) for c in acc.index]
        sizes = [self.sizes[d] for d in space.dims]
        ok = tirx.all(*[tirx.all(p >= 0, p < n) for p, n in zip(pos, sizes)])
        clamped = [tirx.max(tirx.min(p, n - 1), 0) for p, n in zip(pos, sizes)]
        if acc.space in self.glob:
            val = self.glob[acc.space][clamped]
            val = val if self.glob[acc.space].dtype == F32 else tirx.Cast(F32, val)
        else:
            prod = self.smg.producer(acc.space)
            if prod.reduce or any(a.space not in self.smg.inputs for a in prod.inputs):
                raise ScheduleError(
                    f"{self.op.out!r} reads intermediate {acc.space!r} through {acc.index}: recomputing its "
                    f"halo needs {acc.space!r} to be an element-wise function of inputs", code="lower.recompute_read")
            saved_abs, saved_op = dict(self.abs), self.op
            self.abs.update(dict(zip(prod.out_index, clamped)))
            self.op = prod
            try:
                val = self.expr(body_expr(prod), env)
            finally:
                self.abs, self.op = saved_abs, saved_op
        return tirx.if_then_else(ok, val, tirx.FloatImm(F32, 0.0))

    def load(self, name: str, env: dict[str, tirx.PrimExpr]) -> tirx.PrimExpr:
        if name in self.sizes:
            return self.index_value(name, env)
        base = name.replace("__old", "").replace("__new", "")
        if self.op is not None and base == name:
            acc = next((a for a in self.op.inputs if a.space == name), None)
            if acc is not None and not acc.plain:
                return self.gathered(acc, env)
        if name.endswith("__old"):
            return self.local[name][self.local_index(base, env)]
        if name.endswith("__new") or base in self.local:
            val = self.local[base][self.local_index(base, env)]
            return subtracted_max(val) if base in self.maxima and not self.finalizing else val
        if base in self.regs and VEC_I in env:
            val = self.regs[base][env[VEC_I]]
            return val if self.regs[base].dtype == F32 else tirx.Cast(F32, val)
        if base in self.shared:
            val = self.shared[base][self.shared_index(base, env)]
            return val if self.shared[base].dtype == F32 else tirx.Cast(F32, val)
        val = self.glob[base][self.global_index(base, env)]
        return val if self.glob[base].dtype == F32 else tirx.Cast(F32, val)

    def expr(self, text_or_expr, env: dict[str, tirx.PrimExpr], stored: str | None = None) -> tirx.PrimExpr:
        """``stored``: the dtype the value is stored in.  A value stored in 16 bits on the GPU takes ``exp`` as
        one ``ex2.approx`` and divisions as ``__fdividef`` (as the warp-tile kernels' 16-bit values do): a
        GroupNorm's SiLU pass spent more time in ``expf``'s range reduction and the IEEE division's slow path
        than in its loads (5.3 us a call at 2x320x64x64 on the H200, against 3.0 for the pass without SiLU)."""
        e = parse(text_or_expr) if isinstance(text_or_expr, str) else text_or_expr
        fast = self.target == "cuda" and stored in SIXTEEN_BIT
        return to_tir(e, lambda n: self.load(n, env), exp2=fast, fast_div=fast, sums=self.sums)

    # -- loop helpers -------------------------------------------------------------
    def loops(self, dims: tuple[str, ...], stack: ExitStack, reads: tuple[str, ...] = (),
              writes: tuple[str, ...] = (), shifts: tuple[tuple[str, int], ...] = ()) -> dict[str, tirx.PrimExpr]:
        """Loops over ``dims``; the serial dim visits only this lane's elements of the step.

        With a vector width > 1 the serial dim runs as whole vectors of this lane: an outer loop
        over its runs and an unrolled loop within a run.  When the serial dim is innermost, the
        tail guard is emitted once per run and the global inputs in ``reads`` are copied into
        registers with one vectorized (wide) load per run; the body then reads the copies.  The
        outputs in ``writes`` are collected in registers and stored with one wide store per run.
        ``shifts`` (``shift_reads``) are inputs read ``offset`` serial elements away: one wide load per
        run too, or zeros where the shifted run lies outside the dim.
        """
        env: dict[str, tirx.PrimExpr] = {}
        for d in dims:
            if d != self.s.serial:
                env[d] = stack.enter_context(T.serial(0, self.sizes[d]))
            elif self.vec == 1:  # ``unroll``: the lane's loop unrolled (the schedule checked its trip count)
                it = stack.enter_context((T.unroll if self.s.unroll else T.serial)(0, self.lane_step))
                env[d] = it * self.lanes + self.lane if self.lanes > 1 else it
                if self.lanes > 1:
                    env[LANE_IT] = it
            else:  # runs of vec: element = run * lanes * vec + lane * vec + i, position = run * vec + i
                runs = self.lane_step // self.vec
                # unrolled on the GPU so that the register arrays are indexed by constants
                unrolled = T.unroll if self.target == "cuda" else T.serial
                run = stack.enter_context((unrolled if runs <= MAX_UNROLL else T.serial)(0, runs))
                first = run * (self.lanes * self.vec) + self.lane * self.vec
                if d == dims[-1]:
                    if self.has_tail:  # a run is wholly inside the dim or wholly past it
                        stack.enter_context(T.If(self.t0 + first < self.sizes[d]))
                        stack.enter_context(T.Then())
                        env[GUARDED] = tirx.const(True, "bool")
                    self._copy_in(reads, {**env, d: first}, stack)
                    self._copy_in_shifted(shifts, {**env, d: first}, stack)
                    self._copy_out(writes, {**env, d: first}, stack)
                i = stack.enter_context(unrolled(0, self.vec))
                env[d], env[LANE_IT], env[VEC_I] = first + i, run * self.vec + i, i
        return env

    def vector_reads(self, names) -> tuple[str, ...]:
        """Global inputs among ``names`` that a run reads as one wide access: the serial dim is
        their innermost (contiguous) dim and they are not staged in shared memory."""
        if self.vec == 1:
            return ()
        return tuple(sorted(n for n in set(names) if n in self.smg.inputs and n not in self.shared
                            and loads.vector_read(self.smg, n, self.s.serial)
                            and self.smg.inner_read(n) == (self.s.serial, 0)
                            and self.smg.space(n).dims[-1] == self.s.serial))

    def shift_reads(self, op: Op) -> tuple[tuple[str, int], ...]:
        """Accesses of ``op`` that read a global input ``offset`` elements along the serial dim from the
        current element and plainly elsewhere (``X[b, s, h, j - 64]``: RoPE's rotate-half; a concatenation's
        part ``X1[n, s, c - 640]``, whose innermost dim is its own), where the serial dim walks the input's
        innermost and the offset and that dim's length are whole numbers of vectors: a shifted run of
        ``vec`` elements is then one aligned wide load, wholly inside the dim or wholly outside (zeros)."""
        if self.vec == 1:
            return ()
        out = []
        for a in op.inputs:
            space = self.smg.space(a.space)
            if (a.plain or a.space not in self.smg.inputs or a.space in self.shared
                    or not loads.vector_read(self.smg, a.space, self.s.serial)):
                continue
            off = _serial_offset(a, space.dims, self.s.serial)
            if off is not None and off % self.vec == 0 and self.sizes[space.dims[-1]] % self.vec == 0:
                out.append((a.space, off))
        return tuple(dict.fromkeys(out))

    def _copy_in_shifted(self, shifts: tuple[tuple[str, int], ...], env: dict[str, tirx.PrimExpr],
                         stack: ExitStack) -> None:
        for name, off in shifts:
            buf = self.glob[name]
            copy = T.alloc_buffer((self.vec,), buf.dtype, scope="local")
            inner = self.smg.space(name).dims[-1]  # the serial dim, or a concatenation part's own
            start = self.t0 + env[self.s.serial] + off  # the shifted run's first element along the dim
            with T.If(tirx.all(start >= 0, start < self.sizes[inner])):
                with T.Then(), T.vectorized(0, self.vec) as j:
                    # ``global_index`` adds the step's start along the serial dim; a part's own dim is absolute
                    pos = {**env, inner: (env[inner] + off if inner == self.s.serial else start) + j}
                    T.buffer_store(copy, buf[self.global_index(name, pos)], [j])
                with T.Else(), T.vectorized(0, self.vec) as j:
                    T.buffer_store(copy, tirx.const(0, buf.dtype), [j])
            key = _shift_key(name, off)
            self.regs[key] = copy
            stack.callback(self.regs.pop, key)

    def _copy_out(self, writes: tuple[str, ...], env: dict[str, tirx.PrimExpr], stack: ExitStack) -> None:
        for name in writes:
            dtype = self.smg.space(name).dtype  # (a stored output has no buffer of its own: ``lower.stores``)
            copy = self.outs[name] = T.alloc_buffer((self.vec,), dtype, scope="local")
            tails = [self.origin[d] < self.sizes[d] for d in self.smg.space(name).dims if d in self.cut]

            def flush(exc_type, *_, name=name, copy=copy, tails=tails) -> None:
                del self.outs[name]
                if exc_type is not None:
                    return
                run = T.vectorized if stores.vector_run(self, name) else T.serial
                with T.If(tirx.all(*tails) if tails else tirx.const(True, "bool")), T.Then():
                    with run(0, self.vec) as j:
                        stores.store(self, name, copy[j], {**env, self.s.serial: env[self.s.serial] + j})

            stack.push(flush)  # runs once the run's unrolled loop has closed

    def _copy_in(self, reads: tuple[str, ...], env: dict[str, tirx.PrimExpr], stack: ExitStack) -> None:
        for name in reads:
            buf = self.glob[name]
            copy = T.alloc_buffer((self.vec,), buf.dtype, scope="local")
            with T.vectorized(0, self.vec) as j:
                T.buffer_store(copy, buf[self.global_index(name, {**env, self.s.serial: env[self.s.serial] + j})],
                               [j])
            self.regs[name] = copy
            stack.callback(self.regs.pop, name)

    @property
    def has_tail(self) -> bool:
        """Whether some step holds serial positions past the dim's end (or past the step)."""
        return self.sizes[self.s.serial] % self.s.step != 0 or self.s.step % self.lanes != 0

    def valid_serial(self, env: dict[str, tirx.PrimExpr]) -> tirx.PrimExpr:
        if GUARDED in env or not self.has_tail:
            return tirx.const(True, "bool")
        ok = self.t0 + env[self.s.serial] < self.sizes[self.s.serial]
        return tirx.all(ok, env[self.s.serial] < self.s.step) if self.lanes > 1 else ok

    def allreduce(self, value: tirx.PrimExpr, combiner: str) -> tirx.PrimExpr:
        """Combine ``value`` over the lanes of this thread's group: a butterfly of warp shuffles,
        and for groups wider than a warp the warps' results meet in shared memory (two barriers:
        every thread of the block reaches each reduction, in the same order); with a cluster, the blocks'
        results then meet in distributed shared memory (``_cluster_reduce``)."""
        width = min(self.block_lanes, 32)
        off = width // 2
        while off >= 1:
            other = T.tvm_warp_shuffle_xor(T.tvm_warp_activemask(), value, off, width, 32)
            value = value + other if combiner == "sum" else tirx.max(value, other)
            off //= 2
        if self.block_lanes <= 32:
            return self._cluster_reduce(value, combiner)
        warps = self.block_lanes // 32
        group, wi = self.tid // self.block_lanes, (self.tid % self.block_lanes) // 32
        mine = T.alloc_buffer((1,), F32, scope="local")  # shuffled by the whole warp, then one lane stores
        T.buffer_store(mine, value, [0])
        with T.If(self.tid % 32 == 0), T.Then():
            T.buffer_store(self.scratch, mine[0], [group * warps + wi])
        T.evaluate(T.tvm_storage_sync("shared"))
        total = T.alloc_buffer((1,), F32, scope="local")
        terms = [self.scratch[group * warps + w] for w in range(warps)]
        acc = terms[0]
        for t in terms[1:]:
            acc = acc + t if combiner == "sum" else tirx.max(acc, t)
        T.buffer_store(total, acc, [0])
        T.evaluate(T.tvm_storage_sync("shared"))  # the scratch is reused by the next reduction
        return self._cluster_reduce(total[0], combiner)

    def _cluster_reduce(self, value: tirx.PrimExpr, combiner: str) -> tirx.PrimExpr:
        """``value`` (this block's result, held by every lane) combined over the cluster's blocks: thread 0
        publishes it, a cluster barrier, thread 0 reads every block's in rank order (the same total in every
        block) and hands the total to its block through shared memory, and a second cluster barrier keeps the
        slots until every block has read them (and the block's threads have read the total).  One thread
        reads, so a block makes ``cluster`` remote loads a reduction, not ``cluster`` a thread (the form the
        H200 run measured, ``docs/convolutions.md``, 'A row over a thread-block cluster'; this one is not
        measured yet)."""
        if self.cluster == 1:
            return value
        mine = T.alloc_buffer((1,), F32, scope="local")
        T.buffer_store(mine, value, [0])
        with T.If(self.tid == 0), T.Then():
            T.buffer_store(self.exchange, mine[0], [0])
        T.evaluate(tirx.call_extern("void", cluster.SYNC))
        with T.If(self.tid == 0), T.Then():
            terms = [tirx.call_extern(F32, cluster.LOAD, tirx.address_of(self.exchange[0]), r)
                     for r in range(self.cluster)]
            T.buffer_store(self.exchange, tree(terms, combiner), [1])
        T.evaluate(T.tvm_storage_sync("shared"))
        total = T.alloc_buffer((1,), F32, scope="local")
        T.buffer_store(total, self.exchange[1], [0])
        T.evaluate(tirx.call_extern("void", cluster.SYNC))
        return total[0]


def build_primfunc(s: Schedule, target: str, dynamic_smem: bool = False,
                   symbolic: SymbolicDim | None = None) -> tirx.PrimFunc:
    """Lower ``s`` to a PrimFunc for ``target`` kind ``"llvm"`` or ``"cuda"``; with
    ``dynamic_smem`` the block-shared tiles live in dynamic shared memory (above 48 KB).  With ``symbolic``
    (checked by ``symbolic.check``), that dim's size is the kernel's int32 argument ``symbolic.var``: the
    buffers holding it take it as their extent, the grid ``ceil(size / tile)`` blocks along it."""
    if symbolic is not None:
        check_symbolic(s, symbolic)
    stores.check(s)
    loads.check(s)
    k = _Kernel(s, target, symbolic)
    k.smem_scope = "shared.dyn" if dynamic_smem else "shared"
    grid: dict[str, int | tirx.PrimExpr] = dict(s.grid())
    if symbolic is not None:
        tile = s.tiles[symbolic.dim]
        grid[symbolic.dim] = tirx.floordiv(k.sizes[symbolic.dim] + (tile - 1), tile)
    cuda = target == "cuda"
    nblocks = math.prod(grid.values()) * k.cluster  # a cluster of consecutive blocks per tile
    sig = signature(s)
    with IB.IRBuilder() as ib:
        with T.prim_func():
            T.func_name("main")
            for name, shape, dtype, role in sig.params:
                if symbolic is not None and role in ("input", "output"):  # ids and positions too: ``param_dims``
                    shape = tuple(k.sizes[d] for d in param_dims(s.smg, name) or ()) or shape
                k.glob[name] = T.arg(name, T.buffer(shape, dtype))
            for ld in loads.loaded(s.smg).values():  # read through its ids (``lower.loads``)
                k.glob[ld.value] = loads.Gathered(s.smg, ld, k.glob[ld.table], k.glob[ld.ids])
            T.func_attr({"global_symbol": "main", "tirx.noalias": True})
            with ExitStack() as top:
                if cuda:
                    bid = top.enter_context(T.thread_binding(0, nblocks, thread="blockIdx.x"))
                    tid = top.enter_context(T.thread_binding(0, s.threads, thread="threadIdx.x"))
                else:
                    bid = top.enter_context(T.parallel(0, nblocks))
                    tid = top.enter_context(T.serial(0, s.threads // s.lanes))
                k.tid = tid
                rest = bid
                if k.cluster > 1:  # the row's lanes: block rank r of the cluster has lanes r * block_lanes + ...
                    rank, rest = bid % k.cluster, bid // k.cluster
                    k.lane, rest_t = rank * k.block_lanes + tid % k.block_lanes, tid // k.block_lanes
                elif k.lanes > 1:  # lanes fastest: a lane group is consecutive threads (of one or more warps)
                    k.lane, rest_t = tid % k.lanes, tid // k.lanes
                else:
                    rest_t = tid
                # thread id -> position in the block tile, thread_dim fastest (coalesced)
                order = [s.thread_dim] + [d for d, _ in reversed(s.block) if d != s.thread_dim]
                within = {}
                for d in order:
                    within[d] = rest_t % s.tiles[d] if d != order[-1] else rest_t
                    rest_t = rest_t // s.tiles[d]
                for d, _t in reversed(s.block):  # mixed-radix decode of the block id
                    blk = rest % grid[d] if d != s.block[0][0] else rest
                    rest = rest // grid[d]
                    k.base[d], k.within[d] = blk * s.tiles[d], within[d]
                    k.origin[d] = blk * s.tiles[d] + within[d]
                _emit_body(k, cuda)
    return ib.get()


def _shift_key(space: str, offset: int | None) -> str:
    """The register copy of ``space`` read ``offset`` serial elements away (``_Kernel.shift_reads``)."""
    return f"{space}@{offset}"


def _serial_offset(acc: Access, dims: tuple[str, ...], serial: str) -> int | None:
    """``c`` where ``acc`` reads its space's innermost dim at ``serial + c`` and at the iteration's own
    index along every other dim, else None: c != 0 along ``serial`` itself (a shift), any c along a dim of
    the space's own (a concatenation's part, whose first is read at ``serial - 0``)."""
    *outer, last = zip(acc.index, dims)
    if any(comp != d for comp, d in outer):
        return None
    comp, d = last
    if comp == d:
        return None
    e = acc.exprs[-1] - index_symbol(serial)
    if not e.is_Integer or (int(e) == 0 and d == serial):
        return None
    return int(e)


def _alloc_local(k: _Kernel, name: str, space: str) -> None:
    k.local[name] = T.alloc_buffer(k.local_shape(space), F32, scope="local")


def _emit_body(k: _Kernel, cuda: bool) -> None:
    s, smg, plan = k.s, k.smg, k.s.plan
    olds = sorted({sym.name for u in plan.states for sym in parse(u.carry or "0").free_symbols
                   if sym.name.endswith("__old")})
    for u in plan.states:
        _alloc_local(k, u.state, u.state)
    for o in olds:
        _alloc_local(k, o, o)
    for u in plan.states:
        with ExitStack() as st_loops:
            env = k.loops(k.local_dims(u.state), st_loops)
            T.buffer_store(k.local[u.state], tirx.FloatImm(F32, MAX_IDENTITY if u.combiner == "max" else 0.0),
                           k.local_index(u.state, env))
    if k.block_lanes > 32:  # one partial result per warp of each lane group
        k.scratch = T.alloc_buffer((s.threads // 32,), F32, scope="shared")
    if k.cluster > 1:
        k.exchange = T.alloc_buffer((2,), F32, scope="shared")  # this block's result, the cluster's total
    shared = {n for n, lvl in s.memory if lvl == "shared"} if cuda else set()
    staged = [n for n in smg.inputs if n in shared]
    for n in shared:
        dt = smg.space(n).dtype if n in smg.inputs else F32
        k.shared[n] = T.alloc_buffer(k.shared_shape(n), dt, scope=k.smem_scope)
    for n in plan.streamed:
        if n not in shared:
            _alloc_local(k, n, n)
    per_step = tuple(n for n in plan.streamed if s.serial in smg.producer(n).iter_dims)
    k.t0 = tirx.const(0, "int32")
    for n in plan.streamed:  # streamed ops without the serial dim: once per block, before the loop
        if n not in per_step:
            _emit_streamed(k, n)
    if plan.states:  # an element-wise graph (no states) has only the pass that stores its outputs
        with _steps(s.num_steps) as step:
            k.t0 = step * s.step
            _emit_step_inputs(k, staged, per_step)
            for o in olds:
                with ExitStack() as st:
                    env = k.loops(k.local_dims(o), st)
                    base = o.replace("__old", "")  # the state as it is, unguarded (``subtracted_max``)
                    T.buffer_store(k.local[o], k.local[base][k.local_index(base, env)], k.local_index(o, env))
            for u in plan.states:
                if u.space and s.num_steps == 1:
                    # an auxiliary accumulator feeds only its state's carry into a later step: with one step
                    # there is none (a split's stats kernel spent a reduction pass, two barriers, on each)
                    continue
                _emit_update(k, u)
            if k.shared:  # the next step overwrites the block-shared tiles
                T.evaluate(T.tvm_storage_sync("shared"))
    fin = dict(plan.finalize)
    k.finalizing = True
    for out in smg.outputs:
        if out not in plan.second_pass:
            _emit_store(k, out, fin[out], serial=False)
    k.finalizing = False
    if plan.second_pass:
        # outputs keeping the serial dim: a second pass once the reductions are final; with
        # one step the streamed tile is still on chip and is not recomputed
        with _steps(s.num_steps) as step:
            k.t0 = step * s.step
            if s.num_steps > 1 or not plan.states:
                _emit_step_inputs(k, staged, per_step)
            for out in plan.second_pass:
                _emit_store(k, out, fin[out], serial=True)
            if k.shared and s.num_steps > 1:
                T.evaluate(T.tvm_storage_sync("shared"))


@contextmanager
def _steps(n: int):
    """The serial loop over steps; with one step, no loop at all (the index is 0)."""
    if n == 1:
        yield tirx.const(0, "int32")
        return
    with T.serial(0, n) as step:
        yield step


def _emit_step_inputs(k: _Kernel, staged: list[str], streamed: tuple[str, ...]) -> None:
    """Stage this step's input tiles and materialise the streamed spaces."""
    for n in staged:
        _emit_stage(k, n)
    if staged:
        T.evaluate(T.tvm_storage_sync("shared"))
    coop = [n for n in streamed if n in k.shared]
    for n in coop:
        _emit_shared_streamed(k, n)
    if coop:
        T.evaluate(T.tvm_storage_sync("shared"))
    for n in streamed:
        if n not in k.shared:
            _emit_streamed(k, n)


def _emit_store(k: _Kernel, out: str, text: str, serial: bool) -> None:
    """Store an output element-wise (masked on cut-dim and serial-dim tails)."""
    with ExitStack() as st:
        wide = serial and k.vec > 1 and k.smg.space(out).dims[-1] == k.s.serial
        reads = k.vector_reads(sym.name for sym in parse(text).free_symbols) if serial else ()
        local = k.local_dims(out)
        spread = not serial and k.lanes > 1 and bool(local)
        across = _pass_spread(k, out, text) if serial else None
        keep = None
        if across is not None:
            across, text = across
            env, keep = _spread_loop(k, across, st)
        else:
            env = k.loops(local[:-1] if spread else local, st, reads=reads, writes=(out,) if wide else ())
        conds = [k.origin[d] < k.sizes[d] for d in k.smg.space(out).dims if d in k.cut]
        if across is not None:
            conds += [keep] if keep is not None else []
        elif serial:
            conds.append(k.valid_serial(env))
        elif spread:
            # every lane holds the row's final values: the lanes take turns over its last local dim (a
            # GroupNorm's per-channel scale and shift), where lane 0 alone stored all 80 of a 2560-channel
            # group's one by one, each after its own load of W, in a serial chain
            last = local[-1]
            it = st.enter_context(T.serial(0, -(-k.sizes[last] // k.lanes)))
            env[last] = it * k.lanes + k.lane
            conds.append(env[last] < k.sizes[last])
        elif k.lanes > 1:
            conds.append(k.lane == 0)  # every lane holds the same final value; one writes it
        with T.If(tirx.all(*conds) if conds else tirx.const(True, "bool")):
            with T.Then():
                dt = k.smg.space(out).dtype
                val = k.expr(text, env, stored=dt)
                val = val if dt == F32 else tirx.Cast(dt, val)
                if out in k.outs:
                    T.buffer_store(k.outs[out], val, [env[VEC_I]])
                else:
                    stores.store(k, out, val, env)


def _pass_spread(k: _Kernel, out: str, text: str) -> tuple[tuple[str, ...], str] | None:
    """The dims a second pass's lanes spread over when storing ``out`` (its local dims: the step's serial
    positions and the others whole, in its own layout, consecutive lanes on the innermost, as the state
    updates spread theirs in ``_spread_dims``) and ``text`` with each streamed element-wise tile of inputs
    recomputed from its body (a lane holds only its own part of the tile: ``T = X + E``).  None where the lanes
    keep to the serial dim: no lanes or a vector width, no other local dim, or a read of another per-lane
    tile.  Why: a one-kernel GroupNorm's pass over a group (serial: its 40 channels, 128 lanes; the 64 pixels a
    loop) ran 40 of 128 lanes, each pixel one dependent trip."""
    local = k.local_dims(out)
    if k.lanes <= 1 or k.vec > 1 or k.s.serial not in local or len(local) < 2:
        return None
    states = {u.state for u in k.s.plan.states}
    if any(sym.name in states and not set(k.local_dims(sym.name)) <= set(local)
           for sym in parse(text).free_symbols):
        return None
    text = _inline_tiles(k, text)
    if text is None:
        return None
    dims = k.smg.space(out).dims
    return tuple(d for d in dims if d in local), text


def _inline_tiles(k: _Kernel, text: str) -> str | None:
    """``text`` with each streamed element-wise tile of inputs (``T = X + E``) replaced by its body, for lanes
    that spread over positions other than their own tile's; None where it reads another intermediate."""
    states = {u.state for u in k.s.plan.states}
    expr = parse(text)
    subs = {}
    for sym in expr.free_symbols:
        n = sym.name
        if n in k.sizes or n in k.smg.inputs or n.split("__")[0] in states:
            continue  # an input staged in shared memory is indexed by position too
        op = k.smg.producer(n) if n in k.s.plan.streamed else None
        if op is None or op.reduce or not all(a.plain and a.space in k.smg.inputs for a in op.inputs):
            return None
        subs[sym] = body_expr(op)
    return str(expr.xreplace(subs)) if subs else text


def _cooperative(k: _Kernel, name: str, emit) -> None:
    """Spread the elements of block-shared buffer ``name`` over the block's threads;
    ``emit(env)`` writes one element (with ``k.at`` set to that element)."""
    dims = k.smg.space(name).dims
    shape = k.shared_shape(name)
    total = math.prod(shape)
    threads = k.s.threads
    with T.serial(0, (total + threads - 1) // threads) as it:
        flat = it * threads + k.tid
        env, rest = {}, flat
        for d, ext in reversed(list(zip(dims, shape))):
            env[d] = rest % ext
            rest = rest // ext
        ok = flat < total
        if k.s.serial in env:
            ok = tirx.all(ok, k.valid_serial(env))
        with T.If(ok):
            with T.Then():
                with k.at({d: env[d] for d in dims if d in k.cut}):
                    emit(env)


def _emit_stage(k: _Kernel, name: str) -> None:
    """Cooperative copy of one step's tile of an input into shared memory; a window's input copies its halo
    box, zero where the box reaches past the input's edges (the window's padding)."""
    if window_box(k.smg, name) is None:
        _cooperative(k, name, lambda env: T.buffer_store(
            k.shared[name], k.glob[name][k.global_index(name, env)], k.shared_index(name, env)))
        return
    dims, sizes = k.smg.space(name).dims, [k.sizes[d] for d in k.smg.space(name).dims]
    origin = k.halo_origin(name)

    def emit(env: dict[str, tirx.PrimExpr]) -> None:
        local = [env[d] for d in dims]
        pos = [o + i for o, i in zip(origin, local)]
        inside = tirx.all(*[tirx.all(p >= 0, p < n) for p, n in zip(pos, sizes)])
        clamped = [tirx.max(tirx.min(p, n - 1), 0) for p, n in zip(pos, sizes)]
        zero = tirx.const(0, k.glob[name].dtype)
        T.buffer_store(k.shared[name], tirx.if_then_else(inside, k.glob[name][clamped], zero), local)

    _cooperative(k, name, emit)


def _emit_shared_streamed(k: _Kernel, name: str) -> None:
    """A streamed space that several threads read: computed once per block, cooperatively."""
    op = k.smg.producer(name)
    body = body_expr(op)

    def emit(env: dict[str, tirx.PrimExpr]) -> None:
        with k.emitting(op):
            _emit_shared_element(k, name, op, body, env)

    _cooperative(k, name, emit)


def _emit_shared_element(k: _Kernel, name: str, op: Op, body, env: dict[str, tirx.PrimExpr]) -> None:
    idx = k.shared_index(name, env)
    if not op.reduce:
        T.buffer_store(k.shared[name], k.expr(body, env), idx)
        return
    acc = T.alloc_buffer((1,), F32, scope="local")
    T.buffer_store(acc, tirx.FloatImm(F32, MAX_IDENTITY if op.combiner == "max" else 0.0), [0])
    with ExitStack() as red:
        val = k.expr(body, {**env, **k.loops(op.reduce, red)})
        T.buffer_store(acc, acc[0] + val if op.combiner == "sum" else tirx.max(acc[0], val), [0])
    T.buffer_store(k.shared[name], acc[0], idx)


def _emit_streamed(k: _Kernel, name: str) -> None:
    op = k.smg.producer(name)
    body = body_expr(op)
    with ExitStack() as st, k.emitting(op):
        reads = () if op.reduce else k.vector_reads(a.space for a in op.inputs if a.plain)
        shifts = () if op.reduce else k.shift_reads(op)
        env = k.loops(k.local_dims(name), st, reads=reads, shifts=shifts)
        idx = k.local_index(name, env)
        init = MAX_IDENTITY if op.combiner == "max" else 0.0
        T.buffer_store(k.local[name], tirx.FloatImm(F32, init), idx)
        guard = k.valid_serial(env) if k.s.serial in env else tirx.const(True, "bool")
        with T.If(guard):
            with T.Then():
                if not op.reduce:
                    T.buffer_store(k.local[name], k.expr(body, env), idx)
                else:
                    with ExitStack() as red:
                        env2 = {**env, **k.loops(op.reduce, red)}
                        val = k.expr(body, env2)
                        cur = k.local[name][idx]
                        T.buffer_store(k.local[name], cur + val if op.combiner == "sum"
                                       else tirx.max(cur, val), idx)


def _emit_update(k: _Kernel, u) -> None:
    """``S = max(S, max_t body)`` or ``S = carry + sum_t body`` over one step; with lanes, each
    lane reduces its own elements and the partial results meet in warp shuffles."""
    op = k.smg.producer(u.base)
    windowed = any(not a.plain for a in op.inputs)  # its body reads through the op's own window
    with ExitStack() as st:
        if windowed:
            st.enter_context(k.emitting(op))
        env = k.loops(k.local_dims(u.state), st)
        idx = k.local_index(u.state, env)
        buf = k.local[u.state]
        part = T.alloc_buffer((1,), F32, scope="local")
        T.buffer_store(part, tirx.FloatImm(F32, MAX_IDENTITY if u.combiner == "max" else 0.0), [0])
        with ExitStack() as red:
            # the state's op may reduce over more dims than the serial one (GroupNorm: cg, y, x)
            others = tuple(d for d in k.smg.producer(u.base).reduce if d != k.s.serial)
            inlined = _inline_tiles(k, u.body)  # lanes spread over others' positions recompute T = X + E
            spread = _spread_dims(k, inlined, others) if inlined is not None and not windowed else None
            body = inlined if spread is not None else u.body
            keep = None  # the spread loop's flattened-tail predicate: past it an element adds the identity
            if spread is not None:
                got, keep = _spread_loop(k, spread, red)
                env2 = {**env, **got}
            else:
                # a run's inputs read as one wide access where the serial dim is the innermost loop (a decode
                # step's GEMV read its weight rows as 2-byte loads: 1.8 TB/s on the H100)
                reads = () if others else k.vector_reads(sym.name for sym in parse(body).free_symbols)
                env2 = {**env, **k.loops((k.s.serial,), red, reads=reads)}
                # the tail guard reads the serial index alone: tested once, outside the other reduced dims'
                # loops. Inside them it put every load in a branch of its own, which ptxas does not hoist
                # loads across: a stats kernel's 16 loads a lane ran one after another, each a memory latency
                red.enter_context(T.If(k.valid_serial(env2)))
                red.enter_context(T.Then())
                env2 |= k.loops(others, red)
            val = k.expr(body, env2)
            if keep is not None:  # loaded unconditionally (the index is clamped), then selected
                loaded = T.alloc_buffer((1,), F32, scope="local")
                T.buffer_store(loaded, val, [0])
                val = tirx.Select(keep, loaded[0], part[0] if u.combiner == "max" else tirx.FloatImm(F32, 0.0))
            T.buffer_store(part, tirx.max(part[0], val) if u.combiner == "max" else part[0] + val, [0])
        total = k.allreduce(part[0], u.combiner) if k.lanes > 1 else part[0]
        if u.combiner == "max":
            T.buffer_store(buf, tirx.max(buf[idx], total), idx)
        else:
            carried = k.expr(_new_to_cur(u.carry), dict(env)) if u.carry else buf[idx]
            T.buffer_store(buf, carried + total, idx)


def _spread_dims(k: _Kernel, body: str, others: tuple[str, ...]) -> tuple[str, ...] | None:
    """``schedule.lane_spread`` for an update of ``body``, where it reads only global inputs and states (no
    per-lane tiles, which are indexed by the lane's own serial positions: ``_inline_tiles`` recomputes a
    streamed ``X + E`` from its inputs instead, whose lanes then read along the channels, not 640 bytes apart
    along the pixels); the layout is the largest input's."""
    if k.lanes <= 1:
        return None
    names = {sym.name for sym in parse(body).free_symbols} - set(k.sizes)
    states = {v.state for v in k.s.plan.states}
    inputs = [n for n in names if n in k.smg.inputs]
    if not inputs or any(n not in k.smg.inputs and n.split("__")[0] not in states for n in names) \
            or any(n in k.shared for n in inputs):
        return None
    big = max(inputs, key=lambda n: math.prod(k.smg.shape(n)))
    return lane_spread(k.s, others, k.smg.space(big).dims)


def _spread_loop(k: _Kernel, dims: tuple[str, ...], stack: ExitStack
                 ) -> tuple[dict[str, tirx.PrimExpr], tirx.PrimExpr | None]:
    """One loop over a step's elements of ``dims`` (the serial dim's ``step`` positions and the others whole),
    lane ``l`` taking elements ``l, l + lanes, ...`` of their flattened index, the last dim fastest: a warp
    reads consecutive elements of the innermost one.  The tails (the flattened index's and the serial dim's)
    are not branches: their indices are clamped to an element inside and the returned predicate says which
    elements count.  Why: a branch per unrolled trip put every load in a block of its own, which ptxas does not hoist
    loads across, so a stats kernel's 40 loads a lane ran one memory latency after another."""
    sizes = [k.s.step if d == k.s.serial else k.sizes[d] for d in dims]
    total = math.prod(sizes)
    trips = -(-total // k.lanes)
    it = stack.enter_context((T.unroll if trips <= MAX_UNROLL else T.serial)(0, trips))
    flat = it * k.lanes + k.lane
    ok = [flat < total] if total % k.lanes else []
    rest = tirx.min(flat, total - 1) if ok else flat
    env: dict[str, tirx.PrimExpr] = {}
    for d, n in zip(reversed(dims), reversed(sizes)):
        env[d] = rest % n if d != dims[0] else rest
        rest = rest // n
    if k.has_tail:  # the step's last positions past the dim (or past the step): clamped to its last element
        pos, serial = env[k.s.serial], k.s.serial
        ok += [k.t0 + pos < k.sizes[serial], pos < k.s.step]
        env[serial] = tirx.min(tirx.min(pos, k.s.step - 1), k.sizes[serial] - 1 - k.t0)
    return env, (tirx.all(*ok) if ok else None)


def _new_to_cur(text: str) -> str:
    """Inside a step, ``X__new`` is the already-updated state buffer ``X``."""
    return text.replace("__new", "")


__all__ = ["KernelSignature", "build_primfunc", "signature"]
