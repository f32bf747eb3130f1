"""Hardware models: frozen, hashable records whose field names carry their units.

The resource-aware scheduler asks a model whether a block fits (shared memory, threads,
registers), how many blocks an SM holds, how many waves a grid takes and how long a kernel
takes at best (roofline).  Presets carry vendor numbers and say in ``source`` where each comes
from; ``from_device`` queries the GPU in hand.  Importing this module needs the standard
library only: cupy / torch are imported lazily inside ``from_device``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "A100",
    "CPU_STAND_IN",
    "DEFAULT_GPU",
    "H100",
    "H200",
    "NPU",
    "PRESETS",
    "V100",
    "HardwareChoice",
    "HardwareError",
    "HardwareModel",
    "ResourceError",
    "ZERO_ALLOWED_FIELDS",
    "choose_hardware",
    "from_device",
    "get_hardware",
    "local_device",
    "preset_of_device",
]

KiB = 1024
MiB = 1024**2
GiB = 1024**3

#: Registers are allocated per warp in units of this many (all NVIDIA GPUs since Volta).
_REG_ALLOC_UNIT = 256
#: Shared-memory bandwidth estimate: 32 banks x 4 B per SM clock (all NVIDIA GPUs since Volta).
_SMEM_BYTES_PER_CLK = 128


class HardwareError(ValueError):
    """A hardware model is malformed, unknown, or lacks the number asked for."""

    def __init__(self, message: str = "", *, code: str = "hardware") -> None:
        super().__init__(message)
        self.code = code  # stable: the search counts refusals by it


class ResourceError(HardwareError):
    """A block does not fit the hardware; the message names the resource, the need and the limit, and
    ``code`` (``resource.shared_memory``, ``resource.threads``, ``resource.registers``, ``resource.sm``)
    the resource."""


_INT_FIELDS = (
    "num_sms", "smem_per_sm_bytes", "smem_per_block_bytes", "smem_static_per_block_bytes",
    "smem_reserved_per_block_bytes", "regs_per_sm", "regs_per_block", "regs_per_thread_max",
    "max_threads_per_block", "max_threads_per_sm", "max_blocks_per_sm", "warp_size", "l2_bytes", "dram_bytes",
)
_FLOAT_FIELDS = (
    "clock_hz", "dram_bandwidth_bytes_per_s", "l2_bandwidth_bytes_per_s", "smem_bandwidth_bytes_per_s_per_sm",
)
#: Numeric fields that may be 0: no reservation (Volta, NPU), no hardware-managed L2 (NPU) or unknown.
ZERO_ALLOWED_FIELDS = frozenset({"smem_reserved_per_block_bytes", "l2_bytes", "l2_bandwidth_bytes_per_s"})

_DTYPE_ALIASES = {
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp64": "float64", "double": "float64", "f64": "float64",
    "fp8": "float8_e4m3", "e4m3": "float8_e4m3", "float8_e4m3fn": "float8_e4m3",
    "e5m2": "float8_e5m2", "float8_e5m2fnuz": "float8_e5m2", "float8_e4m3fnuz": "float8_e4m3",
}


def _dtype_key(dtype: Any) -> str:
    """Canonical dtype key: accepts 'fp16', numpy/torch dtypes ('torch.float16'), ..."""
    key = str(dtype).strip().lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(key, key)


def _kib(n: float) -> str:
    return f"{n / KiB:.1f} KiB"


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def _norm_peaks(where: str, value: Any) -> tuple[tuple[str, float], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    out: dict[str, float] = {}
    try:
        for key, peak in items:
            k = _dtype_key(key)
            if k in out:
                raise HardwareError(f"{where}: dtype {k!r} listed twice")
            if isinstance(peak, bool) or not isinstance(peak, int | float) or not math.isfinite(peak) or peak <= 0:
                raise HardwareError(f"{where}[{k!r}] must be a positive finite number, got {peak!r}")
            out[k] = float(peak)
    except (TypeError, ValueError) as e:
        if isinstance(e, HardwareError):
            raise
        raise HardwareError(f"{where} must be (dtype, FLOP/s) pairs or a mapping, got {value!r}") from e
    return tuple(sorted(out.items()))


def _norm_mma(value: Any) -> tuple[tuple[str, tuple[tuple[int, int, int], ...]], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    out: dict[str, tuple[tuple[int, int, int], ...]] = {}
    try:
        for key, shapes in items:
            k = _dtype_key(key)
            if k in out:
                raise HardwareError(f"mma_shapes: dtype {k!r} listed twice")
            norm = []
            for shape in shapes:
                mnk = tuple(shape)
                if len(mnk) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in mnk):
                    raise HardwareError(f"mma_shapes[{k!r}]: {shape!r} is not three positive ints (m, n, k)")
                norm.append(mnk)
            if not norm:
                raise HardwareError(f"mma_shapes[{k!r}] is empty")
            out[k] = tuple(norm)
    except (TypeError, ValueError) as e:
        if isinstance(e, HardwareError):
            raise
        raise HardwareError(f"mma_shapes must be (dtype, ((m, n, k), ...)) pairs or a mapping, got {value!r}") from e
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class HardwareModel:
    """One accelerator, as the scheduler needs it.  Immutable and hashable (tuples, not dicts).

    GPU terms are used for the NPU too: an SM is an NPU core, and shared memory is the core's
    explicit on-chip SRAM.  Thread and register limits are GPU notions and are not checked for
    ``kind == "npu"`` (a core runs one block; its fields hold placeholders of 1).
    """

    name: str
    kind: str  # "gpu" | "npu"
    arch: str  # e.g. "sm_90a"; "" for the NPU
    num_sms: int  # NPU: number of cores
    clock_hz: float  # boost clock of the SMs
    smem_per_sm_bytes: int
    smem_per_block_bytes: int  # largest dynamic allocation a block may opt in to
    smem_static_per_block_bytes: int  # static (__shared__) limit, 48 KiB on NVIDIA; NPU: the SRAM size
    smem_reserved_per_block_bytes: int  # taken by the driver per resident block (1 KiB since sm_80)
    regs_per_sm: int
    regs_per_block: int
    regs_per_thread_max: int
    max_threads_per_block: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    warp_size: int
    l2_bytes: int
    dram_bytes: int
    dram_bandwidth_bytes_per_s: float
    l2_bandwidth_bytes_per_s: float  # estimate; vendors rarely publish it
    smem_bandwidth_bytes_per_s_per_sm: float  # estimate: bytes per clock x clock
    peak_flops_per_s: tuple[tuple[str, float], ...]  # dense tensor-core / matrix-unit peak per input dtype
    peak_simt_flops_per_s: tuple[tuple[str, float], ...]  # CUDA-core (non-tensor) peak per dtype
    mma_shapes: tuple[tuple[str, tuple[tuple[int, int, int], ...]], ...]  # mma.sync (m, n, k) per input dtype
    source: str  # where the numbers come from

    def __post_init__(self) -> None:
        """Validate and canonicalise, so equal hardware gives equal records and equal fingerprints."""
        for f in ("name", "kind", "arch", "source"):
            if not isinstance(getattr(self, f), str):
                raise HardwareError(f"{f} must be a str, got {getattr(self, f)!r}")
        if self.kind not in ("gpu", "npu"):
            raise HardwareError(f"{self.name}: kind must be 'gpu' or 'npu', got {self.kind!r}")
        for f in _INT_FIELDS:
            v = getattr(self, f)
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int):
                raise HardwareError(f"{self.name}: {f} must be an int, got {v!r}")
            if v < 0 or (v == 0 and f not in ZERO_ALLOWED_FIELDS):
                raise HardwareError(f"{self.name}: {f} must be {'>= 0' if f in ZERO_ALLOWED_FIELDS else '> 0'}, "
                                    f"got {v}")
            object.__setattr__(self, f, v)
        for f in _FLOAT_FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise HardwareError(f"{self.name}: {f} must be a finite number, got {v!r}")
            if v < 0 or (v == 0 and f not in ZERO_ALLOWED_FIELDS):
                raise HardwareError(f"{self.name}: {f} must be {'>= 0' if f in ZERO_ALLOWED_FIELDS else '> 0'}, "
                                    f"got {v}")
            object.__setattr__(self, f, float(v))
        object.__setattr__(self, "peak_flops_per_s", _norm_peaks("peak_flops_per_s", self.peak_flops_per_s))
        object.__setattr__(self, "peak_simt_flops_per_s",
                           _norm_peaks("peak_simt_flops_per_s", self.peak_simt_flops_per_s))
        object.__setattr__(self, "mma_shapes", _norm_mma(self.mma_shapes))
        if not self.smem_static_per_block_bytes <= self.smem_per_block_bytes <= self.smem_per_sm_bytes:
            raise HardwareError(f"{self.name}: need smem static ({self.smem_static_per_block_bytes}) <= per block "
                                f"({self.smem_per_block_bytes}) <= per SM ({self.smem_per_sm_bytes}) bytes")
        if self.regs_per_block > self.regs_per_sm or self.max_threads_per_block > self.max_threads_per_sm:
            raise HardwareError(f"{self.name}: a block's register / thread limit exceeds the SM's")

    # ------------------------------------------------------------------ peaks and roofline
    def peak_flops(self, dtype: Any, tensor_core: bool = True) -> float:
        """Dense peak FLOP/s (int8: OP/s) for ``dtype`` on the tensor cores / matrix unit or the SIMT cores."""
        key = _dtype_key(dtype)
        table = dict(self.peak_flops_per_s if tensor_core else self.peak_simt_flops_per_s)
        if key in table:
            return table[key]
        unit = "tensor-core" if tensor_core else "SIMT (non-tensor)"
        other = dict(self.peak_simt_flops_per_s if tensor_core else self.peak_flops_per_s)
        hint = f"; {key!r} is known with tensor_core={not tensor_core}" if key in other else ""
        if tensor_core and key == "float32" and "tf32" in table:
            hint += "; fp32 matmuls on tensor cores run as 'tf32'"
        raise HardwareError(f"{self.name} has no {unit} peak for dtype {key!r}; known: "
                            f"{', '.join(table) or 'none'}{hint}")

    def mma_shapes_for(self, dtype: Any) -> tuple[tuple[int, int, int], ...]:
        """The mma.sync (m, n, k) shapes for input ``dtype``, preferred first."""
        key = _dtype_key(dtype)
        table = dict(self.mma_shapes)
        if key not in table:
            raise HardwareError(f"{self.name} has no MMA shape for dtype {key!r}; known: {', '.join(table) or 'none'}")
        return table[key]

    def ridge_point(self, dtype: Any, tensor_core: bool = True) -> float:
        """Arithmetic intensity (FLOP per DRAM byte) above which a kernel is compute bound."""
        return self.peak_flops(dtype, tensor_core) / self.dram_bandwidth_bytes_per_s

    def roofline_time_s(self, flops: float, nbytes: float, dtype: Any, tensor_core: bool = True) -> float:
        """Lower bound on run time: the slower of computing ``flops`` and moving ``nbytes`` through DRAM."""
        if flops < 0 or nbytes < 0:
            raise HardwareError(f"flops and nbytes must be >= 0, got {flops}, {nbytes}")
        return max(flops / self.peak_flops(dtype, tensor_core), nbytes / self.dram_bandwidth_bytes_per_s)

    # ------------------------------------------------------------------ occupancy and limits
    def waves(self, num_blocks: int, blocks_per_sm: int) -> int:
        """Number of waves a grid of ``num_blocks`` takes when every SM holds ``blocks_per_sm`` at a time."""
        if blocks_per_sm <= 0:
            raise HardwareError(f"blocks_per_sm must be > 0 (0 means the block does not fit {self.name}), "
                                f"got {blocks_per_sm}")
        if num_blocks < 0:
            raise HardwareError(f"num_blocks must be >= 0, got {num_blocks}")
        return math.ceil(num_blocks / (blocks_per_sm * self.num_sms))

    def _regs_per_warp(self, regs_per_thread: int) -> int:
        return _round_up(regs_per_thread * self.warp_size, _REG_ALLOC_UNIT)

    def occupancy_blocks_per_sm(self, smem_bytes: int, threads: int, regs_per_thread: int = 0) -> int:
        """Resident blocks per SM: the minimum over the shared-memory, thread, register and block limits.

        0 when one block does not fit.  ``regs_per_thread=0`` leaves registers out.  Like the CUDA
        occupancy calculator it counts the per-block shared-memory reservation and allocates
        registers per warp in units of 256; it ignores the shared-memory allocation granularity
        and the L1/shared carve-out (the whole ``smem_per_sm_bytes`` is taken as available).
        """
        if smem_bytes < 0 or threads <= 0 or regs_per_thread < 0:
            raise HardwareError(f"need smem_bytes >= 0, threads > 0, regs_per_thread >= 0; "
                                f"got {smem_bytes}, {threads}, {regs_per_thread}")
        if smem_bytes > self.smem_per_block_bytes:
            return 0
        limits = [self.max_blocks_per_sm]
        per_block = smem_bytes + self.smem_reserved_per_block_bytes
        if per_block:
            limits.append(self.smem_per_sm_bytes // per_block)
        if self.kind == "gpu":
            if threads > self.max_threads_per_block:
                return 0
            warps = math.ceil(threads / self.warp_size)
            limits.append(self.max_threads_per_sm // (warps * self.warp_size))
            if regs_per_thread:
                per_warp = self._regs_per_warp(regs_per_thread)
                if regs_per_thread > self.regs_per_thread_max or per_warp * warps > self.regs_per_block:
                    return 0
                limits.append(self.regs_per_sm // per_warp // warps)
        return max(0, min(limits))

    def check_block(self, smem_bytes: int, threads: int, regs_per_thread: int | None = None, *,
                    dynamic: bool = False) -> None:
        """Raise ResourceError naming the resource, need and limit if one block cannot launch; else None.

        ``dynamic`` says the shared memory is allocated dynamically (with the opt-in attribute), so it
        may go up to ``smem_per_block_bytes``; static ``__shared__`` memory stops at 48 KiB on NVIDIA.
        ``regs_per_thread=None`` leaves registers out.
        """
        if smem_bytes < 0 or threads <= 0:
            raise HardwareError(f"need smem_bytes >= 0 and threads > 0, got {smem_bytes}, {threads}")
        if self.kind == "npu":
            if smem_bytes > self.smem_per_block_bytes:
                raise ResourceError(f"shared memory: block needs {_kib(smem_bytes)}, {self.name} allows "
                                    f"{_kib(self.smem_per_block_bytes)} of on-chip SRAM per core",
                code="resource.shared_memory")
            return
        limit = self.smem_per_block_bytes if dynamic else self.smem_static_per_block_bytes
        if smem_bytes > limit:
            hint = ""
            if not dynamic and smem_bytes <= self.smem_per_block_bytes:
                hint = " (it would fit as dynamic shared memory with the opt-in attribute)"
            raise ResourceError(f"shared memory: block needs {_kib(smem_bytes)}, {self.name} allows "
                                f"{_kib(self.smem_static_per_block_bytes)} static / "
                                f"{_kib(self.smem_per_block_bytes)} dynamic per block{hint}",
                                code="resource.shared_memory")
        if threads > self.max_threads_per_block:
            raise ResourceError(f"threads: block needs {threads} threads, {self.name} allows "
                                f"{self.max_threads_per_block} per block", code="resource.threads")
        if regs_per_thread is not None:
            if regs_per_thread > self.regs_per_thread_max:
                raise ResourceError(f"registers: block needs {regs_per_thread} registers per thread, {self.name} "
                                    f"allows {self.regs_per_thread_max} per thread", code="resource.registers")
            need = self._regs_per_warp(regs_per_thread) * math.ceil(threads / self.warp_size)
            if need > self.regs_per_block:
                raise ResourceError(f"registers: block needs {need} registers ({threads} threads x "
                                    f"{regs_per_thread} per thread, allocated per warp in units of "
                                    f"{_REG_ALLOC_UNIT}), {self.name} allows {self.regs_per_block} per block",
                                    code="resource.registers")

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: per-dtype tables become objects, shapes lists."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["peak_flops_per_s"] = dict(self.peak_flops_per_s)
        d["peak_simt_flops_per_s"] = dict(self.peak_simt_flops_per_s)
        d["mma_shapes"] = {k: [list(s) for s in v] for k, v in self.mma_shapes}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HardwareModel:
        """Inverse of ``to_dict`` (also after a JSON round trip); every field must be present, no others."""
        if not isinstance(d, Mapping):
            raise HardwareError(f"hardware record must be a mapping, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in d]
        unknown = sorted(set(d) - set(names))
        if missing or unknown:
            raise HardwareError(f"hardware record {d.get('name', '?')!r}: missing fields {missing}, "
                                f"unknown fields {unknown}")
        return cls(**{n: d[n] for n in names})

    @property
    def fingerprint(self) -> str:
        """sha256 hex of the canonical JSON of the record: content-based and stable across processes."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    # ------------------------------------------------------------------ what kernels for a target may use
    def capabilities(self, arch: str | None = None) -> Capabilities:
        """What kernels built for ``arch`` (default: this model's own) may use on this model: the features the
        arch has and the model's block limits.  The option groups (``schedulers.options``) refuse a knob the
        target cannot run with these before the search enumerates it, as Triton's ``parse_options`` refuses
        what the target cannot do before compiling; the lowering's checks (``spacefusion.lower.build``) are
        a safety net behind them.  Derived, not stored: ``to_dict`` and the fingerprint are unchanged."""
        arch = self.arch if arch is None else arch
        sm = _sm_version(arch) if self.kind == "gpu" else None
        major = sm[0] if sm else 0
        return Capabilities(arch=arch, wgmma=sm == (90, True), tma=major >= 90, clusters=major >= 90,
                            mma_sync=major >= 80,
                            max_dynamic_smem_bytes=self.smem_per_block_bytes,
                            max_threads_per_block=self.max_threads_per_block)


