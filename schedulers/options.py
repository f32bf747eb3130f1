"""Typed schedule options: three groups of knobs, each a frozen dataclass that checks itself.

A knob is a field declared with ``schedulers.knobs.knob``: its default, help, values, the learned model's feature,
the refusal codes of its checks and what the search offers where (its ``offer``, a function of the point being
enumerated).  Everything else is derived from the groups: the Schedule's JSON (non-default knobs only, so older
records keep their keys), ``make_schedule``'s keyword options, the search's ``Knobs`` and its points (a product
over the offers, walked in ``SEARCH_ORDER``), the CLI's flags, the features and the table of refusal codes.
Adding a knob is a field in its group (with its offer and its place in ``SEARCH_ORDER``, or no offer for a user's
knob), its check in the group's ``check`` and its use in the lowering, which reads it from the schedule or the
warp-tile program's group (``p.warp.<knob>``).

A group's ``check_target`` refuses what the target cannot run (``HardwareModel.capabilities``): ``make_schedule``
asks it first, and the search asks it before offering a knob at all.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from schedulers.knobs import Rejection, Where, changed, check_values, coerce, knob, typed_key
from smg.ir import itemsize

if TYPE_CHECKING:
    from schedulers.hardware import Capabilities
    from schedulers.schedule import Schedule

LANES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # threads sharing a tile element's reductions
VECTORS = (1, 2, 4, 8)  # serial elements per vector access of a lane (CUDA-core kernels)
SPLITS = (1, 2, 4, 8)
CLUSTERS = (1, 2, 4, 8)  # blocks of a thread-block cluster (sm_90; 8 is the portable maximum)
MAX_VECTOR_BYTES = 16  # the widest global load/store of one thread
MAX_UNROLL = 64  # loop trips unrolled at most (register arrays indexed by constants, code size)


# -- what the search offers (each knob's ``offer``).  The H100 measurements behind these choices:
# docs/tuning.md, "Why the search space looks as it does".

SEARCH_LANES = (1, 8, 32, 128)  # lanes the search offers (128: four warps); a subset of LANES
#: more lanes where the grid leaves most SMs idle (a GroupNorm at batch 2: 64 rows of 10240+ elements)
WIDE_LANES = (512, 1024)
SEARCH_STAGES = (1, 2, 3)  # tensor-core warp-tile programs: shared buffers per streamed tile
#: deeper rings offered for GEMMs (their ring holds only the A and B tiles), in blocks taking all of a
#: row tile's steps or half: a deep K (BERT's and ViT's FFN output GEMMs, K = 3072) ran faster on 6
#: stages than on 3 stages in 4 slices; on small grids only (``Where.small_grid``: on LLaMA's 2048-row
#: GEMMs, 700-2800 tiles, the analytical model preferred them and they measured slower)
GEMM_STAGES = (4, 6)
PRODUCER_STAGES = (2, 3, 4)  # a producer warpgroup's TMA ring (it needs 2+)
DEEP_PRODUCER_STAGES = (6, 8)  # and deeper on small grids (8 for BERT's FFN output GEMM)
SEARCH_WARPS = (0, 8)  # 0: up to 4 warps (FlashAttention-2's default); 8: more warps per row tile
SEARCH_SPLITS = (1, 4)  # warp groups dividing a block's serial steps; a subset of SPLITS
SEARCH_SLICES = (2, 4, 8)  # blocks dividing a row tile's steps, offered when the grid cannot fill the SMs
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


def _lanes(w: Where) -> tuple[int, ...]:
    """Lanes whose block (the tile's elements times the lanes) has between the floor and the hardware's threads;
    the wide ones only where the grid leaves most SMs idle (at most half of them take a block)."""
    wide = WIDE_LANES if 2 * w.blocks <= w.num_sms else ()
    return tuple(n for n in SEARCH_LANES + wide if w.threads_floor <= w.threads * n <= w.max_threads)


def _vector(w: Where) -> tuple[int, ...]:
    """Scalar, or the widest (16-byte) vector of the graph's widest element type, where every lane gets whole
    vectors of the step and none straddles the dim's end (on the CPU only scalar: LLVM vectorizes the loops by
    itself); the lanes a step's positions (times the dims reduced with the serial one, scalar) can occupy."""
    out = []
    for v in (1, max(1, MAX_VECTOR_BYTES // w.widest_item)) if w.cuda else (1,):
        if v not in VECTORS or w.lanes > w.step * (w.others if v == 1 else 1):
            continue
        if v > 1 and (w.step % (w.lanes * v) or w.serial_size % v):
            continue
        out.append(v)
    return tuple(out)


def _deep(w: Where) -> tuple[int, ...]:
    """The deep GEMM rings offered here: a plain or gated GEMM on Hopper on a small grid."""
    return GEMM_STAGES if w.hopper and w.one_reduction and w.small_grid else ()


def _stages(w: Where) -> tuple[int, ...]:
    """1-3 stages, and the deep GEMM rings (``GEMM_STAGES``); 1 where the graph has no warp-tile program (the
    knob sets asking for one were each refused for that one reason)."""
    return (1,) if w.no_program else SEARCH_STAGES + _deep(w)


def _warps(w: Where) -> tuple[int, ...]:
    return (0,) if w.no_program else SEARCH_WARPS


def _slices(w: Where) -> tuple[int, ...]:
    """Blocks slicing a row tile's steps where the grid has fewer blocks than SMs (2, 4, 8; 16 and 32 where
    that leaves at most ``SLICED_BLOCKS_PER_SM`` blocks per SM), each with a step of its own; a deep GEMM ring
    takes all of a row tile's steps or half (an implicit GEMM's 4-deep ring up to ``SLICED_DEEP_MAX``)."""
    if w.no_program or w.blocks >= w.num_sms:
        return (1,)
    more = tuple(n for n in MORE_SLICES if w.blocks * n <= SLICED_BLOCKS_PER_SM * w.num_sms)
    cap = (SLICED_DEEP_MAX if w.gathers and w.stages == 4 else 2) if w.stages in _deep(w) else w.steps
    return (1,) + tuple(n for n in SEARCH_SLICES + more if n <= min(cap, w.steps))


def _split(w: Where) -> tuple[int, ...]:
    """Warp groups splitting a block's steps, in blocks that take all of them (no slices, no deep ring); on
    Hopper only those wgmma takes (``warp_tile.wgmma_knobs_refusal``: none), since wgmma is offered on there."""
    from schedulers.warp_tile import wgmma_knobs_refusal

    if w.no_program or w.slices != 1 or w.stages in _deep(w):
        return (1,)
    if w.hopper and w.analyse_forms:
        return tuple(n for n in SEARCH_SPLITS if wgmma_knobs_refusal(n, False) is None)
    return SEARCH_SPLITS


def _reload_a(w: Where) -> tuple[bool, ...]:
    """Both ways where the first GEMM runs per step (attention's Q @ K^T over d, not over the serial dim)."""
    return (False, True) if w.gemm_per_step else (False,)


def _early_scores(w: Where) -> tuple[bool, ...]:
    return (False, True) if w.stages > 1 and w.split == 1 else (False,)


def _lazy_rescale(w: Where) -> tuple[bool, ...]:
    return (False, True) if w.running_max else (False,)


def _mma_row_sums(w: Where) -> tuple[bool, ...]:
    """On wherever an op sums one computed tile (it won or tied on every harness workload; searching it both ways
    doubled the space); make_schedule's refusal drops it where no such state is a GEMM's factor tile."""
    return (w.row_sum,)


def _fast_math(w: Where) -> tuple[bool, ...]:
    return (w.fast_math_asked,)


def _wgmma(w: Where) -> tuple[bool, ...]:
    """On wherever the target has it (it won on every harness workload it applies to), not with early_scores,
    which it refuses; make_schedule's refusal drops it elsewhere."""
    return (w.hopper and not w.early_scores,)


def _tma(w: Where) -> tuple[bool, ...]:
    """On for a plain or gated GEMM on Hopper (not attention, where it measured a wash); both ways for blocks
    slicing a GEMM's steps (the ring's fill is a larger share of a slice's few steps) and for an implicit GEMM's
    gathered tile (TMA im2col lost to the cp.async gather on the UNet's small grids); never with early_scores."""
    on = w.hopper and w.one_reduction
    return tuple(v and not w.early_scores for v in ((True, False) if on and (w.slices > 1 or w.gathers) else (on,)))


def _producer(w: Where) -> Iterator[dict[str, Any] | bool]:
    """No producer, then the warp-specialised variants, each setting the knobs it fixes.

    A plain or gated GEMM on Hopper (where the knob set is a one-stage ring taking all its steps, Q not
    re-read): a producer warpgroup over TMA rings of 2..4 slots (4 were the fastest on 128 x 256 tiles), 6 and
    8 on a small grid (8 for BERT's 3072-deep K); one block per tile or a persistent grid (``persistent``,
    ``pingpong``).  Attention over long rows (``FA3_MIN_SERIAL``): FlashAttention-3's structure (K and V apart,
    each step's softmax beside the previous P @ V, two MMA warpgroups taking turns) in its own shape, two MMA
    warpgroups over a 2-slot ring, steps of 64+, without mma_row_sums (its mma.sync per step stalls the async
    wgmma pipe)."""
    yield False
    fixed = {"producer": True, "wgmma": True, "tma": True, "early_scores": False, "mma_row_sums": False}
    if (w.hopper and w.one_reduction and not w.no_program
            and (w.stages, w.split, w.slices, w.reload_a) == (SEARCH_STAGES[0], 1, 1, False)):
        for stages in PRODUCER_STAGES + (DEEP_PRODUCER_STAGES if w.small_grid else ()):
            yield fixed | {"stages": stages, "lazy_rescale": False}
    if (w.hopper and w.gemm_per_step and (w.split, w.slices) == (1, 1) and w.stages == PRODUCER_STAGES[0]
            and w.warps == 8 and w.step >= 64 and w.serial_size >= FA3_MIN_SERIAL):
        yield fixed | {"persistent": 0, "pingpong": False}


def _persistent(w: Where) -> tuple[int, ...]:
    """With a GEMM's producer: one block per tile, or a persistent grid of one block per SM (estimated and
    measured faster for the 8192^2 x 1024 GEMM)."""
    return (0, w.num_sms) if w.producer else (0,)


def _pingpong(w: Where) -> tuple[bool, ...]:
    """With a persistent grid: also two MMA warpgroups taking turns on alternate tiles."""
    return (False, True) if w.persistent else (False,)


@dataclass(frozen=True)
class SimtOptions:
    """CUDA-core kernels: how a block's threads share a tile element's serial reductions."""

    lanes: int = knob(1, "threads sharing each tile element's serial reductions (warp shuffles, then shared "
                         "memory across warps)", "threads", choices=LANES,
                      valid=f"a power of two up to {LANES[-1]} (beyond a warp, 32, the lanes of a group are whole "
                            f"warps)", offer=_lanes,
                      refusals={"tensor_cores": "lanes on a tensor-core kernel"})
    vector: int = knob(1, "consecutive serial elements a lane loads and stores as one vector", "log2_vector",
                       choices=VECTORS, encode="log2", valid=f"one of {VECTORS} elements", offer=_vector,
                       refusals={"tensor_cores": "vector on a tensor-core kernel",
                                 "step": "a step that is not a multiple of lanes x vector",
                                 "straddles": "a serial dim that is not a multiple of the vector",
                                 "width": "a vector wider than 16 bytes"})
    unroll: bool = knob(False, f"unroll each lane's loop over its elements of a step (at most {MAX_UNROLL} trips; "
                               f"vector runs are unrolled already)", "unroll", encode="flag",
                        refusals={"not_simt_scalar": "unroll of a vector or tensor-core loop",
                                  "too_long": "unroll of a loop of more trips than unrolled at most"})
    cluster: int = knob(1, "blocks of a thread-block cluster sharing each row's reductions (sm_90): a block's lanes "
                           "reduce their part, the blocks' results meet in distributed shared memory",
                        "log2_num_blocks", choices=CLUSTERS,
                        valid=f"one of {CLUSTERS} blocks (a portable cluster)",
                        refusals={"tensor_cores": "cluster on a tensor-core kernel",
                                  "lanes": "a cluster's block is not one row's lane group of whole warps",
                                  "scalar": "cluster with vector or unroll",
                                  "shared": "cluster with spaces staged in shared memory",
                                  "no_reduction": "cluster on a graph with no reduction"})

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
                width = self.vector * itemsize(space.dtype)
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
                       valid="1..8 (shared buffers per streamed tile)", encode="value", offer=_stages)
    warps: int = knob(0, "warps per block, each taking rows/16/warps 16-row MMA tiles (0: up to 4)", "warp_mtiles",
                      lo=0, offer=_warps)
    split: int = knob(1, "warp groups dividing a block's serial steps (split-K inside the block)", "threads",
                      choices=SPLITS, valid="1, 2, 4 or 8 warp groups", offer=_split)
    slices: int = knob(1, "blocks dividing one row tile's serial steps (split-K across the grid)", "log2_num_blocks",
                       lo=1, hi=32, offer=_slices,
                       refusals={"range": "slices outside 1..32 or more than the serial steps"})
    reload_a: bool = knob(False, "re-read the first GEMM's A operand from shared memory every step",
                          "reload_a", encode="flag", offer=_reload_a,
                          refusals={"no_gemm": "reload_a on a program without a first GEMM"})
    early_scores: bool = knob(False, "wait for the score tile's operands before the second GEMM's (two groups)",
                              "early_scores", encode="flag", offer=_early_scores,
                              refusals={"no_scores": "early_scores on a program with no score tile and second GEMM "
                                                     "apart",
                                        "ring": "early_scores with a ring of one stage or with warp groups"})
    lazy_rescale: bool = knob(False, "skip the accumulator rescale while the running max stays within its lag",
                              "lazy_rescale", encode="flag", offer=_lazy_rescale,
                              refusals={"no_reference": "lazy_rescale on a program with no max state only "
                                                        "referenced"})
    mma_row_sums: bool = knob(False, "sum row statistics that are a second GEMM's factor tile on tensor cores",
                              "mma_row_sums", encode="flag", offer=_mma_row_sums, droppable=True,
                              refusals={"no_factor": "mma_row_sums on a program with no row sum that is a GEMM's "
                                                     "factor tile"})
    fast_math: bool = knob(False, "tanh and logistics on tanh.approx.f32 where stored in 16 bits",
                           "fast_math", encode="flag", offer=_fast_math, droppable=True)
    # not offered: the order of its additions, so the last bits of the outputs, vary from run to run (a user's
    # choice, like fast_math's numerics), and no GPU measurement says where it beats the last block's merge
    atomic_slices: bool = knob(False, "blocks slicing a row tile's steps add their partial sums into one fp32 "
                                      "workspace part with atomics, which the last block reads alone (the order of "
                                      "the additions varies from run to run)", "atomic_slices", encode="flag",
                               refusals={"no_slices": "atomic_slices without slices",
                                         "not_sums": "atomic_slices on a program with a state that is not a sum "
                                                     "without a carry (a max, or a sum its carry rescales)"},
                               says="the slices' partial sums added into one workspace part by atomics")

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
        if self.atomic_slices and self.slices == 1:
            return Rejection("atomic_slices.no_slices", "atomic_slices", "atomic_slices adds the partial sums of "
                             "blocks slicing a row tile's steps; give slices > 1")
        if self.atomic_slices and any(u.combiner != "sum" or u.carry for u in s.plan.states):
            odd = [u.state for u in s.plan.states if u.combiner != "sum" or u.carry]
            return Rejection("atomic_slices.not_sums", "atomic_slices", f"atomic_slices adds the slices' partial "
                             f"states, which merge by a sum alone only where each is a sum without a carry; "
                             f"{name!r} has {odd} (a max, or a sum its carry rescales)")
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
                       "wgmma", encode="flag", offer=_wgmma, droppable=True)
    tma: bool = knob(False, "the ring's tiles loaded by the Tensor Memory Accelerator (with wgmma)",
                     "tma", encode="flag", offer=_tma, droppable=True,
                     refusals={"unfit": "tma on a program whose ring TMA cannot load"})
    producer: bool = knob(False, "a producer warpgroup issues the TMA loads (warp specialisation)",
                          "producer", encode="flag", offer=_producer, droppable=True,
                          refusals={"needs_tma": "producer without tma or with a ring of one stage",
                                    "shape": "producer on a program that is neither a plain GEMM nor attention's "
                                             "one GEMM state",
                                    "slices": "producer with slices"})
    persistent: int = knob(0, "a persistent grid of this many blocks looping over the tiles (0: one per tile)",
                           "persistent", lo=0, encode="flag", offer=_persistent, droppable=True,
                           refusals={"needs_producer": "persistent without producer",
                                     "shape": "persistent on a program that is not a plain GEMM",
                                     "range": "persistent blocks not fewer than the tiles"})
    pingpong: bool = knob(False, "two MMA warpgroups per persistent block taking turns on alternate tiles",
                          "pingpong", encode="flag", offer=_pingpong, droppable=True,
                          refusals={"shape": "pingpong without a persistent block of one warpgroup per tile"})

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
#: the order in which the search walks the offered knobs: each knob's offer sees the values of those before it,
#: and a knob after another varies faster (the candidates' order breaks the cost model's ties).  The CUDA-core
#: points walk the ``simt`` knobs, the tensor-core points the others; a knob not listed is not searched.
SEARCH_ORDER = ("lanes", "vector", "stages", "warps", "slices", "split", "reload_a", "producer", "persistent",
                "pingpong", "early_scores", "lazy_rescale", "wgmma", "tma", "mma_row_sums", "fast_math")


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
    return {g: cls(**{k: coerce(fields[k], v) for k, v in knobs.items() if KNOB_GROUP[k] == g})
            for g, cls in GROUPS.items()}


def non_defaults(group: Any) -> dict[str, Any]:
    """The knobs of ``group`` that differ from their defaults (what the schedule JSON records)."""
    key = typed_key(group)
    if key is None:
        return {n: getattr(group, n) for n in changed(group)}
    got = _NON_DEFAULTS.get(key)
    if got is None:
        got = _NON_DEFAULTS[key] = {n: getattr(group, n) for n in changed(group)}
    return dict(got)


#: non_defaults by ``_typed`` key
_NON_DEFAULTS: dict[tuple, dict[str, Any]] = {}


def needs_tensor_cores(s: Schedule) -> Rejection | None:
    """Every warp-tile and Hopper knob left at its default unless the schedule runs on tensor cores."""
    if s.tensor_cores:
        return None
    set_ = [n for g in TENSOR_CORE_GROUPS for n in changed(getattr(s, g))]
    if set_:
        names = [f.name for f in KNOB_FIELDS if KNOB_GROUP[f.name] in TENSOR_CORE_GROUPS]
        return Rejection("options.need_tensor_cores", None, f"{', '.join(set_)} set: {', '.join(names[:-1])} and "
                         f"{names[-1]} apply to tensor-core warp-tile kernels (tensor_cores=True)")
    return None

