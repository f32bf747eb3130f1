"""The Schedule: an immutable, JSON-serialisable record of all slicing decisions.

Lowering is a pure function of (Schedule, target), so a Schedule read back from
JSON or a tuning database replays the same kernel.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import sympy as sp

from schedulers.errors import ScheduleError, TemporalSliceError
from schedulers.halo import window_box
from schedulers.hardware import PRESETS, HardwareError, HardwareModel, get_hardware
from schedulers.knobs import Rejection, check_values
from schedulers.options import (
    GROUPS,
    KNOB_FIELDS,
    KNOB_GROUP,
    LANES,
    VECTORS,
    HopperOptions,
    SimtOptions,
    WarpTileOptions,
    needs_tensor_cores,
    non_defaults,
    split_knobs,
)
from schedulers.spatial import DimDecision, analyse_spatial, elementwise_serial
from schedulers.temporal import TemporalPlan, UpdateFunction, plan_temporal
from smg.expr import parse
from smg.hashing import canonical_text, text_key
from smg.ir import SMG
from smg.serialize import smg_from_dict, smg_to_dict

FORMAT = "spacefusion-schedule/1"
LEVELS = ("global", "shared", "register", "inlined")
__all__ = ["LANES", "VECTORS", "Schedule", "input_lane_spread", "lane_spread", "make_schedule", "pick_serial"]


#: where ``Schedule.key`` splices the SMG's canonical text into the schedule's
_SMG_SLOT = "@@spacefusion-smg-canonical-text@@"


def _plan_dict(p: TemporalPlan) -> dict[str, Any]:
    return {"streamed": list(p.streamed), "inlined": list(p.inlined), "states": [vars(u) for u in p.states],
            "finalize": [list(f) for f in p.finalize], "second_pass": list(p.second_pass)}


@lru_cache(maxsize=1024)
def _plan_text(p: TemporalPlan) -> str:
    """The canonical text of a plan as ``to_dict`` writes it (plans are shared by a search's candidates)."""
    return canonical_text(_plan_dict(p))


@lru_cache(maxsize=1024)
def _spatial_text(decisions: tuple[DimDecision, ...]) -> str:
    return canonical_text([vars(d) for d in decisions])


@lru_cache(maxsize=4096)
def _memory_text(memory: tuple[tuple[str, str], ...]) -> str:
    return canonical_text([list(m) for m in memory])


@dataclass(frozen=True)
class Schedule:
    """Block dims and sizes, serial dim and step, update functions, memory levels.

    ``block`` lists each spatially cut dim with its tile; dims not listed are
    whole inside a block.  Every element of a block's tile is one thread;
    ``thread_dim`` is the fastest-varying one (consecutive threads, coalesced).
    """

    smg: SMG
    block: tuple[tuple[str, int], ...]
    thread_dim: str
    serial: str
    step: int
    plan: TemporalPlan
    memory: tuple[tuple[str, str], ...]
    spatial: tuple[DimDecision, ...]
    #: lower on tensor cores (CUDA only): a GEMM + element-wise epilogue through TVM's WMMA
    #: tensorizer, or a warp-tile program (schedulers.warp_tile) through mma.sync/ldmatrix
    tensor_cores: bool = False
    #: the knobs, in their typed groups (``schedulers.options``); ``s.<knob>`` reads one through its group
    simt: SimtOptions = SimtOptions()
    warp: WarpTileOptions = WarpTileOptions()
    hopper: HopperOptions = HopperOptions()

    def __getattr__(self, name: str) -> Any:
        """A knob by its name (``s.stages`` is ``s.warp.stages``): readers need not know its group."""
        group = KNOB_GROUP.get(name)
        if group is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, group), name)

    @cached_property
    def key(self) -> str:
        """``content_key(self.to_dict())``, with the canonical texts of the SMG (built once per graph), the
        temporal plan, the spatial decisions and the memory levels (once per plan, decision tuple and level
        tuple, which a search's candidates share) spliced in rather than re-serialised for every candidate:
        the same digest."""
        body = self._fields()
        texts = {"smg": self.smg.canonical_text, "plan": _plan_text(self.plan),
                 "spatial": _spatial_text(self.spatial), "memory": _memory_text(self.memory)}
        text = canonical_text(body | {k: f"{_SMG_SLOT}{k}" for k in texts})
        for k, t in texts.items():
            text = text.replace(f'"{k}":"{_SMG_SLOT}{k}"', f'"{k}":' + t, 1)
        return text_key(text)

    @property
    def tiles(self) -> dict[str, int]:
        return dict(self.block)

    @cached_property
    def warp_tile(self):
        """The warp-tile program of a tensor-core schedule (None for WMMA or CUDA-core kernels)."""
        if not self.tensor_cores:
            return None
        from schedulers.warp_tile import warp_tile_program

        try:
            return warp_tile_program(self)
        except ScheduleError as e:  # kept for ``warp_tile_refusal``: the search's refusals quote it
            self.__dict__["_warp_tile_error"] = Rejection(e.code, None, str(e))
            return None

    @property
    def threads(self) -> int:
        if self.warp_tile is not None:
            return self.warp_tile.threads
        return math.prod(t for _, t in self.block) * self.lanes

    def grid(self) -> dict[str, int]:
        """Number of blocks along each cut dim."""
        sizes = self.smg.dim_sizes
        return {d: math.ceil(sizes[d] / t) for d, t in self.block}

    @property
    def num_tiles(self) -> int:
        """Work tiles: one per tile of the cut dims, times the serial slices."""
        return math.prod(self.grid().values()) * self.slices

    @property
    def num_blocks(self) -> int:
        """Thread blocks launched: one per work tile (a cluster of them per tile with ``cluster``), or the
        persistent grid that loops over them."""
        return self.persistent or self.num_tiles * self.cluster

    @property
    def row_lanes(self) -> int:
        """Threads sharing one tile element's reductions: the lanes of every block of its cluster."""
        return self.lanes * self.cluster

    @property
    def num_steps(self) -> int:
        return math.ceil(self.smg.dim_sizes[self.serial] / self.step)

    @property
    def steps_per_block(self) -> int:
        """Serial steps one block runs: all of them, or its slice's contiguous share."""
        return -(-self.num_steps // self.slices)

    def level(self, space: str) -> str:
        return dict(self.memory)[space]

    # -- serialisation ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {**self._fields(), "smg": smg_to_dict(self.smg)}

    def _fields(self) -> dict[str, Any]:
        """Every field of ``to_dict`` but the SMG."""
        return {
            "format": FORMAT,
            "block": [list(b) for b in self.block],
            "thread_dim": self.thread_dim,
            "serial": self.serial,
            "step": self.step,
            "plan": _plan_dict(self.plan),
            "memory": [list(m) for m in self.memory],
            "spatial": [vars(d) for d in self.spatial],
        } | ({"tensor_cores": True} if self.tensor_cores else {}) | {  # knobs only where changed: old keys hold
            k: v for g in GROUPS for k, v in non_defaults(getattr(self, g)).items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScheduleError(f"schedule JSON is not valid JSON: {e}", code="schedule.json") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            tag = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ScheduleError(f"not a spacefusion schedule (format tag {tag!r})", code="schedule.format")
        try:
            s = cls._from_dict(d)
        except (KeyError, TypeError, ValueError) as e:
            raise ScheduleError(f"schedule JSON is incomplete or malformed: {e!r}", code="schedule.malformed") from None
        _check_loaded(s)
        return s

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> Schedule:
        p = d["plan"]
        plan = TemporalPlan(
            serial=d["serial"],
            streamed=tuple(p["streamed"]),
            states=tuple(UpdateFunction(**u) for u in p["states"]),
            finalize=tuple(tuple(f) for f in p["finalize"]),
            inlined=tuple(p["inlined"]),
            second_pass=tuple(p.get("second_pass", ())),
        )
        return cls(
            smg=smg_from_dict(d["smg"]),
            block=tuple((b[0], int(b[1])) for b in d["block"]),
            thread_dim=d["thread_dim"],
            serial=d["serial"],
            step=int(d["step"]),
            plan=plan,
            memory=tuple(tuple(m) for m in d["memory"]),
            spatial=tuple(DimDecision(**{**x, "recomputes": tuple(x.get("recomputes", ()))}) for x in d["spatial"]),
            tensor_cores=bool(d.get("tensor_cores", False)),
            **split_knobs({f.name: d[f.name] for f in KNOB_FIELDS if f.name in d}),
        )

    def __str__(self) -> str:
        from schedulers.printing import schedule_summary

        return schedule_summary(self)

    def _repr_html_(self) -> str:
        """Jupyter: slices, memory levels, derived update functions and the SMG."""
        from schedulers.display import schedule_html

        return schedule_html(self)


def lane_spread(s: Schedule, others: tuple[str, ...], layout: tuple[str, ...]) -> tuple[str, ...] | None:
    """The dims a lane group's elements are spread over in a step, outermost first, where a state's op
    reduces ``others`` besides the serial dim: the step's serial positions and ``others`` as one index,
    laid out as ``layout`` (the dims of the input it streams) orders them, consecutive lanes on its
    innermost.  None where the lanes stay on the serial dim alone (no lanes, vectors, or no other dims).
    Why: a split's stats kernel reduces (chunks, channels) per group; lanes over the chunks alone read one
    float from each 64-byte row of channels.  The lowering (``lower.tir``) and the cost model
    (``search.simt_memory.warp_sectors``) both read this."""
    if s.lanes <= 1 or s.vector > 1 or not others:
        return None
    dims = (s.serial, *others)
    return tuple(sorted(dims, key=lambda d: layout.index(d) if d in layout else -1))


def input_lane_spread(s: Schedule, name: str) -> tuple[str, ...] | None:
    """``lane_spread`` of the state updates' reads of input ``name``: the other reduced dims it has, in its
    own layout (what the cost model asks of each input)."""
    dims = s.smg.space(name).dims
    reduced = {d for u in s.plan.states for d in s.smg.producer(u.base).reduce} - {s.serial}
    return lane_spread(s, tuple(d for d in dims if d in reduced and d not in s.tiles), dims)


def _check_loaded(s: Schedule) -> None:
    """The numbers of a schedule read from JSON, checked as ``make_schedule`` checks them (an edited file
    with step 0 or tile -5 would otherwise reach the lowering: a ZeroDivisionError, or TVM's InternalError)."""
    sizes = s.smg.dim_sizes
    if s.serial not in sizes:
        raise ScheduleError(f"schedule JSON: serial dim {s.serial!r} is not a dim of {s.smg.name!r}",
                            code="schedule.serial")
    if not 1 <= s.step <= sizes[s.serial]:
        raise ScheduleError(f"schedule JSON: step {s.step} for serial dim {s.serial!r} must be 1..{sizes[s.serial]}",
                            code="schedule.step")
    for d, tile in s.block:
        if d not in sizes:
            raise ScheduleError(f"schedule JSON: block dim {d!r} is not a dim of {s.smg.name!r}",
                                code="schedule.block_dim")
        if tile < 1 or (tile > sizes[d] and not s.tensor_cores):
            raise ScheduleError(f"schedule JSON: tile {tile} for dim {d!r} must be 1..{sizes[d]}",
                                code="schedule.tile")
    for g in GROUPS:
        bad = check_values(getattr(s, g))
        if bad is not None:
            raise ScheduleError(f"schedule JSON: {bad.sentence}", code=bad.code, knob=bad.knob)
    _check_against_graph(s)


def _check_against_graph(s: Schedule) -> None:
    """A schedule read from JSON must be one the slicers make of its graph: the same decisions given to
    ``make_schedule`` (block tiles, serial dim and step, thread dim, knobs) give the same spatial decisions
    and temporal plan (update functions, finalize), and its memory levels differ from theirs only where the
    lowering has a choice.  Why: the lowering trusts all of it; a tile on a reduced dim, another serial dim
    or an edited finalize built kernels that were wrong (every output, or differently on each call)."""
    knobs = {k: v for g in GROUPS for k, v in non_defaults(getattr(s, g)).items()}
    name = s.smg.name
    try:
        made = make_schedule(s.smg, dict(s.block), serial=s.serial, step=s.step, thread_dim=s.thread_dim,
                             tensor_cores=s.tensor_cores, **knobs)
    except ScheduleError as e:
        raise ScheduleError(f"schedule JSON does not fit its graph {name!r}: {e}", code=e.code, knob=e.knob) from None
    if [n for n, _ in s.memory] != [n for n, _ in made.memory]:
        raise ScheduleError(f"schedule JSON: its memory levels name {[n for n, _ in s.memory]}, the spaces of "
                            f"{name!r} are {[n for n, _ in made.memory]}", code="schedule.graph")
    moved = {n: lvl for (n, lvl), (_, was) in zip(s.memory, made.memory) if lvl != was}
    try:
        _override_levels(list(made.memory), moved, s.smg.inputs)
    except ScheduleError as e:
        raise ScheduleError(f"schedule JSON: {e}", code="schedule.graph") from None
    for what, differs in (("spatial decisions", None if s.spatial == made.spatial else "their cuts"),
                          ("temporal plan", _plan_differs(s.plan, made.plan))):
        if differs is not None:
            raise ScheduleError(f"schedule JSON: the slicers derive other {what} for {name!r} with serial dim "
                                f"{s.serial!r} than the file holds (in {differs})", code="schedule.graph")


def _plan_differs(got: TemporalPlan, want: TemporalPlan) -> str | None:
    """Where a plan read from a file differs from the one derived (None: nowhere).  Expressions are compared
    by meaning where their texts differ: another sympy may print a derived carry otherwise, and a plan
    recorded so still replays the kernel it was measured as."""
    if got == want:
        return None
    for f in ("serial", "streamed", "inlined", "second_pass"):
        if getattr(got, f) != getattr(want, f):
            return f
    if len(got.states) != len(want.states) or [o for o, _ in got.finalize] != [o for o, _ in want.finalize]:
        return "states" if len(got.states) != len(want.states) else "finalize"
    for a, b in zip(got.states, want.states):
        if (a.state, a.combiner, a.space) != (b.state, b.combiner, b.space):
            return "states"
        if any(not _same_expr(getattr(a, f), getattr(b, f)) for f in ("body", "carry", "value", "postponed")):
            return "states"
    if any(not _same_expr(a, b) for (_, a), (_, b) in zip(got.finalize, want.finalize)):
        return "finalize"
    return None


def _same_expr(a: str, b: str) -> bool:
    """Whether two expression texts of a plan mean the same (an empty text means none: only equal to one)."""
    if a == b:
        return True
    if not a or not b:
        return False
    try:
        return bool(sp.simplify(parse(a) - parse(b)) == 0)
    except (sp.SympifyError, TypeError, SyntaxError):
        return False


def _override_levels(memory: list[tuple[str, str]], levels: dict[str, str], inputs: tuple[str, ...]
                     ) -> list[tuple[str, str]]:
    """Apply the choices the lowering supports: staged input -> global, shared tile -> per thread."""
    cur = dict(memory)
    for name, lvl in levels.items():
        if name not in cur:
            raise ScheduleError(f"memory level given for unknown space {name!r}", code="levels.unknown_space")
        if lvl == cur[name]:
            continue
        allowed = {cur[name], "global"} if name in inputs else {cur[name], "register"}
        if cur[name] != "shared" or lvl not in allowed:
            raise ScheduleError(f"space {name!r} cannot move from {cur[name]!r} to {lvl!r}; the lowering can "
                                f"only read a staged input from global memory or compute a shared tile per thread",
                                code="levels.move")
        cur[name] = lvl
    return [(n, cur[n]) for n, _ in memory]


def pick_serial(smg: SMG, spatial: tuple[DimDecision, ...]) -> str:
    """The reduced dim whose slicing removes the largest on-chip footprint,
    among those the temporal slicer accepts; an element-wise graph's is its outputs' innermost dim
    (``schedulers.spatial.elementwise_serial``)."""
    row = elementwise_serial(smg)
    if row is not None:
        return row
    cut = {d.dim for d in spatial if d.cut}
    sizes = smg.dim_sizes
    cands = [d.dim for d in spatial if not d.cut and any(d.dim in op.reduce for op in smg.ops)]
    if not cands:
        raise ScheduleError(f"{smg.name!r} has no reduced dim to slice temporally", code="serial.none")

    def weight(dim: str) -> int:
        return sum(math.prod(sizes[x] for x in s.dims if x not in cut)
                   for s in smg.spaces if dim in s.dims)

    refused = []
    for c in sorted(cands, key=lambda c: (weight(c), sizes[c]), reverse=True):
        try:
            plan_temporal(smg, c)
            return c
        except TemporalSliceError as e:
            refused.append(f"{c}: {e}")
    raise TemporalSliceError(f"no reduced dim of {smg.name!r} can be sliced temporally: " + "; ".join(refused),
                             code="serial.unsliceable")


def _pads_rows(tile: int, size: int) -> bool:
    """Whether a tensor-core row tile of ``tile`` may cover a dim of ``size`` < ``tile``: a warp-tile
    program's rows come in 16-row MMA tiles (64 per warpgroup), so a GQA decoder's 4-8 query rows
    run in one padded tile whose spare rows are masked like any row tail."""
    return tile % 16 == 0 and tile <= max(64, -(-size // 16) * 16)


@lru_cache(maxsize=4096)
def _levels(smg: SMG, plan: TemporalPlan, wide: frozenset[str]) -> list[tuple[str, str]]:
    """Each space's memory level before a user's overrides, given the cut dims whose tile is > 1 (``wide``):
    what the schedule's slicing implies (cached: a search's candidates share a few of these)."""
    memory = []
    states = {u.state for u in plan.states}
    serial = plan.serial
    for s in smg.spaces:
        # shared by several threads of the block (it lacks a cut dim whose tile is > 1)
        shared_by_threads = any(d not in s.dims for d in wide)
        if s.name in smg.inputs:
            # an input read through a window is staged as its halo box (``schedulers.halo``): a block's taps
            # read it many times, and its rows are copied once, coalesced
            halo = bool(wide) and window_box(smg, s.name) is not None
            lvl = "shared" if (serial in s.dims and shared_by_threads) or halo else "global"
        elif s.name in plan.streamed and serial in s.dims and shared_by_threads:
            lvl = "shared"  # computed once per block and step, cooperatively
        elif s.name in states or s.name in plan.streamed:
            lvl = "register"
        elif s.name in smg.outputs:
            lvl = "global"
        else:
            lvl = "inlined"
        memory.append((s.name, lvl))
    return memory


#: the serial step when none is given (capped at the serial dim's size)
DEFAULT_STEP = 32


def _checked_tiles(tiles: Mapping[str, int] | None) -> dict[str, int]:
    """``tiles`` as a dict of positive ints; ScheduleError (code ``tile.type``/``tile.range``) naming the dim
    and value otherwise.  Why: ``int()`` truncated a tile of 2.5 to 2 and read True as 1 without a word, so
    the schedule built was not the one asked for.  numpy integers count as ints."""
    if tiles is None:
        return {}
    if not isinstance(tiles, Mapping):
        raise ScheduleError(f"tiles must map dim names to sizes, e.g. {{'m': 64}}; got {tiles!r}", code="tile.type")
    out: dict[str, int] = {}
    for d, t in tiles.items():
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ScheduleError(f"tile {t!r} for dim {d!r} must be a whole number (an int), not "
                                f"{type(t).__name__}", code="tile.type")
        if t <= 0:
            raise ScheduleError(f"tile {t} for dim {d!r} is not positive: a tile is a block size of at least 1",
                                code="tile.range")
        out[d] = int(t)
    return out


#: the threads a CUDA block may have on every GPU since compute capability 2.0: ``make_schedule``'s bound where
#: no machine is named (a schedule for llvm is held to it too, so one schedule lowers for either target)
THREADS_PER_BLOCK = 1024


def _hardware(hw: HardwareModel | str | None) -> HardwareModel | None:
    """``hw`` as a HardwareModel: a model passes, a preset name (``"h100"``, ``"H200"``, an alias such as
    ``"H100-SXM"``; case-insensitive) is looked up, None stays None (``THREADS_PER_BLOCK`` bounds it).
    Raises HardwareError listing the known names for an unknown one, and for anything else, at once rather
    than as an AttributeError deep in the slicers."""
    if hw is None or isinstance(hw, HardwareModel):
        return hw
    if not isinstance(hw, str):
        raise HardwareError(f"hw must be a HardwareModel or a preset name ({', '.join(PRESETS)}); got "
                            f"{type(hw).__name__} {hw!r}", code="hardware.type")
    return get_hardware(hw)


def blocking(smg: SMG, tiles: dict[str, int] | None, thread_dim: str | None, recompute: bool,
             tensor_cores: bool) -> tuple[tuple[DimDecision, ...], str, tuple[tuple[str, int], ...]]:
    """The spatial slicer's decisions, the thread dim and the block (each cut dim with its tile) of a request,
    as ``make_schedule`` records them; ScheduleError where the tiles do not fit the cut."""
    tiles = _checked_tiles(tiles)
    spatial = analyse_spatial(smg)
    if recompute:
        spatial = tuple(
            DimDecision(d.dim, True, f"cut on request, recomputing {', '.join(d.recomputes)} per block",
                        d.recomputes) if d.recomputes and d.dim in (tiles or {}) else d
            for d in spatial)
    cut = [d.dim for d in spatial if d.cut]
    sizes = smg.dim_sizes
    for d in tiles:
        if d not in sizes:
            raise ScheduleError(f"tile given for unknown dim {d!r}; dims are {list(sizes)}", code="tile.unknown_dim")
        if d not in cut:
            dec = next(x for x in spatial if x.dim == d)
            hint = " (recompute=True cuts it anyway)" if dec.recomputes else ""
            raise ScheduleError(f"dim {d!r} cannot be cut spatially: {dec.reason}{hint}", code="tile.not_cut")
    if not cut:
        raise ScheduleError(f"no dim of {smg.name!r} can be cut spatially", code="spatial.none")
    out_dims = smg.space(smg.outputs[0]).dims
    thread_dim = thread_dim or [d for d in out_dims if d in cut][-1]
    if thread_dim not in cut:
        raise ScheduleError(f"thread dim {thread_dim!r} is not a spatially cut dim {cut}", code="thread_dim.not_cut")
    block = []
    for d in cut:
        t = tiles.get(d, min(64, sizes[d]) if d == thread_dim else 1)
        if t <= 0 or (t > sizes[d] and not (tensor_cores and _pads_rows(t, sizes[d]))):
            raise ScheduleError(f"tile {t} for dim {d!r} is larger than the dim ({sizes[d]}) or not positive",
                                code="tile.range")
        block.append((d, t))
    return spatial, thread_dim, tuple(block)


def make_schedule(smg: SMG, tiles: dict[str, int] | None = None, serial: str | None = None,
                  step: int | None = None, thread_dim: str | None = None, recompute: bool = False,
                  hw: HardwareModel | str | None = None, levels: dict[str, str] | None = None,
                  tensor_cores: bool = False, **knobs: Any) -> Schedule:
    """Run the spatial then the temporal slicer and record every decision.

    ``tiles`` gives block sizes for cut dims (default: 1, and 64 for the
    innermost cut output dim, which is spread over threads).  With
    ``recompute`` a tile may also cut a dim whose only obstacle is that each
    block recomputes an intermediate (e.g. the MLP's hidden tile per output
    column block): a trade of FLOPs for on-chip memory.  Each tile is a positive int (else
    ScheduleError naming the dim and value).  ``hw`` (a HardwareModel or a preset name of
    ``schedulers.hardware.PRESETS``, case-insensitive) bounds the threads per block; None: CUDA's own limit,
    ``THREADS_PER_BLOCK``, which every CUDA GPU shares (no machine is assumed).
    ``levels`` overrides memory levels where the lowering has a choice: a staged input may be read from ``global``
    instead, a block-shared streamed tile may be computed per thread (``register``).  ``knobs`` are the fields of
    the option groups of ``schedulers.options``, each declared there with its help, values and checks
    (``docs/knobs.md`` is their reference); an unknown one is refused with code ``option.unknown``.
    """
    hw = _hardware(hw)
    spatial, thread_dim, block = blocking(smg, tiles, thread_dim, recompute, tensor_cores)
    sizes = smg.dim_sizes
    limit = hw.max_threads_per_block if hw is not None else THREADS_PER_BLOCK
    groups = split_knobs(knobs)
    serial = serial or pick_serial(smg, spatial)
    if serial not in sizes:
        raise ScheduleError(f"serial dim {serial!r} is not a dim of {smg.name!r}", code="serial.unknown")
    if step is None:  # the default step, never longer than the serial dim (a 16-key attention: step 16)
        step = min(DEFAULT_STEP, sizes[serial])
    if isinstance(step, bool) or not isinstance(step, int):
        raise ScheduleError(f"step {step!r} for serial dim {serial!r} must be a whole number", code="step.type")
    if step <= 0:
        raise ScheduleError(f"step {step} for serial dim {serial!r} must be positive", code="step.range")
    if step > sizes[serial]:
        raise ScheduleError(f"step {step} for serial dim {serial!r} is larger than the dim ({sizes[serial]})",
                            code="step.range")
    plan = plan_temporal(smg, serial)
    memory = _levels(smg, plan, frozenset(d for d, t in block if t > 1))
    memory = _override_levels(memory, levels or {}, smg.inputs)
    out = Schedule(smg, block, thread_dim, serial, int(step), plan, tuple(memory), spatial,
                   bool(tensor_cores), **groups)
    for g in GROUPS:  # the values each knob declares, before anything reads them
        bad = check_values(getattr(out, g))
        if bad is not None and bad.code != "slices.range":
            raise ScheduleError.rejected(bad)
    if hw is not None:  # then what the target cannot run (wgmma, tma, clusters), by its group; no machine: none
        caps = hw.capabilities()
        _refuse(out.simt.check_target(caps), out.hopper.check_target(caps))
    _refuse(out.simt.check(out), out.warp.check(out) if not tensor_cores else None)
    padded = [d for d, t in block if t > sizes[d]]
    if padded and (out.warp_tile is None or padded != [out.warp_tile.row]):
        raise ScheduleError(f"tile {dict(block)[padded[0]]} for dim {padded[0]!r} is larger than the dim "
                            f"({sizes[padded[0]]}): only a warp-tile program's row tile may pad its dim to whole "
                            f"MMA row tiles", code="tile.padded")
    if tensor_cores:
        from schedulers.tensorcore_fit import tensorcore_reason
        from schedulers.warp_tile import warp_tile_refusal

        if out.warp_tile is None:  # the warp-tile reading is tried first (cached on the Schedule)
            wmma = tensorcore_reason(out)
            if wmma is not None:  # no form: counted by the warp-tile reading's code (``wmma.*`` as a GEMM)
                why = warp_tile_refusal(out)
                raise ScheduleError(f"tensor cores requested for {smg.name!r}: as a GEMM + epilogue: {wmma}; "
                                    f"as a warp-tile program: {why.sentence}", code=why.code)
        elif hw is not None and not hw.capabilities().mma_sync:
            raise ScheduleError(f"{smg.name!r}'s warp-tile program runs mma.sync m16n8k16, which {hw.name} "
                                f"({hw.arch}) does not have: sm_80 and later", code="warp_tile.target")
        _refuse(out.simt.check_tensor_cores(out), out.warp.check(out), out.hopper.check(out),
                out.warp.check_last(out), out.hopper.check_last(out))
    else:
        _refuse(needs_tensor_cores(out))
    if out.threads > limit:  # one thread per tile element (x lanes), or 32 per warp of a warp-tile program
        raise ScheduleError(f"block tile {dict(block)} x {out.lanes} lanes needs {out.threads} threads; at most "
                            f"{limit} on {hw.name if hw is not None else 'any CUDA GPU'}", code="threads.block")
    return out


def _refuse(*rejections: Rejection | None) -> None:
    """Raise the first rejection (checks run in the order given; None passes)."""
    for r in rejections:
        if r is not None:
            raise ScheduleError.rejected(r)
