"""The search space: every choice the slicers and the lowering leave open, and
resource-aware pruning against a hardware model (analysis only, no GPU).

Knobs: the serial dim (each one the temporal slicer accepts), block tiles per
spatially cut dim (powers of two, one thread per tile element), the thread
dim (which cut dim is fastest across threads), the serial step, whether each
stageable input is staged in shared memory, whether each block-shared streamed
tile is computed cooperatively or per thread, and -- on request -- cuts that
recompute an intermediate.  For fp16/bf16 graphs whose plan is a warp-tile
program (schedulers.warp_tile: attention, softmax-GEMM, GEMM + epilogue) the
tensor-core variants add the cp.async pipeline depth (stages), the warps per
block and the warp groups splitting the serial steps -- or, for grids too small
to fill the SMs, blocks slicing them; their steps are multiples of 16.  On the
GPU the CUDA-core kernels also choose a vector width (consecutive serial
elements per load/store of a lane) and the lanes sharing each row's
reductions; a block's threads are its tile elements times its lanes, so a tile
of one or a few rows is offered where lanes make up the block (a row per warp,
as a hand-written norm kernel has it, for grids that fill the SMs).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, make_dataclass
from functools import cached_property

import numpy as np

from schedulers.errors import ScheduleError
from schedulers.hardware import HardwareError, HardwareModel
from schedulers.options import KNOB_FIELDS, MAX_VECTOR_BYTES, HopperOptions, Rejection
from schedulers.resources import check_resources
from schedulers.schedule import Schedule, blocking, make_schedule
from schedulers.spatial import analyse_spatial, elementwise_serial
from schedulers.temporal import plan_temporal
from schedulers.tensorcore_fit import plan_refusal
from schedulers.warp_tile import gemm_with_statistics, program_checks, program_form, wgmma_knobs_refusal
from smg.fold import fold_dims, foldable
from smg.ir import SMG

# The H100 measurements behind the choices below (stages, slices, tiles, the FlashAttention-3 variants, the
# knobs offered on): docs/tuning.md, "Why the search space looks as it does".
LANES = (1, 8, 32, 128)  # threads sharing one tile element's serial reductions (128: four warps)
#: more lanes where the grid leaves most SMs idle (a GroupNorm at batch 2: 64 rows of 10240+ elements)
WIDE_LANES = (512, 1024)
STAGES = (1, 2, 3)  # tensor-core warp-tile programs: shared buffers per streamed tile
#: deeper rings offered for GEMMs (their ring holds only the A and B tiles), in blocks taking all of a
#: row tile's steps or half: a deep K (BERT's and ViT's FFN output GEMMs, K = 3072) ran faster on 6
#: stages than on 3 stages in 4 slices
GEMM_STAGES = (4, 6)
PRODUCER_STAGES = (2, 3, 4)  # a producer warpgroup's TMA ring (it needs 2+)
DEEP_PRODUCER_STAGES = (6, 8)  # and deeper (8 for BERT's FFN output GEMM)
#: the deep rings and the 192-column tiles are offered for grids of at most this many waves of one block
#: per SM, where a block alone must keep its loads in flight (BERT's and ViT's GEMMs: 48-208 tiles); on
#: LLaMA's 2048-row GEMMs (700-2800 tiles) the analytical model preferred them and they measured slower
DEEP_WAVES = 2
WARPS = (0, 8)  # 0: up to 4 warps (FlashAttention-2's default); 8: more warps per row tile
SPLITS = (1, 4)  # warp groups dividing a block's serial steps (merged through the derived carries)
SLICES = (2, 4, 8)  # blocks dividing a row tile's steps, offered when the grid cannot fill the SMs
#: more slices where even 8 leave the SMs short (a GQA decoder's few kv heads at one sequence: 8 row
#: tiles x 8 slices stayed behind cuDNN's time), up to this many blocks per SM in all
MORE_SLICES, SLICED_BLOCKS_PER_SM = (16, 32), 4
#: an implicit GEMM's slices of up to this many blocks also get a 4-deep ring: SD 1.5 UNet's 8x8 convs (128 rows,
#: 11520-23040 steps of reduction) ran 19-26% faster in 8 slices on 4 stages than on 3, whose wgmma group in
#: flight leaves the loads a single step ahead (experiments/tuning/unet_convs_h100.json)
SLICED_DEEP_MAX = 8
#: the serial extent from which the search offers attention's warp-specialised (FlashAttention-3)
#: variants: one block of 384 threads per SM pays each block's ring fill alone, which long rows
#: amortise (LLaMA's 2048) and short ones do not (BERT's 512, ViT's 197), where the cost model puts
#: them level
FA3_MIN_SERIAL = 1024
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
#: knobs offered where they may apply and dropped, one at a time, where the schedule refuses them
DROPPABLE = ("mma_row_sums", "wgmma", "tma", "producer", "persistent", "pingpong", "fast_math")


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
        floor = max(1, self.block_threads_floor // max(LANES))
        for combo in itertools.product(*opts):
            threads = math.prod(combo)
            if threads <= limit and threads >= floor:
                yield dict(zip(self.cut_dims, combo))

    def knobs(self, simt: bool = True, tc: bool = True) -> Iterator[Knobs]:
        """The space's points: CUDA-core ones (``simt``) and tensor-core ones (``tc``)."""
        sizes = self.smg.dim_sizes
        tc = tc and self.tensor_cores and self.tensor_core_dtypes
        for serial in self.serials:
            tc_here = tc and (not self.analyse_forms or None in self.forms[serial])
            steps = _pow2_upto(min(sizes[serial], self.max_step or sizes[serial]), lo=min(8, sizes[serial]))
            if sizes[serial] not in steps:
                steps.append(sizes[serial])
            # the dims reduced with the serial one: lanes spread over a step's positions times these
            # (``schedule.lane_spread``; a split's stats kernel: 16 chunks x 20 channels a step of 16 or 20)
            others = math.prod(sizes[d] for d in {d for op in self.smg.ops if serial in op.reduce
                                                  for d in op.reduce} - {serial})
            for tiles in self.tilings():
                movers = [d for d, t in tiles.items() if t > 1] or list(tiles)
                threads = math.prod(tiles.values())
                lanes_here = LANES + (WIDE_LANES if 2 * self._blocks(tiles) <= self.hw.num_sms else ())
                simt_points = itertools.product(movers, steps, lanes_here, self.vectors) if simt else ()
                for thread_dim, step, lanes, vec in simt_points:
                    if lanes > step * (others if vec == 1 else 1) or (
                            vec > 1 and (step % (lanes * vec) or sizes[serial] % vec)):
                        continue
                    if not self.block_threads_floor <= threads * lanes <= self.hw.max_threads_per_block:
                        continue
                    base = Knobs(tuple(tiles.items()), serial, step, thread_dim, (), self.recompute, lanes=lanes,
                                 vector=vec)
                    yield from self._level_variants(base)
                # whole MMA tiles (16 x 16, or WMMA's 8 x 32) along every dim a block spans: the warp-tile
                # programs refuse the rest and TVM's WMMA tensorizer pads them (they were half of a GEMM's
                # tensor-core points, 3 s of its search)
                if (tc_here and len(movers) <= 2 and max(tiles.values()) >= 16
                        and all(tiles[d] % 8 == 0 for d in movers) and threads >= self.block_threads_floor):
                    yield from self._tc_knobs(serial, steps, tiles, movers)
            if tc_here:  # warp-tile blocks larger than a thread each
                for tiles in self.tc_tilings():
                    yield from self._tc_knobs(serial, steps, tiles, [d for d, t in tiles.items() if t > 1])

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

    def _tc_knobs(self, serial: str, steps: list[int], tiles: dict[str, int], movers: list[str]) -> Iterator[Knobs]:
        sizes = self.smg.dim_sizes
        steps16 = [s for s in steps if s % 16 == 0]
        blocks = self._blocks(tiles)
        parts = [(sp, 1) for sp in self.splits]
        if blocks < self.hw.num_sms:  # too few row tiles: slices of the steps make more blocks
            parts += [(1, sl) for sl in SLICES]
            parts += [(1, sl) for sl in MORE_SLICES if blocks * sl <= SLICED_BLOCKS_PER_SM * self.hw.num_sms]
        reloads = (False, True) if self.first_gemm and serial not in self.first_gemm else (False,)
        small = self._small_grid(tiles)
        deep = GEMM_STAGES if self.hopper and self.one_reduction and small else ()
        # no warp-tile program along this serial dim whatever the block (``forms``): only the knob sets that ask
        # for none (a GEMM + epilogue's); the prefilter refused each of the others, for the one reason
        no_program = self.analyse_forms and self.forms[serial][0] is not None
        for step, stages, warps, (split, sl), rl in itertools.product(steps16, STAGES + deep, WARPS, parts, reloads):
            if sl > -(-sizes[serial] // step):  # a slice needs a step of its own
                continue
            if no_program and (stages != 1 or warps or split != 1 or sl != 1):
                continue
            if stages in deep and (split > 1 or sl > (SLICED_DEEP_MAX if self.gathers and stages == 4 else 2)):
                continue
            earlies = (False, True) if stages > 1 and split == 1 else (False,)
            lazies = (False, True) if self.running_max else (False,)
            tma = self.hopper and self.one_reduction
            # blocks slicing a plain GEMM's steps: by TMA and by cp.async (measured apart: the ring's fill
            # is a larger share of a slice's few steps); an implicit GEMM's gathered tile both ways too (TMA
            # im2col lost to the cp.async gather on the UNet's small grids: docs/convolutions.md)
            both = tma and (sl > 1 or self.gathers)
            for early, lazy, by_tma in itertools.product(earlies, lazies, (True, False) if both else (tma,)):
                yield Knobs(tuple(tiles.items()), serial, step, movers[-1], (), self.recompute, tensor_cores=True,
                            stages=stages, warps=warps, split=split, slices=sl, reload_a=rl, early_scores=early,
                            lazy_rescale=lazy,
                            mma_row_sums=self.row_sum, wgmma=self.hopper and not early,
                            tma=by_tma and not early, fast_math=self.fast_math)
            if (self.hopper and self.one_reduction and not no_program
                    and (stages, split, sl, rl) == (STAGES[0], 1, 1, False)):
                yield from self._producer_knobs(tiles, serial, step, movers[-1], warps, small)
            if (self.hopper and self.first_gemm and serial not in self.first_gemm and (split, sl) == (1, 1)
                    and stages == PRODUCER_STAGES[0] and warps == 8 and step >= 64
                    and sizes[serial] >= FA3_MIN_SERIAL):
                for lazy in lazies:
                    yield Knobs(tuple(tiles.items()), serial, step, movers[-1], (), self.recompute,
                                tensor_cores=True, stages=stages, warps=warps, reload_a=rl, lazy_rescale=lazy,
                                wgmma=True, tma=True, producer=True,
                                fast_math=self.fast_math)

    # A score GEMM per step (attention) with a producer warpgroup is FlashAttention-3's structure (K and V
    # apart, each step's softmax beside the previous P @ V, two MMA warpgroups taking turns): offered in
    # its own shape -- two MMA warpgroups (8 warps), a 2-slot ring, steps of 64+ -- without mma_row_sums,
    # whose mma.sync per step stalls the async wgmma pipe, and only over long rows (FA3_MIN_SERIAL)
    # (measured: docs/tuning.md, 'Why the search space looks as it does').
    def _producer_knobs(self, tiles: dict[str, int], serial: str, step: int, thread_dim: str,
                        warps: int, deep: bool = False) -> Iterator[Knobs]:
        """A TMA GEMM's warp-specialised variants: a producer warpgroup, rings of 2..4 slots (it keeps
        the deeper rings fed: 4 stages were the fastest of 2..4 on the H100's 128 x 256 tiles), also 6
        and 8 on a ``deep`` (small) grid (8 on BERT's 3072-deep K with 64 x 128 tiles), one block
        per tile or a persistent grid of one block per SM (estimated and measured faster for the
        8192^2 x 1024 GEMM), the latter also with two MMA warpgroups taking turns on alternate tiles
        (pingpong).  Measured: docs/tuning.md, 'Why the search space looks as it does'."""
        modes = ((0, False), (self.hw.num_sms, False), (self.hw.num_sms, True))
        rings = PRODUCER_STAGES + (DEEP_PRODUCER_STAGES if deep else ())
        for stages, (persistent, pingpong) in itertools.product(rings, modes):
            yield Knobs(tuple(tiles.items()), serial, step, thread_dim, (), self.recompute, tensor_cores=True,
                        stages=stages, warps=warps, wgmma=True, tma=True, producer=True, persistent=persistent,
                        pingpong=pingpong,
                        fast_math=self.fast_math)

    @cached_property
    def hopper(self) -> bool:
        """Whether the target runs warpgroup MMA, TMA and a producer warpgroup (sm_90a), as the Hopper options'
        own ``check_target`` says for ``hw.capabilities()`` (no wgmma, tma or producer knob set is enumerated for
        another target): ``wgmma`` is then offered on, not searched both ways (it won on every harness workload
        it applies to; measured: docs/tuning.md, 'Why the search space looks as it does'); where make_schedule
        refuses it the candidate goes without."""
        return HopperOptions(wgmma=True, tma=True, producer=True).check_target(self.hw.capabilities()) is None

    #: derive the graph's forms once (``forms``) and leave out the knob sets they refuse whatever else they hold
    #: (``splits``); off only to check that the search is the same with it (tests/test_space_prefilter.py)
    analyse_forms: bool = True

    @cached_property
    def splits(self) -> tuple[int, ...]:
        """The warp groups offered to split a block's steps: ``SPLITS``, less those that wgmma refuses whatever the
        graph (``warp_tile.wgmma_knobs_refusal``) where wgmma is offered on -- every tensor-core knob set on
        Hopper but early_scores', which takes no split.  make_schedule refused each such knob set without dropping
        wgmma (its reason blames no knob), so none was ever a candidate."""
        if not (self.hopper and self.analyse_forms):
            return SPLITS
        return tuple(sp for sp in SPLITS if wgmma_knobs_refusal(sp, False) is None)

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
        ``reload_a`` applies when the serial dim is not one of them (a GEMM per step, not over steps)."""
        op = self.smg.ops[0] if self.smg.ops else None
        if op is None or op.combiner != "sum" or len(op.inputs) != 2 or not op.reduce:
            return ()
        return op.reduce if all(a.space in self.smg.inputs for a in op.inputs) else ()

    @cached_property
    def vectors(self) -> tuple[int, ...]:
        """Scalar, or the widest (16-byte) vector of the graph's widest element type; on the CPU
        only scalar (LLVM vectorizes the loops by itself)."""
        if not self.cuda:
            return (1,)
        item = max(np.dtype(self.smg.space(n).dtype).itemsize for n in (*self.smg.inputs, *self.smg.outputs))
        return (1, max(1, MAX_VECTOR_BYTES // item))

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
            yield Knobs(k.tiles, k.serial, k.step, k.thread_dim, levels, k.recompute, lanes=k.lanes, vector=k.vector)

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
                f"steps up to {self.max_step or 'the dim'}, lanes {list(LANES)}, vector widths "
                f"{list(self.vectors)}, staging/cooperative choices per shared space, tensor-core warp tiles "
                f"(stages {list(STAGES)}, for GEMMs also {list(GEMM_STAGES)}, warps {list(WARPS)}, split "
                f"{list(self.splits)}, slices {list(SLICES)} (up to "
                f"{MORE_SLICES[-1]} for the smallest) for grids smaller than the SMs, A fragments held or reloaded) "
                f"where the plan is one"
                + (f"; also over the graph with {', '.join(f'{o}*{i}' for o, i in self.folds)} folded into one row "
                   f"dim" if self.folds else ""))

