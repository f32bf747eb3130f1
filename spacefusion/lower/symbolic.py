"""A kernel whose size along one dim is read at run time: one build serves every size in a range.

Issue 55 ("any shape, one compile").  A graph compiled with symbolic sizes meets a new sequence length in
the middle of a session, and each new length cost its own TVM lowering and nvcc build (1-5 s per SMG on the
GPU).  Along a dim that the schedule cuts into blocks and no op reduces, nothing of the kernel but the
number of blocks and the tail masks depends on the dim's size: the tiles, threads, serial loop and update
functions are the same at every size.  So the kernel can take that size as an argument (``tirx.Var`` in the
buffers' shapes, the grid's extent ``ceil(size / tile)`` computed from it, the tiles bounds-checked as
they already are for a tail) and be built once.

Contract of a ``SymbolicDim``: the dim (of the schedule's SMG) whose size is a run-time argument, and the
range ``[lo, hi]`` of sizes the kernel is *offered* for.  Every size in the range gives the unfused result
(the tiles are predicated); the range is where the schedule picked at the SMG's own size is still the pick
we would make (the family transfer's rule: within ``NEAR`` times, ``frontend.families``), and where every
tensor stays addressable by 32-bit indices.  A caller (the runtime, a backend's cache) dispatches a size
outside it to another kernel; the kernel's own runner refuses it with an error naming the range.

What stays as built: the op bodies.  A constant the SMG's builder derived from the dim's size (a causal
mask's offset between query and key lengths) is the one of the size the kernel was built at, at every size;
``check`` cannot see it, since the body does not name the dim.  So a caller reuses a symbolic kernel only
for graphs equal to its own up to the dim's size, bodies included (the frontend compares
``families.family_key``, which keeps the bodies and leaves out the sizes).

What ``check`` refuses (``ScheduleError`` code ``lower.symbolic``), and why: a dim the schedule does not
cut (the block's loops would run to the size: a loop bound, not a mask), the serial dim or a reduced dim
(the step count and the update functions follow the size), a read through an index expression (windows,
shifts: their halos and the vector checks take sizes), slices and clusters (their workspaces and block
counts follow the size), and the tensor-core forms whose lowering still bakes it (``tensor_core_refusal``).

Indexed loads and stores (``smg.loads``, ``smg.stores``) are taken along the dim their ids or positions are
indexed by: the ids (one per gathered element: BERT's token ids, ``[batch, seq]``) and a store's positions
take the run-time size as the graph's own buffers do (``param_dims``), while a gathered table keeps its
extents (its rows are the vocabulary) and a store's tensor its (the caller's cache, ``length`` along the
stored dim; the range is cut to ``length`` there).  ``check`` refuses the dim where a table or a store's
tensor would hold it.  The gather's contract is the static kernel's at every size: the row index is clamped
into the table and an id outside it reads zeros (``lower.loads``), the CPU callers check the ids first.

The tensor-core GEMM (+ epilogue) path (a warp-tile program without a score GEMM: ``lower.mma``, mma.sync or
wgmma, cp.async or TMA, a producer warpgroup, persistent, pingpong) takes a run-time row count: its row tails
are guarded whenever the rows are symbolic, its grid and a persistent block's tile loop are counted from the
argument, and TMA reads rows past the end as zeros from tensor maps the launcher encodes at the run-time
shapes (the stores are guarded, as for a static tail).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from schedulers.errors import ScheduleError
from schedulers.schedule import Schedule
from smg.ir import SMG
from smg.loads import loads_of
from smg.stores import stores_of

#: how far the range reaches from the size the schedule was picked at (each way), as ``families.NEAR``:
#: the family transfer keeps a ranking for sizes within 2x, measured to hold within 6% on BERT's GEMMs
NEAR = 2.0
#: the most elements a tensor of a kernel may have: the kernels index with 32-bit integers
MAX_INDEX = 2**31 - 1
#: the error code of every refusal here
CODE = "lower.symbolic"
#: kernel.json's format tag and the size param's role: the runtime's ``artefact`` declares the same (the
#: lowering may not import the runtime; ``tests/test_symbolic_kernels.py`` checks they agree)
SYMBOLIC_FORMAT_TAG = "spacefusion-kernel/2"
SIZE_ROLE = "size"


@dataclass(frozen=True)
class SymbolicDim:
    """``dim``'s size is the kernel argument ``var`` (``sf_<dim>``), offered for sizes ``lo..hi``."""

    dim: str
    lo: int
    hi: int

    @property
    def var(self) -> str:
        """The name of the size argument (a C identifier: the CUDA kernel's int parameter)."""
        return f"sf_{self.dim}"

    def contains(self, size: int) -> bool:
        return self.lo <= size <= self.hi

    def to_json(self) -> dict[str, object]:
        return {"dim": self.dim, "var": self.var, "range": [self.lo, self.hi]}


