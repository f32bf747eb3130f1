"""How fast a CUDA-core kernel can pull its bytes from device memory: the memory-level parallelism
it keeps in flight (Little's law) and the inputs every block re-reads from L2.

The roofline's DRAM bandwidth is reached only with enough bytes in flight: a load stays outstanding
for the DRAM latency, so the achieved bandwidth is at most (bytes in flight) / latency.  The bytes
in flight are set by what the schedule does, which is what separates the row-reduction kernels a
hand-writer would write from the ones the search used to pick:

- a lane's loads are ``vector`` elements wide: a 16-byte vector keeps 8x the bytes of a scalar
  2-byte load in flight for the same load instructions (nvcc does not merge scalar loads: the
  lowering emits one ``ld.global`` per element unless ``vector`` > 1);
- a thread has only a few independent loads outstanding before it needs one of them
  (``LOADS_IN_FLIGHT``), and at most the loads one step gives it;
- only resident threads issue loads: blocks per SM are bounded by occupancy and by how many
  blocks there are, and SMs without a block add nothing (a 32-block grid uses 32 of 132 SMs);
- one SM's port to L2 bounds what a few busy SMs can draw (``SM_PORT_BYTES_PER_CLK``).

Checked against the H100 row norms of the whole-model runs (residual RMSNorm and LayerNorm, scalar
and vector loads, few and many blocks; measured: docs/tuning.md, 'What the cost models are fitted
to').  The scalar kernels reached the same bandwidth whatever their threads per SM, which is what
``WARP_LOADS_PER_SM`` encodes.  The model ranked them all level before (the old bandwidth share only
counted busy SMs, and vectors and scalars tied).

A warp's load is served by L1 one 32-byte sector at a time (``l1_sector_seconds``): where the warp's 32
addresses spread over more sectors than its bytes need, the extra sectors cost L1 time on top of the
memory time.  The lowering puts a row's lanes on consecutive threads, so lanes along a serial dim that
is not the input's innermost read a few bytes from each of several rows (GroupNorm's partial sums: 8
lanes over pixels read 8 bytes a sector, 32 lanes 2 bytes); measured on the H100, each extra sector
cost about one SM clock (``experiments/tuning/raw/groupnorm_round_h100/``: 47 -> 55.6 -> 68 us for 2, 4
and 8 sectors a warp load at 512x512x128).

Inputs with none of the cut dims (a norm's weight and bias, a bias vector) are the same bytes for
every block, read at about the same time: the first block's read comes from device memory, the
other blocks' from L2 where the tensor fits there (``l2_reread_bytes``); the cost model keeps
those re-reads in its L1/L2 operand term.
"""

from __future__ import annotations

import math
from functools import lru_cache

from schedulers.hardware import HardwareModel
from schedulers.schedule import Schedule, input_lane_spread
from schedulers.traffic import KernelTraffic
from smg.expr import Role, names_of
from smg.ir import SMG, itemsize

#: DRAM round-trip latency under load (H100 HBM3: ~500 ns idle, more when the memory system is busy)
DRAM_LATENCY_S = 700e-9
#: independent global loads a thread keeps outstanding before it stalls on the first one's use
#: (nvcc hoists the loads of unrolled runs ahead of their use, within its register budget)
LOADS_IN_FLIGHT = 8
#: loads a thread of an element-wise pass (no reduction: each element loaded, computed, stored) keeps
#: outstanding.  Fitted on the UNet's GroupNorm ``apply`` kernels on the H100
#: (``experiments/tuning/unet_groupnorms_h100.json``): their bandwidth followed the resident threads, about
#: 1.5 vector loads in flight each (512-thread blocks on 128 SMs drew 0.9-1.2 TB/s, two 1024-thread blocks
#: an SM 1.5-2.1), where the row norms' reductions keep ``LOADS_IN_FLIGHT``
ELEMENTWISE_LOADS_IN_FLIGHT = 1.5
#: warp-wide global loads one SM keeps outstanding (its miss-tracking capacity); at 2 bytes a lane
#: a warp load brings 64 bytes, at 16 bytes 512: calibrated on the scalar row norms above, whose
#: bandwidth on 128-132 SMs, whatever their threads, is 64 x 64 B per SM per DRAM_LATENCY_S
WARP_LOADS_PER_SM = 64
#: bytes per clock one SM can draw from L2 (its crossbar port; a few busy SMs cannot reach the
#: whole device's bandwidth however many loads they keep in flight)
SM_PORT_BYTES_PER_CLK = 64
#: a broadcast input re-read by every block is served by L2 when it is at most this share of L2
L2_SHARE = 0.25
SECTOR_BYTES = 32
#: sectors one SM's L1 serves per clock (fitted on the GroupNorm partial rounds, see the module doc)
L1_SECTORS_PER_CLK = 1.0


