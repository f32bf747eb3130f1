"""Typed schedule options: three groups of knobs, each a frozen dataclass that checks itself.

A knob is a field with its metadata (``knob(...)``: a sentence of help, and the values it may take).
Everything else is derived from the groups: the Schedule's JSON (non-default knobs only, so older
records keep their keys), ``make_schedule``'s keyword options, the search's ``Knobs``, the CLI's flags.
Adding a knob is a field in its group, its check in the group's ``check`` and its use in the lowering.

A check returns a ``Rejection`` (a stable code, the knob to blame, a sentence) instead of raising prose:
the search counts rejections by code, and drops a knob that was offered where it cannot apply by its
name, never by reading the sentence.  Every code is in ``schedulers.codes``.  A group's ``check_target``
refuses what the target cannot run (``HardwareModel.capabilities``): ``make_schedule`` asks it first, and
the search asks it before offering a knob at all.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from schedulers.hardware import Capabilities
    from schedulers.schedule import Schedule

LANES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # threads sharing a tile element's reductions
VECTORS = (1, 2, 4, 8)  # serial elements per vector access of a lane (CUDA-core kernels)
SPLITS = (1, 2, 4, 8)
CLUSTERS = (1, 2, 4, 8)  # blocks of a thread-block cluster (sm_90; 8 is the portable maximum)
MAX_VECTOR_BYTES = 16  # the widest global load/store of one thread
MAX_UNROLL = 64  # loop trips unrolled at most (register arrays indexed by constants, code size)


@dataclass(frozen=True)
class Rejection:
    """Why an option value cannot apply: ``code`` is stable (the search counts by it), ``knob`` names the
    option to blame (None when the schedule as a whole is at fault), ``sentence`` is for people."""

    code: str
    knob: str | None
    sentence: str


#: how a knob's own feature column encodes its value (``search.features`` applies them)
ENCODINGS = ("value", "flag", "log2")


def knob(default: Any, help: str, feature: str, choices: tuple[Any, ...] | None = None, lo: int | None = None,
         hi: int | None = None, valid: str | None = None, encode: str | None = None) -> Any:
    """A group field that is a knob: its default, a sentence of help, the learned model's feature that
    sees it (``search.features``), the values it may take (``choices``, or bounds ``lo``..``hi``) and,
    optionally, how a refusal says what is valid.

    With ``encode`` (one of ``ENCODINGS``) the feature is the knob's own column, generated from this field:
    ``value`` (the number), ``flag`` (1 when set or nonzero) or ``log2`` (log2(1 + value)).  Without it,
    ``feature`` names a schedule-level feature through which the model sees the knob (threads, blocks)."""
    if encode is not None and encode not in ENCODINGS:
        raise ValueError(f"encode {encode!r} is not one of {ENCODINGS}")
    return field(default=default, metadata={"help": help, "feature": feature, "choices": choices, "lo": lo,
                                            "hi": hi, "valid": valid, "encode": encode})


def is_int_knob(f: dataclasses.Field) -> bool:
    return f.type in ("int", int)


def _typed(group: Any) -> tuple | None:
    """``group``'s class and its values each with its type (``True`` is not ``1`` here): the key of the
    caches below, which the search's tens of thousands of candidates hit with a few dozen groups.  None
    where a value cannot be a key (a list given by hand): that group is checked uncached."""
    key = (type(group), tuple((type(v), v) for v in (getattr(group, f.name) for f in _fields(type(group)))))
    try:
        hash(key)
    except TypeError:
        return None
    return key


@functools.cache
def _fields(cls: type) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(cls)


def check_values(group: Any) -> Rejection | None:
    """The value checks every knob declares (type, choices, bounds), in field order.  Cached per group
    instance (``split_knobs`` hands the search's schedules shared ones), then per ``_typed`` key."""
    seen = _BY_ID.get(id(group))
    if seen is not None and seen[0] is group:
        return seen[1]
    key = _typed(group)
    if key is None:
        return _check_values(group)
    got = _CHECKED.get(key, _MISSING)
    if got is _MISSING:
        got = _CHECKED[key] = _check_values(group)
    if len(_BY_ID) < _BY_ID_MAX:  # the instance is held, so its id names no other object meanwhile
        _BY_ID[id(group)] = (group, got)
    return got


_MISSING = object()
#: check_values by ``_typed`` key (a bounded set: the groups the search and the users make)
_CHECKED: dict[tuple, Rejection | None] = {}
#: and by instance, for the instances ``split_knobs`` shares (at most this many held)
_BY_ID: dict[int, tuple[Any, Rejection | None]] = {}
_BY_ID_MAX = 4096


def _check_values(group: Any) -> Rejection | None:
    for f in _fields(type(group)):
        v, m = getattr(group, f.name), f.metadata
        ok_type = (isinstance(v, int) and not isinstance(v, bool)) if is_int_knob(f) else isinstance(v, bool)
        if not ok_type:
            kind = "a whole number" if is_int_knob(f) else "True or False"
            return Rejection(f"{f.name}.type", f.name, f"{f.name} {v!r} must be {kind}")
        lo, hi, choices = m.get("lo"), m.get("hi"), m.get("choices")
        if ((choices is not None and v not in choices) or (lo is not None and v < lo)
                or (hi is not None and v > hi)):
            valid = m.get("valid") or (f"one of {choices}" if choices is not None else
                                       f"{lo}..{hi}" if hi is not None else f">= {lo}")
            return Rejection(f"{f.name}.range", f.name, f"{f.name} {v} must be {valid}")
    return None


def _coerce(f: dataclasses.Field, v: Any) -> Any:
    """numpy and other integral values as Python ints, 0/1 as bools; anything else is left for the check."""
    import numbers

    if is_int_knob(f):
        return int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool | np.bool_) else v
    return bool(v) if isinstance(v, bool | np.bool_) or (isinstance(v, numbers.Integral) and v in (0, 1)) else v