@dataclass(frozen=True)
class Capabilities:
    """What kernels for one target may use (``HardwareModel.capabilities``).  Each flag says which
    architectures have the feature, from the PTX ISA."""

    arch: str
    #: warpgroup MMA (wgmma.mma_async) and setmaxnreg: sm_90a only (not plain sm_90, not sm_100a)
    wgmma: bool
    #: the Tensor Memory Accelerator (cp.async.bulk.tensor) with mbarrier transaction counts: sm_90 and later
    tma: bool
    #: thread-block clusters and distributed shared memory: sm_90 and later
    clusters: bool
    #: the warp-tile programs' ``mma.sync.m16n8k16`` on fp16/bf16: sm_80 and later (a V100 has WMMA only)
    mma_sync: bool
    #: the most dynamic shared memory a block may opt in to (``smem_per_block_bytes``)
    max_dynamic_smem_bytes: int
    #: the most threads a block may have
    max_threads_per_block: int


def _sm_version(arch: str) -> tuple[int, bool] | None:
    """``"sm_90a"`` -> (90, True), ``"sm_80"`` -> (80, False); None for anything else (the NPU's "")."""
    head, _, tail = arch.partition("_")
    if head != "sm" or not tail:
        return None
    suffix = tail.endswith("a")
    digits = tail[:-1] if suffix else tail
    return (int(digits), suffix) if digits.isdigit() else None