def _itemsize(s: Schedule, name: str) -> int:
    return int(itemsize(s.smg.space(name).dtype))


def broadcast_inputs(s: Schedule) -> tuple[str, ...]:
    """Inputs indexed by none of the cut dims: every block reads all of them (W, B of a norm)."""
    cut = {d for d, _ in s.block}
    return tuple(n for n in s.smg.inputs if not cut & set(s.smg.space(n).dims))


def l2_reread_bytes(s: Schedule, k: KernelTraffic, hw: HardwareModel) -> float:
    """Bytes of ``k``'s reads that are broadcast inputs re-read by all but the first block, where the
    input fits in L2: they come from L2, not device memory."""
    reads = dict(k.reads)
    out = 0.0
    for n in broadcast_inputs(s):
        size = math.prod(s.smg.shape(n)) * _itemsize(s, n)
        if n in reads and hw.l2_bytes and size <= L2_SHARE * hw.l2_bytes:
            out += max(0.0, reads[n] - size)
    return out


def warp_sectors(s: Schedule, name: str) -> tuple[int, int]:
    """Sectors and distinct bytes of one warp-wide load of global input ``name`` (the first one: every
    loop at 0), from the lowering's thread order: lanes fastest, then the thread dim, then the other
    block dims (``lower.tir``); a lane's serial element is ``lane * vector``, read ``vector`` wide where
    the serial dim is the input's innermost, or its place in the spread of ``schedule.input_lane_spread``.
    Cached by exactly what it reads (a search's candidates differ mostly in what it does not)."""
    return _warp_sectors(s.smg, name, s.thread_dim, s.block, s.lanes, s.vector, s.serial, s.step, s.threads,
                         input_lane_spread(s, name))