def near_range(size: int, near: float = NEAR) -> tuple[int, int]:
    """``[ceil(size / near), floor(size * near)]``: the sizes a schedule picked at ``size`` is offered for."""
    if size < 1:
        raise ValueError(f"a size must be positive, got {size}")
    return max(1, math.ceil(size / near)), max(size, math.floor(size * near))


def around(s: Schedule, dim: str, near: float = NEAR) -> SymbolicDim:
    """``dim`` symbolic over ``near_range`` of its size in ``s``'s SMG, cut down to what 32-bit indices
    address and to the positions an indexed store's tensor holds along it (``check`` then holds for the
    range)."""
    lo, hi = near_range(s.smg.dim_sizes[dim], near)
    return SymbolicDim(dim, lo, min(hi, _addressable(s, dim), _stored(s.smg, dim)))


def param_dims(smg: SMG, name: str) -> tuple[str, ...] | None:
    """The graph's dims along the axes of kernel parameter ``name``, where they follow the graph's sizes: a
    space's own dims; an indexed load's ids its ``dims`` (``smg.loads``: one id per gathered element); an
    indexed store's positions its ``dim`` (``smg.stores``: one position per element).  None for a parameter
    whose extents are its own: a load's table (its rows are the vocabulary, ``length``), a store's tensor
    (``length`` along the stored dim), an ``offset`` store's one start position."""
    if name in {sp.name for sp in smg.spaces}:
        return smg.space(name).dims
    for ld in loads_of(smg):
        if name == ld.ids:
            return ld.dims
    for st in stores_of(smg):
        if name == st.positions and not st.offset:
            return (st.dim,)
    return None


def _stored(smg: SMG, dim: str) -> int:
    """The most elements ``dim`` may have: an indexed store along it has ``length`` positions (``smg.stores``
    checks ``size <= length`` at the graph's size; the run-time sizes keep it)."""
    return min([MAX_INDEX, *(st.length for st in stores_of(smg) if st.dim == dim)])


