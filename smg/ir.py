"""The Space-Mapping Graph IR: data spaces, iteration spaces and typed mappings.

An operator is written once as a tensor index expression (``Op``): an output
element is ``combiner_{reduce dims}(body(inputs at their indices))``.  Everything
else -- iteration spaces, edges and the per-dimension dependency kind of each
edge -- is derived from those expressions, so it cannot drift from them.
"""

from __future__ import annotations

import enum
import numbers
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

from smg.errors import BadNameError, DTypeError, ShapeError, UnknownAxisError
from smg.hashing import canonical_text, text_key

if TYPE_CHECKING:
    from collections.abc import Mapping

    import sympy as sp

COMBINERS = ("none", "sum", "max")


class Kind(enum.StrEnum):
    """Dependency kind of a mapping along one dimension (paper, Sec. 2)."""

    ONE_TO_ONE = "One-to-One"
    ONE_TO_ALL = "One-to-All"
    ALL_TO_ONE = "All-to-One"
    #: a sliding window (``y + ky``): neighbouring elements overlap, a tile needs a halo.
    #: Not in the paper's SMG; it lets the slicers tile convolutions.
    WINDOWED = "Windowed"

    @property
    def short(self) -> str:
        return {"One-to-One": "1:1", "One-to-All": "1:A", "All-to-One": "A:1", "Windowed": "W"}[self.value]


@dataclass(frozen=True)
class Dim:
    """A named dimension; equal names across operators are the same dimension."""

    name: str
    size: int

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.name.isascii():  # it names CUDA loop variables
            raise BadNameError(f"dimension name {self.name!r} is not an identifier of ASCII letters, digits and '_'")
        if isinstance(self.size, bool) or not isinstance(self.size, numbers.Real) or int(self.size) != self.size:
            raise ShapeError(f"dimension {self.name!r} has size {self.size!r}: sizes are whole numbers")
        if int(self.size) <= 0:
            raise ShapeError(f"dimension {self.name!r} has non-positive size {self.size}")