# ---------------------------------------------------------------------- presets

_MMA_SM80: dict[str, tuple[tuple[int, int, int], ...]] = {
    "float16": ((16, 8, 16), (16, 8, 8)),
    "bfloat16": ((16, 8, 16), (16, 8, 8)),
    "tf32": ((16, 8, 8), (16, 8, 4)),
    "int8": ((16, 8, 32), (16, 8, 16)),
    "float64": ((8, 8, 4),),
}
_MMA_SM89 = {**_MMA_SM80, "float8_e4m3": ((16, 8, 32),), "float8_e5m2": ((16, 8, 32),)}
_MMA_SM70 = {"float16": ((8, 8, 4),)}

V100 = HardwareModel(
    name="V100", kind="gpu", arch="sm_70",
    num_sms=80, clock_hz=1.53e9,
    smem_per_sm_bytes=96 * KiB, smem_per_block_bytes=96 * KiB, smem_static_per_block_bytes=48 * KiB,
    smem_reserved_per_block_bytes=0,
    regs_per_sm=65536, regs_per_block=65536, regs_per_thread_max=255,
    max_threads_per_block=1024, max_threads_per_sm=2048, max_blocks_per_sm=32, warp_size=32,
    l2_bytes=6 * MiB, dram_bytes=32 * GiB,
    dram_bandwidth_bytes_per_s=900e9,
    l2_bandwidth_bytes_per_s=2048 * 1.53e9,
    smem_bandwidth_bytes_per_s_per_sm=_SMEM_BYTES_PER_CLK * 1.53e9,
    peak_flops_per_s=(("float16", 125e12),),
    peak_simt_flops_per_s=(("float16", 31.4e12), ("float32", 15.7e12), ("float64", 7.8e12)),
    mma_shapes=tuple(_MMA_SM70.items()),
    source=("Tesla V100 SXM2 32GB: NVIDIA V100 datasheet (125 TFLOPS fp16 tensor, 15.7 fp32, 7.8 fp64, "
            "900 GB/s HBM2) and Volta whitepaper (80 SMs, 1530 MHz boost, 6 MB L2, 96 KB shared/SM); limits from "
            "the CUDA Programming Guide, compute capability 7.0; mma.sync m8n8k4 from the PTX ISA; L2 bandwidth "
            "2048 B/clk from the A100 whitepaper; shared-memory bandwidth estimated as 32 banks x 4 B/clk"),
)