def _changed(group: Any) -> list[str]:
    return [f.name for f in _fields(type(group)) if getattr(group, f.name) != f.default]


@dataclass(frozen=True)
class SimtOptions:
    """CUDA-core kernels: how a block's threads share a tile element's serial reductions."""

    lanes: int = knob(1, "threads sharing each tile element's serial reductions (warp shuffles, then shared "
                         "memory across warps)", "threads", choices=LANES,
                      valid=f"a power of two up to {LANES[-1]} (beyond a warp, 32, the lanes of a group are whole "
                            f"warps)")
    vector: int = knob(1, "consecutive serial elements a lane loads and stores as one vector", "log2_vector",
                       choices=VECTORS, encode="log2",
                       valid=f"one of {VECTORS} elements")
    unroll: bool = knob(False, f"unroll each lane's loop over its elements of a step (at most {MAX_UNROLL} trips; "
                               f"vector runs are unrolled already)", "unroll", encode="flag")
    cluster: int = knob(1, "blocks of a thread-block cluster sharing each row's reductions (sm_90): a block's lanes "
                           "reduce their part, the blocks' results meet in distributed shared memory",
                        "log2_num_blocks", choices=CLUSTERS,
                        valid=f"one of {CLUSTERS} blocks (a portable cluster)")

    def check(self, s: Schedule) -> Rejection | None:
        """A vector is a run of consecutive serial elements wholly inside the dim or wholly past its end (one
        guard covers it), aligned and at most 16 bytes (one load or store moves it)."""
        bad = check_values(self)
        if bad is not None:
            return bad
        if self.vector != 1:
            if s.tensor_cores:
                return Rejection("vector.tensor_cores", "vector", "vector applies to CUDA-core kernels; warp-tile "
                                 "kernels load with cp.async and ldmatrix")
            if s.step % (self.lanes * self.vector):
                return Rejection("vector.step", "vector", f"step {s.step} must be a multiple of lanes x vector "
                                 f"({self.lanes} x {self.vector}) so that every lane gets whole vectors")
            size = s.smg.dim_sizes[s.serial]
            if size % self.vector:
                return Rejection("vector.straddles", "vector", f"serial dim {s.serial!r} ({size}) must be a multiple "
                                 f"of vector {self.vector}: a vector may not straddle the end of the dim")
            for name in (*s.smg.inputs, *s.smg.outputs):
                space = s.smg.space(name)
                width = self.vector * np.dtype(space.dtype).itemsize
                # a concatenation's part is walked by the serial dim through its own innermost dim
                if s.smg.inner_read(name)[0] == s.serial and width > MAX_VECTOR_BYTES:
                    return Rejection("vector.width", "vector", f"vector {self.vector} of {name!r} ({space.dtype}) is "
                                     f"{width} bytes; a thread loads at most {MAX_VECTOR_BYTES} at once")
        if self.cluster != 1:
            bad = self._check_cluster(s)
            if bad is not None:
                return bad
        if self.unroll:
            trips = -(-s.step // self.lanes)
            if self.vector != 1 or s.tensor_cores:
                return Rejection("unroll.not_simt_scalar", "unroll", "unroll applies to a CUDA-core kernel's "
                                 "scalar loop (vector 1): vector runs are unrolled already, warp-tile programs by "
                                 "construction")
            if trips > MAX_UNROLL:
                return Rejection("unroll.too_long", "unroll", f"unroll: a lane's loop has {trips} trips per step "
                                 f"(step {s.step} / lanes {self.lanes}); at most {MAX_UNROLL} are unrolled")
        return None

    def _check_cluster(self, s: Schedule) -> Rejection | None:
        """A cluster spreads one row over its blocks: each block is one lane group of whole warps (a tile of one
        element), its lanes scalar, its inputs read from global memory (a tile staged in shared memory would be
        staged by every block of the cluster)."""
        if s.tensor_cores:
            return Rejection("cluster.tensor_cores", "cluster", "cluster applies to CUDA-core reductions; warp-tile "
                             "kernels divide their steps with slices")
        if s.lanes < 32 or math.prod(t for _, t in s.block) != 1:
            return Rejection("cluster.lanes", "cluster", f"cluster: each block must be one row's lane group of whole "
                             f"warps (a block tile of one element, lanes 32+); got tile {dict(s.block)}, lanes "
                             f"{s.lanes}")
        if self.vector != 1 or self.unroll:
            return Rejection("cluster.scalar", "cluster", "cluster: the lanes of a cluster take scalar elements "
                             "(vector 1, no unroll)")
        staged = [n for n, lvl in s.memory if lvl == "shared"]
        if staged:
            return Rejection("cluster.shared", "cluster", f"cluster: {staged} would be staged in shared memory by "
                             f"every block of the cluster; keep them in global memory")
        if not s.plan.states:
            return Rejection("cluster.no_reduction", "cluster", f"cluster shares a row's reductions; "
                             f"{s.smg.name!r} has none")
        return None

    def check_target(self, caps: Capabilities) -> Rejection | None:
        """What the target cannot run: a cluster where it has no thread-block clusters (before sm_90)."""
        if self.cluster != 1 and not caps.clusters:
            return Rejection("cluster.target", "cluster", f"cluster {self.cluster}: thread-block clusters exist on "
                             f"sm_90 and later; the target is {caps.arch or 'not a GPU'}: use cluster 1 for it")
        return None

    def check_tensor_cores(self, s: Schedule) -> Rejection | None:
        if s.tensor_cores and self.lanes != 1:
            return Rejection("lanes.tensor_cores", "lanes", "lanes apply to CUDA-core kernels; tensor-core kernels "
                             "place threads by mma tiles")
        return None


@dataclass(frozen=True)
class WarpTileOptions:
    """Tensor-core warp-tile programs (``schedulers.warp_tile``) on mma.sync or wgmma."""

    stages: int = knob(1, "shared-memory buffers per streamed input tile (the ring's depth)", "stages", lo=1, hi=8,
                       valid="1..8 (shared buffers per streamed tile)", encode="value")
    warps: int = knob(0, "warps per block, each taking rows/16/warps 16-row MMA tiles (0: up to 4)", "warp_mtiles",
                      lo=0)
    split: int = knob(1, "warp groups dividing a block's serial steps (split-K inside the block)", "threads",
                      choices=SPLITS,
                      valid="1, 2, 4 or 8 warp groups")
    slices: int = knob(1, "blocks dividing one row tile's serial steps (split-K across the grid)", "log2_num_blocks",
                       lo=1, hi=32)
    reload_a: bool = knob(False, "re-read the first GEMM's A operand from shared memory every step",
                          "reload_a", encode="flag")
    early_scores: bool = knob(False, "wait for the score tile's operands before the second GEMM's (two groups)",
                              "early_scores", encode="flag")
    lazy_rescale: bool = knob(False, "skip the accumulator rescale while the running max stays within its lag",
                              "lazy_rescale", encode="flag")
    mma_row_sums: bool = knob(False, "sum row statistics that are a second GEMM's factor tile on tensor cores",
                              "mma_row_sums", encode="flag")
    fast_math: bool = knob(False, "tanh and logistics on tanh.approx.f32 where stored in 16 bits",
                           "fast_math", encode="flag")

    def check(self, s: Schedule) -> Rejection | None:
        from schedulers.warp_tile import warp_tile_refusal

        bad = check_values(self)
        if bad is not None and bad.knob != "slices":
            return bad
        if not 1 <= self.slices <= min(32, s.num_steps):
            return Rejection("slices.range", "slices", f"slices {self.slices} must be 1..32 blocks and at most the "
                             f"{s.num_steps} steps of {s.step} along {s.serial!r}")
        if not s.tensor_cores:
            return None  # reported with the Hopper options' (one sentence for both groups)
        p, name = s.warp_tile, s.smg.name
        if p is None and (self.stages != 1 or self.warps or self.split != 1 or self.slices != 1):
            why = warp_tile_refusal(s)  # its code: why there is no program (``warp_tile.*``)
            return Rejection(why.code, None, f"stages/warps/split/slices need a warp-tile program, and {name!r} is "
                             f"not one: {why.sentence}")
        if self.reload_a and (p is None or p.gemm is None):
            return Rejection("reload_a.no_gemm", "reload_a", f"reload_a re-reads the A operand of a warp-tile "
                             f"program's first GEMM (attention's Q @ K^T); {name!r} has no such GEMM")
        if self.early_scores:
            if p is None or not p.gemm_states or (p.gemm is None and not p.tiles_in):
                return Rejection("early_scores.no_scores", "early_scores", f"early_scores waits for a warp-tile "
                                 f"program's score operands before its second GEMM's; {name!r} has no score tile "
                                 f"and second GEMM to wait for apart")
            if self.stages < 2 or self.split != 1:
                return Rejection("early_scores.ring", "early_scores", f"early_scores needs a ring of 2+ stages and "
                                 f"no warp groups (stages {self.stages}, split {self.split}): a mid-step barrier "
                                 f"must be reached by the whole block")
        if self.lazy_rescale and (p is None or not p.lazy):
            return Rejection("lazy_rescale.no_reference", "lazy_rescale", f"lazy_rescale keeps a running max that "
                             f"only references the carried states; {name!r} has none (a max state whose readers "
                             f"rescale exponentially in its change and whose outputs do not change with it)")
        if self.mma_row_sums and (p is None or not p.row_sums):
            return Rejection("mma_row_sums.no_factor", "mma_row_sums", f"mma_row_sums sums a row statistic on "
                             f"tensor cores as a second GEMM's factor tile times ones; {name!r} has no sum state "
                             f"whose body is such a factor (with a per-row carry, and read by no GEMM state)")
        return None

    def check_last(self, s: Schedule) -> Rejection | None:
        """After the Hopper options: a warp-tile program that wgmma could not read is refused as wgmma's
        fault first (the search then drops wgmma and keeps ``fast_math`` on the mma.sync program)."""
        from schedulers.warp_tile import warp_tile_refusal

        if self.fast_math and s.warp_tile is None:
            why = warp_tile_refusal(s)
            return Rejection(why.code, "fast_math", f"fast_math puts a warp-tile kernel's tanh and logistics on "
                             f"tanh.approx.f32; {s.smg.name!r} has no warp-tile program: {why.sentence}")
        return None


@dataclass(frozen=True)
class HopperOptions:
    """Hopper (sm_90a) features of a warp-tile program: warpgroup MMA, TMA, warp specialisation."""

    wgmma: bool = knob(False, "the GEMMs on warpgroup MMA (wgmma.mma_async, swizzled shared tiles)",
                       "wgmma", encode="flag")
    tma: bool = knob(False, "the ring's tiles loaded by the Tensor Memory Accelerator (with wgmma)",
                     "tma", encode="flag")
    producer: bool = knob(False, "a producer warpgroup issues the TMA loads (warp specialisation)",
                          "producer", encode="flag")
    persistent: int = knob(0, "a persistent grid of this many blocks looping over the tiles (0: one per tile)",
                           "persistent", lo=0, encode="flag")
    pingpong: bool = knob(False, "two MMA warpgroups per persistent block taking turns on alternate tiles",
                          "pingpong", encode="flag")

    def check_target(self, caps: Capabilities) -> Rejection | None:
        """What the target cannot run: warpgroup MMA and a producer warpgroup (setmaxnreg) but on sm_90a, TMA
        before sm_90.  (``persistent`` and ``pingpong`` need ``producer``, refused by ``check``.)"""
        for code, name, can, where in (("wgmma.target", "wgmma", caps.wgmma, "sm_90a"),
                                       ("tma.target", "tma", caps.tma, "sm_90 and later"),
                                       ("producer.target", "producer", caps.wgmma, "sm_90a")):
            if getattr(self, name) and not can:
                return Rejection(code, name, f"{name} exists on {where} only; the target is "
                                 f"{caps.arch or 'not a GPU'}: build without {name} for it")
        return None

    def check(self, s: Schedule) -> Rejection | None:
        from schedulers.warp_tile import tma_reason, warp_tile_refusal

        bad = check_values(self)
        if bad is not None:
            return bad
        p, name = s.warp_tile, s.smg.name
        if self.wgmma and p is None:
            why = warp_tile_refusal(s)
            return Rejection(why.code, "wgmma", f"wgmma runs a warp-tile program's GEMMs on warpgroup MMA: "
                             f"{why.sentence}")
        if self.tma:
            why = "it is not a warp-tile program" if p is None else tma_reason(p)
            if why is not None:
                return Rejection("tma.unfit", "tma", f"tma loads the ring of a warp-tile program on warpgroup MMA: a "
                                 f"plain GEMM's tiles (one block per tile), or attention's K/V (or an input on the "
                                 f"score plane); {name!r} with these options cannot: {why}")
        if self.producer and (not self.tma or s.warp.stages < 2):
            return Rejection("producer.needs_tma", "producer", f"producer gives the TMA loads of a wgmma GEMM a "
                             f"warpgroup of their own; it needs tma=True and a ring of 2+ stages (one slot stays with "
                             f"the wgmma in flight); got tma={self.tma}, stages {s.warp.stages}")
        if self.producer and p is not None and not p.wgmma_ss and (p.gemm is None or len(p.gemm_states) != 1):
            return Rejection("producer.shape", "producer", f"producer feeds a plain GEMM (+ epilogue), or a score "
                             f"GEMM per step with one GEMM state after it (attention); {name!r} has "
                             f"{'no score GEMM' if p.gemm is None else f'{len(p.gemm_states)} GEMM states'}")
        if self.producer and p is not None and s.warp.slices != 1:
            return Rejection("producer.slices", "producer", f"producer: the MMA warpgroups of a warp-specialised "
                             f"block meet at named barriers only, and blocks slicing the steps merge through "
                             f"block-wide ones; got slices {s.warp.slices}")
        if self.persistent and not self.producer:
            return Rejection("persistent.needs_producer", "persistent", "persistent blocks loop over the tiles with "
                             "the loads in a producer warpgroup; it needs producer=True")
        if self.persistent and p is not None and not p.wgmma_ss:
            return Rejection("persistent.shape", "persistent", f"persistent blocks loop over a plain GEMM's tiles "
                             f"(+ epilogue); {name!r} has a score GEMM or row states: one block per tile")
        return None

    def check_last(self, s: Schedule) -> Rejection | None:
        """The checks that need the warp-tile options judged first (the pairing and the tile count)."""
        p = s.warp_tile
        if self.pingpong and (not self.persistent or p is None or p.warps != 4):
            return Rejection("pingpong.shape", "pingpong", f"pingpong gives a persistent block (persistent > 0, "
                             f"producer) two MMA warpgroups on alternate tiles of one warpgroup (4 warps) each; got "
                             f"persistent {self.persistent}, {p.warps if p else 0} warps per tile")
        if self.persistent and not 1 <= self.persistent < s.num_tiles:
            return Rejection("persistent.range", "persistent", f"persistent {self.persistent} blocks must be fewer "
                             f"than the {s.num_tiles} tiles (and at least 1)")
        return None


#: the option groups a Schedule holds, by attribute name
GROUPS: dict[str, type] = {"simt": SimtOptions, "warp": WarpTileOptions, "hopper": HopperOptions}
#: knob name -> its group's attribute name
KNOB_GROUP: dict[str, str] = {f.name: g for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}
#: every knob's field, in group order (what the JSON, the search's Knobs and the CLI are derived from)
KNOB_FIELDS: tuple[dataclasses.Field, ...] = tuple(f for cls in GROUPS.values() for f in dataclasses.fields(cls))
#: knobs that only a tensor-core schedule may change from their defaults
TENSOR_CORE_GROUPS = ("warp", "hopper")


def split_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    """Flat knob keywords -> one instance per group (defaults for the rest); an unknown name is an error
    that lists the known ones.  The groups are immutable, so the same keywords give the same instances
    (cached by each value with its type: the search makes tens of thousands of schedules of a few dozen)."""
    try:
        key = tuple((k, type(v), v) for k, v in knobs.items())
        hash(key)
    except TypeError:
        return _split_knobs(knobs)
    got = _SPLIT.get(key)
    if got is None:
        got = _SPLIT[key] = _split_knobs(knobs)
    return dict(got)


#: split_knobs by its keywords (each with its type)
_SPLIT: dict[tuple, dict[str, Any]] = {}


def _split_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    from schedulers.errors import ScheduleError

    unknown = sorted(set(knobs) - set(KNOB_GROUP))
    if unknown:
        raise ScheduleError(f"unknown schedule option {unknown[0]!r}; options are {sorted(KNOB_GROUP)}",
                            code="option.unknown")
    fields = {f.name: f for f in KNOB_FIELDS}
    return {g: cls(**{k: _coerce(fields[k], v) for k, v in knobs.items() if KNOB_GROUP[k] == g})
            for g, cls in GROUPS.items()}


def non_defaults(group: Any) -> dict[str, Any]:
    """The knobs of ``group`` that differ from their defaults (what the schedule JSON records)."""
    key = _typed(group)
    if key is None:
        return {n: getattr(group, n) for n in _changed(group)}
    got = _NON_DEFAULTS.get(key)
    if got is None:
        got = _NON_DEFAULTS[key] = {n: getattr(group, n) for n in _changed(group)}
    return dict(got)


#: non_defaults by ``_typed`` key
_NON_DEFAULTS: dict[tuple, dict[str, Any]] = {}


def needs_tensor_cores(s: Schedule) -> Rejection | None:
    """Every warp-tile and Hopper knob left at its default unless the schedule runs on tensor cores."""
    if s.tensor_cores:
        return None
    if any(_changed(getattr(s, g)) for g in TENSOR_CORE_GROUPS):
        return Rejection("options.need_tensor_cores", None, "stages, warps, split, slices, reload_a, early_scores, "
                         "lazy_rescale, mma_row_sums, wgmma and tma apply to tensor-core warp-tile kernels "
                         "(tensor_cores=True), as do producer, persistent, pingpong and fast_math")
    return None