def _addressable(s: Schedule, dim: str) -> int:
    """The largest size of ``dim`` at which every tensor holding it has at most ``MAX_INDEX`` elements."""
    top = MAX_INDEX
    for space in s.smg.spaces:
        if dim in space.dims:
            rest = math.prod(s.smg.dim_sizes[d] for d in space.dims if d != dim)
            top = min(top, MAX_INDEX // rest)
    return top


def check(s: Schedule, sym: SymbolicDim) -> None:
    """Raise ``ScheduleError`` (code ``lower.symbolic``) naming what keeps ``sym.dim`` of ``s`` from being a
    run-time size (see the module's docstring); return None where the lowering can take it."""
    smg, d, name = s.smg, sym.dim, s.smg.name

    def refuse(why: str) -> None:
        raise ScheduleError(f"{name}: dim {d!r} cannot be a run-time size: {why}", code=CODE)

    if d not in smg.dim_sizes:
        refuse(f"the graph has no such dim (dims: {', '.join(smg.dim_sizes)})")
    if not 1 <= sym.lo <= sym.hi:
        refuse(f"the range [{sym.lo}, {sym.hi}] is empty or not positive")
    if not sym.contains(smg.dim_sizes[d]):
        refuse(f"the range [{sym.lo}, {sym.hi}] leaves out the size {smg.dim_sizes[d]} the schedule was picked at")
    if d == s.serial:
        refuse("it is the serial dim (the step count follows its size)")
    for ld in loads_of(smg):
        if d in ld.rest(smg):
            refuse(f"{ld.value} is gathered from {ld.table}, which holds it (a table's extents are static: only "
                   f"the ids' dims {ld.dims} may be a run-time size)")
    for st in stores_of(smg):
        if d in st.layout and d != st.dim:
            refuse(f"{st.value} is stored into {st.into}, which holds it (the caller's tensor: static extents "
                   f"but along the stored dim {st.dim!r})")
        if d == st.dim and sym.hi > st.length:
            refuse(f"at {sym.hi} {st.value} would have more positions than the {st.length} of {st.into}")
    for op in smg.ops:
        if d in op.reduce:
            refuse(f"{op.out} reduces over it (the update functions follow its size)")
    if d not in dict(s.block):
        refuse("the schedule does not cut it into blocks (its loops would run to the size)")
    for op in smg.ops:
        bad = next((a.space for a in op.inputs if not a.plain), None)
        if bad is not None:
            refuse(f"{op.out} reads {bad} through an index expression (a window or a shift)")
    knobs = [k for k, on in (("slices", s.slices > 1), ("a cluster", s.cluster > 1)) if on]
    if knobs:
        refuse(f"the schedule uses {', '.join(knobs)}, whose workspaces and block counts follow the sizes")
    why = tensor_core_refusal(s, sym)
    if why is not None:
        refuse(why)
    top = _addressable(s, d)
    if sym.hi > top:
        refuse(f"at {sym.hi} a tensor would pass {MAX_INDEX} elements (32-bit indices): at most {top}")


def tensor_core_refusal(s: Schedule, sym: SymbolicDim) -> str | None:
    """Why ``s``'s tensor-core lowering cannot take ``sym.dim`` at run time (None: it can, or ``s`` runs on CUDA
    cores).  Done: a warp-tile GEMM (+ epilogue, + row-state prologue) over its row dim.  Not yet: TVM's WMMA
    tensorizer (it schedules from the static shapes), a score GEMM (attention: masks and halos tie the rows to
    the key length), gathered / im2col tiles (a convolution's rows are pixels of an image of fixed size),
    and a run-time dim other than the program's rows (its tile counts and tensor-map boxes are not counted)."""
    if not s.tensor_cores and s.warp_tile is None and not s.tma:
        return None
    p = s.warp_tile
    if p is None:
        return "the schedule's tensor cores run through TVM's WMMA tensorizer, which schedules from static shapes"
    if p.gemm is not None:
        return "its warp-tile program has a score GEMM (attention), whose masks tie the rows to the key length"
    if p.gathers:
        return "its warp-tile program gathers tiles (an implicit GEMM's im2col view of an image of fixed size)"
    if sym.dim != p.row:
        return (f"its warp-tile program counts only its row dim {p.row!r} at run time (tile counts and tensor-map "
                f"boxes along {sym.dim!r} are static)")
    return None


def symbolic_key(s: Schedule, sym: SymbolicDim) -> str:
    """sha256 of the schedule's content key, the dim and the range: what names a symbolic kernel (its
    schedule's static kernel keeps ``s.key``; the two never share a name or a cache entry)."""
    text = "\0".join([s.key, "symbolic", sym.dim, str(sym.lo), str(sym.hi)])
    return hashlib.sha256(text.encode()).hexdigest()


def axes(s: Schedule, sym: SymbolicDim, names: list[str]) -> dict[str, int]:
    """{param name: the axis of ``sym.dim`` in it} for the params of ``names`` that hold the dim
    (``param_dims``: an indexed load's ids and a store's positions too)."""
    dims = {n: param_dims(s.smg, n) or () for n in names}
    return {n: ds.index(sym.dim) for n, ds in dims.items() if sym.dim in ds}


def grid_rule(s: Schedule, sym: SymbolicDim) -> dict[str, int]:
    """The launch's block count as ``times * ceil(size / tile)``: ``tile`` the dim's block tile, ``times``
    the blocks of the other cut dims (and a cluster's, refused here, would multiply it).  A persistent grid
    (``s.persistent`` blocks looping over the tiles, a stride of ``cap`` tiles) adds ``cap``: the launch then
    has ``min(cap, times * ceil(size / tile))`` blocks, every tile still met by the stride (below ``cap``
    tiles each block takes one)."""
    grid = s.grid()
    rule = {"tile": s.tiles[sym.dim], "times": math.prod(n for d, n in grid.items() if d != sym.dim)}
    return rule | ({"cap": s.persistent} if s.persistent else {})


def blocks(rule: dict[str, int], size: int) -> int:
    """The grid's block count at ``size`` by ``grid_rule``'s record."""
    tiles = rule["times"] * -(-size // rule["tile"])
    return min(rule["cap"], tiles) if "cap" in rule else tiles


def symbolic_meta(meta: dict, s: Schedule, sym: SymbolicDim) -> dict:
    """``meta`` (a static kernel.json of ``s``, its shapes and grid at the SMG's own sizes) made the record of
    a kernel whose ``sym.dim`` is its argument ``sym.var``: format ``spacefusion-kernel/2`` (a runtime that
    knows only /1 refuses it rather than launch it without the size), the size as a param of role ``size``
    (an int32 passed by value, where ``param_order`` has it), and ``symbolic``: the dim, the argument, the
    range, each tensor's axis that takes the size and the grid's rule (``grid_rule``).  The shapes and grid
    kept are those at the SMG's size: what ``KernelArtefact.shapes_at`` / ``grid_at`` rescale."""
    tensors = [p["name"] for p in meta["params"] if p["role"] in ("input", "output")]
    size = {"name": sym.var, "shape": [1], "dtype": "int32", "role": SIZE_ROLE}
    return meta | {"format": SYMBOLIC_FORMAT_TAG, "params": [*meta["params"], size],
                   "symbolic": sym.to_json() | {"axes": axes(s, sym, tensors), "grid": grid_rule(s, sym)},
                   "symbolic_key": symbolic_key(s, sym)}


__all__ = ["CODE", "NEAR", "SymbolicDim", "around", "axes", "blocks", "check", "grid_rule", "near_range",
           "param_dims", "symbolic_key", "symbolic_meta", "tensor_core_refusal"]
