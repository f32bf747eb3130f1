"""The state that the phases of a warp-tile kernel share while one generator builds it.

Every phase (ring loader, tensor-core MMA, row update, epilogue, producer warpgroup) reads and
writes this one object; it declares everything they exchange.  Fields fall in three groups:
facts derived from the schedule when the state is made; IR handles bound once while the kernel
is built (buffers, thread and block coordinates); and the per-step cursor (step, ring slot, the
fragments of the current score tile), rebound by the loop that runs the steps.  A handle is
unset until the phase that establishes it has run: reading it earlier is a bug, and fails.

The accumulator layout of ``mma.sync.m16n8k16``: a thread owns 2 rows per 16-row mma tile, row
slot ``r = 2 * tile + (0 for g, 1 for g + 8)``; in a fragment array of ``per`` elements per tile,
element ``E`` is tile ``E // per``, column tile ``(E % per) // 4``, and within it c0..c3 are
(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy as sp
from tvm import tirx

from schedulers.schedule import Schedule
from schedulers.temporal import exp_sums
from schedulers.warp_tile import (
    Bound,
    ColumnMask,
    WarpTileProgram,
    column_masks,
    killing_masks,
    smem_layout,
    split_ring,
    tile_columns,
    wgmma_swizzled,
)
from smg.expr import body_expr
from smg.ir import SMG
from spacefusion.lower.exprs import F32, MAX_IDENTITY
from spacefusion.lower.symbolic import SymbolicDim

#: a row max's identity (``exprs.MAX_IDENTITY``: -inf, no longer a finite stand-in above float32's lowest)
NEG_INF = MAX_IDENTITY
I32 = "int32"


def f32(v: float) -> tirx.PrimExpr:
    """An fp32 constant."""
    return tirx.FloatImm(F32, float(v))


def tree(terms: list[tirx.PrimExpr], combiner: str) -> tirx.PrimExpr:
    """A balanced reduction tree (independent partial results: instruction-level parallelism)."""
    while len(terms) > 1:
        nxt = [tirx.max(a, b) if combiner == "max" else a + b for a, b in zip(terms[::2], terms[1::2])]
        terms = nxt + ([terms[-1]] if len(terms) % 2 else [])
    return terms[0]


def _unset() -> Any:
    """A field without a value until the phase that establishes it binds one."""
    return field(init=False, repr=False)


@dataclass(eq=False)
class KernelState:
    """What the phases of one warp-tile kernel share (see the module docstring)."""

    s: Schedule  # the schedule being lowered
    p: WarpTileProgram  # its warp-tile reading
    # the row dim's size as the kernel's int32 argument (``lower.symbolic``; checked by ``symbolic.check``)
    symbolic: SymbolicDim | None = None

    # -- derived from the schedule -----------------------------------------------------------------
    smg: SMG = field(init=False, repr=False)  # the schedule's graph
    # dim -> extent (the symbolic row dim's: its argument, a ``tirx.Var``)
    sizes: dict[str, int | tirx.PrimExpr] = field(init=False, repr=False)
    ab: str = field(init=False)  # operand type as mma.sync names it: "fp16" or "bf16"
    half: str = field(init=False)  # the same as a TIR dtype: "float16" or "bfloat16"
    layout: dict[str, tuple[int, int, int]] = field(init=False, repr=False)  # tile -> (copies, rows, row stride)
    cols: dict[str, int] = field(init=False, repr=False)  # tile -> columns of data per row (less padding)
    nt: int = field(init=False)  # 8-column tiles of the score tile
    mt: int = field(init=False)  # 16-row mma tiles per warp
    ns: int = field(init=False)  # score-tile elements per thread
    # log2 e folds into exp's operands unless a mask can fill a whole row slice with a sentinel: then
    # m and s are both -1e30 and only s - m computed first is exactly 0
    fold_log2e: bool = field(init=False)
    masks: dict[str, Bound] = field(init=False, repr=False)  # killing masks: score op -> its bound
    # whether the steps a killing mask keeps whole (run unmasked) fold the scalings into exp2 again
    fold_unmasked: bool = field(init=False)
    lazy: dict[str, float] = field(init=False, repr=False)  # max states kept while within their lag
    row_sums: dict[str, str] = field(init=False, repr=False)  # sum state -> GEMM state whose MMA sums it
    swizzled: set[str] = field(init=False, repr=False)  # tiles wgmma reads through descriptors
    overlap: bool = field(init=False)  # each step's softmax overlaps the previous step's P @ V (split ring)
    sums: frozenset[str] = field(init=False)  # row sums of exponentials: divided by as ``exprs.nonzero_sum``
    # storing the outputs: row maxima read as they are (elsewhere through ``exprs.subtracted_max``)
    finalizing: bool = field(init=False)

    # -- IR handles, bound once per kernel ---------------------------------------------------------
    glob: dict[str, tirx.Buffer] = field(init=False, repr=False)  # kernel parameter -> its buffer
    smem: dict[str, tirx.Buffer] = field(init=False, repr=False)  # tile -> the shared arena holding it
    sbase: dict[str, tirx.PrimExpr | int] = field(init=False, repr=False)  # tile -> element offset in the arena
    coord: dict[str, tirx.PrimExpr] = field(init=False, repr=False)  # batch dim -> block coordinate
    tid: tirx.PrimExpr = _unset()  # threadIdx.x
    gtid: tirx.PrimExpr = _unset()  # thread index within its warp group (MMA threads only)
    grp: tirx.PrimExpr = _unset()  # warp group (split), 0 without
    warp: tirx.PrimExpr = _unset()  # warp within the warp group
    lane: tirx.PrimExpr = _unset()  # lane within the warp
    g: tirx.PrimExpr = _unset()  # quad: the thread's row within an 8-row half of an mma tile
    t4: tirx.PrimExpr = _unset()  # thread within its quad: its column pair
    mma_wg: tirx.PrimExpr = _unset()  # which tiles this MMA warpgroup takes (pingpong), 0 without
    slice: tirx.PrimExpr = _unset()  # this block's slice of the steps
    tile: tirx.PrimExpr = _unset()  # the row tile's index among all row tiles
    row0: tirx.PrimExpr = _unset()  # first row of the block's row tile
    arena: tirx.Buffer = _unset()  # the dynamic shared arena
    arena_addr: tirx.Buffer = _unset()  # its shared-window address (wgmma descriptors)
    stage_base: int = _unset()  # arena element where staged outputs start
    mbar_base: int = _unset()  # arena element where the TMA ring's mbarriers start
    rs: dict[str, tirx.Buffer] = field(init=False, repr=False)  # row state -> its 2 * mt rows
    rs_old: dict[str, tirx.Buffer] = field(init=False, repr=False)  # row state -> its value before this step
    # row max -> its rows as the updates read them (``exprs.subtracted_max``: 0 where still -inf), one select a
    # row after each update rather than one at every read
    rs_safe: dict[str, tirx.Buffer] = field(init=False, repr=False)
    acc: dict[str, tirx.Buffer] = field(init=False, repr=False)  # GEMM state -> its accumulator fragments
    groups: int = _unset()  # cp.async groups committed per step (2: the score tile's operands first)
    lag: int = _unset()  # wgmma groups left in flight across a step's barrier
    first: tirx.PrimExpr = _unset()  # first serial step of this block
    lo: tirx.PrimExpr = _unset()  # first step of the consumer's range (producer kernels)
    n: tirx.PrimExpr = _unset()  # steps in the consumer's range (producer kernels)
    pf_keep: tirx.Buffer = _unset()  # P kept in registers for the next step's P @ V (overlap)

    # -- the current step ----------------------------------------------------------------------------
    j: tirx.PrimExpr | int = _unset()  # the consumer's step (an int when peeled before the loop)
    t0: tirx.PrimExpr = _unset()  # first serial position of the step
    slot: tirx.PrimExpr | int = _unset()  # ring slot its tiles are in
    unmasked: bool = field(init=False)  # emitting the copy of the step that a killing mask keeps whole
    col_masks: dict[str, ColumnMask] = field(init=False, repr=False)  # padding masks read from inputs, by op
    #: (first kept key, last kept key, whether every key between is kept) of this block, once scanned
    col_kept: tuple[tirx.PrimExpr, tirx.PrimExpr, tirx.PrimExpr] | None = field(init=False, repr=False)
    cache: dict[str, tuple[frozenset[str], tirx.Buffer]] = field(init=False, repr=False)  # values by expression
    score: dict[str, tirx.Buffer] = field(init=False, repr=False)  # score op -> its fp32 fragments
    tin: dict[str, tirx.Buffer] = field(init=False, repr=False)  # staged input -> its fragments
    inline: dict[str, sp.Expr] = field(init=False, repr=False)  # score ops that are constant scalings
    moved: dict[str, tirx.Buffer] = field(init=False, repr=False)  # lazy max state -> warp-uniform "rescale" flag

    def __post_init__(self) -> None:
        s, p = self.s, self.p
        self.smg = s.smg
        self.sizes = self.smg.dim_sizes
        if self.symbolic is not None:
            self.sizes = dict(self.sizes) | {self.symbolic.dim: tirx.Var(self.symbolic.var, I32)}
        self.ab = "fp16" if self.smg.space(self.smg.inputs[0]).dtype == "float16" else "bf16"
        self.half = "float16" if self.ab == "fp16" else "bfloat16"
        self.layout = smem_layout(s, p)
        self.cols = tile_columns(s, p)
        self.glob, self.smem, self.sbase, self.coord = {}, {}, {}, {}
        self.nt = p.step // 8
        self.mt = p.warp_mtiles
        self.ns = self.mt * self.nt * 4
        piecewise = {n for n in p.score_ops if body_expr(self.smg.producer(n)).has(sp.Piecewise)}
        # and unless a score op reads a float32 input (a mask, a bias): its values may reach float32's lowest
        # (HF's finfo.min), whose product with log2 e is -inf, and a row of them would give exp2(-inf + inf)
        wide = any(a.space in self.smg.inputs and self.smg.space(a.space).dtype == F32
                   for n in p.score_ops for a in self.smg.producer(n).inputs)
        self.fold_log2e = not piecewise and not wide
        # steps whose whole tile the killing mask keeps (below a causal diagonal) run a copy of the
        # step without it: no per-element select, and the scalings fold into exp2 again
        self.masks = dict(killing_masks(self.smg, p))
        # padding masks read from inputs (column_masks): with a block's kept keys one dense run, the steps
        # inside it run the same unmasked copy, the mask's input read as 1
        self.col_masks = {m[0]: m for m in column_masks(self.smg, p)}
        self.col_kept = None
        self.unmasked = False
        self.fold_unmasked = bool(self.masks or self.col_masks) and piecewise <= set(self.masks) | set(self.col_masks)
        self.cache, self.score, self.tin, self.inline, self.moved = {}, {}, {}, {}, {}
        self.rs, self.rs_old, self.rs_safe, self.acc = {}, {}, {}, {}
        self.lazy = dict(p.lazy)
        self.row_sums = dict(p.row_sums)
        self.swizzled = set(wgmma_swizzled(p))
        self.overlap = split_ring(p)
        self.sums = exp_sums(s.plan.states)
        self.finalizing = False

    # -- counts that follow a symbolic row dim -----------------------------------------------------------
    @property
    def row_tail(self) -> bool:
        """Whether some row tile may run past the rows' end: a static size not a multiple of the tile, or a
        run-time one (a tail exists for some size in its range)."""
        return self.symbolic is not None or self.sizes[self.p.row] % self.p.rows != 0

    def grid(self) -> dict[str, int | tirx.PrimExpr]:
        """Blocks along each cut dim (``Schedule.grid``), the symbolic row dim's ``ceil(size / rows)`` of its
        argument."""
        grid: dict[str, int | tirx.PrimExpr] = dict(self.s.grid())
        if self.symbolic is not None:
            grid[self.p.row] = tirx.floordiv(self.sizes[self.p.row] + (self.p.rows - 1), self.p.rows)
        return grid

    def num_tiles(self) -> int | tirx.PrimExpr:
        """Work tiles (``Schedule.num_tiles``; symbolic slices are refused, so one per tile of the cut dims)."""
        if self.symbolic is None:
            return self.s.num_tiles
        out: int | tirx.PrimExpr = 1
        for n in self.grid().values():
            out = out * n
        return out

    def num_blocks(self) -> int | tirx.PrimExpr:
        """Blocks launched (``Schedule.num_blocks``): a persistent grid's ``min(persistent, tiles)`` where the
        rows are symbolic (``symbolic.grid_rule``'s cap: the tile stride stays ``persistent``)."""
        s = self.s
        if self.symbolic is None:
            return s.num_blocks
        return tirx.min(s.persistent, self.num_tiles()) if s.persistent else self.num_tiles()

    # -- fragment positions ----------------------------------------------------------------------
    def half_of(self, mi: int) -> tirx.PrimExpr:
        """The block's 64-row half that this warp's 16-row tile ``mi`` lies in (its warpgroup's)."""
        return (self.warp // 4) * self.mt + mi

    def mtile_row(self, mi: int) -> tirx.PrimExpr:
        """First row (in the block's tile) of this warp's 16-row mma tile ``mi``: the warp's own
        16 * mt rows, or with warpgroup MMA the warp's 16 rows of each of its warpgroup's 64-row halves."""
        if self.p.hopper.wgmma:
            return self.half_of(mi) * 64 + (self.warp % 4) * 16
        return self.warp * (16 * self.mt) + mi * 16

    def row_of(self, r: int) -> tirx.PrimExpr:
        """Row (of the whole dim) of this thread's row slot ``r``."""
        return self.row0 + self.mtile_row(r // 2) + self.g + 8 * (r % 2)

    @staticmethod
    def slot_of(e: int, per: int) -> int:
        """Row slot of fragment element ``e`` in an array of ``per`` elements per mma tile."""
        return (e // per) * 2 + (e % 4) // 2

    def col_of(self, e: int, per: int) -> tirx.PrimExpr:
        """Column (within the tile) of fragment element ``e``."""
        return ((e % per) // 4) * 8 + 2 * self.t4 + e % 2

    def col0(self, n: str) -> tirx.PrimExpr:
        """First column of this block along a GEMM state's column dim (0 unless it is cut)."""
        return self.coord[n] * self.s.tiles[n] if n in self.s.tiles else tirx.const(0, I32)

    def slot_tile(self, name: str, slot: tirx.PrimExpr | int) -> tirx.PrimExpr:
        """Arena element where ring slot ``slot`` of the shared tile ``name`` starts."""
        _, rows, stride = self.layout[name]
        return self.sbase[name] + slot * (rows * stride)
