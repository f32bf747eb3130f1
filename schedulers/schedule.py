"""The Schedule: an immutable, JSON-serialisable record of all slicing decisions.

Lowering is a pure function of (Schedule, target), so a Schedule read back from
JSON or a tuning database replays the same kernel.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from schedulers.errors import ScheduleError, TemporalSliceError
from schedulers.hardware import H100, HardwareModel
from schedulers.spatial import DimDecision, analyse_spatial, elementwise_serial
from schedulers.temporal import TemporalPlan, UpdateFunction, plan_temporal
from smg.hashing import canonical_text, text_key
from smg.ir import SMG
from smg.serialize import smg_from_dict, smg_to_dict

FORMAT = "spacefusion-schedule/1"
LEVELS = ("global", "shared", "register", "inlined")
VECTORS = (1, 2, 4, 8)  # serial elements per vector access of a lane (CUDA-core kernels)
LANES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # threads sharing a tile element's reductions
MAX_VECTOR_BYTES = 16  # the widest global load/store of one thread


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
    #: threads sharing each tile element's serial reductions: each takes every lanes-th element
    #: (run) of a step; partial results meet in warp shuffles, then across warps in shared memory
    lanes: int = 1
    #: lower on tensor cores (CUDA only): a GEMM + element-wise epilogue through TVM's WMMA
    #: tensorizer, or a warp-tile program (schedulers.warp_tile) through mma.sync/ldmatrix
    tensor_cores: bool = False
    #: shared-memory buffers per streamed input tile of a warp-tile program (cp.async pipeline depth)
    stages: int = 1
    #: warps of a warp-tile program (0: up to 4); each takes rows/16/warps 16-row mma tiles
    warps: int = 0
    #: consecutive serial elements a lane takes at once (CUDA-core kernels): one vector
    #: load/store of ``vector`` elements (8 bytes of fp16 at 4) instead of scalar ones
    vector: int = 1
    #: warp groups of a warp-tile program that divide the serial steps of a block among them
    #: (split-K inside the block); their partial states merge through the derived carries
    split: int = 1
    #: blocks that divide one row tile's serial steps (split-K across the grid, for grids too small
    #: to fill the GPU); each leaves its partial states in a global workspace and the last of them to
    #: finish merges all through the derived carries and stores the outputs
    slices: int = 1
    #: re-read the first GEMM's A operand (attention's Q) from shared memory every step instead of
    #: holding its fragments in registers for the whole loop: frees (16-row tiles per warp) x K / 4
    #: registers a thread (64 for two tiles at d = 128), so two tiles per warp fit without spilling,
    #: for K / 16 more ldmatrix per tile and step and an A tile of its own in shared memory
    reload_a: bool = False
    #: two cp.async groups per step, the score tile's operands (attention's K) before the second
    #: GEMM's (V), each waited for where it is first read: the scores and the softmax start while V
    #: still lands, for one more barrier per step (FlashAttention-2's order)
    early_scores: bool = False
    #: keep a running max that is only a reference (``warp_tile.lazy_references``: attention's row max)
    #: while each step's max stays within ln(256) of it, so that a warp skips the accumulator rescale
    #: (FlashAttention-4's conditional rescale); one warp vote per step
    lazy_rescale: bool = False
    #: sum row statistics whose body is a second GEMM's factor tile (attention's row sum of P) on the
    #: tensor cores, as ``P @ 1`` over the fp16 fragments that GEMM multiplies (``warp_tile.mma_row_sums``):
    #: one n8 mma per k slice in place of an fp32 add per element and the quad's shuffles; the sum is
    #: then over the fp16-rounded P that multiplies V, accumulated in fp32
    mma_row_sums: bool = False
    #: the GEMMs on Hopper's warpgroup MMA (``wgmma.mma_async`` m64nNk16, sm_90a): operands read from
    #: 128 B-swizzled shared tiles through descriptors, or from registers where a tile is computed
    #: (attention's P) or held (Q), instead of ldmatrix fragments and mma.sync
    wgmma: bool = False
    #: the ring's tiles (a plain GEMM's A and B, attention's K and V, an input on the score plane) loaded
    #: by the Tensor Memory Accelerator (``cp.async.bulk.tensor``, sm_90a, with wgmma): one thread per
    #: block issues each tile against a tensor map the launcher builds, an mbarrier per ring slot counts
    #: the bytes in, instead of every thread's 16-byte cp.async and its wait
    tma: bool = False
    #: warp specialisation of a TMA ring (a GEMM's tiles, attention's K/V): a producer warpgroup (128
    #: more threads, 40 registers each beside two MMA warpgroups) issues the loads ``stages - 1`` steps
    #: ahead and the MMA warpgroups hand each ring slot back through its own mbarrier, so no block-wide
    #: barrier sits in the main loop (CUTLASS's sm90 kernels).  With a score GEMM it is FlashAttention-3's
    #: structure: K and V come and go apart, each step's row states overlap the previous step's P @ V,
    #: and two MMA warpgroups take turns issuing their GEMMs
    producer: bool = False
    #: a persistent grid of this many blocks (0: one block per tile), each looping over the tiles
    #: ``bid, bid + persistent, ...``: the producer loads the next tile's steps during the epilogue
    persistent: int = 0
    #: two MMA warpgroups per persistent block, each on its own tiles (every other one of the block's),
    #: taking turns at the tensor cores by an order barrier: one stores its outputs while the other
    #: runs its main loop (CUTLASS's ping-pong kernel); each tile is one warpgroup's (4 warps)
    pingpong: bool = False
    #: tanh, and a logistic ``1 / (1 + exp(z))`` as ``0.5 - 0.5 tanh(z / 2)``, on the SFU's
    #: ``tanh.approx.f32`` (max relative error 2^-10.99) where the value is stored in 16 bits: one
    #: special-function op instead of tanhf's software routine or the logistic's exp2 and reciprocal;
    #: a sigmoid then errs by up to ~2.5e-4 absolute (half an fp16 step near 1, more in its tails)
    fast_math: bool = False

    @cached_property
    def key(self) -> str:
        """``content_key(self.to_dict())``, with the canonical texts of the SMG (built once per graph), the
        temporal plan and the spatial decisions (once per plan and per decision tuple, which a search's
        candidates share) spliced in rather than re-serialised for every candidate: the same digest."""
        body = self._fields()
        texts = {"smg": self.smg.canonical_text, "plan": _plan_text(self.plan),
                 "spatial": _spatial_text(self.spatial)}
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
        except ScheduleError:
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
        """Thread blocks launched: one per work tile, or the persistent grid that loops over them."""
        return self.persistent or self.num_tiles

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
        } | ({"lanes": self.lanes} if self.lanes != 1 else {}) | (  # absent at defaults: older keys stay valid
            {"tensor_cores": True} if self.tensor_cores else {}) | (
            {"stages": self.stages} if self.stages != 1 else {}) | ({"warps": self.warps} if self.warps else {}) | (
            {"vector": self.vector} if self.vector != 1 else {}) | (
            {"split": self.split} if self.split != 1 else {}) | (
            {"slices": self.slices} if self.slices != 1 else {}) | ({"reload_a": True} if self.reload_a else {}) | (
            {"early_scores": True} if self.early_scores else {}) | (
            {"lazy_rescale": True} if self.lazy_rescale else {}) | (
            {"mma_row_sums": True} if self.mma_row_sums else {}) | ({"wgmma": True} if self.wgmma else {}) | (
            {"tma": True} if self.tma else {}) | ({"producer": True} if self.producer else {}) | (
            {"persistent": self.persistent} if self.persistent else {}) | (
            {"pingpong": True} if self.pingpong else {}) | ({"fast_math": True} if self.fast_math else {})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScheduleError(f"schedule JSON is not valid JSON: {e}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            tag = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ScheduleError(f"not a spacefusion schedule (format tag {tag!r})")
        try:
            s = cls._from_dict(d)
        except (KeyError, TypeError, ValueError) as e:
            raise ScheduleError(f"schedule JSON is incomplete or malformed: {e!r}") from None
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
            lanes=int(d.get("lanes", 1)),
            tensor_cores=bool(d.get("tensor_cores", False)),
            stages=int(d.get("stages", 1)),
            warps=int(d.get("warps", 0)),
            vector=int(d.get("vector", 1)),
            split=int(d.get("split", 1)),
            slices=int(d.get("slices", 1)),
            reload_a=bool(d.get("reload_a", False)),
            early_scores=bool(d.get("early_scores", False)),
            lazy_rescale=bool(d.get("lazy_rescale", False)),
            mma_row_sums=bool(d.get("mma_row_sums", False)),
            wgmma=bool(d.get("wgmma", False)),
            tma=bool(d.get("tma", False)),
            producer=bool(d.get("producer", False)),
            persistent=int(d.get("persistent", 0)),
            pingpong=bool(d.get("pingpong", False)),
            fast_math=bool(d.get("fast_math", False)),
        )

    def __str__(self) -> str:
        from schedulers.printing import schedule_summary

        return schedule_summary(self)

    def _repr_html_(self) -> str:
        """Jupyter: slices, memory levels, derived update functions and the SMG."""
        from schedulers.display import schedule_html

        return schedule_html(self)


def _check_loaded(s: Schedule) -> None:
    """The numbers of a schedule read from JSON, checked as ``make_schedule`` checks them (an edited file
    with step 0 or tile -5 would otherwise reach the lowering: a ZeroDivisionError, or TVM's InternalError)."""
    sizes = s.smg.dim_sizes
    if s.serial not in sizes:
        raise ScheduleError(f"schedule JSON: serial dim {s.serial!r} is not a dim of {s.smg.name!r}")
    if not 1 <= s.step <= sizes[s.serial]:
        raise ScheduleError(f"schedule JSON: step {s.step} for serial dim {s.serial!r} must be 1..{sizes[s.serial]}")
    for d, tile in s.block:
        if d not in sizes:
            raise ScheduleError(f"schedule JSON: block dim {d!r} is not a dim of {s.smg.name!r}")
        if tile < 1 or (tile > sizes[d] and not s.tensor_cores):
            raise ScheduleError(f"schedule JSON: tile {tile} for dim {d!r} must be 1..{sizes[d]}")
    for name, value, ok in (("stages", s.stages, s.stages >= 1), ("warps", s.warps, s.warps >= 0),
                            ("lanes", s.lanes, s.lanes in LANES), ("vector", s.vector, s.vector >= 1),
                            ("split", s.split, s.split in (1, 2, 4, 8)), ("slices", s.slices, s.slices >= 1),
                            ("persistent", s.persistent, s.persistent >= 0)):
        if not ok:
            raise ScheduleError(f"schedule JSON: {name} {value} is out of range")


def _override_levels(memory: list[tuple[str, str]], levels: dict[str, str], inputs: tuple[str, ...]
                     ) -> list[tuple[str, str]]:
    """Apply the choices the lowering supports: staged input -> global, shared tile -> per thread."""
    cur = dict(memory)
    for name, lvl in levels.items():
        if name not in cur:
            raise ScheduleError(f"memory level given for unknown space {name!r}")
        if lvl == cur[name]:
            continue
        allowed = {cur[name], "global"} if name in inputs else {cur[name], "register"}
        if cur[name] != "shared" or lvl not in allowed:
            raise ScheduleError(f"space {name!r} cannot move from {cur[name]!r} to {lvl!r}; the lowering can "
                                f"only read a staged input from global memory or compute a shared tile per thread")
        cur[name] = lvl
    return [(n, cur[n]) for n, _ in memory]


def _check_vector(smg: SMG, vector: int, step: int, lanes: int, serial: str, tensor_cores: bool) -> None:
    """A vector is a run of consecutive serial elements that is either wholly inside the dim or
    wholly past its end (so one guard covers it), starts aligned and is at most 16 bytes wide (so
    one load or store moves it)."""
    if vector not in VECTORS:
        raise ScheduleError(f"vector {vector} must be one of {VECTORS} elements")
    if vector == 1:
        return
    if tensor_cores:
        raise ScheduleError("vector applies to CUDA-core kernels; warp-tile kernels load with cp.async and ldmatrix")
    if step % (lanes * vector):
        raise ScheduleError(f"step {step} must be a multiple of lanes x vector ({lanes} x {vector}) so that "
                            f"every lane gets whole vectors")
    size = smg.dim_sizes[serial]
    if size % vector:
        raise ScheduleError(f"serial dim {serial!r} ({size}) must be a multiple of vector {vector}: a vector may "
                            f"not straddle the end of the dim")
    for name in (*smg.inputs, *smg.outputs):
        space = smg.space(name)
        width = vector * np.dtype(space.dtype).itemsize
        if space.dims[-1] == serial and width > MAX_VECTOR_BYTES:
            raise ScheduleError(f"vector {vector} of {name!r} ({space.dtype}) is {width} bytes; a thread loads "
                                f"at most {MAX_VECTOR_BYTES} at once")


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
        raise ScheduleError(f"{smg.name!r} has no reduced dim to slice temporally")

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
    raise TemporalSliceError(f"no reduced dim of {smg.name!r} can be sliced temporally: " + "; ".join(refused))


def _pads_rows(tile: int, size: int) -> bool:
    """Whether a tensor-core row tile of ``tile`` may cover a dim of ``size`` < ``tile``: a warp-tile
    program's rows come in 16-row MMA tiles (64 per warpgroup), so a GQA decoder's 4-8 query rows
    run in one padded tile whose spare rows are masked like any row tail."""
    return tile % 16 == 0 and tile <= max(64, -(-size // 16) * 16)


#: the serial step when none is given (capped at the serial dim's size)
DEFAULT_STEP = 32


def make_schedule(smg: SMG, tiles: dict[str, int] | None = None, serial: str | None = None,
                  step: int | None = None, thread_dim: str | None = None, recompute: bool = False,
                  hw: HardwareModel | None = None, levels: dict[str, str] | None = None,
                  lanes: int = 1, tensor_cores: bool = False, stages: int = 1, warps: int = 0,
                  vector: int = 1, split: int = 1, slices: int = 1, reload_a: bool = False,
                  early_scores: bool = False, lazy_rescale: bool = False,
                  mma_row_sums: bool = False, wgmma: bool = False, tma: bool = False,
                  producer: bool = False, persistent: int = 0, pingpong: bool = False,
                  fast_math: bool = False) -> Schedule:
    """Run the spatial then the temporal slicer and record every decision.

    ``tiles`` gives block sizes for cut dims (default: 1, and 64 for the
    innermost cut output dim, which is spread over threads).  With
    ``recompute`` a tile may also cut a dim whose only obstacle is that each
    block recomputes an intermediate (e.g. the MLP's hidden tile per output
    column block): a trade of FLOPs for on-chip memory.  ``hw`` (default H100)
    bounds the threads per block.  ``levels`` overrides memory levels where
    the lowering has a choice: a staged input may be read from ``global``
    instead, a block-shared streamed tile may be computed per thread
    (``register``).  ``vector`` > 1 gives each lane runs of that many consecutive serial
    elements, loaded and stored as one vector (CUDA-core kernels).  ``split`` > 1 divides a
    warp-tile block's serial steps among that many warp groups, whose partial states merge at
    the end through the derived update functions (more warps per block for few row tiles).
    ``slices`` > 1 divides them among that many blocks (more blocks for a small grid); the last
    block of a row tile to finish merges the others' partial states from global memory (with
    ``split`` too, every warp group's: both at once measured slower on the H100 harness shapes,
    so the search does not offer the pair).
    ``reload_a`` keeps the first GEMM's A operand in shared memory and re-reads its fragments every
    step (fewer registers: two 16-row tiles per warp at head dim 128 without spilling).
    ``early_scores`` waits for the score tile's operands alone at the top of a step and for the
    second GEMM's before that GEMM (a barrier more per step; a ring of 2+ stages, no warp groups).
    ``lazy_rescale`` keeps a reference max while it is within the derived lag (no rescale that step).
    ``mma_row_sums`` sums the row statistics that equal a second GEMM's factor tile on tensor cores.
    ``wgmma`` runs the GEMMs on Hopper's warpgroup MMA (swizzled shared tiles, registers for P).
    ``tma`` loads a wgmma program's ring with the Tensor Memory Accelerator (tensor maps, mbarriers).
    ``producer`` gives those loads a warpgroup of their own (warp specialisation; attention's MMA
    warpgroups then overlap each step's softmax with the previous P @ V and take turns); ``persistent`` > 0
    launches that many blocks, each looping over the tiles (with ``producer``); ``pingpong`` gives such a
    block two MMA warpgroups taking turns on alternate tiles.  ``fast_math`` computes tanh and logistics
    on ``tanh.approx.f32`` where their values are stored in 16 bits.
    """
    spatial = analyse_spatial(smg)
    if recompute:
        spatial = tuple(
            DimDecision(d.dim, True, f"cut on request, recomputing {', '.join(d.recomputes)} per block",
                        d.recomputes) if d.recomputes and d.dim in (tiles or {}) else d
            for d in spatial)
    cut = [d.dim for d in spatial if d.cut]
    sizes = smg.dim_sizes
    tiles = dict(tiles or {})
    for d in tiles:
        if d not in sizes:
            raise ScheduleError(f"tile given for unknown dim {d!r}; dims are {list(sizes)}")
        if d not in cut:
            dec = next(x for x in spatial if x.dim == d)
            hint = " (recompute=True cuts it anyway)" if dec.recomputes else ""
            raise ScheduleError(f"dim {d!r} cannot be cut spatially: {dec.reason}{hint}")
    if not cut:
        raise ScheduleError(f"no dim of {smg.name!r} can be cut spatially")
    out_dims = smg.space(smg.outputs[0]).dims
    thread_dim = thread_dim or [d for d in out_dims if d in cut][-1]
    if thread_dim not in cut:
        raise ScheduleError(f"thread dim {thread_dim!r} is not a spatially cut dim {cut}")
    block = []
    for d in cut:
        t = int(tiles.get(d, min(64, sizes[d]) if d == thread_dim else 1))
        if t <= 0 or (t > sizes[d] and not (tensor_cores and _pads_rows(t, sizes[d]))):
            raise ScheduleError(f"tile {t} for dim {d!r} is larger than the dim ({sizes[d]}) or not positive")
        block.append((d, t))
    limit = (hw or H100).max_threads_per_block
    if lanes not in LANES:
        raise ScheduleError(f"lanes {lanes} must be a power of two up to {LANES[-1]} (beyond a warp, 32, the "
                            f"lanes of a group are whole warps)")
    serial = serial or pick_serial(smg, spatial)
    if serial not in sizes:
        raise ScheduleError(f"serial dim {serial!r} is not a dim of {smg.name!r}")
    if step is None:  # the default step, never longer than the serial dim (a 16-key attention: step 16)
        step = min(DEFAULT_STEP, sizes[serial])
    if isinstance(step, bool) or not isinstance(step, int):
        raise ScheduleError(f"step {step!r} for serial dim {serial!r} must be a whole number")
    if step <= 0:
        raise ScheduleError(f"step {step} for serial dim {serial!r} must be positive")
    if step > sizes[serial]:
        raise ScheduleError(f"step {step} for serial dim {serial!r} is larger than the dim ({sizes[serial]})")
    _check_vector(smg, vector, step, lanes, serial, tensor_cores)
    plan = plan_temporal(smg, serial)
    memory = []
    states = {u.state for u in plan.states}
    for s in smg.spaces:
        # shared by several threads of the block (it lacks a cut dim whose tile is > 1)
        shared_by_threads = any(t > 1 and d not in s.dims for d, t in block)
        if s.name in smg.inputs:
            lvl = "shared" if serial in s.dims and shared_by_threads else "global"
        elif s.name in plan.streamed and serial in s.dims and shared_by_threads:
            lvl = "shared"  # computed once per block and step, cooperatively
        elif s.name in states or s.name in plan.streamed:
            lvl = "register"
        elif s.name in smg.outputs:
            lvl = "global"
        else:
            lvl = "inlined"
        memory.append((s.name, lvl))
    memory = _override_levels(memory, levels or {}, smg.inputs)
    if split not in (1, 2, 4, 8):
        raise ScheduleError(f"split {split} must be 1, 2, 4 or 8 warp groups")
    if not 1 <= stages <= 8:
        raise ScheduleError(f"stages {stages} must be 1..8 (shared buffers per streamed tile)")
    nsteps = math.ceil(sizes[serial] / step)
    if not 1 <= slices <= min(32, nsteps):
        raise ScheduleError(f"slices {slices} must be 1..32 blocks and at most the {nsteps} steps of {step} "
                            f"along {serial!r}")
    out = Schedule(smg, tuple(block), thread_dim, serial, int(step), plan, tuple(memory), spatial, int(lanes),
                   bool(tensor_cores), int(stages), int(warps), int(vector), int(split), int(slices),
                   bool(reload_a), bool(early_scores), bool(lazy_rescale), bool(mma_row_sums), bool(wgmma),
                   bool(tma), bool(producer), int(persistent), bool(pingpong), bool(fast_math))
    padded = [d for d, t in block if t > sizes[d]]
    if padded and (out.warp_tile is None or padded != [out.warp_tile.row]):
        raise ScheduleError(f"tile {dict(block)[padded[0]]} for dim {padded[0]!r} is larger than the dim "
                            f"({sizes[padded[0]]}): only a warp-tile program's row tile may pad its dim to whole "
                            f"MMA row tiles")
    if tensor_cores:
        from schedulers.tensorcore_fit import tensorcore_reason
        from schedulers.warp_tile import warp_tile_reason

        if out.warp_tile is None:  # the warp-tile reading is tried first (cached on the Schedule)
            warp = warp_tile_reason(out)
            wmma = tensorcore_reason(out)
            if wmma is not None:
                raise ScheduleError(f"tensor cores requested for {smg.name!r}: as a GEMM + epilogue: {wmma}; "
                                    f"as a warp-tile program: {warp}")
            if stages != 1 or warps or split != 1 or slices != 1:  # TVM's WMMA tensorizer picks its own tiles
                raise ScheduleError(f"stages/warps/split/slices need a warp-tile program, and {smg.name!r} is not "
                                    f"one: {warp}")
        if lanes != 1:
            raise ScheduleError("lanes apply to CUDA-core kernels; tensor-core kernels place threads by mma tiles")
        if reload_a and (out.warp_tile is None or out.warp_tile.gemm is None):
            raise ScheduleError(f"reload_a re-reads the A operand of a warp-tile program's first GEMM (attention's "
                                f"Q @ K^T); {smg.name!r} has no such GEMM")
        if early_scores:
            p = out.warp_tile
            if p is None or not p.gemm_states or (p.gemm is None and not p.tiles_in):
                raise ScheduleError(f"early_scores waits for a warp-tile program's score operands before its second "
                                    f"GEMM's; {smg.name!r} has no score tile and second GEMM to wait for apart")
            if stages < 2 or split != 1:
                raise ScheduleError(f"early_scores needs a ring of 2+ stages and no warp groups (stages {stages}, "
                                    f"split {split}): a mid-step barrier must be reached by the whole block")
        if lazy_rescale and (out.warp_tile is None or not out.warp_tile.lazy):
            raise ScheduleError(f"lazy_rescale keeps a running max that only references the carried states; "
                                f"{smg.name!r} has none (a max state whose readers rescale exponentially in its change "
                                f"and whose outputs do not change with it)")
        if mma_row_sums and (out.warp_tile is None or not out.warp_tile.row_sums):
            raise ScheduleError(f"mma_row_sums sums a row statistic on tensor cores as a second GEMM's factor tile "
                                f"times ones; {smg.name!r} has no sum state whose body is such a factor (with a "
                                f"per-row carry, and read by no GEMM state)")
        if wgmma and out.warp_tile is None:
            raise ScheduleError(f"wgmma runs a warp-tile program's GEMMs on warpgroup MMA: "
                                f"{warp_tile_reason(out)}")
        if tma:
            from schedulers.warp_tile import tma_reason

            why = "it is not a warp-tile program" if out.warp_tile is None else tma_reason(out.warp_tile)
            if why is not None:
                raise ScheduleError(f"tma loads the ring of a warp-tile program on warpgroup MMA: a plain GEMM's "
                                    f"tiles (one block per tile), or attention's K/V (or an input on the score "
                                    f"plane); {smg.name!r} with these options cannot: {why}")
        if producer and (not tma or stages < 2):
            raise ScheduleError(f"producer gives the TMA loads of a wgmma GEMM a warpgroup of their own; it needs "
                                f"tma=True and a ring of 2+ stages (one slot stays with the wgmma in flight); got "
                                f"tma={bool(tma)}, stages {stages}")
        wt = out.warp_tile
        if producer and wt is not None and not wt.wgmma_ss and (wt.gemm is None or len(wt.gemm_states) != 1):
            raise ScheduleError(f"producer feeds a plain GEMM (+ epilogue), or a score GEMM per step with one GEMM "
                                f"state after it (attention); {smg.name!r} has "
                                f"{'no score GEMM' if wt.gemm is None else f'{len(wt.gemm_states)} GEMM states'}")
        if producer and out.warp_tile is not None and out.slices != 1:
            raise ScheduleError(f"producer: the MMA warpgroups of a warp-specialised block meet at named barriers "
                                f"only, and blocks slicing the steps merge through block-wide ones; got slices "
                                f"{out.slices}")
        if persistent and not producer:
            raise ScheduleError("persistent blocks loop over the tiles with the loads in a producer warpgroup; it "
                                "needs producer=True")
        if persistent and out.warp_tile is not None and not out.warp_tile.wgmma_ss:
            raise ScheduleError(f"persistent blocks loop over a plain GEMM's tiles (+ epilogue); {smg.name!r} has a "
                                f"score GEMM or row states: one block per tile")
        if fast_math and out.warp_tile is None:
            raise ScheduleError(f"fast_math puts a warp-tile kernel's tanh and logistics on tanh.approx.f32; "
                                f"{smg.name!r} has no warp-tile program: {warp_tile_reason(out)}")
        if pingpong and (not persistent or out.warp_tile is None or out.warp_tile.warps != 4):
            raise ScheduleError(f"pingpong gives a persistent block (persistent > 0, producer) two MMA warpgroups "
                                f"on alternate tiles of one warpgroup (4 warps) each; got persistent {persistent}, "
                                f"{out.warp_tile.warps if out.warp_tile else 0} warps per tile")
        if persistent and not 1 <= persistent < out.num_tiles:
            raise ScheduleError(f"persistent {persistent} blocks must be fewer than the {out.num_tiles} tiles "
                                f"(and at least 1)")
    elif (stages != 1 or warps or split != 1 or slices != 1 or reload_a or early_scores or lazy_rescale
          or mma_row_sums or wgmma or tma or producer or persistent or pingpong or fast_math):
        raise ScheduleError("stages, warps, split, slices, reload_a, early_scores, lazy_rescale, mma_row_sums, "
                            "wgmma and tma apply to tensor-core warp-tile kernels (tensor_cores=True), as do producer, "
                            "persistent, pingpong and fast_math")
    if out.threads > limit:  # one thread per tile element (x lanes), or 32 per warp of a warp-tile program
        raise ScheduleError(f"block tile {dict(block)} x {lanes} lanes needs {out.threads} threads; at most "
                            f"{limit} on {(hw or H100).name}")
    return out
