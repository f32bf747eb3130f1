"""The search space: every choice the slicers and the lowering leave open, and
resource-aware pruning against a hardware model (analysis only, no GPU).

The slicing choices are enumerated here: the serial dim (each one the temporal
slicer accepts), block tiles per spatially cut dim (powers of two, one thread per
tile element, or fewer elements whose threads are lanes; for tensor cores whole
MMA tiles up to 256, 192-column ones on small grids, row tiles padding a short
dim, folded dims), the thread dim, the serial step (multiples of 16 for tensor
cores), whether each stageable input is staged in shared memory, whether each
block-shared streamed tile is computed cooperatively or per thread, and -- on
request -- cuts that recompute an intermediate.  The knobs are not listed here:
each knob's declaration (``schedulers.options``) says what the search offers at a
point (the graph's forms, the hardware, the block and step, the knobs before it),
and each slicing choice gets the product over those offers (``search.walk``):
``lanes`` and ``vector`` for CUDA-core kernels, the warp-tile and Hopper knobs for
fp16/bf16 graphs whose plan is a warp-tile program (attention, softmax-GEMM,
GEMM + epilogue) or a GEMM + epilogue on TVM's WMMA tensorizer.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, make_dataclass
from functools import cached_property

from schedulers.errors import ScheduleError
from schedulers.hardware import HardwareError, HardwareModel
from schedulers.knobs import Rejection
from schedulers.options import (
    GEMM_STAGES,
    KNOB_FIELDS,
    MORE_SLICES,
    SEARCH_LANES,
    SEARCH_SLICES,
    SEARCH_SPLITS,
    SEARCH_STAGES,
    SEARCH_WARPS,
    WIDE_LANES,
    HopperOptions,
)
from schedulers.resources import check_resources
from schedulers.schedule import Schedule, blocking, make_schedule
from schedulers.spatial import analyse_spatial, elementwise_serial
from schedulers.temporal import plan_temporal
from schedulers.tensorcore_fit import plan_refusal
from schedulers.warp_tile import gemm_with_statistics, program_checks, program_form
from search.walk import SIMT_WALK, TENSOR_CORE_WALK, walk
from smg.fold import fold_dims, foldable
from smg.ir import SMG, itemsize

# The H100 measurements behind the choices below (tiles, folds): docs/tuning.md, "Why the search space looks as it
# does".  What the search offers of each knob is declared with the knob (``schedulers.options``, ``knob(offer=)``).
#: the deep rings and the 192-column tiles are offered for grids of at most this many waves of one block per
#: SM, where a block alone must keep its loads in flight (BERT's and ViT's GEMMs: 48-208 tiles); on
#: LLaMA's 2048-row GEMMs (700-2800 tiles) the analytical model preferred them and they measured slower
DEEP_WAVES = 2
#: largest tensor-core tile per dim the search tries (wgmma's N; two 64-row halves per warpgroup)
TC_MAX_TILE = 256
#: tensor-core tiles besides the powers of two: 192 columns (three 64-column swizzle atoms) fill the
#: H100's 132 SMs where 128 or 256 leave a partial wave (BERT's FFN input GEMM, 1024 x 3072: 128
#: blocks of 128 x 192 beat the best power-of-two tile)
TC_EXTRA_TILES = (192,)
#: the search folds a broadcast pair of dims into one row dim (``smg.fold``) where the inner one is
#: shorter than this: a warpgroup's 64 MMA rows (a GQA decoder's single query row per head)
FOLD_BELOW = 64
#: row tiles padding a dim shorter than them: one mma.sync tile, one warpgroup
PADDED_TILES = (16, 64)


#: given a graph's tensor-core candidates, why its CUDA-core ones need not be enumerated (or None)
SimtVeto = Callable[[list[Schedule]], "str | None"]


def _pow2_upto(n: int, lo: int = 1) -> list[int]:
    out, v = [], lo
    while v <= n:
        out.append(v)
        v *= 2
    if n not in out and n >= lo:
        out.append(n)  # the whole dim (row on chip), also when not a power of two
    return out


#: One point of the space; ``SearchSpace._schedule`` turns it into a Schedule.  Its fields are the
#: slicing choices then every knob of ``schedulers.options``' groups, derived from them (not listed again).
Knobs = make_dataclass("Knobs", [
    ("tiles", tuple[tuple[str, int], ...]), ("serial", str), ("step", int), ("thread_dim", str),
    ("levels", tuple[tuple[str, str], ...], field(default=())), ("recompute", bool, field(default=False)),
    ("tensor_cores", bool, field(default=False)),
    *((f.name, f.type, field(default=f.default)) for f in KNOB_FIELDS)], frozen=True)
Knobs.__module__, Knobs.__doc__ = __name__, "One point of the space: the slicing choices, then every knob."

_DEFAULTS = {f.name: f.default for f in KNOB_FIELDS}
#: knobs offered where they may apply and dropped, one at a time, where the schedule refuses them (declared
#: ``knob(droppable=True)``)
DROPPABLE = tuple(f.name for f in KNOB_FIELDS if f.metadata["droppable"])


@dataclass
class SpaceReport:
    """How large the space is at each stage of pruning, and why candidates went."""

    total: int = 0
    valid: int = 0
    fits: int = 0
    #: refusals by code (``schedulers.codes``), counted per knob set
    pruned: dict[str, int] = field(default_factory=dict)
    skipped: str = ""  # why the CUDA-core points were not enumerated at all
    #: serial dims along which the graph has no tensor-core form, with the code of why (found once per graph:
    #: no tensor-core knob set is enumerated along them)
    no_form: dict[str, str] = field(default_factory=dict)
    #: serial dims along which it has a GEMM + epilogue form but no warp-tile program, with the code of why (no
    #: knob set asking for a program -- stages, warps, split, slices, a producer -- is enumerated along them)
    no_program: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        why = ", ".join(f"{k}: {v}" for k, v in sorted(self.pruned.items(), key=lambda kv: -kv[1]))

        def along(forms: dict[str, str]) -> str:
            return ", ".join(f"along {d!r}: {c}" for d, c in forms.items())

        return (f"search space: {self.total} points, {self.valid} valid schedules, {self.fits} fit the hardware"
                + (f" (pruned: {why})" if why else "") + (f"; CUDA-core points skipped: {self.skipped}"
                                                          if self.skipped else "")
                + (f"; no tensor-core form ({along(self.no_form)}): none enumerated" if self.no_form else "")
                + (f"; no warp-tile program ({along(self.no_program)}): GEMM + epilogue points only"
                   if self.no_program else ""))


class SearchSpace:
    """Enumerates candidate schedules of ``smg`` for ``hw``."""

    def __init__(self, smg: SMG, hw: HardwareModel, *, recompute: bool = False, max_step: int | None = None,
                 min_threads: int = 32, tensor_cores: bool = True, cuda: bool = True, fast_math: bool = False) -> None:
        self.smg, self.hw, self.recompute = smg, hw, recompute
        self.fast_math = fast_math  # tensor-core candidates with tanh.approx transcendentals (a user's choice)
        self.cuda = cuda and hw.kind == "gpu"  # False: the kernels are built for llvm (the CPU)
        self.tensor_cores = tensor_cores and self.cuda  # no CPU form of mma.sync
        self.max_step = max_step
        self.min_threads = min_threads
        self.report = SpaceReport()

    @cached_property
    def serials(self) -> tuple[str, ...]:
        row = elementwise_serial(self.smg)
        if row is not None:  # no op reduces: the rows' dim, streamed whole by each block
            return (row,)
        cut = {d.dim for d in analyse_spatial(self.smg) if d.cut}
        out = []
        for d in self.smg.dims:
            if d.name in cut or not any(d.name in op.reduce for op in self.smg.ops):
                continue
            try:
                plan_temporal(self.smg, d.name)
                out.append(d.name)
            except ScheduleError:
                continue
        if not out:
            raise ScheduleError(f"no reduced dim of {self.smg.name!r} can be sliced temporally",
                                code="serial.unsliceable")
        return tuple(out)

    @cached_property
    def cut_dims(self) -> tuple[str, ...]:
        return tuple(d.dim for d in analyse_spatial(self.smg) if d.cut or (self.recompute and d.recomputes))

    @cached_property
    def block_threads_floor(self) -> int:
        """Fewest threads a CUDA-core block may have: ``min_threads``, or every tile element of a
        graph with fewer."""
        sizes = self.smg.dim_sizes
        return min(self.min_threads, self.hw.max_threads_per_block, math.prod(sizes[d] for d in self.cut_dims))

    def tilings(self) -> Iterator[dict[str, int]]:
        """Block tiles of one thread per element, or of fewer elements whose threads are made up by
        lanes (a row per warp: ``{m: 1}`` x 32 lanes); ``knobs`` checks each lane count's threads."""
        sizes = self.smg.dim_sizes
        limit = self.hw.max_threads_per_block
        opts = [_pow2_upto(min(sizes[d], limit)) for d in self.cut_dims]
        floor = max(1, self.block_threads_floor // max(SEARCH_LANES))
        for combo in itertools.product(*opts):
            threads = math.prod(combo)
            if threads <= limit and threads >= floor:
                yield dict(zip(self.cut_dims, combo))

    def knobs(self, simt: bool = True, tc: bool = True) -> Iterator[Knobs]:
        """The space's points: CUDA-core ones (``simt``) and tensor-core ones (``tc``).  The slicing choices
        (serial dim, tiles, thread dim, step) are enumerated here; the knobs are a product over their declared
        offers (``search.walk``) at the facts of each slicing (``facts`` and the per-serial, -tile and -step ones)."""
        sizes = self.smg.dim_sizes
        tc = tc and self.tensor_cores and self.tensor_core_dtypes
        for serial in self.serials:
            tc_here = tc and (not self.analyse_forms or None in self.forms[serial])
            steps = _pow2_upto(min(sizes[serial], self.max_step or sizes[serial]), lo=min(8, sizes[serial]))
            if sizes[serial] not in steps:
                steps.append(sizes[serial])
            along = self._serial_facts(serial)
            for tiles in self.tilings():
                movers = [d for d, t in tiles.items() if t > 1] or list(tiles)
                threads = math.prod(tiles.values())
                facts = along | self._tile_facts(tiles)
                for thread_dim, step in itertools.product(movers, steps) if simt else ():
                    for values in walk(SIMT_WALK, facts | self._step_facts(serial, step)):
                        base = Knobs(tuple(tiles.items()), serial, step, thread_dim, (), self.recompute, False,
                                     *values)
                        yield from self._level_variants(base)
                # whole MMA tiles (16 x 16, or WMMA's 8 x 32) along every dim a block spans: the warp-tile
                # programs refuse the rest and TVM's WMMA tensorizer pads them (they were half of a GEMM's
                # tensor-core points, 3 s of its search)
                if (tc_here and len(movers) <= 2 and max(tiles.values()) >= 16
                        and all(tiles[d] % 8 == 0 for d in movers) and threads >= self.block_threads_floor):
                    yield from self._tc_knobs(serial, steps, tiles, movers, facts)
            if tc_here:  # warp-tile blocks larger than a thread each
                for tiles in self.tc_tilings():
                    yield from self._tc_knobs(serial, steps, tiles, [d for d, t in tiles.items() if t > 1],
                                              along | self._tile_facts(tiles))

    def tc_tilings(self) -> Iterator[dict[str, int]]:
        """Tensor-core tiles that the thread-per-element tilings miss: one or two cut dims of 16..256
        (the rest 1) whose product is above the thread limit (a warp-tile block has 32 threads per
        warp whatever its tile: the GEMM's 128 x 128)."""
        sizes, limit = self.smg.dim_sizes, self.hw.max_threads_per_block
        for movers in itertools.chain(itertools.combinations(self.cut_dims, 1),
                                      itertools.combinations(self.cut_dims, 2)):
            opts = [[t for t in (*_pow2_upto(min(sizes[d], TC_MAX_TILE)), *TC_EXTRA_TILES) if 16 <= t <= sizes[d]]
                    for d in movers]
            for combo in itertools.product(*opts):
                tiles = {d: dict(zip(movers, combo)).get(d, 1) for d in self.cut_dims}
                if any(t in TC_EXTRA_TILES for t in combo) and not self._small_grid(tiles):
                    continue
                if math.prod(combo) > limit:
                    yield tiles
        ins = [self.smg.space(n).dims for n in self.smg.inputs]
        for d in self.cut_dims:  # GEMM rows (an input lacks them) fewer than an MMA tile: one padded tile
            if not any(d not in x for x in ins):
                continue
            if sizes[d] < PADDED_TILES[0] or (sizes[d] < PADDED_TILES[-1] and sizes[d] % 16):
                for t in (t for t in PADDED_TILES if t > sizes[d]):
                    yield {c: t if c == d else 1 for c in self.cut_dims}
            elif sizes[d] in PADDED_TILES:  # exactly one such tile (an MQA decoder's group of 16 query heads),
                yield {c: sizes[d] if c == d else 1 for c in self.cut_dims}  # below the per-element tilings' floor

    def _blocks(self, tiles: dict[str, int]) -> int:
        """Blocks of a grid of ``tiles`` (one per tile of the cut dims)."""
        return math.prod(-(-self.smg.dim_sizes[d] // t) for d, t in tiles.items())

    def _small_grid(self, tiles: dict[str, int]) -> bool:
        """Whether ``tiles`` make at most ``DEEP_WAVES`` waves of one block per SM (deep rings, 192 tiles)."""
        return self._blocks(tiles) <= DEEP_WAVES * self.hw.num_sms

    def _tc_knobs(self, serial: str, steps: list[int], tiles: dict[str, int], movers: list[str],
                  facts: dict[str, object]) -> Iterator[Knobs]:
        """Tensor-core points of a block: steps of whole MMA k slices (16), each with the product over the
        warp-tile and Hopper knobs' offers."""
        for step in (s for s in steps if s % 16 == 0):
            for values in walk(TENSOR_CORE_WALK, facts | self._step_facts(serial, step)):
                yield Knobs(tuple(tiles.items()), serial, step, movers[-1], (), self.recompute, True, *values)

    @cached_property
    def facts(self) -> dict[str, object]:
        """The facts of the graph and the hardware that the knobs' offers read (``schedulers.knobs.Where``)."""
        return {"cuda": self.cuda, "hopper": self.hopper, "fast_math_asked": self.fast_math,
                "analyse_forms": self.analyse_forms, "num_sms": self.hw.num_sms,
                "max_threads": self.hw.max_threads_per_block,
                "widest_item": max(itemsize(self.smg.space(n).dtype)
                                   for n in (*self.smg.inputs, *self.smg.outputs)),
                "one_reduction": self.one_reduction, "running_max": self.running_max, "row_sum": self.row_sum,
                "gathers": self.gathers, "threads_floor": self.block_threads_floor}

    def _serial_facts(self, serial: str) -> dict[str, object]:
        """The facts along ``serial``: its extent, the other dims reduced with it (lanes spread over a step's
        positions times these: ``schedule.lane_spread``; a split's stats kernel, 16 chunks x 20 channels, a step
        of 16 or 20), whether the graph has no warp-tile program along it (``forms``), and whether the first GEMM
        runs per step (attention's scores)."""
        sizes = self.smg.dim_sizes
        others = math.prod(sizes[d] for d in {d for op in self.smg.ops if serial in op.reduce
                                               for d in op.reduce} - {serial})
        return self.facts | {"serial_size": sizes[serial], "others": others,
                             "no_program": self.analyse_forms and self.tensor_cores and self.tensor_core_dtypes
                             and self.forms[serial][0] is not None,
                             "gemm_per_step": bool(self.first_gemm) and serial not in self.first_gemm}

    def _tile_facts(self, tiles: dict[str, int]) -> dict[str, object]:
        return {"blocks": self._blocks(tiles), "small_grid": self._small_grid(tiles),
                "threads": math.prod(tiles.values())}

    def _step_facts(self, serial: str, step: int) -> dict[str, object]:
        return {"step": step, "steps": -(-self.smg.dim_sizes[serial] // step)}

    @cached_property
    def hopper(self) -> bool:
        """Whether the target runs warpgroup MMA, TMA and a producer warpgroup (sm_90a), as the Hopper options'
        own ``check_target`` says for ``hw.capabilities()``: the offers of ``wgmma``, ``tma`` and ``producer`` are
        off for another target (no such knob set is enumerated there)."""
        return HopperOptions(wgmma=True, tma=True, producer=True).check_target(self.hw.capabilities()) is None

    #: derive the graph's forms once (``forms``) and leave out the knob sets they refuse whatever else they hold
    #: (the offers read it as ``analyse_forms``); off only to check that the search is the same with it
    #: (tests/test_space_prefilter.py)
    analyse_forms: bool = True

    @cached_property
    def forms(self) -> dict[str, tuple[Rejection | None, Rejection | None]]:
        """Per serial dim, why the graph has no warp-tile program along it whatever the block and knobs
        (``warp_tile.program_form``: a second pass, the dtypes, no state that could be a GEMM) and why no GEMM +
        epilogue (``tensorcore_fit.plan_refusal``); None where it may have one.  Derived once per graph: along a
        dim with neither ``knobs`` enumerates no tensor-core knob set (a LayerNorm's were each refused for the one
        reason), and along one with no program no knob set that asks for one (``_tc_knobs``)."""
        out = {}
        for serial in self.serials:
            plan = plan_temporal(self.smg, serial)
            out[serial] = (program_form(self.smg, plan, serial), plan_refusal(self.smg, plan, serial))
        return out

    @cached_property
    def one_reduction(self) -> bool:
        """Whether the graph reduces once (a plain GEMM + epilogue), or only in GEMMs of its inputs (several
        sharing their A: LLaMA's gated MLP input ``silu(X @ Wg) * (X @ Wu)``): the search offers ``tma`` and
        the producer variants there (on, like ``wgmma``: faster for the 8192^2 x 1024 GEMM) and not for
        attention, whose K/V ring it also loads but where it measured a wash on the H100 (docs/tuning.md,
        'Why the search space looks as it does')."""
        reductions = [op for op in self.smg.ops if op.reduce]
        return len(reductions) == 1 or bool(reductions) and all(
            op.combiner == "sum" and len(op.inputs) == 2 and all(a.space in self.smg.inputs for a in op.inputs)
            for op in reductions) or any(  # or a GEMM beside a norm's row statistics (its prologue)
            gemm_with_statistics(self.smg, plan_temporal(self.smg, s)) for s in self.serials)

    @cached_property
    def gathers(self) -> bool:
        """Whether an op reads an input through an index expression (a convolution's im2col view)."""
        return any(not a.plain for op in self.smg.ops for a in op.inputs)

    @cached_property
    def running_max(self) -> bool:
        """Whether an op is a max reduction (a candidate reference for ``lazy_rescale``; make_schedule
        decides with the derived update functions)."""
        return any(op.combiner == "max" and op.reduce for op in self.smg.ops)

    @cached_property
    def row_sum(self) -> bool:
        """Whether an op sums one computed tile over a dim (attention's row sum of P): a candidate for
        ``mma_row_sums``, which is offered on, not searched both ways (it won or tied on every harness
        workload, measured: docs/tuning.md, 'Why the search space looks as it does'; and doubling the
        space doubles its enumeration); where make_schedule finds no such state it is left off."""
        return any(op.combiner == "sum" and op.reduce and len(op.inputs) == 1 for op in self.smg.ops)

    @cached_property
    def first_gemm(self) -> tuple[str, ...]:
        """The dims the first op reduces when it is a product of two inputs (attention's Q @ K^T):
        when the serial dim is not one of them, it runs once per step (not over the steps)."""
        op = self.smg.ops[0] if self.smg.ops else None
        if op is None or op.combiner != "sum" or len(op.inputs) != 2 or not op.reduce:
            return ()
        return op.reduce if all(a.space in self.smg.inputs for a in op.inputs) else ()

    @cached_property
    def tensor_core_dtypes(self) -> bool:
        return all(self.smg.space(n).dtype in ("float16", "bfloat16") for n in self.smg.inputs)

    def _level_variants(self, k: Knobs) -> Iterator[Knobs]:
        try:
            s = self._schedule(k)
        except ScheduleError:
            yield k  # counted as invalid by ``candidates``
            return
        shared = [n for n, lvl in s.memory if lvl == "shared"]
        for alt in itertools.product((False, True), repeat=len(shared)):
            levels = tuple((n, "global" if n in s.smg.inputs else "register") for n, a in zip(shared, alt) if a)
            yield dataclasses.replace(k, levels=levels)

    def _schedule(self, k: Knobs) -> Schedule:
        """The schedule of ``k``; a knob offered where it may apply (``DROPPABLE``) is dropped, one at a
        time, where make_schedule refuses it (by the rejection's knob, never its sentence)."""
        knobs = {f.name: getattr(k, f.name) for f in KNOB_FIELDS}
        while True:
            try:
                return make_schedule(self.smg, dict(k.tiles), serial=k.serial, step=k.step,
                                     thread_dim=k.thread_dim, recompute=k.recompute, hw=self.hw,
                                     levels=dict(k.levels), tensor_cores=k.tensor_cores, **knobs)
            except ScheduleError as e:
                if e.knob not in DROPPABLE or knobs[e.knob] == _DEFAULTS[e.knob]:
                    raise
                knobs[e.knob] = _DEFAULTS[e.knob]

    @cached_property
    def folds(self) -> tuple[tuple[str, str], ...]:
        """Dim pairs whose fold (``smg.fold``) the search offers besides the graph as given: an input
        reaches both One-to-All (K/V along a GQA group and its query rows, so one block's rows share
        its tiles) and the inner dim is shorter than a warpgroup's rows (folding longer ones only
        renames rows the tiles already fill); tensor-core targets only."""
        if not self.tensor_cores:
            return ()
        sizes, ins = self.smg.dim_sizes, [self.smg.space(n) for n in self.smg.inputs]
        return tuple((o, i) for o, i in foldable(self.smg)
                     if sizes[i] < FOLD_BELOW and any(o not in x.dims and i not in x.dims for x in ins))

    def folded(self) -> list[SearchSpace]:
        """The search spaces of the folded graphs, one per offered fold (their schedules carry the
        folded SMG: the same memory seen with one dim fewer)."""
        return [SearchSpace(fold_dims(self.smg, o, i), self.hw, recompute=self.recompute, max_step=self.max_step,
                            min_threads=self.min_threads, tensor_cores=self.tensor_cores, cuda=self.cuda,
                            fast_math=self.fast_math) for o, i in self.folds]

    def candidates(self, skip_simt: SimtVeto | None = None) -> list[Schedule]:
        """Valid schedules that fit ``hw``, of the graph and of its offered folds; ``self.report``
        counts what was pruned and why.  ``skip_simt``, given the tensor-core candidates, may veto
        enumerating the CUDA-core ones (returning why): on a GEMM of 1024 rows they are 96% of the
        space and never rank near the tensor cores."""
        out = {s.key: s for s in self._candidates(skip_simt)}
        for sub in self.folded():
            out.update((s.key, s) for s in sub.candidates(skip_simt))
            self.report.total += sub.report.total
            self.report.valid += sub.report.valid
            for why, n in sub.report.pruned.items():
                self.report.pruned[why] = self.report.pruned.get(why, 0) + n
            for d, code in sub.report.no_form.items():
                self.report.no_form.setdefault(d, code)
            for d, code in sub.report.no_program.items():
                self.report.no_program.setdefault(d, code)
        self.report.fits = len(out)
        return list(out.values())

    def _candidates(self, skip_simt: SimtVeto | None = None) -> list[Schedule]:
        rep = self.report = SpaceReport()
        if self.tensor_cores and self.tensor_core_dtypes and self.analyse_forms:
            for d, (program, wmma) in self.forms.items():  # counted by the warp-tile reading's code
                if program is not None:
                    (rep.no_form if wmma is not None else rep.no_program)[d] = program.code
        out: dict[str, Schedule] = {}
        self._add(self.knobs(simt=False), out)
        why = skip_simt(list(out.values())) if skip_simt is not None and out else None
        if why:
            rep.skipped = why
        else:
            self._add(self.knobs(tc=False), out)
        rep.fits = len(out)
        return list(out.values())

    #: refuse a tensor-core knob set without building its Schedule where it has no warp-tile program
    #: (``_no_program``); off only to check that the search is the same with it (tests/test_space_prefilter.py)
    prefilter: bool = True

    def _no_program(self, k: Knobs) -> str | None:
        """The code ``make_schedule`` refuses ``k`` with, where that is certain before building it: a
        tensor-core knob set that asks for a warp-tile program (stages, warps, split or slices) whose program
        ``warp_tile.program_checks`` refuses.  ``make_schedule`` then refuses it whatever else it holds (by
        ``tile.padded``, or for want of a program with the code of ``program_checks``' refusal: neither drops a
        knob and tries again), so the candidates are those the search built before; it cost a third of a GEMM's
        first pick to build 18,000 such schedules and refuse each.  None: build it and see."""
        if not (self.prefilter and k.tensor_cores and (k.stages != 1 or k.warps or k.split != 1 or k.slices != 1)):
            return None
        try:
            _, _, block = blocking(self.smg, dict(k.tiles), k.thread_dim, k.recompute, True)
            plan = plan_temporal(self.smg, k.serial)
            program_checks(self.smg, plan, k.serial, block, k.step, k.warps, k.split, k.slices, k.wgmma,
                           k.early_scores)
            return None
        except ScheduleError as e:
            code = e.code
        sizes = self.smg.dim_sizes
        return "tile.padded" if any(t > sizes[d] for d, t in block) else code

    def _add(self, knobs: Iterator[Knobs], out: dict[str, Schedule]) -> None:
        """Build each knob's schedule into ``out`` (by key) if it is valid and fits; count the rest."""
        rep = self.report
        for k in knobs:
            rep.total += 1
            code = self._no_program(k)
            if code is not None:
                rep.pruned[code] = rep.pruned.get(code, 0) + 1
                continue
            try:
                s = self._schedule(k)
            except ScheduleError as e:
                rep.pruned[e.code] = rep.pruned.get(e.code, 0) + 1
                continue
            rep.valid += 1
            try:
                check_resources(s, self.hw)
            except HardwareError as e:
                rep.pruned[e.code] = rep.pruned.get(e.code, 0) + 1
                continue
            out.setdefault(s.key, s)

    def describe(self) -> str:
        return (f"{self.report}\n  knobs: serial {list(self.serials)}, cut dims {list(self.cut_dims)}, "
                f"steps up to {self.max_step or 'the dim'}, lanes {list(SEARCH_LANES)} (and {list(WIDE_LANES)} "
                f"for grids leaving most SMs idle), vectors of one element or 16 bytes on the GPU, "
                f"staging/cooperative choices per shared space, tensor-core warp tiles "
                f"(stages {list(SEARCH_STAGES)}, for GEMMs also {list(GEMM_STAGES)}, warps {list(SEARCH_WARPS)}, split "
                f"{list(SEARCH_SPLITS)} (none with wgmma), slices {list(SEARCH_SLICES)} (up to "
                f"{MORE_SLICES[-1]} for the smallest) for grids smaller than the SMs, A fragments held or reloaded) "
                f"where the plan is one"
                + (f"; also over the graph with {', '.join(f'{o}*{i}' for o, i in self.folds)} folded into one row "
                   f"dim" if self.folds else ""))