@dataclass(frozen=True)
class DataSpace:
    """A tensor: its dims (in storage order) and element type."""

    name: str
    dims: tuple[str, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_dtype(self.dtype, self.name)


#: the element types SMG ops compute in (float64: the reference's own)
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INTEGER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "bool")
#: bytes per element of each dtype a space may have.  Stated here rather than asked of ``np.dtype``: numpy knows
#: "bfloat16" only once ``ml_dtypes`` is imported (TVM imports it), so the cost model's ``np.dtype("bfloat16")``
#: raised where TVM was not loaded yet, and ``first_pick`` silently fell back to the slicers' CUDA-core default for
#: every bf16 graph (a 256x1024x512 bf16 GEMM got 4096 blocks of 64 threads, its fp16 twin wgmma)
ITEMSIZE: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "int16": 2,
                            "int32": 4, "int64": 8, "uint8": 1, "bool": 1}


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (``ITEMSIZE``; a DTypeError names an unknown one)."""
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise DTypeError(f"unknown dtype {dtype!r}; known: {', '.join(ITEMSIZE)}") from None


def check_dtype(dtype: str, where: str = "") -> None:
    """Raise ``DTypeError`` naming the problem unless ``dtype`` is one the ops compute in: every op is a
    floating-point index expression (sums, exp, division, the online softmax's rescales), so an integer space
    would wrap or truncate silently (an int8 GEMM of 3200 gives -128)."""
    at = f" of {where!r}" if where else ""
    if dtype in INTEGER_DTYPES:
        raise DTypeError(f"dtype {dtype!r}{at}: integer types are not supported (the ops compute in floating "
                         f"point, an integer result would wrap or truncate); use one of {', '.join(FLOAT_DTYPES)}")
    if dtype not in FLOAT_DTYPES:
        raise DTypeError(f"unknown dtype {dtype!r}{at}; known: {', '.join(FLOAT_DTYPES)}")


#: an index component ``d``, ``d + k`` or ``d - k`` (``SMG.inner_read``)
_AT_OFFSET = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:([+-])\s*(\d+))?\s*")


@dataclass(frozen=True)
class Access:
    """One read of ``space`` inside an op.

    Each index component is an iteration dim's name (the common case) or an
    affine expression of iteration dims with optional ``floor(e/c)``, e.g.
    ``y + ky - 1`` (a window) or ``floor(y/2)`` (nearest upsampling).
    Elements outside the space read as zero (padding).
    """

    space: str
    index: tuple[str, ...]

    @property
    def plain(self) -> bool:
        """True when every component is a dim name, each at most once."""
        return all(c.isidentifier() for c in self.index) and len(set(self.index)) == len(self.index)

    def dims_in(self, component: str) -> tuple[str, ...]:
        return tuple(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", component.replace("floor", " ")))

    @cached_property
    def exprs(self) -> tuple[sp.Expr, ...]:
        """Each index component parsed (``smg.expr.parse``, its dims integer symbols): the one parse every
        consumer reads; ``index`` stays the canonical text the content key hashes.  Kept on the node, not in
        a field: ``canonical`` walks the dataclass fields only."""
        from smg.expr import Role, parse  # sympy waits for the first parse (``smg.ir`` imports without it)

        return tuple(parse(c, Role.INDEX) for c in self.index)


@dataclass(frozen=True)
class Op:
    """A tensor index expression: ``out[out_index] = combiner_{reduce}(body)``.

    ``body`` is a sympy-parsable scalar expression whose free symbols are the
    names of the accessed spaces and, for index-dependent bodies such as a
    causal mask, names of iteration dims.  ``kind`` is the primitive's name;
    ``group`` names the user-level operator it belongs to (a LayerNorm is
    several primitives), which is the unit of the unfused baseline.
    """

    kind: str
    out: str
    out_index: tuple[str, ...]
    inputs: tuple[Access, ...]
    body: str
    reduce: tuple[str, ...] = ()
    combiner: str = "none"
    group: str = ""

    @cached_property
    def expr(self) -> sp.Expr:
        """``body`` parsed (``smg.expr.parse``: every space and dim it reads a real symbol), once per op: the
        one parse every consumer reads; ``body`` stays the canonical text the content key hashes.  Kept on
        the node, not in a field: ``canonical`` walks the dataclass fields only."""
        from smg.expr import parse  # sympy waits for the first parse (``smg.ir`` imports without it)

        return parse(self.body)

    @property
    def iter_dims(self) -> tuple[str, ...]:
        """Dimensions of this op's iteration space (output dims, then reduced)."""
        return self.out_index + self.reduce

    @property
    def iteration_space(self) -> str:
        return f"{self.out}.it"

    def access(self, space: str) -> Access:
        for a in self.inputs:
            if a.space == space:
                return a
        raise UnknownAxisError(f"op {self.out!r} does not read space {space!r}")


@dataclass(frozen=True)
class Edge:
    """A mapping between two spaces with one dependency kind per dimension."""

    src: str
    dst: str
    kinds: tuple[tuple[str, Kind], ...]

    def kind(self, dim: str) -> Kind | None:
        return dict(self.kinds).get(dim)

    def count(self, kind: Kind) -> int:
        return sum(1 for _, k in self.kinds if k is kind)


def _edges_of(op: Op) -> tuple[Edge, ...]:
    """Derive the SMG edges of one operator from its index expression."""
    it = op.iteration_space
    edges = []
    for acc in op.inputs:
        comps = [acc.dims_in(c) for c in acc.index]
        kinds = []
        for d in op.iter_dims:
            holding = [c for c in comps if d in c]
            if not holding:
                kinds.append((d, Kind.ONE_TO_ALL))
            elif any(len(c) > 1 for c in holding):  # shares a component with another dim: y + ky
                kinds.append((d, Kind.WINDOWED))
            else:
                kinds.append((d, Kind.ONE_TO_ONE))
        edges.append(Edge(acc.space, it, tuple(kinds)))
    kinds = tuple((d, Kind.ALL_TO_ONE if d in op.reduce else Kind.ONE_TO_ONE) for d in op.iter_dims)
    edges.append(Edge(it, op.out, kinds))
    return tuple(edges)


@dataclass(frozen=True)
class SMG:
    """A (possibly fused) Space-Mapping Graph.

    ``ops`` are in topological order.  Inputs are spaces no op writes; outputs
    are the spaces the user asked for.  Immutable; ``key`` is a content hash.
    """

    name: str
    dims: tuple[Dim, ...]
    spaces: tuple[DataSpace, ...]
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]
    attrs: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        names = [d.name for d in self.dims]
        if len(set(names)) != len(names):
            raise ShapeError(f"SMG {self.name!r} declares a dimension twice: {names}")
        known = set(names)
        space_names = {s.name for s in self.spaces}
        if len(space_names) != len(self.spaces):
            raise ValueError(f"SMG {self.name!r} declares a space twice: {[s.name for s in self.spaces]}")
        if known & space_names:
            raise ValueError(f"SMG {self.name!r}: names used both for a dim and a space: {sorted(known & space_names)}")
        for s in self.spaces:
            for d in s.dims:
                if d not in known:
                    raise UnknownAxisError(f"space {s.name!r} uses unknown dimension {d!r}")
        written: set[str] = set()
        for op in self.ops:
            if op.out in written:
                raise ValueError(f"two ops of {self.name!r} write space {op.out!r}")
            for a in op.inputs:
                if a.space not in space_names:
                    raise UnknownAxisError(f"op {op.out!r} reads unknown space {a.space!r}")
                want = next(x for x in self.spaces if x.name == a.space).dims
                if len(a.index) != len(want):
                    raise ShapeError(f"op {op.out!r} indexes {a.space!r} with {len(a.index)} components; "
                                     f"it has {len(want)} dims {want}")
                for c in a.index:
                    bad = [d for d in a.dims_in(c) if d not in op.iter_dims]
                    if bad:
                        raise UnknownAxisError(f"op {op.out!r} indexes {a.space!r} with {c!r}, which uses "
                                               f"{bad}, not iteration dims of the op {op.iter_dims}")
                if a.space not in written and a.space in {o.out for o in self.ops}:
                    raise ValueError(f"op {op.out!r} reads {a.space!r} before it is computed")
            written.add(op.out)
        for o in self.outputs:
            if o not in space_names:
                raise UnknownAxisError(f"SMG output {o!r} is not a space")

    # -- lookup -----------------------------------------------------------------
    @cached_property
    def canonical_text(self) -> str:
        """The graph's canonical JSON, built once: every schedule's key embeds it (``Schedule.key``)."""
        return canonical_text(self)

    @cached_property
    def key(self) -> str:
        return text_key(self.canonical_text)

    def __hash__(self) -> int:
        """From the content key (computed once per graph): the dataclass's own hash walked every space, op
        and mapping on each call, and the slicers' caches (``plan_temporal``, the footprints) hash the graph
        on every lookup (a quarter of ranking an attention's search space).  Equal graphs have equal keys."""
        return int(self.key[:16], 16)

    @cached_property
    def dim_sizes(self) -> dict[str, int]:
        return {d.name: d.size for d in self.dims}

    @cached_property
    def _spaces_by_name(self) -> dict[str, DataSpace]:
        return {s.name: s for s in self.spaces}

    def space(self, name: str) -> DataSpace:
        try:
            return self._spaces_by_name[name]
        except KeyError:
            raise UnknownAxisError(f"SMG {self.name!r} has no space {name!r}") from None

    def producer(self, space: str) -> Op | None:
        for op in self.ops:
            if op.out == space:
                return op
        return None

    def consumers(self, space: str) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if any(a.space == space for a in op.inputs))

    def inner_read(self, space: str) -> tuple[str, int]:
        """(``d``, ``k``): every op reading ``space`` walks its innermost dim as the iteration dim ``d`` at
        ``d + k`` (a concatenation's part read at ``c - 640``, RoPE's shift at ``j - 64``), so consecutive
        ``d`` read consecutive elements; (its innermost dim, 0) otherwise, as plain reads walk it (a window's
        taps, an upsampling's ``floor(x/2)``).  The lowering's wide loads and the memory model ask this, not
        whether the innermost dim is named ``d``."""
        return self._inner_reads.get(space) or (self.space(space).dims[-1] if self.space(space).dims else "", 0)

    @cached_property
    def _inner_reads(self) -> dict[str, tuple[str, int]]:
        found: dict[str, set[tuple[str, int] | None]] = {}
        for op in self.ops:
            for a in op.inputs:
                m = _AT_OFFSET.fullmatch(a.index[-1]) if a.index else None
                ok = m is not None and m.group(1) in op.iter_dims
                found.setdefault(a.space, set()).add(
                    (m.group(1), int((m.group(2) or "+") + (m.group(3) or "0"))) if ok else None)
        return {n: next(iter(r)) for n, r in found.items() if len(r) == 1 and None not in r}

    @cached_property
    def inputs(self) -> tuple[str, ...]:
        """Spaces no op produces (cached: the search asks for them per candidate, 600k times a GEMM)."""
        produced = {op.out for op in self.ops}
        return tuple(s.name for s in self.spaces if s.name not in produced)

    def group_of(self, op: Op) -> str:
        return op.group or op.out

    @property
    def groups(self) -> tuple[str, ...]:
        """User-level operators in order (the kernels of the unfused baseline)."""
        return tuple(dict.fromkeys(self.group_of(op) for op in self.ops))

    @property
    def intermediates(self) -> tuple[str, ...]:
        return tuple(op.out for op in self.ops if op.out not in self.outputs)

    def shape(self, space: str) -> tuple[int, ...]:
        return tuple(self.dim_sizes[d] for d in self.space(space).dims)

    @cached_property
    def edges(self) -> tuple[Edge, ...]:
        return tuple(e for op in self.ops for e in _edges_of(op))

    def count_kinds(self) -> dict[Kind, int]:
        """How many (edge, dimension) pairs carry each dependency kind."""
        out = {k: 0 for k in Kind if k is not Kind.WINDOWED}  # the paper's three, plus windows if any
        for e in self.edges:
            for _, k in e.kinds:
                out[k] = out.get(k, 0) + 1
        return out

    # -- fusion -----------------------------------------------------------------
    def join(self, other: SMG, name: str | None = None) -> SMG:
        """Fuse two SMGs by aligning the spaces and dimensions they share."""
        return join_smgs([self, other], name or f"{self.name}+{other.name}")

    def __str__(self) -> str:
        from smg.printing import summary

        return summary(self)

    def _repr_svg_(self) -> str:
        """Jupyter: spaces, iteration spaces and per-dim dependency kinds on the edges."""
        from smg.display import smg_svg

        return smg_svg(self)


