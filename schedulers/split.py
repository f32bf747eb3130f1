"""Split reduction: a reduction too long for the blocks it leaves is cut across blocks, and combined after.

The spatial slicer cannot cut a reduced dim: GroupNorm at batch 1 leaves 32 groups, 32 blocks for 132
SMs, each streaming a million elements.  The temporal slicer's update functions already say how a
partial result over some steps is corrected when the running states change
(``expm((b_new - b_old) D) A``).  The same functions combine partial results computed *in parallel*:

1. ``partial``: the reduced dim ``t`` is viewed as ``(j, t2)`` (a contiguous split: no copy) and every
   state's accumulator (auxiliary ones included) is reduced over ``t2`` alone: each ``j`` and each index of
   the state's other reduced dims (GroupNorm's channels in a group) is a chunk with its own running states,
   so the partial's blocks read whole contiguous rows;
2. ``combine``: each state's total is the sum over the chunks of their accumulators carried to the total
   running states (a max state: the max over them), and the outputs are the temporal plan's finalisation,
   which re-reads what it streams (a second pass).

For LayerNorm-like chains this is Chan's parallel variance; for softmax chains it is split-K
(flash-decoding).  Nothing here names either: the carries are the derived ones.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import sympy as sp

from schedulers.errors import TemporalSliceError
from schedulers.hardware import HardwareModel
from schedulers.temporal import TemporalPlan, _inline, new, old, plan_temporal
from smg.expr import body_expr, parse, symbol
from smg.fold import fold_all
from smg.ir import SMG, with_dtypes
from smg.ops import Builder, Tensor
from smg.serialize import smg_from_dict, smg_to_dict
from smg.subgraph import sub_smg

#: the version of ``decide_split``'s rule and of the graphs it derives: a saved split of another version is
#: derived again (an export stopped halfway once left splits of an older rule that the next one loaded)
SPLIT_RULE = 5
#: a chunk of the split dim shorter than this is not worth its partial accumulators' round trip
MIN_CHUNK = 1024
#: warps of partial states per SM the parts should at least make (each state a thread, its loads one chain):
#: at 512x512x128, 256 chunks left 8 warps an SM, and the partial read 67 MB at 1.24 TB/s; 128x128x512's 256
#: chunks of 64 rows (31 warps an SM) read at 2.3 TB/s
PARTIAL_WARPS_PER_SM = 32
#: rows (one independent reduction's elements) up to this many stay one kernel even where they leave SMs idle:
#: SD 1.5's UNet at batch 2 on the H200, in the model's graph, one kernel a row (up to 1024 lanes, the pass
#: spread as its updates are) against the split's three: 2560-5120 elements 2.9-5.1 us a call against 6.0-9.7;
#: 10240 won plain (4.4 against 7.5) and lost with the time embedding's add (13.2 against 9.6); 20480 lost
#: (21.4 against 9.9) (docs/convolutions.md, 'Short rows in one kernel, again')
ONE_KERNEL_MAX_ROW = 5120
#: rows whose updates stream no element-wise tile (no ``T = X + E``: plain, or with SiLU after) stay one kernel
#: up to this many times ``ONE_KERNEL_MAX_ROW``: in the run above, 10240 won at every such GroupNorm (16x16x1280
#: plain 4.4 against 7.5, + SiLU 6.1 against 8.8; 32x32x320 + SiLU 6.7 against 8.0) and lost with the add
ONE_KERNEL_PLAIN_FACTOR = 2
#: where no split into enough chunks of MIN_CHUNK exists: still split into chunks of at least this many. Why:
#: the one-kernel form reads a group's channels as strided rows (51 us a call for a 2x1280x8x8 GroupNorm on
#: the H100), which the split's folded rows do not
SMALL_CHUNK = 256


@dataclass(frozen=True)
class SplitReduction:
    """``smg`` as ``partial`` then ``combine`` (which reads ``partial``'s outputs by name as ``<name>_p``),
    and why it was split; ``kernels`` is what runs."""

    smg: SMG
    dim: str
    parts: int
    partial: SMG
    combine: SMG
    reason: str

    @property
    def kernels(self) -> tuple[SMG, ...]:
        """The three launches: the partial accumulators, their totals (``stats``: the combine's reductions
        over the chunks, one block per row) and ``apply`` (its outputs, an element-wise pass reading the
        totals as inputs).  Why not the combine as one kernel: each of its blocks would recompute the
        totals, and the CUDA-core lowering did so per thread (13 ms for a 2M-element GroupNorm on the H100,
        against 0.2 ms for the partial).  Where every output is a total itself (``any(isinf(x))``), there is
        no element-wise pass: two launches."""
        finals = [op for op in self.combine.ops if op.out in self.combine.outputs and not op.reduce]
        stats = [op for op in self.combine.ops if op not in finals]
        # the partial and the pass folded (``smg.fold``: the same memory, one dim fewer): a GroupNorm's (group,
        # channel) pair is one contiguous row of channels to their blocks, where a group's 4 channels alone
        # made rows of 8 bytes
        head = (fold_all(self.partial), sub_smg(self.combine, stats, f"{self.smg.name}.stats"))
        return (*head, fold_all(sub_smg(self.combine, finals, f"{self.smg.name}.apply"))) if finals else head

    def to_dict(self) -> dict[str, Any]:
        """The split as derived here: a GPU machine loads it rather than deriving again (another sympy
        may print a carried coefficient differently, which changes the kernels' content keys)."""
        return {"smg": self.smg.key, "rule": SPLIT_RULE, "dim": self.dim, "parts": self.parts, "reason": self.reason,
                "partial": smg_to_dict(self.partial), "combine": smg_to_dict(self.combine)}

    @classmethod
    def from_dict(cls, smg: SMG, d: dict[str, Any]) -> SplitReduction:
        if d.get("smg") != smg.key:
            raise ValueError(f"a split of SMG {d.get('smg')}, not of {smg.name} ({smg.key})")
        if d.get("rule") != SPLIT_RULE:
            raise ValueError(f"a split decided by rule {d.get('rule')}, not the current {SPLIT_RULE}")
        return cls(smg, d["dim"], int(d["parts"]), smg_from_dict(d["partial"]), smg_from_dict(d["combine"]),
                   d["reason"])


def _space_name(state: str) -> str:
    return state.replace("__", "_")


def _rows(smg: SMG, plan: TemporalPlan) -> int:
    """Independent reductions: the elements of the states' spaces (each is one block's row at best)."""
    base = {u.base for u in plan.states}
    return max(math.prod(smg.dim_sizes[d] for d in smg.space(b).dims) for b in base)


def split_reduction(smg: SMG, dim: str, parts: int, reason: str = "") -> SplitReduction:
    """``smg``'s reduction over ``dim`` cut into ``parts`` chunks (see the module doc).  Raises
    ``TemporalSliceError`` with the reason where the chain cannot be split this way."""
    size = smg.dim_sizes.get(dim)
    if size is None:
        raise TemporalSliceError(f"split dim {dim!r} is not a dimension of {smg.name!r}", code="split.dim_unknown")
    if parts < 2 or size % parts:
        raise TemporalSliceError(f"cannot split {dim!r} ({size}) into {parts} equal chunks", code="split.parts")
    plan = plan_temporal(smg, dim)
    if not plan.states:
        raise TemporalSliceError(f"no op of {smg.name!r} reduces over {dim!r}: nothing to split",
                                 code="split.no_reduction")
    inputs = set(smg.inputs)
    states = {u.state for u in plan.states}
    streamed_plan = plan  # its bodies still name the streamed element-wise tiles (``T = X + E``)
    plan = _over_inputs(smg, plan, states)
    for u in plan.states:
        for s in parse(u.body).free_symbols:
            if s.name not in states and s.name not in inputs:
                raise TemporalSliceError(f"state {u.state!r} streams {s.name!r}, an intermediate: a split re-reads "
                                         f"only inputs (partition the graph before {s.name!r})",
                                         code="split.intermediate_stream")
    for o, e in plan.finalize:
        for s in parse(e).free_symbols:
            if s.name not in states and s.name not in inputs and s.name not in smg.dim_sizes:
                raise TemporalSliceError(f"output {o!r} reads {s.name!r}, an intermediate the second pass "
                                         "would recompute", code="split.intermediate_output")
    inner, chunk = f"{dim}2", size // parts
    j = f"{dim}_part"
    partial = _partial(smg, streamed_plan, dim, j, inner, parts, chunk)
    combine = _combine(smg, plan, j, parts, partial)
    return SplitReduction(smg, dim, parts, partial, combine, reason)


def _over_inputs(smg: SMG, plan: TemporalPlan, states: set[str]) -> TemporalPlan:
    """``plan`` with the streamed element-wise intermediates (RMSNorm's ``X**2``) substituted by their bodies
    down to the inputs: each kernel of the split re-reads the inputs and recomputes them."""
    # temporal's inlining, with the element-wise ops that read only plain accesses as the class it substitutes
    cls = {op.out: "post" if op.out not in states and not op.reduce and all(a.plain for a in op.inputs)
           else "streamed" for op in smg.ops}

    def expand(text: str) -> str:
        return str(_inline(smg, parse(text), cls))

    return dataclasses.replace(
        plan, states=tuple(dataclasses.replace(u, body=expand(u.body)) for u in plan.states),
        finalize=tuple((o, expand(e)) for o, e in plan.finalize))


def _reduced(smg: SMG, plan: TemporalPlan, state: str) -> tuple[str, ...]:
    u = next(u for u in plan.states if u.state == state)
    return smg.producer(u.base).reduce


def _constant(smg: SMG, plan: TemporalPlan, state: str, chunk_count: int) -> sp.Expr | None:
    """A state whose body reads nothing accumulates ``body * count``: a constant, never a space."""
    u = next(u for u in plan.states if u.state == state)
    body = parse(u.body)
    if body.free_symbols:
        return None
    return body * chunk_count if u.combiner == "sum" else body


def _partial(smg: SMG, plan: TemporalPlan, dim: str, j: str, inner: str, parts: int, chunk: int) -> SMG:
    g = Builder(f"{smg.name}.partial", "float32")
    handles: dict[str, Tensor] = {}

    def dims_of(d: tuple[str, ...]) -> dict[str, int]:
        out: dict[str, int] = {}
        for x in d:
            if x == dim:
                out |= {j: parts, inner: chunk}
            else:
                out[x] = smg.dim_sizes[x]
        return out

    def handle(name: str) -> Tensor:
        """An input, or a streamed element-wise tile of inputs (``T = X + E``) computed here once, which
        every state's body then reads: expanded into each body instead, each re-read ``X`` and ``E``
        (the partial of SD 1.5's ``X + E`` GroupNorm loaded 6 elements for each it summed)."""
        if name not in handles:
            sp_ = smg.space(name)
            op = smg.producer(name)
            if op is None:
                handles[name] = g.input(name, dims_of(sp_.dims), sp_.dtype)
            else:
                if op.reduce or not all(a.plain for a in op.inputs):
                    raise TemporalSliceError(f"{name!r} is not an element-wise tile of inputs: the partial "
                                             "cannot compute it", code="split.not_elementwise")
                reads = {a.space: handle(a.space) for a in op.inputs}
                body = body_expr(op).xreplace({symbol(n): symbol(t.name) for n, t in reads.items()})
                handles[name] = g.map(str(body), *sorted(reads.values(), key=lambda t: -len(t.dims)), name=name)
        return handles[name]

    outs = []
    for u in plan.states:
        red = (inner,)  # the other reduced dims are kept: each (chunk, c) is a chunk of its own
        if _constant(smg, plan, u.state, chunk) is not None:
            continue
        body = parse(u.body)
        reads = [handle(s.name) for s in sorted(body.free_symbols, key=str)]
        body = body.xreplace({s: symbol(handles[s.name].name) for s in body.free_symbols})
        name = _space_name(u.state)
        mapped = g.map(str(body), *reads, name=f"{name}_body")
        if not set(red) <= set(mapped.dims):  # a body that does not read along a reduced dim: broadcast it
            raise TemporalSliceError(f"state {u.state!r}'s body does not span its reduced dims {red}",
                                     code="split.body_span")
        acc = g.reduce(mapped, red, u.combiner, name=name)
        handles[u.state] = acc
        outs.append(acc)
    return g.build(*outs)


def _hoist(expr: sp.Expr, streamed: set[sp.Symbol]) -> tuple[sp.Expr, list[tuple[sp.Expr, sp.Expr]]]:
    """``expr`` with each maximal subexpression affine in one streamed symbol ``x`` (``p * x + q``, with
    ``p`` and ``q`` free of every streamed symbol) replaced by ``L_i``; returns the pairs ``(p, q)`` in
    order (a negated pair reuses ``-L_i``).  Why: ``p`` and ``q`` depend only on the totals and the
    parameters, so the stats kernel computes them once per channel and the element-wise pass reads
    per-channel coefficients, whose channel dims then fold into one contiguous row (GroupNorm's
    ``silu(x * scale + shift)``)."""
    pairs: list[tuple[sp.Expr, sp.Expr]] = []
    syms: list[sp.Symbol] = []

    def affine(e: sp.Expr) -> tuple[sp.Expr, sp.Expr] | None:
        xs = e.free_symbols & streamed
        if len(xs) != 1:
            return None
        (x,) = xs
        p = sp.simplify(sp.diff(e, x))
        q = sp.simplify(e.subs(x, 0))
        if p.free_symbols & streamed or q.free_symbols & streamed or sp.simplify(p * x + q - e) != 0:
            return None
        return x, (p, q)

    def walk(e: sp.Expr) -> sp.Expr:
        got = affine(e)
        if got is None:
            return e.func(*(walk(a) for a in e.args)) if e.args and e.free_symbols & streamed else e
        x, (p, q) = got
        if not p.free_symbols and not q.free_symbols:
            return e  # constant coefficients: nothing to hoist
        for i, (p0, q0) in enumerate(pairs):
            if not syms[i].name.endswith(f"__{x.name}"):
                continue
            if sp.simplify(p - p0) == 0 and sp.simplify(q - q0) == 0:
                return syms[i]
            if sp.simplify(p + p0) == 0 and sp.simplify(q + q0) == 0:
                return -syms[i]
        pairs.append((p, q))
        syms.append(symbol(f"L__{len(pairs) - 1}__{x.name}"))  # the name keeps x
        return syms[-1]

    return walk(expr), pairs


def _combine(smg: SMG, plan: TemporalPlan, j: str, parts: int, partial: SMG) -> SMG:
    g = Builder(f"{smg.name}.combine", "float32")
    handles: dict[str, Tensor] = {}
    partials: dict[str, Tensor] = {}
    consts: dict[str, sp.Expr] = {}
    chunk = smg.dim_sizes[plan.serial] // parts

    def part(state: str) -> Tensor | sp.Expr:
        if state in consts:
            return consts[state]
        if state not in partials:
            dims = {kept(d): partial.dim_sizes[d] for d in partial.space(_space_name(state)).dims}
            partials[state] = g.input(f"{_space_name(state)}_p", dims, "float32")
        return partials[state]

    def read(name: str) -> Tensor:
        if name not in handles:
            sp_ = smg.space(name)
            handles[name] = g.input(name, {d: smg.dim_sizes[d] for d in sp_.dims}, sp_.dtype)
        return handles[name]

    kept_dims = {d for u in plan.states for d in _reduced(smg, plan, u.state) if d != plan.serial}

    def kept(d: str) -> str:
        """A reduced dim the partial kept is a dim of chunks here, named apart from the output's own (so the
        second pass still cuts the output's channels)."""
        return f"{d}_part" if d in kept_dims else d

    def over(state: str) -> tuple[str, ...]:
        """The chunks' dims: the split's parts and the other dims the state reduces (kept by the partial)."""
        return (j, *(kept(d) for d in _reduced(smg, plan, state) if d != plan.serial))

    for u in plan.states:
        c = _constant(smg, plan, u.state, chunk)
        if c is not None:
            consts[u.state] = c
    totals: dict[str, Tensor] = {}
    for u in plan.states:
        if u.space:  # an auxiliary accumulator: read by its state's carry, never totalled
            continue
        if u.combiner == "max" or not u.carry:
            p = part(u.state)
            if not isinstance(p, Tensor):
                raise TemporalSliceError(f"state {u.state!r} is a constant: nothing to combine",
                                         code="split.constant_state")
            totals[u.state] = g.reduce(p, over(u.state), u.combiner, name=u.state)
            continue
        carry = parse(u.carry)
        subs: dict[sp.Symbol, sp.Expr] = {}
        reads: list[Tensor] = []
        for s in sorted(carry.free_symbols, key=str):  # a set: its order changes with the hash seed
            base = s.name.rsplit("__", 1)[0]
            if s.name == new(base):
                t = totals[base]
            elif s.name == old(base):
                t = part(base)
            else:  # pragma: no cover - a carry reads only old and new values
                raise TemporalSliceError(f"carry of {u.state!r} reads {s.name!r}", code="split.carry_read")
            if isinstance(t, Tensor):
                subs[s] = symbol(t.name)
                reads.append(t)
            else:
                subs[s] = t
        body = g.map(str(carry.xreplace(subs)), *dict.fromkeys(reads), name=f"{u.state}_carried")
        totals[u.state] = g.reduce(body, over(u.state), "sum", name=u.state)
    streamed = {symbol(n) for n in smg.inputs if plan.serial in smg.space(n).dims}
    outs = []
    def tensors(x: sp.Expr, dims: tuple[str, ...]) -> list[Tensor]:
        """The spaces ``x`` reads, ordered so that the map's dims (its reads' order) follow ``dims``."""
        reads = [totals[s.name] if s.name in totals else read(s.name)
                 for s in sorted(x.free_symbols, key=str) if s.name not in smg.dim_sizes]
        order = {d: i for i, d in enumerate(dims)}
        return sorted(reads, key=lambda t: (t.dims != dims, min((order.get(d, len(order)) for d in t.dims), default=0)))

    for o, e in plan.finalize:
        if o in totals and parse(e) == symbol(o):  # the output is a state's total itself
            outs.append(totals[o])
            continue
        expr, pairs = _hoist(parse(e), streamed)
        subs: dict[sp.Symbol, sp.Expr] = {}
        for i, (p, q) in enumerate(pairs):
            lsym = next(x for x in expr.free_symbols if x.name.startswith(f"L__{i}__"))
            x = symbol(lsym.name.split("__", 2)[2])
            coef = {}
            for part, val in (("scale", p), ("shift", q)):
                if val.free_symbols:
                    coef[part] = g.map(str(val), *tensors(val, smg.space(o).dims), name=f"{o}_{part}{i}")
                    handles[coef[part].name] = coef[part]
            pe = symbol(coef["scale"].name) if "scale" in coef else p
            qe = symbol(coef["shift"].name) if "shift" in coef else q
            subs[lsym] = pe * x + qe
        expr = expr.xreplace(subs)
        t = g.map(str(expr), *tensors(expr, smg.space(o).dims), name=o)
        if t.dims != smg.space(o).dims:
            raise TemporalSliceError(f"output {o!r}: the second pass iterates {t.dims}, not {smg.space(o).dims}",
                                     code="split.second_pass_dims")
        outs.append(t)
    out = g.build(*outs)
    return with_dtypes(out, {o: smg.space(o).dtype for o in smg.outputs})


def decide_split(smg: SMG, hw: HardwareModel, dim: str | None = None, min_chunk: int = MIN_CHUNK,
                 one_kernel_max_row: int = ONE_KERNEL_MAX_ROW) -> SplitReduction | str:
    """Split ``smg``'s longest reduction when its rows leave most SMs idle, else say why not.

    The rule: rows (independent reductions, one block each at most) under half the SMs, and a reduced dim
    long enough for at least ``4 * SMs / rows`` chunks of ``min_chunk`` elements; the most such parts up to
    two per SM.  Short rows split too: SD 1.5's UNet's 8x8x1280 GroupNorm (rows of 2560 elements) took 9.7
    us a call as one kernel in the model's CUDA graph on the H100, against 6.7 for its three split kernels
    (1.8 + 2.3 + 2.6, L2 warm); with L2 flushed before each kernel the one kernel won (13.1 against 17.3),
    which is not how a model runs them (``docs/convolutions.md``)."""
    reduced = {d for op in smg.ops for d in op.reduce}
    if not reduced:
        return "no op reduces: nothing to split"
    if any(op.kind == "matmul" for op in smg.ops):
        # split-K and flash-decoding derive the same way, but their partials would run on CUDA cores here
        return "a contraction's reduction is not split (its chunks would leave the tensor cores): one kernel"
    big = max((smg.space(n) for n in smg.inputs), key=lambda sp_: math.prod(smg.dim_sizes[d] for d in sp_.dims))
    if dim is None:  # the outermost reduced dim of the largest input: its chunks are contiguous slabs
        dim = next((d for d in big.dims if d in reduced), max(sorted(reduced), key=lambda d: smg.dim_sizes[d]))
    try:
        plan = plan_temporal(smg, dim)
    except TemporalSliceError as e:
        return f"no update functions over {dim!r}: {e}"
    rows = _rows(smg, plan)
    if 2 * rows >= hw.num_sms:
        return f"{rows} independent reductions already fill {hw.name}'s {hw.num_sms} SMs: one kernel"
    size = smg.dim_sizes[dim]
    want = math.ceil(4 * hw.num_sms / rows)
    other = max(math.prod(smg.dim_sizes[d] for d in op.reduce if d != dim) for op in smg.ops if dim in op.reduce)
    limit = one_kernel_max_row * (1 if plan.streamed else ONE_KERNEL_PLAIN_FACTOR)
    if size * other <= limit:
        return (f"{rows} reductions of {size * other} elements (at most {limit}): one kernel, a block "
                f"a row, whose passes re-read it from L1, costs less in a model's graph than a split's three launches")
    # as many parts as about two waves of blocks: the partial keeps the other reduced dims in its rows (a
    # block reads whole channel rows), so its blocks are the parts, not parts x rows; and at least enough
    # that the partial's states (one thread each) keep PARTIAL_WARPS_PER_SM warps of loads on every SM
    most = max(want, 2 * hw.num_sms, math.ceil(PARTIAL_WARPS_PER_SM * 32 * hw.num_sms / (rows * other)))
    fits = [p for p in range(want, most + 1) if size % p == 0 and size // p * other >= min_chunk]
    if not fits and big.dims[-1] != dim:
        # too short for that many: fewer, shorter chunks still read whole rows of the dims inside ``dim``
        # (GroupNorm's channels), where one kernel reads them strided; a row of contiguous elements (a decode
        # step's RMSNorm) is already read well by one kernel and stays one
        fits = [p for p in range(2, 2 * hw.num_sms + 1) if size % p == 0 and size // p * other >= SMALL_CHUNK]
    parts = max(fits) if fits else None
    if parts is None:
        return (f"{rows} reductions for {hw.num_sms} SMs, but {dim!r} ({size}) has no split into {want}+ chunks of "
                f"{min_chunk} elements" + (f", nor of {SMALL_CHUNK} for strided rows" if big.dims[-1] != dim else
                                           " and its rows are contiguous") + ": one kernel")
    why = (f"{rows} independent reductions would leave {hw.num_sms - rows} of {hw.name}'s {hw.num_sms} SMs idle: "
           f"{dim!r} ({size}) split into {parts} chunks of {size // parts}, then their totals and an element-wise pass")
    try:
        return split_reduction(smg, dim, parts, why)
    except TemporalSliceError as e:
        return f"{why}, but: {e}"


__all__ = ["MIN_CHUNK", "PARTIAL_WARPS_PER_SM", "SMALL_CHUNK", "SPLIT_RULE", "SplitReduction", "decide_split",
           "split_reduction"]