A100 = HardwareModel(
    name="A100", kind="gpu", arch="sm_80",
    num_sms=108, clock_hz=1.41e9,
    smem_per_sm_bytes=164 * KiB, smem_per_block_bytes=163 * KiB, smem_static_per_block_bytes=48 * KiB,
    smem_reserved_per_block_bytes=1 * KiB,
    regs_per_sm=65536, regs_per_block=65536, regs_per_thread_max=255,
    max_threads_per_block=1024, max_threads_per_sm=2048, max_blocks_per_sm=32, warp_size=32,
    l2_bytes=40 * MiB, dram_bytes=80 * GiB,
    dram_bandwidth_bytes_per_s=2039e9,
    l2_bandwidth_bytes_per_s=5120 * 1.41e9,
    smem_bandwidth_bytes_per_s_per_sm=_SMEM_BYTES_PER_CLK * 1.41e9,
    peak_flops_per_s=(("float16", 312e12), ("bfloat16", 312e12), ("tf32", 156e12), ("int8", 624e12),
                      ("float64", 19.5e12)),
    peak_simt_flops_per_s=(("float16", 78e12), ("bfloat16", 39e12), ("float32", 19.5e12), ("float64", 9.7e12)),
    mma_shapes=tuple(_MMA_SM80.items()),
    source=("A100 SXM4 80GB: NVIDIA A100 datasheet (dense tensor 312 TFLOPS fp16/bf16, 156 tf32, 624 TOPS int8, "
            "19.5 fp64; 19.5 fp32, 2039 GB/s HBM2e) and Ampere GA100 whitepaper (108 SMs, 1410 MHz boost, 40 MB L2, "
            "164 KB shared/SM, L2 5120 B/clk, non-tensor fp16 78 / bf16 39 TFLOPS); limits from the CUDA "
            "Programming Guide, compute capability 8.0 (163 KB opt-in per block, 1 KB reserved per block); mma.sync "
            "shapes from the PTX ISA; shared-memory bandwidth estimated as 32 banks x 4 B/clk"),
)