def join_smgs(graphs: list[SMG], name: str, outputs: tuple[str, ...] | None = None) -> SMG:
    """Join SMGs on shared dimension names and shared space names.

    A shared dimension must have one size everywhere; a shared space must have
    the same dims.  Ops are concatenated in order and deduplicated by content.
    """
    dims: dict[str, int] = {}
    spaces: dict[str, DataSpace] = {}
    ops: list[Op] = []
    outs: list[str] = []
    for g in graphs:
        for d in g.dims:
            if d.name in dims and dims[d.name] != d.size:
                raise ShapeError(
                    f"cannot join {g.name!r}: dimension {d.name!r} is {dims[d.name]} in one "
                    f"graph and {d.size} in the other"
                )
            dims[d.name] = d.size
        for s in g.spaces:
            if s.name in spaces and spaces[s.name].dims != s.dims:
                raise ShapeError(
                    f"cannot join {g.name!r}: space {s.name!r} has dims "
                    f"{spaces[s.name].dims} and {s.dims}"
                )
            spaces.setdefault(s.name, s)
        for op in g.ops:
            if op not in ops:
                ops.append(op)
        outs.extend(o for o in g.outputs if o not in outs)
    produced_then_read = {a.space for op in ops for a in op.inputs}
    if outputs is None:
        outputs = tuple(o for o in outs if o not in produced_then_read) or tuple(outs)
    return SMG(
        name=name,
        dims=tuple(Dim(n, s) for n, s in dims.items()),
        spaces=tuple(spaces.values()),
        ops=tuple(ops),
        outputs=tuple(outputs),
    )


def with_dtypes(smg: SMG, dtypes: Mapping[str, str]) -> SMG:
    """``smg`` with the spaces named in ``dtypes`` stored in those element types, every op unchanged.  An SMG's
    ops compute in float32 whatever their spaces store (the kernels load each value as float32 and round only
    where they store it), so a space's dtype is its storage alone: a fp16/bf16 norm's row statistics saved in
    float32 as torch's CUDA kernels save them, a split reduction's outputs in the original graph's dtypes.
    A new graph (its content key covers the dtypes); a name that is no space of ``smg`` is an error."""
    unknown = set(dtypes) - {s.name for s in smg.spaces}
    if unknown:
        raise UnknownAxisError(f"cannot retype {sorted(unknown)}: no spaces of {smg.name!r}")
    spaces = tuple(DataSpace(s.name, s.dims, dtypes[s.name]) if s.name in dtypes else s for s in smg.spaces)
    return replace(smg, spaces=spaces)