@lru_cache(maxsize=16384)
def _warp_sectors(smg: SMG, name: str, thread_dim: str, block: tuple[tuple[str, int], ...], lanes: int, vector: int,
                  serial: str, step: int, threads: int, spread: tuple[str, ...] | None) -> tuple[int, int]:
    dims = smg.space(name).dims
    shape = smg.shape(name)
    item = itemsize(smg.space(name).dtype)
    tiles = dict(block)
    order = [thread_dim] + [d for d, _ in reversed(block) if d != thread_dim]
    walk, off = smg.inner_read(name)  # a concatenation's part: its innermost dim walked by another
    wide = vector if vector > 1 and walk == serial else 1
    spans = [step if d == serial else smg.dim_sizes[d] for d in spread or ()]
    sectors: set[int] = set()
    nbytes: set[int] = set()
    for t in range(min(32, threads)):
        lane, rest = (t % lanes, t // lanes) if lanes > 1 else (0, t)
        pos: dict[str, int] = {}
        for d in order:
            pos[d] = rest % tiles[d] if d != order[-1] else rest
            rest //= tiles[d]
        if spread:  # the lanes spread over the step's serial positions and the other reduced dims
            for d, n in zip(reversed(spread), reversed(spans)):
                pos[d], lane = lane % n, lane // n
        else:
            pos[serial] = lane * vector
        flat = 0
        for d, n in zip(dims, shape):
            at = pos.get(walk, 0) + off if d == dims[-1] else pos.get(d, 0)
            flat = flat * n + max(0, min(at, n - 1))
        first = flat * item
        for b in range(first, first + wide * item):
            nbytes.add(b)
            sectors.add(b // SECTOR_BYTES)
    return len(sectors), len(nbytes)


def l1_sector_seconds(s: Schedule, k: KernelTraffic, hw: HardwareModel, skip: frozenset[str] = frozenset()) -> float:
    """L1 time of the sectors ``s``'s warp loads touch beyond the bytes they bring (``warp_sectors``), for the
    per-thread global inputs that stream (``skip``: those already charged as uncoalesced device traffic)."""
    reads = dict(k.reads)
    broadcast = set(broadcast_inputs(s))
    extra = 0.0
    for n in s.smg.inputs:
        if n in skip or n in broadcast or s.level(n) != "global" or n not in reads:
            continue
        sectors, useful = warp_sectors(s, n)
        need = -(-useful // SECTOR_BYTES)
        if sectors > need:
            extra += reads[n] / useful * (sectors - need)  # warp loads x their extra sectors
    busy = min(hw.num_sms, s.num_blocks)
    return extra / (busy * L1_SECTORS_PER_CLK * hw.clock_hz)


def view_reuse(s: Schedule, name: str) -> float:
    """How many times a view (``window``: a pool's or a conv's taps) reads each element of input ``name``: its
    points over the input's elements (1 for an input read plainly).  Overlapping windows re-read neighbours
    from L1/L2, and a load that hits there frees its miss slot long before ``DRAM_LATENCY_S``: the miss slots
    then carry that many times the scalar loads' device-memory bytes.  Measured: ResNet-50's stem pool (3x3,
    stride 2: 2.25 reads an element) drew 1.8 TB/s with scalar fp16 loads on the H100, 2.3x the row norms'
    cap (``experiments/tuning/raw/pool_round_view3_h100.json``)."""
    smg = s.smg
    for op in smg.ops:
        if op.kind == "window" and any(a.space == name for a in op.inputs):
            size = math.prod(smg.dim_sizes[d] for d in smg.space(name).dims)
            return max(1.0, math.prod(smg.dim_sizes[d] for d in op.iter_dims) / size)
    return 1.0


def view_run_bytes(s: Schedule, name: str) -> float | None:
    """Bytes of the run of neighbours consecutive threads read of input ``name`` through a view (``window``),
    None where it is read plainly: the lanes' or the thread dim's tile of elements where that dim is in the
    expression of the input's innermost index, else one element (the threads a channel row or more apart)."""
    for op in s.smg.ops:
        acc = next((a for a in op.inputs if a.space == name), None) if op.kind == "window" else None
        if acc is None:
            continue
        fastest = s.serial if s.lanes > 1 else s.thread_dim
        inner = names_of(acc.index[-1], Role.INDEX)
        run = (min(s.lanes, s.step) if s.lanes > 1 else s.tiles.get(fastest, 1)) if fastest in inner else 1
        return float(run * _itemsize(s, name))
    return None


def _per_thread_loads(s: Schedule, uncoalesced: frozenset[str]) -> tuple[int, float]:
    """Global load instructions one thread issues per step for the inputs that stream from device
    memory, and the device-memory bytes they keep in flight (a whole sector for a load whose neighbours
    are far apart; a view's re-reads scaled by ``view_reuse``)."""
    lane_step = -(-s.step // s.row_lanes)
    broadcast = set(broadcast_inputs(s))
    loads, nbytes = 0, 0.0
    for n in s.smg.inputs:
        if s.level(n) != "global" or n in broadcast:
            continue  # staged inputs are loaded cooperatively: counted below with the block's threads
        dims = s.smg.space(n).dims
        viewed = view_run_bytes(s, n) is not None
        # a view streams the input along its own dims (a pool's taps): a load per serial element as well
        per_elem = lane_step if s.serial in dims or viewed or s.smg.inner_read(n)[0] == s.serial else 1
        width = s.vector if s.vector > 1 and s.smg.inner_read(n)[0] == s.serial else 1
        count = -(-per_elem // width)
        loads += count
        item = width * _itemsize(s, n)
        if viewed:
            # a view's short runs (a sector's worth of threads spread over several sectors) hold a miss slot
            # per sector, not more bytes per slot: their extra sectors are extra bytes at the same cap (a pool's
            # 8-channel runs took 100 us on the H100, its 64-channel ones 36)
            nbytes += count * item * view_reuse(s, n)
            continue
        nbytes += count * (SECTOR_BYTES if n in uncoalesced else item)
    staged = [n for n in s.smg.inputs if s.level(n) == "shared" and n not in broadcast]
    for n in staged:  # a staged tile is copied element by element, spread over the block's threads
        tile = math.prod(s.tiles.get(d, s.step if d == s.serial else s.smg.dim_sizes[d])
                         for d in s.smg.space(n).dims)
        count = -(-tile // s.threads)
        loads += count
        nbytes += count * _itemsize(s, n)
    return loads, nbytes


def dram_bandwidth(s: Schedule, hw: HardwareModel, occupancy: int, threads: int,
                   uncoalesced: frozenset[str] = frozenset()) -> float:
    """Bytes/s a CUDA-core schedule can draw from device memory: the peak, or less where its
    resident threads keep too few bytes in flight or too few SMs have blocks."""
    blocks = s.num_blocks
    busy = min(hw.num_sms, blocks)
    per_sm = min(max(1, occupancy), -(-blocks // hw.num_sms)) * threads
    loads, nbytes = _per_thread_loads(s, uncoalesced)
    if loads == 0:
        return hw.dram_bandwidth_bytes_per_s
    per_load = nbytes / loads  # bytes one thread's load brings in, on average
    ahead = LOADS_IN_FLIGHT if any(op.reduce for op in s.smg.ops) else ELEMENTWISE_LOADS_IN_FLIGHT
    in_flight = min(per_sm * min(loads, ahead), WARP_LOADS_PER_SM * 32) * per_load  # per SM
    little = busy * in_flight / DRAM_LATENCY_S
    port = busy * SM_PORT_BYTES_PER_CLK * hw.clock_hz
    return max(1.0, min(hw.dram_bandwidth_bytes_per_s, little, port))