H100 = HardwareModel(
    name="H100", kind="gpu", arch="sm_90a",
    num_sms=132, clock_hz=1.98e9,
    smem_per_sm_bytes=228 * KiB, smem_per_block_bytes=227 * KiB, smem_static_per_block_bytes=48 * KiB,
    smem_reserved_per_block_bytes=1 * KiB,
    regs_per_sm=65536, regs_per_block=65536, regs_per_thread_max=255,
    max_threads_per_block=1024, max_threads_per_sm=2048, max_blocks_per_sm=32, warp_size=32,
    l2_bytes=50 * MiB, dram_bytes=80 * GiB,
    dram_bandwidth_bytes_per_s=3.35e12,
    l2_bandwidth_bytes_per_s=10.0e12,
    smem_bandwidth_bytes_per_s_per_sm=_SMEM_BYTES_PER_CLK * 1.98e9,
    peak_flops_per_s=(("float16", 989.4e12), ("bfloat16", 989.4e12), ("tf32", 494.7e12),
                      ("float8_e4m3", 1979e12), ("float8_e5m2", 1979e12), ("int8", 1979e12), ("float64", 66.9e12)),
    peak_simt_flops_per_s=(("float16", 133.8e12), ("bfloat16", 133.8e12), ("float32", 66.9e12),
                           ("float64", 33.5e12)),
    mma_shapes=tuple(_MMA_SM89.items()),
    source=("H100 SXM5 80GB HBM3: NVIDIA H100 datasheet and Hopper whitepaper (132 SMs, dense tensor 989.4 TFLOPS "
            "fp16/bf16, 494.7 tf32, 1979 fp8 and int8 (half the sparse 3958), 66.9 fp64; non-tensor 66.9 fp32, "
            "133.8 fp16/bf16, 33.5 fp64; 3.35 TB/s, 50 MB L2, 228 KB shared/SM). clock_hz is the 1980 MHz max "
            "boost, at which fp32 = 66.9 TFLOPS; the tensor peaks correspond to about 1830 MHz. Limits from the "
            "CUDA Programming Guide, compute capability 9.0 (227 KB opt-in per block, 1 KB reserved per block); "
            "mma.sync shapes from the PTX ISA (wgmma not listed); L2 bandwidth ~10 TB/s is an estimate "
            "(NVIDIA publishes none; our 128x128 wgmma GEMM streams 2.1 GB of tiles from L2 in 262 us, >= 8.2 TB/s); "
            "shared-memory bandwidth estimated as 32 banks x 4 B/clk"),
)

