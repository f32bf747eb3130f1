"""Recognise a *warp-tile program* in a Schedule: the form the mma lowering takes.

A temporal plan whose block is a tile of one row dim R (the other cut dims have
tile 1) and whose per-step work lives on the (R, serial) plane maps onto tensor
cores the way FlashAttention does, with nothing named attention:

- a streamed op that is a two-input matmul over a whole dim K (``Q*K`` over d) is
  an ``mma.sync`` GEMM whose result is the *score tile* in the accumulator layout;
- the other streamed ops are element-wise on that tile (scale, mask);
- inputs on the (R, serial) plane (softmax-GEMM's S) are staged and read into the
  same layout with ``ldmatrix``;
- states over R alone are row statistics (warp-quad shuffles);
- a state over (R, N) whose body is ``X * f`` with X an input on (serial, N) is the
  second GEMM ``f @ X`` on tensor cores, rescaled by its derived carry each step.

Everything here is analysis (no TVM): the schedule and the search use it to count
threads and shared memory before anything is built.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sympy as sp

from schedulers.errors import ScheduleError
from schedulers.gather_tile import GatherTile, Im2col, gather_tile, im2col_of
from schedulers.knobs import Rejection
from schedulers.options import HopperOptions, WarpTileOptions
from schedulers.temporal import UpdateFunction, parse
from smg.expr import body_expr
from smg.ops import UPSAMPLE_VIEW

#: shared-memory rows are padded by 8 halfs (16 B): ldmatrix row addresses then fall in distinct banks
PAD = 8
#: elements of a 16-byte chunk (fp16 / bf16): a cp.async copy, or a staged output's global store
CHUNK = 8
MMA_DTYPES = ("float16", "bfloat16")
#: the producer warpgroup of a warp-specialised kernel (``producer``): thread 0 issues the TMA loads
PRODUCER_THREADS = 128
#: columns of an output band that a warp-specialised kernel's warpgroups stage at a time
BAND = 64
#: registers per thread after ``setmaxnreg`` for a producer warpgroup beside two MMA warpgroups:
#: 128 x 40 + 256 x 232 = 64512 of the 65536 (the launch gives all 384 threads 168)
PRODUCER_REGS, CONSUMER_REGS = 40, 232


@dataclass(frozen=True)
class ScoreGemm:
    """``out[.., R, L] = sum_K a[.., R, K] * b[..]`` on tensor cores."""

    out: str
    a: str
    b: str
    k: str
    b_trans: bool  # b is [.., K, L] (L contiguous) rather than [.., L, K]
    kd: int  # K's extent
    kp: int  # K as the MMAs run it: rounded up to their k of 16, the pad columns zero in shared memory


@dataclass(frozen=True)
class GemmState:
    """A state ``X[.., R, N] = sum_L x[.., L, N] * factor`` accumulated on tensor cores."""

    update: UpdateFunction
    x: str
    n: str
    factor: str
    n_tile: int  # columns per block: the tile when N is cut spatially (a GEMM's output columns), else all
    pad: int = 0  # of those, columns past an uncut N (40 -> 48): computed for the MMAs' n of 16, not stored
    #: ``x`` is [.., N, .., L] with L contiguous (K-major: ``nn.Linear``'s weight [n, k] as stored), staged as
    #: [n_tile, step] tiles: ldmatrix without ``.trans`` for mma.sync, wgmma's B without transposition
    k_major: bool = False

    def x_tile(self, step: int, wgmma: bool) -> tuple[int, int]:
        """(rows, padded row length) of a ring slot's ``x`` tile: [step, n_tile] (N contiguous), or K-major
        [n_tile, step]; rows padded by ``PAD`` for ldmatrix, or whole 128 B-swizzled bands for wgmma."""
        if self.k_major:
            return self.n_tile, padded_band(step) if wgmma else step + PAD
        return step, padded_band(self.n_tile) if wgmma else self.n_tile + PAD


@dataclass(frozen=True)
class WarpTileProgram:
    """The warp-tile reading of a schedule: what the graph and block make of it (rows, GEMMs, states), and the
    schedule's own option groups, held as they are (``warp.stages``, ``hopper.wgmma``): the lowering and the
    cost model read a knob there, so a knob reaches them with no field of its own here.  Only what the reading
    derives from a knob is a field: the warps it resolves (0: up to 4) and the lazily kept maxima and tensor-core
    row sums that ``lazy_rescale`` and ``mma_row_sums`` find in the plan."""

    row: str
    rows: int  # block tile along R: 16 rows per warp
    batch: tuple[str, ...]  # cut dims of tile 1, outermost first
    serial: str
    step: int
    gemm: ScoreGemm | None
    score_ops: tuple[str, ...]  # element-wise streamed ops on the score tile, in order
    tiles_in: tuple[str, ...]  # inputs on (R, serial), staged and read in the score layout
    row_states: tuple[UpdateFunction, ...]
    gemm_states: tuple[GemmState, ...]
    outputs: tuple[tuple[str, str], ...]  # (output, finalize expression)
    warps: int  # each warp owns rows / warps rows: one K/V fragment feeds that many 16-row mma tiles
    warp: WarpTileOptions  # the schedule's warp-tile knobs (stages, split, slices, reload_a, ...)
    hopper: HopperOptions  # and its Hopper knobs (wgmma, tma, producer, persistent, pingpong)
    lazy: tuple[tuple[str, float], ...] = ()  # max states kept while within their lag (lazy_rescale)
    row_sums: tuple[tuple[str, str], ...] = ()  # (sum state, GEMM state) summed on tensor cores (mma_row_sums)
    gathers: tuple[GatherTile, ...] = ()  # tiles_in that are views of an input (an implicit GEMM's im2col tile)
    im2cols: tuple[Im2col, ...] = ()  # each gather as a TMA im2col load (empty when one is not: im2col_why)
    im2col_why: str = ""  # why the gathers are not TMA im2col loads

    def gather(self, name: str) -> GatherTile | None:
        return next((g for g in self.gathers if g.tile == name), None)

    def im2col(self, name: str) -> Im2col | None:
        """The TMA im2col form of gathered tile ``name`` (None: not gathered, or not expressible)."""
        return next((i for g, i in zip(self.gathers, self.im2cols, strict=False) if g.tile == name), None)

    @property
    def wgmma_ss(self) -> bool:
        """wgmma with both operands from shared memory: the plain GEMM (+ epilogue) form, or several
        GEMM states over one staged A, each with its own B and accumulator (a gated GEMM).  Row states
        may come with it where every GEMM state multiplies the staged A itself (``staged_factors``): a
        norm's statistics of the rows the GEMM multiplies (``rmsnorm(X) @ W`` with the norm applied after
        the loop), read from the same tile by ldmatrix while the step's wgmma runs."""
        return self.hopper.wgmma and self.gemm is None and staged_factors(self.tiles_in, self.gemm_states)

    @property
    def warp_mtiles(self) -> int:
        return self.rows // 16 // self.warps

    @property
    def mma_groups(self) -> int:
        """Warp groups of a block each on its own tiles: two with ``pingpong``."""
        return 2 if self.hopper.pingpong else 1

    @property
    def threads(self) -> int:
        return 32 * self.warps * self.warp.split * self.mma_groups + (PRODUCER_THREADS if self.hopper.producer else 0)

    def merge_floats(self) -> int:
        """fp32 registers per thread that a warp group hands over when the groups merge."""
        return self.warp_mtiles * (2 * len(self.row_states) + sum(g.n_tile // 8 * 4 for g in self.gemm_states))


def staged_factors(tiles_in: tuple[str, ...], gemm_states: tuple[GemmState, ...]) -> bool:
    """Whether every GEMM state multiplies the one staged input itself, with no carry (``X @ W``: its
    accumulators need nothing but that tile and ``x``, whatever row states run beside them)."""
    return bool(gemm_states) and all(tiles_in == (g.factor,) and not g.update.carry for g in gemm_states)


def gemm_with_statistics(smg, plan) -> bool:
    """Whether every running state of ``plan`` is a GEMM of two inputs (its body their product, times a
    constant, no carry) or a ``row_statistic``: a GEMM whose norm before it is applied after the loop
    (``rmsnorm(X) @ W``: the sum of squares of X beside ``X @ W``), the ss form with row states."""
    gemms = 0
    for u in plan.states:
        if u.combiner != "sum" or u.carry:
            return False
        _, rest = parse(u.body).as_coeff_Mul()
        factors = sp.Mul.make_args(rest)
        if len(factors) == 2 and all(f.is_Symbol and f.name in smg.inputs for f in factors):
            gemms += 1
        elif not row_statistic(smg, smg.producer(u.state)):
            return False
    return gemms > 0


def row_statistic(smg, op) -> bool:
    """Whether ``op`` sums an element-wise function of one graph input and nothing reduced (a norm's sum of
    squares of X): beside a GEMM of that input it is a row state of the GEMM's own A tile (the ss form's
    ``staged_factors``)."""
    if op.combiner != "sum" or not op.reduce:
        return False
    seen, todo, found = set(), [a.space for a in op.inputs], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        up = smg.producer(name)
        if up is None:
            found.add(name)
        elif up.reduce:
            return False
        else:
            todo += [a.space for a in up.inputs]
    return len(found) == 1


def _dims_ok(dims: tuple[str, ...], allowed: set[str], last: str) -> bool:
    return set(dims) <= allowed and bool(dims) and dims[-1] == last


@dataclass(frozen=True)
class _Reading:
    """The part of a warp-tile reading fixed by the graph, its plan, serial dim and block (no knob): shared by
    every knob set the search tries on one tiling, so it is derived once per tiling (``_reading``)."""

    row: str
    rows: int
    col_cut: dict[str, int]
    batch: tuple[str, ...]
    gemm: ScoreGemm | None
    score_ops: tuple[str, ...]
    tiles_in: tuple[str, ...]
    row_states: tuple[UpdateFunction, ...]
    gemm_states: tuple[GemmState, ...]
    outs: tuple[tuple[str, str], ...]
    gathers: tuple[GatherTile, ...]


@functools.lru_cache(maxsize=4096)
def _row_of(smg, plan, block: tuple[tuple[str, int], ...]
            ) -> tuple[str, int, tuple[tuple[str, int], ...]] | Rejection:
    """(row dim, its tile, the other tiled dims) of a block, or why the block is not a warp-tile block."""
    state_dims = [smg.space(u.space or u.state).dims for u in plan.states]
    big = [(d, t) for d, t in block if t > 1]
    rowish = [(d, t) for d, t in big if all(d in dims for dims in state_dims)]
    if len(rowish) > 1:  # a GEMM's one state has both: the row is not its last (column) dim
        rowish = [(d, t) for d, t in rowish if all(d != dims[-1] for dims in state_dims)]
    if len(rowish) != 1 or len(big) > 2:
        return Rejection("warp_tile.row_dim", None, f"the warp-tile path tiles one row dim (and optionally a "
                         f"GEMM's column dim); block tiles are {dict(block)}")
    row, rows = rowish[0]
    if rows % 16:
        return Rejection("warp_tile.row_tile", None, f"row tile {rows} along {row!r} must be a multiple of 16 "
                         f"(16-row mma tiles)")
    return row, rows, tuple((d, t) for d, t in big if d != row)


@functools.lru_cache(maxsize=4096)
def _reading(smg, plan, serial: str, block: tuple[tuple[str, int], ...]) -> _Reading | Rejection:
    """The knob-free part of the warp-tile reading (after ``_row_of`` and the step's check), or why there is
    none: the graph, plan, serial dim and block decide it alone, so one derivation serves a tiling's every
    knob set (before, it was derived again for each: a third of enumerating a GEMM's space).  A refusal is
    returned, not raised: a cached exception would gather every raise's traceback."""
    try:
        return _read(smg, plan, serial, block)
    except ScheduleError as e:
        return Rejection(e.code, e.knob, str(e))


def _read(smg, plan, L: str, block: tuple[tuple[str, int], ...]) -> _Reading:
    sizes = smg.dim_sizes
    row, rows, cut = _row_of(smg, plan, block)
    col_cut = dict(cut)
    batch = tuple(d for d, t in block if t == 1 and d not in col_cut)
    plane = set(batch) | {row, L}

    gemm, score_ops, gathers = None, [], []
    for i, name in enumerate(plan.streamed):
        op = smg.producer(name)
        if any(not a.plain for a in op.inputs):  # an implicit GEMM's im2col tile, staged through its index
            gathers.append(gather_tile(smg, op, row, L))
            continue
        if not set(op.out_index) <= plane or row not in op.out_index or L not in op.out_index:
            raise ScheduleError(f"streamed space {name!r} {op.out_index} is not on the ({row}, {L}) plane "
                                f"(block tiles {dict(block)}: its other dims need tile 1)",
                                code="warp_tile.off_plane")
        if op.reduce:
            gemm = _score_gemm(smg, op, i, row, L, plane)
        else:
            score_ops.append(name)
    used = set()
    for u in plan.states:
        used |= {x.name for x in parse(u.body).free_symbols}
    for name in score_ops:
        used |= {a.space for a in smg.producer(name).inputs}
    tiles_in = tuple(n for n in smg.inputs if n in used and L in smg.space(n).dims and row in smg.space(n).dims)
    tiles_in += tuple(g.tile for g in gathers if g.tile in used)
    if {g.tile for g in gathers} - set(tiles_in):
        raise ScheduleError(f"gathered views {[g.tile for g in gathers]} must be read by the states directly",
                            code="warp_tile.gather_unread")
    for n in tiles_in:
        if not _dims_ok(smg.space(n).dims, plane, L) or sizes[L] % 8:
            raise ScheduleError(f"input {n!r} {smg.space(n).dims} must be on ({row}, {L}) with {L} last, "
                                f"{L} a multiple of 8", code="warp_tile.tile_input")

    row_states, gemm_states = [], []
    for u in plan.states:
        dims = smg.space(u.space or u.state).dims
        if set(dims) <= set(batch) | {row} and row in dims:
            row_states.append(u)
        else:
            gemm_states.append(_gemm_state(smg, u, dims, row, L, batch, col_cut))
    if not gemm_states:
        raise ScheduleError.rejected(_NO_GEMM_STATE)
    if set(col_cut) - {g.n for g in gemm_states}:
        raise ScheduleError(f"tiled dims {sorted(col_cut)} are not a GEMM state's column dim",
                            code="warp_tile.column_dim")
    ns = {g.n for g in gemm_states}
    outs = []
    for out, text in plan.finalize:
        dims = smg.space(out).dims
        extra = set(dims) - set(batch) - {row}
        if row not in dims or len(extra) > 1 or (extra and not extra <= ns):
            raise ScheduleError(f"output {out!r} {dims} is not on the rows (and a GEMM state's column dim)",
                                code="warp_tile.output")
        outs.append((out, text))
    return _Reading(row, rows, col_cut, batch, gemm, tuple(score_ops), tiles_in, tuple(row_states),
                    tuple(gemm_states), tuple(outs), tuple(gathers))


_NO_GEMM_STATE = Rejection("warp_tile.no_gemm_state", None,
                           "no state is a GEMM over the serial dim: nothing for tensor cores")


@functools.lru_cache(maxsize=1024)
def program_form(smg, plan, L: str) -> Rejection | None:
    """Why no block and no knob give ``smg`` a warp-tile program along serial dim ``L`` (None: some may): what the
    graph and its plan decide alone -- a second pass, the inputs' dtypes, no state that could be a GEMM state
    whatever the block (one needs a sum over [.., R, N] whose body multiplies an input over (L, N), N last).
    ``program_checks`` asks it first, and the search once per graph and serial dim (``SearchSpace.forms``): where
    neither this nor the GEMM + epilogue reading (``schedulers.tensorcore_fit``) has a form, no tensor-core knob
    set is enumerated (a LayerNorm's were all refused, each for this one reason)."""
    if plan.second_pass:
        return Rejection("warp_tile.second_pass", None,
                         "outputs keep the serial dim (a second pass); the warp-tile path needs none")
    for n in smg.inputs:
        if smg.space(n).dtype not in MMA_DTYPES:
            return Rejection("warp_tile.dtype", None,
                             f"input {n!r} is {smg.space(n).dtype}; tensor cores take {MMA_DTYPES}")
    dt = {smg.space(n).dtype for n in smg.inputs}
    if len(dt) > 1:
        return Rejection("warp_tile.mixed_dtypes", None, f"inputs mix dtypes {sorted(dt)}")
    if not any(_may_be_gemm_state(smg, u, L) for u in plan.states):
        return _NO_GEMM_STATE
    return None


def _may_be_gemm_state(smg, u: UpdateFunction, L: str) -> bool:
    """Whether some block could read state ``u`` as a GEMM state (``_gemm_state``'s checks that no block decides):
    a sum accumulator of its space over [.., R, N] (the row dim is in every state, N last) whose body has an
    input factor over (L, N) with N or L last (K-major: ``nn.Linear``'s weight [n, k])."""
    dims = smg.space(u.space or u.state).dims
    if u.combiner != "sum" or u.state != (u.space or u.state) or len(dims) < 2:
        return False
    return any(smg.space(x.name).dims[-1] in (dims[-1], L) and L in smg.space(x.name).dims
               for x in _column_operands(smg, u.body, dims[-1]))


def _column_operands(smg, body: str, n: str) -> list[sp.Symbol]:
    """The factors of a state's ``body`` that are inputs over column dim ``n`` (a GEMM state has one)."""
    return [f for f in sp.Mul.make_args(parse(body)) if f.is_Symbol and f.name in smg.inputs
            and n in smg.space(f.name).dims]


def program_checks(smg, plan, L: str, block: tuple[tuple[str, int], ...], step: int, warps: int, split: int,
                   slices: int, wgmma: bool, early_scores: bool) -> tuple[_Reading, int]:
    """The checks of a warp-tile reading on what they read (the graph, plan, serial dim, block, step and five
    knobs): the reading and the warps it runs with, or ScheduleError saying why there is none (its code from
    ``schedulers.codes``).  The search asks it before building a knob set's Schedule (``SearchSpace``),
    ``warp_tile_program`` before building the program: one set of rules for both.  The graph's own reasons
    (``program_form``) come first, then the block's, then the knobs'."""
    form = program_form(smg, plan, L)
    if form is not None:
        raise ScheduleError.rejected(form)
    head = _row_of(smg, plan, block)
    if isinstance(head, Rejection):
        raise ScheduleError.rejected(head)
    if step % 16:
        raise ScheduleError(f"step {step} along {L!r} must be a multiple of 16 (the mma k extent)",
                            code="warp_tile.step")
    r = _reading(smg, plan, L, block)
    if isinstance(r, Rejection):
        raise ScheduleError.rejected(r)
    rows = r.rows
    warps = warps or min(4, rows // 16)  # default: FlashAttention-2's 4 warps
    if warps not in (1, 2, 4, 8) or rows % (16 * warps):
        raise ScheduleError(f"{warps} warps must be 1, 2, 4 or 8 and divide the {rows}-row tile into 16-row tiles",
                            code="warp_tile.warps")
    if split > 1 or slices > 1:
        what = " and ".join(f"{k} {v}" for k, v in (("split", split), ("slices", slices)) if v > 1)
        for g in r.gemm_states:  # the merge rescales each part's accumulator by its row factor
            if g.update.carry and carry_factor(g.update.carry, g.update.state) is None:
                raise ScheduleError(f"{what}: the carry of {g.update.state!r} ({g.update.carry}) is not its old "
                                    f"value times a per-row factor, so partial results cannot merge",
                                    code="warp_tile.merge_carry")
    if wgmma:
        _check_wgmma(smg, step, split, early_scores, r, warps, L)
    return r, warps


def warp_tile_program(s) -> WarpTileProgram:  # s: Schedule (import cycle)
    """The warp-tile reading of ``s``; ScheduleError says why there is none (``program_checks``)."""
    r, warps = program_checks(s.smg, s.plan, s.serial, s.block, s.step, s.warps, s.split, s.slices, s.wgmma,
                              s.early_scores)
    im2cols, im2col_why = _im2cols(s.smg, list(r.gathers), r.row)
    # (wgmma's ss form issues no mma.sync on fragments of its factor: no P @ 1 there)
    ss = s.wgmma and r.gemm is None and staged_factors(r.tiles_in, r.gemm_states)
    return WarpTileProgram(
        row=r.row, rows=r.rows, batch=r.batch, serial=s.serial, step=s.step, gemm=r.gemm, score_ops=r.score_ops,
        tiles_in=r.tiles_in, row_states=r.row_states, gemm_states=r.gemm_states, outputs=r.outs, warps=warps,
        warp=s.warp, hopper=s.hopper,
        lazy=tuple(lazy_references(s.plan).items()) if s.lazy_rescale else (),
        row_sums=tuple(mma_row_sums(r.row_states, r.gemm_states).items()) if s.mma_row_sums and not ss else (),
        gathers=r.gathers, im2cols=im2cols, im2col_why=im2col_why)


def _im2cols(smg, gathers: list[GatherTile], row: str) -> tuple[tuple[Im2col, ...], str]:
    """Every gathered tile's TMA im2col form, or none and the first reason one has none (a load walks the
    pixels of an image row: by output parity the row tile must run along them, ``j``)."""
    got: list[Im2col | str] = [im2col_of(smg, g) for g in gathers]
    got = [f"by output parity a TMA im2col load walks the pixels j of an image row, and the row tile runs along "
           f"{row!r}" if isinstance(g, Im2col) and g.shift and row != UPSAMPLE_VIEW[3] else g for g in got]
    why = next((g for g in got if isinstance(g, str)), "")
    return (() if why else tuple(got)), why


#: the N of wgmma.mma_async m64nNk16 (a multiple of 8 up to 256; here of the 64-column swizzle atoms)
WGMMA_MAX_N = 256
#: K elements per step: A's rows are one 128-byte swizzle atom
WGMMA_STEP = 64
#: elements (fp16/bf16) of a 1 KB swizzle atom: swizzled tiles start on one
SWIZZLE_ATOM = 512
#: registers per thread that a second GEMM state of wgmma's ss form takes besides its accumulator (its
#: B descriptors): nvcc gave the gated GEMM's 128 x 128 tile on two warpgroups 171-175 (3-ring), a
#: plain GEMM's 128 x 256 163, both estimated 168 without it
WGMMA_STATE_REGS = 8


def wgmma_knobs_refusal(split: int, early_scores: bool) -> Rejection | None:
    """wgmma's refusal of knobs alone, whatever the graph (None: it may take them): its warpgroups do not split
    the steps (``split``) nor wait for the score operands apart (``early_scores``).  The search asks it before
    offering wgmma with a split (the ``split`` knob's offer): such a knob set was refused whatever else it held."""
    if split != 1:
        return Rejection("warp_tile.wgmma_split", None, "wgmma: no split or early_scores")
    if early_scores:
        return Rejection("warp_tile.wgmma_early_scores", None, "wgmma: no split or early_scores")
    return None


def _check_wgmma(smg, step: int, split: int, early_scores: bool, r: _Reading, warps: int, L: str) -> None:
    """Refuse ``wgmma`` unless its GEMMs fit warpgroup MMA.  A plain GEMM (+ epilogue) takes A (a
    staged input) and B straight from shared memory, as do several GEMM states over the same A tile
    (a gated GEMM's G and U: one ring slot holds A's band and each state's B, and the epilogue reads
    every accumulator at one element index, so they share the column dim and tile); otherwise
    (attention) each GEMM state's factor tile (P) stays in registers as the A operand and its ``x`` (V)
    is read from shared memory, and the score GEMM reads K from shared memory and Q from there
    (reload_a) or from registers.  Row states beside a plain GEMM (a norm's statistics of its A rows) keep
    the ss form where every GEMM state multiplies the staged A itself (``staged_factors``)."""
    if warps not in (4, 8):
        raise ScheduleError(f"wgmma: one or two warpgroups (4 or 8 warps), each over its own 64-row halves; got "
                            f"{warps} warps", code="warp_tile.wgmma_warps")
    gemm, score_ops, tiles_in, row_states, gemm_states = r.gemm, r.score_ops, r.tiles_in, r.row_states, r.gemm_states
    knobs = wgmma_knobs_refusal(split, early_scores)
    if knobs is not None:
        raise ScheduleError.rejected(knobs)
    # a plain GEMM; or one whose rows' statistics run beside it, read from its staged A tile (a norm's prologue)
    plain = gemm is None and (not score_ops and not row_states or staged_factors(tiles_in, gemm_states))
    for g in gemm_states:  # attention's V may end in a partial band (padded_band); a plain GEMM's B may not
        if (g.n_tile % 64 if plain else g.n_tile % 16) or g.n_tile > WGMMA_MAX_N:
            unit = "64 (128 B swizzle atoms)" if plain else "16"
            raise ScheduleError(f"wgmma: {g.n_tile} columns per block must be a multiple of {unit} up to "
                                f"{WGMMA_MAX_N}", code="warp_tile.wgmma_columns")
    if plain:  # plain GEMMs: both operands from shared memory, one A tile shared by every GEMM state
        for g in gemm_states:  # (LLaMA's gated MLP input: G = X @ Wg and U = X @ Wu over one staged X)
            if tiles_in != (g.factor,) or g.update.carry:
                raise ScheduleError(f"wgmma multiplies a staged input by {g.x!r} with no carry; {g.update.state!r} "
                                    f"has factor {g.factor!r} and carry {g.update.carry!r}",
                                    code="warp_tile.wgmma_operand")
        shapes = {(g.n, g.n_tile) for g in gemm_states}
        if len(shapes) != 1:  # the epilogue reads every accumulator at the same element index
            raise ScheduleError(f"wgmma: GEMM states sharing the A tile must have one column dim and tile; "
                                f"{smg.name!r} has {sorted(shapes)}", code="warp_tile.wgmma_shared_a")
        if step != WGMMA_STEP or smg.dim_sizes[L] % step:
            raise ScheduleError(f"wgmma: the step {step} must be {WGMMA_STEP} (an A row is one 128 B swizzle "
                                f"atom) and divide {L!r} = {smg.dim_sizes[L]} (no tail to mask in shared memory)",
                                code="warp_tile.wgmma_step")
    elif not gemm_states or any(g.factor in tiles_in for g in gemm_states):
        raise ScheduleError("wgmma takes a plain GEMM (+ epilogue), or GEMM states whose factor tile is computed "
                            "in registers (attention's P @ V)", code="warp_tile.wgmma_form")
    if gemm is not None:  # the score GEMM too: its B (K) read K-major from 64-wide bands of swizzle atoms,
        if gemm.b_trans or step % 8 or step > WGMMA_MAX_N:  # the last one partial (padded_band): only
            raise ScheduleError(f"wgmma: the score GEMM needs {gemm.b!r} with {gemm.k!r} contiguous and a step "  # its
                                f"(its N) a multiple of 8 up to {WGMMA_MAX_N}",  # k16 slices that exist
                                code="warp_tile.wgmma_score_gemm")


#: columns (fp16/bf16) of one band of a 128 B-swizzled tile: an atom row
SWIZZLE_COLS = 64


def padded_band(cols: int) -> int:
    """Row length of a swizzled tile of ``cols`` columns: whole 64-column bands.  A partial last band
    (head dim 96: bands of 64 and 32) still spans a full 1 KB atom per 8 rows, since the XOR spreads
    its chunks over all 8 of each 128 B row; its unloaded chunks are never read (wgmma issues only
    the k16 slices, or the N columns, that exist)."""
    return -(-cols // SWIZZLE_COLS) * SWIZZLE_COLS


def tile_columns(s, p: WarpTileProgram) -> dict[str, int]:
    """Columns of data each shared tile of ``smem_layout`` holds (its row length less padding)."""
    sizes = s.smg.dim_sizes
    cols: dict[str, int] = {}
    if p.wgmma_ss:
        return {p.tiles_in[0]: p.step} | {g.x: p.step if g.k_major else g.n_tile for g in p.gemm_states}
    if p.gemm is not None:
        cols[p.gemm.a] = sizes[p.gemm.k]
        cols[p.gemm.b] = p.step if p.gemm.b_trans else sizes[p.gemm.k]
    for n in p.tiles_in:
        cols[n] = p.step
    for g in p.gemm_states:
        cols.setdefault(g.x, p.step if g.k_major else g.n_tile)
    return cols


def wgmma_swizzled(p: WarpTileProgram) -> tuple[str, ...]:
    """The shared tiles in the 128 B-swizzled layout (unpadded): those wgmma reads through
    descriptors -- a plain GEMM's A and B; or the score GEMM's B (K), its A (Q) when re-read, and the
    GEMM states' ``x`` (V) -- and, loaded by TMA, the inputs staged in the score layout (Softmax-GEMM's
    S), which ldmatrix then reads through the same XOR."""
    if not p.hopper.wgmma:
        return ()
    xs = tuple(dict.fromkeys(g.x for g in p.gemm_states))
    if p.wgmma_ss:
        return (p.tiles_in[0], *xs)
    if p.gemm is not None:  # the score GEMM's B (K), and its A (Q) when re-read from shared memory
        xs = (p.gemm.b, *((p.gemm.a,) if p.warp.reload_a else ()), *xs)
    return (*p.tiles_in, *xs) if p.hopper.tma else xs


#: how far a lazily kept reference may lag the true running max: values grow by at most this factor
LAZY_GROWTH = 256.0


def lazy_references(plan) -> dict[str, float]:
    """Max states that may lag behind the true running max, with the lag allowed (in their units).

    A max state ``m`` is only a reference when every state that reads it is carried by a factor
    ``f(m__old, m__new) = exp(k * (m__old - m__new))`` (k > 0), its body rescales by that factor
    when ``m`` is replaced by another value ``mu`` (``body(mu) = body(m) * f(m, mu)``), and every
    output is unchanged when those states are rescaled so and ``m`` is ``mu`` (attention's
    ``O / l``).  Then a step whose new max exceeds the kept one by less than ``ln(256) / k`` may keep
    it: the carried states are unchanged (f = 1) and no accumulator is rescaled, while the values
    summed stay below 256x their true-max-referenced size (FlashAttention-4's conditional rescale).
    Derived with sympy; nothing names softmax."""
    return dict(_lazy_references(plan))


@functools.lru_cache(maxsize=256)  # a search space asks for the same plan's at every point
def _lazy_references(plan) -> tuple[tuple[str, float], ...]:
    out: dict[str, float] = {}
    mu = sp.Symbol("lazy__mu", real=True)
    for m in plan.states:
        if m.combiner != "max" or m.carry:
            continue
        ms, old, new = (sp.Symbol(f"{m.state}{x}", real=True) for x in ("", "__old", "__new"))
        names = {m.state, f"{m.state}__old", f"{m.state}__new"}
        readers = [u for u in plan.states if u is not m and names & {
            x.name for x in parse(u.body).free_symbols | parse(u.carry or "0").free_symbols}]
        if not readers:
            continue
        ks, scaled = set(), {}
        for u in readers:
            f = carry_factor(u.carry, u.state) if u.carry else None
            if f is None or f.free_symbols - {old, new}:
                break
            logf = sp.expand(sp.expand_log(sp.log(f), force=True))
            k = sp.simplify(logf.diff(old))
            if not k.is_Number or k <= 0 or sp.simplify(logf - k * (old - new)) != 0:
                break
            body = parse(u.body)
            if sp.simplify(body.subs(ms, mu) - body * f.subs({old: ms, new: mu})) != 0:
                break
            ks.add(k)
            scaled[sp.Symbol(u.state, real=True)] = sp.Symbol(u.state, real=True) * f.subs({old: ms, new: mu})
        else:
            outs = [parse(text) for _, text in plan.finalize]
            if len(ks) == 1 and all(sp.simplify(e.xreplace({**scaled, ms: mu}) - e) == 0 for e in outs):
                out[m.state] = math.log(LAZY_GROWTH) / float(ks.pop())
    return tuple(out.items())


@functools.lru_cache(maxsize=1024)
def carry_factor(carry: str, state: str) -> sp.Expr | None:
    """``c`` when ``carry == state__old * c`` with ``c`` free of the accumulator (else None)."""
    e, old = parse(carry), sp.Symbol(f"{state}__old", real=True)
    c = sp.simplify(e / old)
    if old in c.free_symbols or any(x.name.startswith(f"{state}__") for x in c.free_symbols):
        return None
    return c


def _score_gemm(smg, op, i: int, row: str, L: str, plane: set[str]) -> ScoreGemm:
    if i != 0 or len(op.reduce) != 1 or op.combiner != "sum" or len(op.inputs) != 2:
        raise ScheduleError(f"streamed op {op.out!r} reduces but is not the first, a two-operand sum over one dim",
                            code="warp_tile.score_gemm")
    k = op.reduce[0]
    a, b = op.inputs
    if str(parse(op.body)) not in (f"{a.space}*{b.space}", f"{b.space}*{a.space}"):
        raise ScheduleError(f"streamed GEMM {op.out!r} has body {op.body!r}, not a product of its operands",
                            code="warp_tile.score_gemm_body")
    if L in a.index:
        a, b = b, a
    if a.space not in smg.inputs or b.space not in smg.inputs:
        raise ScheduleError(f"GEMM {op.out!r} operands must be inputs (staged through shared memory)",
                            code="warp_tile.score_gemm_operands")
    if not _dims_ok(a.index, plane | {k}, k) or L in a.index:
        raise ScheduleError(f"GEMM operand {a.space!r} {a.index} must be [.., {row}, {k}] with {k} last",
                            code="warp_tile.score_gemm_a")
    if set(b.index) - (plane - {row}) - {k} or row in b.index or {k, L} - set(b.index):
        raise ScheduleError(f"GEMM operand {b.space!r} {b.index} must be on ({L}, {k})", code="warp_tile.score_gemm_b")
    if b.index[-1] not in (k, L):
        raise ScheduleError(f"GEMM operand {b.space!r} {b.index} must end in {k!r} or {L!r}",
                            code="warp_tile.score_gemm_b")
    kd = smg.dim_sizes[k]
    kp = -(-kd // 16) * 16
    if kd % 8:
        raise ScheduleError(f"GEMM dim {k!r} = {kd} must be a multiple of 8 (16-byte rows of fp16 for cp.async; "
                            f"the MMAs' k of 16 is reached by zero columns in shared memory)",
                            code="warp_tile.k_not_multiple")
    b_trans = b.index[-1] == L
    if b_trans and smg.dim_sizes[L] % 8:
        raise ScheduleError(f"{L!r} = {smg.dim_sizes[L]} must be a multiple of 8 when {b.space!r} ends in it",
                            code="warp_tile.serial_not_multiple")
    if b_trans and kp != kd:
        raise ScheduleError(f"GEMM dim {k!r} = {kd} is not a multiple of 16 and {b.space!r} {b.index} has it "
                            f"as rows: zero rows are not padded in (K-contiguous {b.space!r} is)",
                            code="warp_tile.k_padding")
    return ScoreGemm(op.out, a.space, b.space, k, b_trans, kd, kp)


def _gemm_state(smg, u: UpdateFunction, dims: tuple[str, ...], row: str, L: str, batch: tuple[str, ...],
                col_cut: dict[str, int]) -> GemmState:
    if u.combiner != "sum" or u.state != (u.space or u.state):
        raise ScheduleError(f"state {u.state!r} over {dims} is not a sum accumulator of its space",
                            code="warp_tile.gemm_state_sum")
    extra = [d for d in dims if d not in batch and d != row]
    if len(extra) != 1 or dims[-1] != extra[0]:
        raise ScheduleError(f"state {u.state!r} {dims} must be [.., {row}, N] with one column dim N last",
                            code="warp_tile.gemm_state_dims")
    n = extra[0]
    xs = _column_operands(smg, u.body, n)
    if len(xs) != 1:
        raise ScheduleError(f"state {u.state!r} body {u.body!r} is not (input over {n!r}) * factor",
                            code="warp_tile.gemm_state_body")
    x = xs[0]
    factor, free = _factor_of(u.body, x.name)
    if x.name in free or n in free:
        raise ScheduleError(f"state {u.state!r}: the factor of {x.name!r} depends on {n!r}",
                            code="warp_tile.gemm_state_factor")
    xd = smg.space(x.name).dims
    k_major = xd[-1] == L  # [.., N, .., L]: nn.Linear's weight [n, k] as stored
    if xd[-1] not in (n, L) or {L, n} - set(xd) or set(xd) - set(batch) - {L, n}:  # a bshd V is [b, L, h, n]
        raise ScheduleError(f"GEMM operand {x.name!r} {xd} must be [.., {L}, .., {n}] or [.., {n}, .., {L}] ({n} "
                            f"or {L} last, the others batch dims {batch})", code="warp_tile.gemm_state_operand")
    if k_major and smg.dim_sizes[L] % 8:
        raise ScheduleError(f"{L!r} = {smg.dim_sizes[L]} must be a multiple of 8 when {x.name!r} {xd} ends in it "
                            f"(16-byte chunks along its rows)", code="warp_tile.serial_not_multiple")
    n_tile = col_cut.get(n, smg.dim_sizes[n])
    pad = 8 if n not in col_cut and n_tile % 16 and n_tile % 8 == 0 else 0  # a head dim of 40: 48 columns,
    n_tile += pad  # the last 8 not stored; their loads are clamped and land only in those columns
    if n_tile % 16 or smg.dim_sizes[n] % 8:
        raise ScheduleError(f"GEMM dim {n!r}: {n_tile} columns per block must be a multiple of 16 "
                            f"(and {n!r} = {smg.dim_sizes[n]} of 8)", code="warp_tile.gemm_columns")
    return GemmState(u, x.name, n, factor, n_tile, pad, k_major)


@functools.lru_cache(maxsize=1024)
def _factor_of(body: str, x: str) -> tuple[str, frozenset[str]]:
    """The factor of ``x`` in a GEMM state's body, printed, and its symbols' names: cached, as the
    search asks again for every candidate of a graph (sympy's printing was a fifth of its time)."""
    factor = _quotient(body, x)
    return str(factor), frozenset(sym.name for sym in factor.free_symbols)


def warp_tile_refusal(s) -> Rejection | None:
    """Why ``s`` has no warp-tile program, with its code (None: it has one).  A tensor-core schedule whose
    program was already asked for answers from what that attempt raised: the search's refusals quote it for
    every knob set they reject (a tenth of ranking a GEMM's space went to deriving it again)."""
    if getattr(s, "tensor_cores", False) and "warp_tile" in getattr(s, "__dict__", {}):
        return None if s.warp_tile is not None else s.__dict__.get("_warp_tile_error")
    try:
        warp_tile_program(s)
    except ScheduleError as e:
        return Rejection(e.code, None, str(e))
    return None


def warp_tile_reason(s) -> str | None:
    """The sentence of ``warp_tile_refusal`` (None: ``s`` has a warp-tile program)."""
    r = warp_tile_refusal(s)
    return None if r is None else r.sentence


def smem_layout(s, p: WarpTileProgram) -> dict[str, tuple[int, int, int]]:
    """Shared tiles as name -> (copies, rows, padded row length in elements); each warp group has
    its own ring of ``stages`` copies of every streamed tile."""
    out: dict[str, tuple[int, int, int]] = {}
    ring = p.warp.stages * p.warp.split
    if p.wgmma_ss:  # 128 B-swizzled 1 KB atoms, read by wgmma: no padding; a slot holds A's [rows, 64]
        # band and each GEMM state's [64, n_tile] B tile (gated GEMMs: X, Wg's and Wu's)
        return {p.tiles_in[0]: (ring, p.rows, p.step)} | {g.x: (ring, *g.x_tile(p.step, True)) for g in p.gemm_states}
    if p.gemm is not None:  # read by wgmma (swizzled): whole bands, unpadded
        kp = p.gemm.kp
        out[p.gemm.a] = (1, p.rows, padded_band(kp) if p.hopper.wgmma and p.warp.reload_a else kp + PAD)
        out[p.gemm.b] = ((ring, kp, p.step + PAD) if p.gemm.b_trans
                         else (ring, p.step, padded_band(kp) if p.hopper.wgmma else kp + PAD))
    for n in p.tiles_in:  # swizzled for TMA (bands of 64 columns), else rows padded for ldmatrix
        out[n] = (ring, p.rows, p.step + (0 if p.hopper.tma else PAD))
    for g in p.gemm_states:  # read by wgmma (P @ V with P in registers): swizzled, whole bands, unpadded
        out.setdefault(g.x, (ring, *g.x_tile(p.step, p.hopper.wgmma)))
    return out


def staged_output(s, p: WarpTileProgram, out: str) -> tuple[str, int] | None:
    """(column dim, padded row length) when output ``out`` leaves through shared memory, else None.

    An accumulator tile [.., R, N] (N contiguous, 2-byte elements) is written into the arena in
    the mma layout, then copied out in 16-byte chunks along whole rows: full sectors, where each
    thread's own pairs of columns would touch 8 rows per store instruction and use a quarter of
    every sector (the sigmoid GEMM sent 4x its output's bytes to L2).  Not with warp groups
    (``split``): only group 0 stores, and a block-wide barrier cannot sit in its branch."""
    smg = s.smg
    dims = smg.space(out).dims
    by_n = {g.n: g for g in p.gemm_states}
    if p.warp.split > 1 or len(dims) < 2 or dims[-1] not in by_n or p.row not in dims[:-1]:
        return None
    if not set(dims[:-1]) - {p.row} <= set(p.batch) or smg.space(out).dtype not in MMA_DTYPES:
        return None
    # the row dim may sit before batch dims (a bshd O [b, m, h, n]: its rows h * n apart); a unit dim
    # there (a bhsd GQA decoder's single query m behind its group r as rows) keeps the per-thread
    # stores its kernels were verified with on the GPU
    if any(smg.dim_sizes[d] == 1 for d in dims[dims.index(p.row) + 1:-1]):
        return None
    n = dims[-1]
    if by_n[n].n_tile % CHUNK or smg.dim_sizes[n] % CHUNK:
        return None
    return n, by_n[n].n_tile + PAD


def warp_tile_smem_bytes(s, p: WarpTileProgram) -> int:
    """The kernel's arena: the ring tiles side by side, then the A tile (its load overlaps the
    ring's first tiles'), and after the loop the groups' fp32 hand-over or the staged output
    tiles over it all."""
    item = 2  # fp16 / bf16
    tiles = sum(math.prod(v) for v in smem_layout(s, p).values()) * item
    # the groups hand over through the arena, unless blocks slice the steps too (then every group's
    # part goes to the global workspace)
    tiles += SWIZZLE_ATOM * item * len(wgmma_swizzled(p))  # each swizzled tile aligned to its atoms
    merge = (p.warp.split - 1) * 32 * p.warps * p.merge_floats() * 4 if p.warp.slices == 1 else 0
    if p.hopper.producer:  # the loads run on through the epilogue: its bands are staged beside the ring
        return tiles + staged_elements(s, p) * item + mbarrier_bytes(p)
    return max(tiles, merge, staged_elements(s, p) * item) + mbarrier_bytes(p)


def mbarrier_bytes(p: WarpTileProgram) -> int:
    """A TMA ring's mbarriers, after everything else in the arena: one per slot counting its bytes
    in, and with a producer warpgroup one more per slot counting the MMA warpgroups done with it
    (twice that when the score GEMM's tiles and the GEMM states' come and go apart: ``split_ring``);
    with ``pingpong`` one per MMA warpgroup by which the other lets it start its next main loop."""
    if not p.hopper.tma:
        return 0
    per_slot = (4 if split_ring(p) else 2) if p.hopper.producer else 1
    return 8 * p.warp.stages * per_slot + 8 * (2 if p.hopper.pingpong else 0)


def moves_registers(p: WarpTileProgram) -> bool:
    """Whether a producer warpgroup hands registers to two MMA warpgroups (``setmaxnreg``): each MMA
    thread may then hold ``CONSUMER_REGS`` though the block of 384 launches with 168 a thread."""
    return p.hopper.producer and p.warps * p.mma_groups == 8


def split_ring(p: WarpTileProgram) -> bool:
    """Whether a producer-fed ring loads and frees each slot's score-GEMM tile (K) apart from its GEMM
    states' (V): a step's scores need K at its start and V only at the next step, when its P @ V
    runs behind that step's scores (FlashAttention-3's intra-warpgroup overlap)."""
    return p.hopper.producer and p.gemm is not None


def staged_elements(s, p: WarpTileProgram) -> int:
    """Arena elements the largest staged output tile needs after the loop (0: none is staged); with a
    producer warpgroup each MMA warpgroup stages one ``BAND``-column band of its rows at a time (of
    its own tile with ``pingpong``)."""
    staged = [staged_output(s, p, out) for out, _ in p.outputs]
    widths = [BAND + PAD if p.hopper.producer else st[1] for st in staged if st is not None]
    return max((p.rows * w for w in widths), default=0) * p.mma_groups


#: registers per thread besides the tiles ``warp_tile_registers`` counts (indices, smem and global addresses,
#: loop state, wgmma descriptors, temporaries), by form: nvcc's count less those tiles (one register per
#: 32-bit word) over the corpus (``experiments/tuning/register_corpus.json``) has least-squares intercepts of
#: 37.3 (wgmma's ss form), 19.5 (wgmma attention) and 34.6 (mma.sync), medians 38 / 18 / 33; the ss form
#: keeps the 40 its estimate was checked with (168 against nvcc's 166), the others take about the median
WGMMA_SS_BASE_REGS = 40
WGMMA_BASE_REGS = 20
MMA_SYNC_BASE_REGS = 33
#: the second cp.async group of ``early_scores`` on mma.sync: its addresses and the wait between (fitted 9.7)
EARLY_SCORES_REGS = 10


def warp_tile_registers(s, p: WarpTileProgram) -> int:
    """Estimate of the 32-bit registers per thread nvcc gives the kernel: what a thread keeps live at the
    busiest point of a step, plus a per-form base for addressing.  Each lane holds 1/32 of a warp's
    16-row tiles (``warp_mtiles`` of them; a warpgroup's m64 wgmma tile is the same 16 rows per warp):

    - accumulators: a 16 x n fp32 tile is n / 2 registers, for every GEMM state, all through the loop;
    - row states: each lane owns 2 rows per 16-row tile (the per-step old copy lives only briefly);
    - the score GEMM's A (Q) held as fp16 fragments for the whole loop: kd / 4 per 16-row tile, none
      with ``reload_a`` (wgmma reads it from shared memory; mma.sync's two k slices are transient);
    - the fp32 score tile, step / 2 per 16-row tile (and each copy a later score op keeps beside it);
    - the second GEMM's fp16 A fragments (P), step / 4, counted half: they are packed from the score
      tile as it dies; whole where a producer warpgroup feeds the score GEMM (``split_ring``: a step's
      P @ V runs behind the next step's scores, so P stays beside them);
    - with one serial step nothing is carried: the peak is the larger of the score phase (Q + scores)
      and the P @ V phase (accumulators + P), not their sum;
    - a plain GEMM on mma.sync reads its A tile's fragments k slice by k slice (two live), and wgmma's ss
      form holds only its accumulators (plus ``WGMMA_STATE_REGS`` per further GEMM state).

    The B operands' fragments (K, V, a reloaded Q: one or two k slices at a time) are left out: over the
    corpus they add nothing the base does not already cover (least squares: -0.03 a register).  Against
    nvcc 13.0 on the 534 corpus kernels that neither spill nor move registers (``setmaxnreg``), the error
    is 10.4 registers on average (26.2 for the estimate before, which counted 40 of addressing
    everywhere, Q in registers under wgmma's ``reload_a`` and P beside the whole score tile); ptxas's own
    pull to occupancy steps (many kernels land at exactly 128 or 168) is not modelled.  mma.sync
    GEMMs with wide B tiles are the worst (nvcc up to 98 above).  The blocks per SM it gives match nvcc's
    count's on 487 of the 534 (399 before); ``tests/test_warp_tile_registers.py`` holds the bounds."""
    mt = p.warp_mtiles
    acc = mt * sum(g.n_tile // 2 for g in p.gemm_states)
    if p.wgmma_ss:  # row states beside it: A's fragments of the step and two rows per 16-row tile each
        rows = mt * (p.step // 4) + 2 * mt * len(p.row_states) if p.row_states else 0
        return WGMMA_SS_BASE_REGS + acc + WGMMA_STATE_REGS * (len(p.gemm_states) - 1) + rows
    base = WGMMA_BASE_REGS if p.hopper.wgmma else MMA_SYNC_BASE_REGS + (EARLY_SCORES_REGS if p.warp.early_scores else 0)
    if not p.row_states and not p.score_ops:  # a plain GEMM (+ epilogue) on mma.sync
        return base + acc + mt * min(p.step // 4, 8)
    rows = 2 * mt * len(p.row_states)
    scores = mt * (p.step // 2) * (1 + _held_score_ops(s, p))
    held_a = mt * p.gemm.kp // 4 if p.gemm is not None and not p.warp.reload_a else 0
    factor = mt * (p.step // 4)
    if p.gemm is not None and s.steps_per_block == 1:
        return base + rows + max(held_a + scores, acc + factor)
    return base + acc + rows + held_a + scores + (factor if split_ring(p) else factor // 2)


def _held_score_ops(s, p: WarpTileProgram) -> int:
    """Score ops whose tile stays live beside a later one: read by two or more of the later score
    ops and the states.  One read by its successor alone (causal's scaled scores, read only by the
    mask) is overwritten element by element in place: nvcc gives causal MHA 255 registers and
    44 spilled bytes against LLaMA's 255 and none, not the 64 registers a second copy would take."""
    readers = [parse(s.smg.producer(n).body).free_symbols for n in p.score_ops]
    readers += [parse(u.body).free_symbols for u in s.plan.states]
    held = 0
    for i, name in enumerate(p.score_ops[:-1]):
        if sum(any(x.name == name for x in r) for r in readers[i + 1:]) > 1:
            held += 1
    return held



def mma_row_sums(row_states: Sequence[UpdateFunction], gemm_states: Sequence[GemmState]) -> dict[str, str]:
    """Sum row states that the tensor cores can compute with a GEMM state: state -> GEMM state.

    A sum over the serial dim whose body is the factor tile ``f`` of a GEMM state
    ``X = sum f * x`` is ``f @ 1``: one more n8 mma per k slice on the fp16 fragments that GEMM
    already holds (every column of the result is the row's sum), in place of an fp32 add per
    element and the quad's shuffles.  Its carry must rescale it by a per-row factor, and no GEMM
    state may read it: it is now updated after that GEMM, not before."""
    return dict(_mma_row_sums(tuple(row_states), tuple(gemm_states)))


@functools.lru_cache(maxsize=256)  # a search space asks for the same program's at every point
def _mma_row_sums(row_states: tuple[UpdateFunction, ...], gemm_states: tuple[GemmState, ...]
                  ) -> tuple[tuple[str, str], ...]:
    readers: set[str] = set()
    for g in gemm_states:
        names = parse(g.factor).free_symbols | (parse(g.update.carry).free_symbols if g.update.carry else set())
        readers |= {x.name.removesuffix("__old").removesuffix("__new") for x in names}
    found: dict[str, str] = {}
    for u in row_states:
        if u.combiner != "sum" or u.state in readers or (u.carry and carry_factor(u.carry, u.state) is None):
            continue
        body = parse(u.body)
        g = next((g for g in gemm_states if sp.simplify(parse(g.factor) - body) == 0), None)
        if g is not None:
            found[u.state] = g.update.state
    return tuple(found.items())


@functools.lru_cache(maxsize=256)  # a search space asks for the same body's at every point
def _quotient(body: str, x: str) -> sp.Expr:
    """``body / x`` simplified: the factor tile of a GEMM state's body ``x * factor``."""
    return sp.simplify(parse(body) / sp.Symbol(x, real=True))


def swizzled_128b(r, j, rows: int, xor=operator.xor):
    """Element offset of 16-byte chunk ``j`` of row ``r`` in a tile that wgmma reads with the
    128-byte swizzle: 1 KB atoms of 8 rows x 128 B (64 halfs), a chunk's index XORed with its row's
    within the atom (conflict-free cp.async writes and wgmma reads); atoms run down the ``rows``
    first, then across the 64-column bands.  K-major A [rows, 64] is one band; B [k, n] has n / 64.
    Ints or TIR (``xor``: the XOR to use)."""
    band, jj = j // 8, j % 8
    return (band * (rows // 8) + r // 8) * 512 + (r % 8) * 64 + xor(jj, r % 8) * 8


#: a killing mask's affine condition: kept where ``a*L + b*R + c <= 0`` (``< 0`` if strict)
Bound = tuple[int, int, int, bool]


def mask_bound(smg, p: WarpTileProgram) -> Bound | None:
    """(a, b, c, strict) of the killing mask that bounds L from above (a > 0: causal), if any."""
    found = killing_mask(smg, p)
    return None if found is None else found[1]


def killing_mask(smg, p: WarpTileProgram) -> tuple[str, Bound] | None:
    """The first killing mask that bounds L from above (a > 0) and its name."""
    return next(((n, b) for n, b in killing_masks(smg, p) if b[0] > 0), None)


def killing_masks(smg, p: WarpTileProgram) -> list[tuple[str, Bound]]:
    """Every score op that is a killing mask (kept where ``a*L + b*R + c <= 0``, a != 0, else a fill
    <= -1e30) with its (a, b, c, strict): a > 0 bounds L from above (causal), a < 0 from below (the far
    edge of a sliding window).  Whole steps outside the bounds are skipped, whole tiles inside run
    without the select."""
    return list(_killing_masks(smg, p.serial, p.row, tuple(p.score_ops)))


@functools.lru_cache(maxsize=256)  # the cost model asks at every point of a search space: 2.6 of a causal
def _killing_masks(smg, serial: str, row: str, score_ops: tuple[str, ...]  # attention's 8.8 s first pick
                   ) -> tuple[tuple[str, Bound], ...]:
    L, R = sp.Symbol(serial, real=True), sp.Symbol(row, real=True)
    found = []
    for name in score_ops:
        op = smg.producer(name)
        e = body_expr(op)
        if op.kind not in ("mask", "map") or not isinstance(e, sp.Piecewise) or len(e.args) != 2:
            continue
        (_, cond), (fill, _) = e.args
        if not fill.is_Number or float(fill) > -1e30:
            continue
        if isinstance(cond, (sp.GreaterThan, sp.StrictGreaterThan)):
            f, strict = cond.rhs - cond.lhs, isinstance(cond, sp.StrictGreaterThan)
        elif isinstance(cond, (sp.LessThan, sp.StrictLessThan)):
            f, strict = cond.lhs - cond.rhs, isinstance(cond, sp.StrictLessThan)
        else:
            continue
        f = sp.expand(f)
        if not f.free_symbols <= {L, R} or not f.is_polynomial(L, R) or sp.Poly(f, L, R).total_degree() > 1:
            continue
        a, b, c = f.coeff(L), f.coeff(R), f.subs({L: 0, R: 0})
        if all(x.is_Integer for x in (a, b, c)) and a != 0:
            found.append((name, (int(a), int(b), int(c), strict)))
    return tuple(found)


#: a padding mask read per key from an input: score op, input, kept where ``input[batch.., L] > threshold``
#: (``>=`` unless strict)
ColumnMask = tuple[str, str, float, bool]


def column_masks(smg, p: WarpTileProgram) -> list[ColumnMask]:
    """Score ops that kill (fill <= -1e30) where an input over (batch dims, L) alone fails a threshold
    (a padding mask ``Keep[b, l] > 0.5``) and whose input also zeroes every GEMM state's factor
    (``patterns.ScoreMod.zero_v``: a query row that keeps no key gives 0).  The same keys are killed for
    every row of a block, so the steps before its first kept key and after its last hold nothing and are
    skipped (found at run time, by a scan of the input): with the factor zeroed a row that keeps nothing
    still gives 0 from the steps that run, where a finite fill alone would average V over every key.
    Only where nothing else can make a row keep nothing (no affine killing mask, no other score input
    such as a bias): such a row's result depends on how many keys run, so every step must."""
    dims_ok = set(p.batch) | {p.serial}
    if killing_masks(smg, p):
        return []
    found = []
    for name in p.score_ops:
        op = smg.producer(name)
        e = body_expr(op)
        if op.kind != "map" or not isinstance(e, sp.Piecewise) or len(e.args) != 2:
            continue
        (_, cond), (fill, _) = e.args
        if not fill.is_Number or float(fill) > -1e30:
            continue
        if not isinstance(cond, (sp.StrictGreaterThan, sp.GreaterThan)) or not cond.rhs.is_Number:
            continue
        x = cond.lhs
        if not x.is_Symbol or x.name not in smg.inputs:
            continue
        xd = smg.space(x.name).dims
        if p.serial not in xd or not set(xd) <= dims_ok:
            continue
        if not p.gemm_states or any(sp.simplify(parse(g.factor).subs(x, 0)) != 0 for g in p.gemm_states):
            continue
        found.append((name, x.name, float(cond.rhs), isinstance(cond, sp.StrictGreaterThan)))
    gemm_in = {p.gemm.a, p.gemm.b} if p.gemm is not None else set()
    read = {a.space for n in p.score_ops for a in smg.producer(n).inputs if a.space in smg.inputs}
    if read - gemm_in - {m[1] for m in found}:
        return []
    return found


@dataclass(frozen=True)
class IndexOps:
    """The integer operations :func:`step_range` needs, for Python ints or for TIR expressions."""

    min: Callable
    max: Callable
    floordiv: Callable
    select: Callable  # (condition, then, else)
    all: Callable  # (*conditions)


INT_OPS = IndexOps(min, max, operator.floordiv, lambda c, x, y: x if c else y, lambda *c: all(c))


def step_range(bounds: Sequence[Bound], r_lo, r_hi, step: int, length: int, ops: IndexOps = INT_OPS):
    """The serial steps [lo, hi) that rows ``r_lo..r_hi`` need under killing masks ``bounds``: past the
    last kept L of the tile's best row (upper bounds, a > 0) and before the first kept L of its best row
    (lower bounds, where every bound has a = +-1: the kept interval's length is then affine in the row,
    so its shortest row is at an end of the tile).  A tile with a row that keeps nothing runs every
    step (such a row averages over all L).  Ints, or TIR with ``ops``: the lowering and the cost model
    share it."""
    total = -(-length // step)
    upper, lower = [b for b in bounds if b[0] > 0], [b for b in bounds if b[0] < 0]
    if not bounds or (lower and any(abs(b[0]) != 1 for b in bounds)):
        return 0, total  # no mask, or one whose empty rows the tile's ends do not show: every step

    def lmax(b: Bound, r):  # the largest L that ``b`` keeps in row r
        a, rb, c, strict = b
        return ops.floordiv(-rb * r - c - (1 if strict else 0), a)

    def lmin(b: Bound, r):  # the smallest L that ``b`` (a = -1) keeps in row r
        _, rb, c, strict = b
        return rb * r + c + (1 if strict else 0)

    def kept(r):  # row r keeps some L in [0, length)
        hi = functools.reduce(ops.min, [lmax(b, r) for b in upper], length - 1)
        lo = functools.reduce(ops.max, [lmin(b, r) for b in lower], 0)
        return lo <= hi

    hi = functools.reduce(ops.min, [ops.floordiv(lmax(b, r_hi if b[1] < 0 else r_lo), step) + 1 for b in upper],
                          total)
    lo = functools.reduce(ops.max, [ops.floordiv(lmin(b, r_lo if b[1] > 0 else r_hi), step) for b in lower], 0)
    whole = ops.all(kept(r_lo), kept(r_hi))
    return ops.select(whole, lo, 0), ops.select(whole, hi, total)


def steps_per_row_tile(s, p: WarpTileProgram) -> list[int]:
    """Serial steps each row tile runs (as the lowering's ``_step_range``): all of them, or, under
    killing masks, those between the first and last steps that keep an element of the tile."""
    sizes = s.smg.dim_sizes
    tiles = -(-sizes[p.row] // p.rows)
    bounds = [b for _, b in killing_masks(s.smg, p)]
    out = []
    for i in range(tiles):
        r_lo, r_hi = i * p.rows, min((i + 1) * p.rows, sizes[p.row]) - 1
        lo, hi = step_range(bounds, r_lo, r_hi, p.step, sizes[p.serial])
        out.append(hi - lo)
    return out


def tma_maps(s, p: WarpTileProgram) -> dict[str, dict]:
    """The tensor maps a ``tma`` kernel takes, as kernel param -> {tensor, box (innermost first),
    swizzle (bytes)}: [rows, 64] bands of the inputs on the score plane (a plain GEMM's A, with K
    innermost), [step, 64] bands of the others (K, V, a plain GEMM's B), one (batch, head)
    coordinate at a time; the launcher encodes them for the tensors it binds.  A gathered tile (an
    implicit GEMM's) maps its image in im2col mode: box [64 channels, rows pixels], and ``im2col``'s
    pixel-box corners (w, h) and, for a strided window, its traversal stride (w, h)."""
    if not p.hopper.tma:
        return {}
    maps = {}
    for n in tma_streamed(p):
        im = p.im2col(n)
        if im is not None:  # a gathered tile: the image's map in im2col mode, [rows pixels, 64 channels] a load
            lower, upper = im.corners
            spec = {"lower": lower, "upper": upper} | ({"stride": [im.stride] * 2} if im.stride > 1 else {})
            maps[f"{n}__tmap"] = {"tensor": im.src, "box": [64, p.rows, 1, 1], "swizzle": 128, "im2col": spec}
            continue
        kx = k_major_x(p, n)
        rows = p.rows if n in p.tiles_in else kx.n_tile if kx is not None else p.step
        spec = {"tensor": n, "box": [64, rows] + [1] * (len(s.smg.space(n).dims) - 2), "swizzle": 128}
        dims = s.smg.space(n).dims
        order = [dims.index(d) for d in tma_dims(s.smg, p, n)]
        if order != list(range(len(dims)))[::-1]:  # not plain innermost-first (bshd): the launcher needs it
            spec["dims"] = order
        maps[f"{n}__tmap"] = spec
    return maps


def tma_dims(smg, p: WarpTileProgram, n: str) -> tuple[str, ...]:
    """The dims of TMA-loaded tile ``n`` in its tensor map's order: the contiguous column dim, the
    tile's row dim (the row dim R for an input on the score plane, a K-major ``x``'s column dim N, else
    the serial dim), then the others innermost first.  A tensor map takes each dim's own stride, so the
    row dim may lie anywhere
    in memory (a bshd K [b, L, h, d] is mapped as (d, L, h, b)) while the box and the kernel's
    coordinates keep the order (cols, rows, batch...)."""
    dims = smg.space(n).dims
    kx = k_major_x(p, n)
    rows = p.row if n in p.tiles_in else kx.n if kx is not None else p.serial
    return (dims[-1], rows, *(d for d in reversed(dims[:-1]) if d != rows))


def k_major_x(p: WarpTileProgram, name: str) -> GemmState | None:
    """The GEMM state whose ``x`` is ``name`` staged K-major ([n_tile, step] tiles: ``nn.Linear``'s weight
    as stored), else None."""
    return next((g for g in p.gemm_states if g.x == name and g.k_major), None)


def tma_streamed(p: WarpTileProgram) -> tuple[str, ...]:
    """The tiles a TMA ring loads per step: the inputs on the score plane ([rows, step]: a plain
    GEMM's A, Softmax-GEMM's S), the score GEMM's B (K) and the GEMM states' ``x`` (V, a plain GEMM's
    B) ([step, cols]), each in 64-column swizzled bands."""
    b = (p.gemm.b,) if p.gemm is not None else ()
    return tuple(dict.fromkeys(p.tiles_in + b + tuple(g.x for g in p.gemm_states)))


def tma_reason(p: WarpTileProgram) -> str | None:
    """Why the ring of ``p`` cannot be loaded by TMA (None: it can): it needs warpgroup MMA's
    swizzled tiles (so one warp group) and steps of whole 64-column bands of an input staged in the
    score layout (Softmax-GEMM's S)."""
    if not p.hopper.wgmma:
        return "its tiles are not wgmma's swizzled ones (wgmma=True)"
    if p.gathers:  # an implicit GEMM's im2col view: TMA's im2col mode loads a window's [rows, 64] bands
        if p.im2col_why:
            return (f"{p.gathers[0].tile!r} is gathered (an implicit GEMM's im2col view) and no TMA im2col load "
                    f"describes it: {p.im2col_why}")
        if p.step % 64:
            return f"the step {p.step} is not whole 64-channel bands of the gathered view (one TMA im2col load each)"
        if p.rows > 256:
            return f"the row tile {p.rows} is more pixels than one TMA im2col load takes (256)"
    if p.wgmma_ss:  # (blocks slicing the steps: each block's coordinates along L start at its first step)
        return None
    if p.tiles_in and p.step % 64:
        return f"the step {p.step} is not whole 64-column bands of the inputs staged in the score layout"
    if p.gemm is not None and p.gemm.b_trans:
        return f"{p.gemm.b!r} is not [.., L, K] with K contiguous"
    return None
