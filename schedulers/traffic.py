"""Memory-traffic model: device-memory and on-chip bytes of a Schedule vs the unfused chain.

Footprints are exact: islpy images of one block's iteration domain (cut dims
restricted to the block's tile, the serial dim to one step where on-chip
sizes are asked) under every access map of the graph.  A block is charged the
*distinct* elements it touches.  Blocks at the edges of the grid have smaller
tiles; each distinct block shape is counted once and weighted by how many
blocks have it, so the totals are exact for sizes the tiles don't divide.

The unfused baseline runs one kernel per user-level operator (``Op.group``:
a LayerNorm is one kernel, not six): each reads its inputs from device memory
and writes what later operators or the user need.  ``accesses`` counts
device-memory phases the way the design notes do (each kernel reads once and
writes once; a second pass over the serial dim reads again).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import islpy as isl

from schedulers.memo import per_schedule
from schedulers.schedule import Schedule
from smg.expr import names_of
from smg.ir import SMG, itemsize

ON_CHIP_BYTES = 4  # on-chip values are fp32 (accumulators, streamed tiles)


def _bytes(smg: SMG, space: str, elems: int | None = None) -> int:
    n = math.prod(smg.shape(space)) if elems is None else elems
    return n * itemsize(smg.space(space).dtype)


@dataclass(frozen=True)
class KernelTraffic:
    """Device-memory traffic of one kernel (an unfused operator or a fused schedule)."""

    name: str
    reads: tuple[tuple[str, int], ...]  # space -> bytes read from device memory
    writes: tuple[tuple[str, int], ...]
    read_phases: int = 1

    @property
    def read_bytes(self) -> int:
        return sum(b for _, b in self.reads)

    @property
    def write_bytes(self) -> int:
        return sum(b for _, b in self.writes)

    @property
    def accesses(self) -> int:
        return (self.read_phases if self.reads else 0) + (1 if self.writes else 0)


@dataclass(frozen=True)
class Traffic:
    """Fused schedule against the unfused operator chain."""

    unfused: tuple[KernelTraffic, ...]
    fused: tuple[KernelTraffic, ...]
    on_chip_bytes_per_block: int
    on_chip: tuple[tuple[str, int], ...]  # space -> bytes held on chip per block (per step if streamed)

    @property
    def unfused_bytes(self) -> int:
        return sum(k.read_bytes + k.write_bytes for k in self.unfused)

    @property
    def fused_bytes(self) -> int:
        return sum(k.read_bytes + k.write_bytes for k in self.fused)

    @property
    def unfused_accesses(self) -> int:
        return sum(k.accesses for k in self.unfused)

    @property
    def fused_accesses(self) -> int:
        return sum(k.accesses for k in self.fused)

    @property
    def reduction(self) -> float:
        return 1.0 - self.fused_bytes / self.unfused_bytes

    def __str__(self) -> str:
        return (f"device memory: fused {self.fused_bytes / 1e6:.3f} MB in {self.fused_accesses} accesses vs "
                f"unfused {self.unfused_bytes / 1e6:.3f} MB in {self.unfused_accesses} accesses "
                f"({100 * self.reduction:.1f}% less); on chip {self.on_chip_bytes_per_block / 1024:.1f} KiB/block")


# -- unfused baseline ---------------------------------------------------------------------------


def unfused_kernels(smg: SMG) -> tuple[KernelTraffic, ...]:
    """One kernel per user-level operator; intermediates inside an operator stay on chip."""
    group_of = {op.out: smg.group_of(op) for op in smg.ops}
    kernels = []
    for grp in smg.groups:
        ops = [op for op in smg.ops if group_of[op.out] == grp]
        produced = {op.out for op in ops}
        reads = dict.fromkeys(a.space for op in ops for a in op.inputs if a.space not in produced)
        needed_later = {a.space for op in smg.ops if group_of[op.out] != grp for a in op.inputs}
        writes = [o for o in produced if o in needed_later or o in smg.outputs]
        writes.sort(key=[op.out for op in ops].index)
        kernels.append(KernelTraffic(grp, tuple((r, _bytes(smg, r)) for r in reads),
                                     tuple((w, _bytes(smg, w)) for w in writes)))
    return tuple(kernels)


def unfused_traffic(smg: SMG) -> int:
    """Bytes moved by the unfused operator chain."""
    return sum(k.read_bytes + k.write_bytes for k in unfused_kernels(smg))


# -- exact per-block footprints -----------------------------------------------------------------


def _box(dims: Iterable[str], lo: dict[str, int], hi: dict[str, int]) -> str:
    return " and ".join(f"{lo[d]} <= {d} < {hi[d]}" for d in dims) or "true"


def _footprint(smg: SMG, space: str, lo: dict[str, int], hi: dict[str, int],
               readers: Iterable[str] | None = None) -> int:
    """Distinct elements of ``space`` touched by ops (``readers``, default all)
    whose iteration domains are restricted to the box ``lo <= d < hi``."""
    return _footprint_cached(smg, space, tuple(sorted(lo.items())), tuple(sorted(hi.items())),
                             None if readers is None else tuple(readers))


@lru_cache(maxsize=65536)
def _footprint_cached(smg: SMG, space: str, lo_items: tuple, hi_items: tuple, readers: tuple | None) -> int:
    """Memoised: a search asks for the same block shapes over and over (steps, levels vary)."""
    lo, hi = dict(lo_items), dict(hi_items)
    target = smg.space(space)
    union = None
    for op in smg.ops:
        if readers is not None and op.out not in readers:
            continue
        maps = []
        if op.out == space:
            maps.append(op.out_index)
        maps += [a.index for a in op.inputs if a.space == space]
        for index in maps:
            it = f"IT[{', '.join(op.iter_dims)}]"
            dst = f"{space}[{', '.join(index)}]"
            m = isl.Map(f"{{ {it} -> {dst} : {_box(op.iter_dims, lo, hi)} }}")
            img = m.range()
            union = img if union is None else union.union(img)
    if union is None:
        return 0
    rng = isl.Set(f"{{ {space}[{', '.join(target.dims)}] : "
                  f"{_box(target.dims, dict.fromkeys(target.dims, 0), smg.dim_sizes)} }}")
    return int(union.intersect(rng).coalesce().count_val().to_python())


def _block_shapes(s: Schedule) -> list[tuple[dict[str, int], int]]:
    """Distinct block extents along the cut dims (full tile or tail), with multiplicities."""
    sizes = s.smg.dim_sizes
    per_dim = []
    for d, t in s.block:
        full, tail = divmod(sizes[d], t)
        opts = [(t, full)] + ([(tail, 1)] if tail else [])
        per_dim.append([(d, ext, n) for ext, n in opts if n])
    out = []
    for combo in itertools.product(*per_dim):
        out.append(({d: ext for d, ext, _ in combo}, math.prod(n for _, _, n in combo)))
    return out


def _box_for(s: Schedule, ext: dict[str, int], step: bool) -> tuple[dict[str, int], dict[str, int]]:
    sizes = s.smg.dim_sizes
    lo = dict.fromkeys(sizes, 0)
    hi = dict(sizes)
    hi.update(ext)
    if step:
        hi[s.serial] = min(s.step, sizes[s.serial])
    return lo, hi


@per_schedule  # derived once per candidate: the estimate reads it for its bytes and for its uncoalesced reads
def fused_kernel(s: Schedule) -> KernelTraffic:
    """Device-memory bytes of the fused kernel of ``s``, exact over all blocks."""
    smg, plan = s.smg, s.plan
    reads = dict.fromkeys(smg.inputs, 0)
    writes = dict.fromkeys(smg.outputs, 0)
    again = _second_pass_inputs(s) if plan.second_pass else set()
    for ext, count in _block_shapes(s):
        lo, hi = _box_for(s, ext, step=False)
        for name in smg.inputs:
            fp = _footprint(smg, name, lo, hi)
            reads[name] += fp * count * (2 if name in again else 1)
        for name in smg.outputs:
            writes[name] += _footprint(smg, name, lo, hi, readers=[name]) * count
    return KernelTraffic(
        smg.name,
        tuple((n, _bytes(smg, n, e)) for n, e in reads.items() if e),
        tuple((n, _bytes(smg, n, e)) for n, e in writes.items()),
        read_phases=2 if again else 1,
    )


def _inputs_reached(s: Schedule, names: list[str], through_streamed: bool) -> set[str]:
    """Inputs read along the serial dim from device memory to evaluate ``names``
    (directly, or through streamed spaces when ``through_streamed``)."""
    smg = s.smg
    spaces = {sp.name for sp in smg.spaces}
    need: set[str] = set()
    todo = [(n, True, s.serial in smg.space(n).dims) for n in names if n in spaces]
    seen: set[tuple[str, bool, bool]] = set()
    while todo:
        item = todo.pop()
        n, direct, along = item
        if item in seen:
            continue
        seen.add(item)
        if n in smg.inputs:
            if along and (direct or through_streamed):
                need.add(n)
        elif n in s.plan.streamed:
            op = smg.producer(n)
            # an input is read along the serial dim if its index mentions it (y, y + ky, floor(y/2))
            todo += [(a.space, False, any(s.serial in a.dims_in(c) for c in a.index)) for a in op.inputs]
    return need


def _second_pass_inputs(s: Schedule) -> set[str]:
    """Inputs the second pass reads from device memory *again*: read in the
    first pass too, and read directly in the second, or through streamed
    spaces that are recomputed because there is more than one step."""
    first = [n for u in s.plan.states for n in names_of(u.body)]
    second = [n for o, e in s.plan.finalize if o in s.plan.second_pass for n in names_of(e)]
    return _inputs_reached(s, first, True) & _inputs_reached(s, second, s.num_steps > 1)


def on_chip(s: Schedule) -> tuple[tuple[str, int], ...]:
    """Bytes each non-global space holds on chip for one full block (one step for streamed spaces)."""
    smg = s.smg
    ext = {d: t for d, t in s.block}
    lo, hi = _box_for(s, ext, step=True)
    out = []
    states = {u.state: u for u in s.plan.states}
    for name, level in s.memory:
        if level in ("global", "inlined"):
            continue
        fp = _footprint(smg, name, lo, hi, readers=None if name in smg.inputs else [name])
        if name in states:  # an accumulator holds the whole block's result, plus derived auxiliaries
            fp *= sum(1 for u in s.plan.states if u.base == name)
        staged = level == "shared" and name in smg.inputs  # staged inputs keep their dtype
        width = itemsize(smg.space(name).dtype) if staged else ON_CHIP_BYTES
        out.append((name, fp * width))
    return tuple(out)


def traffic(s: Schedule) -> Traffic:
    """The fused schedule's traffic against the unfused chain, plus its on-chip footprint."""
    chip = on_chip(s)
    return Traffic(unfused_kernels(s.smg), (fused_kernel(s),), sum(b for _, b in chip), chip)