H200 = dataclasses.replace(
    H100,
    name="H200",
    dram_bytes=141 * GiB,
    dram_bandwidth_bytes_per_s=4.8e12,
    source=("H200 SXM 141GB HBM3e: NVIDIA H200 datasheet (4.8 TB/s, 141 GB; same GH100 compute as H100 SXM5, "
            "so SMs, clocks, peaks, limits and MMA shapes are the H100 preset's, which see)"),
)

NPU = HardwareModel(
    name="NPU", kind="npu", arch="",
    num_sms=32, clock_hz=1.0e9,
    smem_per_sm_bytes=96 * KiB, smem_per_block_bytes=96 * KiB, smem_static_per_block_bytes=96 * KiB,
    smem_reserved_per_block_bytes=0,
    regs_per_sm=1, regs_per_block=1, regs_per_thread_max=1,
    max_threads_per_block=1, max_threads_per_sm=1, max_blocks_per_sm=1, warp_size=1,
    l2_bytes=0, dram_bytes=32 * GiB,
    dram_bandwidth_bytes_per_s=1e12,
    l2_bandwidth_bytes_per_s=0.0,
    smem_bandwidth_bytes_per_s_per_sm=512 * 1.0e9,
    peak_flops_per_s=(("int8", 200e12), ("float16", 100e12)),
    peak_simt_flops_per_s=(),
    mma_shapes=(("float16", ((16, 16, 16),)), ("int8", ((16, 16, 32),))),
    source=("NPU from the project's design notes: 200 TOPS int8, 1 TB/s DRAM, explicit on-chip SRAM of 96 KB per "
            "core (the notes' FlashAttention exercise), hence a ridge point of 200 ops/byte. Assumptions, not from "
            "the notes: fp16 at half the int8 rate (100 TFLOPS); 32 cores; 1 GHz clock (not used by the peaks); "
            "SRAM bandwidth 512 B/clk per core; 32 GiB DRAM; no hardware-managed L2 (0); no separate vector-unit "
            "peak (peak_simt_flops_per_s empty); 16x16x16 fp16 / 16x16x32 int8 matrix-unit shapes; one block per "
            "core, thread and register fields are placeholders (1) that are not checked"),
)

PRESETS: dict[str, HardwareModel] = {"v100": V100, "a100": A100, "h100": H100, "h200": H200, "npu": NPU}

_ALIASES = {
    "tesla-v100": "v100", "v100-sxm2": "v100", "v100-sxm2-32gb": "v100", "v100-32gb": "v100",
    "a100-sxm4": "a100", "a100-sxm": "a100", "a100-sxm4-80gb": "a100", "a100-80gb": "a100",
    "h100-sxm": "h100", "h100-sxm5": "h100", "h100-sxm5-80gb": "h100", "h100-80gb": "h100", "h100-80gb-hbm3": "h100",
    "h200-sxm": "h200", "h200-sxm-141gb": "h200", "h200-141gb": "h200",
    "npu-200tops": "npu",
}


def get_hardware(name: str | HardwareModel) -> HardwareModel:
    """Preset by name, case-insensitive, with aliases ('H100-SXM', 'nvidia a100', ...); a model passes through."""
    if isinstance(name, HardwareModel):
        return name
    key = str(name).strip().lower().replace("_", "-").replace(" ", "-").removeprefix("nvidia-")
    key = _ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    raise HardwareError(f"unknown hardware {name!r}; known: {', '.join(PRESETS)} "
                        f"(aliases: {', '.join(sorted(_ALIASES))})")


# ---------------------------------------------------------------------- querying the device

# cudaDeviceAttr numbers, stable across CUDA versions (driver_types.h).
_ATTR_CLOCK_RATE_KHZ = 13
_ATTR_MEMORY_CLOCK_RATE_KHZ = 36
_ATTR_MEMORY_BUS_WIDTH_BITS = 37


def _query_cupy(index: int) -> dict[str, Any] | None:
    """Device properties via cupy, in this module's units; None when cupy is missing or sees no device."""
    try:
        import cupy
    except ImportError:
        return None
    rt = cupy.cuda.runtime
    try:
        if index >= rt.getDeviceCount():
            return None
        p = rt.getDeviceProperties(index)
    except Exception:  # CUDARuntimeError: no driver / no device
        return None

    def attr(num: int, key: str) -> int | None:
        if p.get(key):
            return int(p[key])
        try:
            return int(rt.deviceGetAttribute(num, index))
        except Exception:
            return None

    name = p.get("name", b"")
    clock_khz = attr(_ATTR_CLOCK_RATE_KHZ, "clockRate")
    mem_khz = attr(_ATTR_MEMORY_CLOCK_RATE_KHZ, "memoryClockRate")
    return {
        "via": "cupy",
        "name": name.decode(errors="replace") if isinstance(name, bytes) else str(name),
        "major": p.get("major"), "minor": p.get("minor"),
        "num_sms": p.get("multiProcessorCount"),
        "clock_hz": clock_khz * 1e3 if clock_khz else None,
        "smem_per_sm_bytes": p.get("sharedMemPerMultiprocessor"),
        "smem_per_block_bytes": p.get("sharedMemPerBlockOptin"),
        "smem_static_per_block_bytes": p.get("sharedMemPerBlock"),
        "smem_reserved_per_block_bytes": p.get("reservedSharedMemPerBlock"),
        "regs_per_sm": p.get("regsPerMultiprocessor"),
        "regs_per_block": p.get("regsPerBlock"),
        "max_threads_per_block": p.get("maxThreadsPerBlock"),
        "max_threads_per_sm": p.get("maxThreadsPerMultiProcessor"),
        "max_blocks_per_sm": p.get("maxBlocksPerMultiProcessor"),
        "warp_size": p.get("warpSize"),
        "l2_bytes": p.get("l2CacheSize"),
        "dram_bytes": p.get("totalGlobalMem"),
        "mem_clock_hz": mem_khz * 1e3 if mem_khz else None,
        "bus_width_bits": attr(_ATTR_MEMORY_BUS_WIDTH_BITS, "memoryBusWidth"),
    }


def _query_torch(index: int) -> dict[str, Any] | None:
    """Device properties via torch (no clocks or bus width there); None when torch is missing or sees no device."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            return None
        p = torch.cuda.get_device_properties(index)
    except Exception:
        return None

    def g(key: str) -> Any:  # attributes vary across torch versions
        return getattr(p, key, None)

    return {
        "via": "torch",
        "name": str(p.name), "major": g("major"), "minor": g("minor"),
        "num_sms": g("multi_processor_count"), "clock_hz": None,
        "smem_per_sm_bytes": g("shared_memory_per_multiprocessor"),
        "smem_per_block_bytes": g("shared_memory_per_block_optin"),
        "smem_static_per_block_bytes": g("shared_memory_per_block"),
        "smem_reserved_per_block_bytes": None,
        "regs_per_sm": g("regs_per_multiprocessor"), "regs_per_block": None,
        "max_threads_per_block": None, "max_threads_per_sm": g("max_threads_per_multi_processor"),
        "max_blocks_per_sm": None, "warp_size": g("warp_size"),
        "l2_bytes": g("L2_cache_size"), "dram_bytes": g("total_memory"),
        "mem_clock_hz": None, "bus_width_bits": None,
    }


def preset_of_device(name: str, capability: tuple[int, int] | None = None) -> HardwareModel | None:
    """The preset a device's name ("NVIDIA H200", "NVIDIA H100 PCIe", ...) names, or None: the key a
    measurement on that device is filed under.  With ``capability`` (major, minor), a name that names no
    preset falls back to the data-centre part of that compute capability (9.0: the H100)."""
    return _matching_preset(name, *(capability or (None, None)))


# ---------------------------------------------------------------------- which model ranks, and why

#: The model where nothing says which GPU: no ``hw``/``hardware`` given and no CUDA device here (an export
#: on a CPU machine for a GPU one, an offline tune), or a device that matches no preset.  Whoever uses it
#: reports it (``HardwareChoice.defaulted``): an export's ``hardware.json`` and ``timing.json``, the
#: backend's report, a log line.
DEFAULT_GPU = H100
#: The CPU has no hardware model.  Where an llvm path needs one all the same, it is this GPU preset, named
#: here and never a claim about the CPU: the search space and first-round order of an llvm tune (which
#: candidates fit and which are measured first; the LLVM runner's measurements decide) and the key its
#: records are filed under, and a convolution's image-layout decision on llvm (which of two correct
#: kernels is built).
CPU_STAND_IN = H100


@dataclass(frozen=True)
class HardwareChoice:
    """The hardware model that ranks schedules (first picks, layouts, splits), and why that one: given,
    the GPU in hand (by name or compute capability), or ``DEFAULT_GPU`` standing in (``defaulted``)."""

    model: HardwareModel
    why: str
    defaulted: bool = False

    def __str__(self) -> str:
        return f"{self.model.name} ({self.why})"

    def to_dict(self) -> dict[str, Any]:
        return {"hardware": self.model.name, "why": self.why, "defaulted": self.defaulted}


def choose_hardware(hw: HardwareModel | str | None = None,
                    device: tuple[str, tuple[int, int] | None] | None = None) -> HardwareChoice:
    """Which model ranks: ``hw`` where given (a model, or a preset's name); else the preset of ``device``
    ((name, (major, minor) or None), the GPU in hand) by name, then by compute capability; else
    ``DEFAULT_GPU``, marked ``defaulted`` with the reason.  Pure: the caller says what device it has."""
    if hw is not None:
        model = get_hardware(hw)
        return HardwareChoice(model, "given")
    if device is None:
        return HardwareChoice(DEFAULT_GPU, f"no CUDA GPU here: the {DEFAULT_GPU.name} preset by default "
                                           f"(give the hardware to rank for another)", True)
    name, capability = device
    by_name = preset_of_device(name)
    if by_name is not None:
        return HardwareChoice(by_name, f"the GPU in hand, {name}")
    by_cc = preset_of_device(name, capability)
    cc = ".".join(map(str, capability)) if capability else "unknown"
    if by_cc is not None:
        return HardwareChoice(by_cc, f"the GPU in hand, {name}: its name names no preset, compute capability "
                                     f"{cc} does")
    return HardwareChoice(DEFAULT_GPU, f"the GPU in hand, {name} (compute capability {cc}), matches no preset: "
                                       f"the {DEFAULT_GPU.name} preset by default", True)


def local_device(index: int = 0) -> tuple[str, tuple[int, int] | None] | None:
    """(name, (major, minor)) of CUDA device ``index`` via cupy, else torch (both imported lazily); None
    where neither sees one."""
    info = _query_cupy(index) or _query_torch(index)
    if info is None:
        return None
    major, minor = info.get("major"), info.get("minor")
    return str(info["name"]), (int(major), int(minor)) if major is not None and minor is not None else None


def _matching_preset(name: str, major: int | None, minor: int | None) -> HardwareModel | None:
    """Preset whose FLOP peaks apply: by marketing name first, then by data-centre compute capability."""
    upper = name.upper()
    for preset in (H200, H100, A100, V100):
        if preset.name in upper:
            return preset
    return {(9, 0): H100, (8, 0): A100, (7, 0): V100}.get((major, minor))


def _mma_family(major: int, minor: int) -> dict[str, tuple[tuple[int, int, int], ...]]:
    if (major, minor) >= (8, 9):
        return _MMA_SM89
    if major >= 8:
        return _MMA_SM80
    if major == 7:
        return _MMA_SM70 if minor == 0 else {"float16": ((16, 8, 8),), "int8": ((8, 8, 16),)}
    return {}


def from_device(index: int = 0) -> HardwareModel:
    """Model of CUDA device ``index``, queried with cupy (else torch), never TVM.

    Queried: SM count, shared memory, registers, threads, L2, memory size, clock, arch and DRAM
    bandwidth (memory clock x 2 x bus width).  Not queryable, so taken from the matching preset
    (by name, else compute capability): FLOP peaks, MMA shapes, L2 bandwidth, and whatever the
    backend lacks (torch reports no clocks).  A different SKU of a preset's chip (e.g. H100 PCIe)
    gets the preset's peaks scaled by SM count x clock.
    """
    info = _query_cupy(index) or _query_torch(index)
    if info is None:
        raise HardwareError(f"no CUDA device {index}: neither cupy nor torch (both imported lazily) sees one")
    major, minor = int(info["major"] or 0), int(info["minor"] or 0)
    preset = _matching_preset(info["name"], major, minor)
    fallback = preset or H100
    notes: list[str] = []  # fields taken from the fallback preset
    by_cc = ["regs_per_thread_max"]  # fields set from the compute capability

    def pick(key: str) -> Any:
        value = info.get(key)
        if value is None:
            notes.append(key)
            return getattr(fallback, key)
        return value

    vals = {k: int(pick(k)) for k in (
        "num_sms", "smem_per_sm_bytes", "smem_per_block_bytes", "smem_static_per_block_bytes", "regs_per_sm",
        "regs_per_block", "max_threads_per_block", "max_threads_per_sm", "warp_size", "l2_bytes", "dram_bytes")}
    num_sms, clock_hz = vals["num_sms"], float(pick("clock_hz"))
    if info["mem_clock_hz"] and info["bus_width_bits"]:
        dram_bw = info["mem_clock_hz"] * 2 * info["bus_width_bits"] / 8
    else:
        notes.append("dram_bandwidth_bytes_per_s")
        dram_bw = fallback.dram_bandwidth_bytes_per_s
    smem_reserved = info["smem_reserved_per_block_bytes"]
    if smem_reserved is None:
        by_cc.append("smem_reserved_per_block_bytes")
        smem_reserved = KiB if major >= 8 else 0
    max_blocks = info["max_blocks_per_sm"]
    if max_blocks is None:
        by_cc.append("max_blocks_per_sm")
        max_blocks = {(8, 6): 16, (8, 7): 16, (8, 9): 24, (7, 5): 16}.get((major, minor), 32)

    if preset is not None:
        peaks, simt, l2_bw = preset.peak_flops_per_s, preset.peak_simt_flops_per_s, preset.l2_bandwidth_bytes_per_s
        if num_sms != preset.num_sms:
            scale = num_sms * clock_hz / (preset.num_sms * preset.clock_hz)
            peaks = tuple((k, v * scale) for k, v in peaks)
            simt = tuple((k, v * scale) for k, v in simt)
            peak_note = f"FLOP peaks of the {preset.name} preset scaled by SMs x clock ({scale:.3f})"
        else:
            peak_note = f"FLOP peaks and L2 bandwidth from the {preset.name} preset"
    else:
        peaks, simt, l2_bw = (), (), 0.0
        peak_note = "no preset matches, so FLOP peaks and L2 bandwidth are unknown"
    arch = f"sm_{major}{minor}" + ("a" if major >= 9 else "")
    source = (f"queried from device {index} ({info['name']}, compute capability {major}.{minor}) via {info['via']}; "
              f"{peak_note}; MMA shapes by compute capability from the PTX ISA; shared-memory bandwidth estimated "
              f"as 32 banks x 4 B/clk; by compute capability: {', '.join(by_cc)}")
    if notes:
        source += f"; not queryable, from the {fallback.name} preset: {', '.join(notes)}"
    return HardwareModel(
        **vals,
        name=info["name"], kind="gpu", arch=arch, clock_hz=clock_hz,
        smem_reserved_per_block_bytes=int(smem_reserved),
        regs_per_thread_max=255,
        max_blocks_per_sm=int(max_blocks),
        dram_bandwidth_bytes_per_s=float(dram_bw),
        l2_bandwidth_bytes_per_s=float(l2_bw),
        smem_bandwidth_bytes_per_s_per_sm=_SMEM_BYTES_PER_CLK * clock_hz,
        peak_flops_per_s=peaks,
        peak_simt_flops_per_s=simt,
        mma_shapes=tuple(_mma_family(major, minor).items()),
        source=source,
    )
