"""Run kernel artefacts on a GPU with torch tensors, through CuPy; no TVM needed.

torch and cupy are imported inside functions so that this module imports (and its errors can be
tested) on machines without a GPU stack.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .artefact import INOUT_ROLE, ArtefactError, KernelArtefact, ParamSpec, SizeRangeError, check_cubin

if TYPE_CHECKING:
    import torch

#: Flags for our own nvcc run; -arch comes from the artefact.
DEFAULT_NVCC_OPTIONS: tuple[str, ...] = ("-O3", "-std=c++17", "-lineinfo")
#: Above this, CUDA requires an explicit opt-in attribute for dynamic shared memory.
DEFAULT_SMEM_LIMIT = 48 * 1024
#: Vectorised loads in generated code (float4, half8) need 16-byte aligned pointers; a misaligned
#: pointer raises a sticky "misaligned address" that kills the whole CUDA context, so we refuse early.
POINTER_ALIGNMENT = 16


class KernelLaunchError(ValueError):
    """The tensors passed to a kernel do not match its params; the message names the param."""


class KernelCompileError(RuntimeError):
    """No way of building the artefact gave a loadable kernel; the message lists every attempt."""


def torch_dtype(name: str) -> torch.dtype:
    """Map an artefact dtype name (TVM spelling, e.g. 'float16') to the torch dtype."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise KernelLaunchError(f"dtype {name!r} has no torch equivalent")
    return dtype


def find_nvcc() -> str | None:
    """Locate the real nvcc, preferring $CUDA_PATH/$CUDA_HOME (PATH may hold a wrapper script)."""
    for var in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(var)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    fallback = Path("/usr/local/cuda/bin/nvcc")
    return str(fallback) if fallback.is_file() else None


def cubin_cache_dir() -> Path:
    """Where nvcc-built cubins are kept: $SPACEFUSION_CUBIN_CACHE or ~/.cache/spacefusion/cubin."""
    env = os.environ.get("SPACEFUSION_CUBIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "spacefusion" / "cubin"


def compile_cubin(source: str, arch: str, options: Sequence[str] = DEFAULT_NVCC_OPTIONS) -> Path:
    """Compile CUDA source to a cubin with nvcc, cached by content, and return its path.

    We run nvcc ourselves rather than through cupy's nvcc backend because cupy adds its own
    ``-gencode=...sm_90`` (no 'a' suffix, so no wgmma/TMA) and ``-ftz=true``.
    """
    nvcc = find_nvcc()
    if nvcc is None:
        raise KernelCompileError("nvcc not found (set CUDA_PATH or put nvcc on PATH)")
    cmd_flags = ["-cubin", f"-arch={arch}", *options]
    key = hashlib.sha256("\0".join([nvcc, *cmd_flags, source]).encode()).hexdigest()[:32]
    cache = cubin_cache_dir()
    out = cache / f"{key}.cubin"
    if out.is_file():
        try:
            check_cubin(out)
            return out
        except ArtefactError:  # a damaged cache entry (a full disk, a stray write): build it again
            out.unlink(missing_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.cu"
        src.write_text(source)
        tmp_out = Path(tmp) / "kernel.cubin"
        proc = subprocess.run(
            [nvcc, *cmd_flags, "-o", str(tmp_out), str(src)], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise KernelCompileError(f"nvcc {' '.join(cmd_flags)} failed:\n{proc.stderr or proc.stdout}")
        staged = cache / f"{key}.{os.getpid()}.tmp"
        shutil.copyfile(tmp_out, staged)
        os.replace(staged, out)  # atomic, so concurrent runs never read a half-written cubin
    return out


#: device tensor maps that a captured CUDA graph's launches read (by address, at every replay): dropped
#: from a kernel's cache, they would be freed and their memory reused under the graph
_GRAPHED_MAPS: dict[int, Any] = {}


#: tensor maps a kernel keeps before it retires them all (freed once its stream has passed a fence)
MAX_MAPS = 64


class MapCache:
    """A kernel's device tensor maps by (param, address, strides, device).

    A launch reads its map by address when it runs, not when it is queued: a map dropped from the cache
    while a launch that reads it is still queued would be freed, its memory handed to the next tensor, and
    the TMA unit would read garbage (CUDA_ERROR_ILLEGAL_INSTRUCTION on LLaMA-2's 32 layers, whose stacked
    Q/K/V weights gave one kernel more maps than the cache kept).  So evicted maps stay referenced until a
    fence recorded on the launching stream at eviction has passed (``fence`` None: under graph capture,
    where nothing is evicted and the graph keeps its maps)."""

    def __init__(self, limit: int = MAX_MAPS) -> None:
        self.limit = limit
        self.maps: dict[tuple, Any] = {}
        self.retired: list[tuple[Any, list[Any]]] = []  # (fence, maps a queued launch may still read)

    def get(self, key: tuple, make: Callable[[], Any], fence: Callable[[], Any] | None) -> Any:
        self.retired = [(f, ms) for f, ms in self.retired if not f.query()]
        if key not in self.maps:
            if len(self.maps) >= self.limit and fence is not None:
                self.retired.append((fence(), list(self.maps.values())))
                self.maps.clear()
            self.maps[key] = make()
        return self.maps[key]


class CudaKernel:
    """A launchable artefact kernel: validates torch tensors against the params, then launches.

    The kernel is built lazily on first launch (or by ``compile()``), trying in order: the artefact's
    prebuilt cubin, nvcc, then NVRTC. ``backend`` records which one worked, ``compile_errors`` why the
    ones before it did not (a named but missing cubin included).  A cubin that is not one was already
    refused by ``KernelArtefact.load``, so a broken binary is never silently replaced by a rebuild.
    """

    def __init__(
        self,
        artefact: KernelArtefact | str | Path,
        *,
        nvcc_options: Sequence[str] = DEFAULT_NVCC_OPTIONS,
        prefer_cubin: bool = True,
    ) -> None:
        self.artefact = artefact if isinstance(artefact, KernelArtefact) else KernelArtefact.load(artefact)
        self.nvcc_options = tuple(nvcc_options)
        self.prefer_cubin = prefer_cubin
        self.backend: str | None = None
        self.compile_errors: dict[str, str] = {}
        self._kernels: dict[int, Any] = {}  # device index -> cupy.RawKernel
        self._scratch: dict[int, dict[str, Any]] = {}  # device index -> zeroed workspaces, kept
        self._maps = MapCache()  # (param, tensor address, shape, strides, device) -> tensor map

    def __repr__(self) -> str:
        art = self.artefact
        return f"CudaKernel({art.kernel_name!r}, folder={str(art.folder)!r}, backend={self.backend})"

    # ---- building -----------------------------------------------------------------------------

    def compile(self, device: int | None = None) -> str:
        """Load the kernel onto ``device`` (default: torch's current device); return the backend used."""
        import torch

        index = torch.cuda.current_device() if device is None else device
        self._kernel(index)
        assert self.backend is not None
        return self.backend

    def _strategies(self) -> list[tuple[str, Callable[[], Any]]]:
        import cupy

        art = self.artefact
        out: list[tuple[str, Callable[[], Any]]] = []
        cubin = art.cubin_path
        if self.prefer_cubin and cubin is not None:
            out.append(("cubin", lambda: cupy.RawModule(path=str(cubin))))
        flags = (*self.nvcc_options, *art.nvcc_flags)
        out.append(("nvcc", lambda: cupy.RawModule(path=str(compile_cubin(art.source, art.arch, flags)))))
        nvrtc_flags = (f"-arch={art.arch}", "-std=c++17", *art.nvcc_flags)
        out.append(("nvrtc", lambda: cupy.RawModule(code=art.source, backend="nvrtc", options=nvrtc_flags)))
        return out

    def _kernel(self, device: int) -> Any:
        if device in self._kernels:
            return self._kernels[device]
        import cupy

        art = self.artefact
        errors: dict[str, str] = {}
        if art.cubin is not None and art.cubin_path is None:  # KernelArtefact.load warned; the record says so
            errors["cubin"] = f"{art.folder / art.cubin} is missing; built from {art.source_path.name} instead"
        with cupy.cuda.Device(device):
            for backend, make_module in self._strategies():
                try:
                    kernel = make_module().get_function(art.kernel_name)
                    limit = kernel.max_threads_per_block  # forces the module load, surfacing arch mismatches
                except Exception as exc:  # any failure means: try the next way
                    errors[backend] = f"{type(exc).__name__}: {exc}"
                    continue
                break
            else:
                self.compile_errors = errors
                detail = "\n".join(f"  {k}: {v}" for k, v in errors.items())
                raise KernelCompileError(f"{art.folder}: could not build {art.kernel_name} for {art.arch}:\n{detail}")
            threads = art.block[0] * art.block[1] * art.block[2]
            if threads > limit:
                raise KernelLaunchError(
                    f"{art.folder}: block {list(art.block)} has {threads} threads, but {art.kernel_name} allows {limit}"
                )
            if art.dynamic_smem_bytes > DEFAULT_SMEM_LIMIT:
                optin = cupy.cuda.runtime.getDeviceProperties(device)["sharedMemPerBlockOptin"]
                if art.dynamic_smem_bytes > optin:
                    raise KernelLaunchError(
                        f"{art.folder}: dynamic_smem_bytes={art.dynamic_smem_bytes} exceeds the device limit {optin}"
                    )
                kernel.max_dynamic_shared_size_bytes = art.dynamic_smem_bytes
        self.compile_errors = errors
        self.backend = backend
        self._kernels[device] = kernel
        return kernel

    # ---- launching ----------------------------------------------------------------------------

    def __call__(self, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Launch with params by name: every input, and any outputs to write into (others allocated)."""
        roles = {p.name: p.role for p in self.artefact.params}
        unknown = sorted(set(tensors) - set(roles))
        if unknown:
            raise KernelLaunchError(
                f"{self.artefact.kernel_name}: unknown params {unknown}; params are {sorted(roles)}"
            )
        scratch = sorted(n for n in tensors if roles[n] in ("scratch", "tensormap"))
        if scratch:
            raise KernelLaunchError(
                f"{self.artefact.kernel_name}: {scratch} are workspaces or tensor maps the launcher builds and "
                "keeps; pass only inputs and outputs"
            )
        sized = sorted(n for n in tensors if roles[n] == "size")
        if sized:
            raise KernelLaunchError(f"{self.artefact.kernel_name}: {sized} is the run-time size, which the launcher "
                                    "reads from the tensors' shapes; pass only inputs and outputs")
        inputs = {n: t for n, t in tensors.items() if roles[n] in ("input", INOUT_ROLE)}
        outputs = {n: t for n, t in tensors.items() if roles[n] == "output"}
        return self.launch(inputs, outputs)

    def launch(
        self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Check tensors, allocate missing outputs, launch on torch's current stream; return outputs.

        Asynchronous like any CUDA launch: synchronise (or use the tensors on the same stream) before
        reading the results on the host.
        """
        import cupy
        import numpy
        import torch

        art = self.artefact
        size = self._size(inputs)
        tensors = self._bind(inputs, dict(outputs or {}), size)
        device = next(iter(tensors.values())).device
        kernel = self._kernel(device.index)
        if art.scratch and device.index not in self._scratch:  # zeroed once: the kernel leaves them zeroed
            self._scratch[device.index] = {
                p.name: torch.zeros(p.shape, dtype=torch_dtype(p.dtype), device=device) for p in art.scratch}
        tensors.update(self._scratch.get(device.index, {}))
        for p in art.params:
            if p.tensor_map is not None:
                tensors[p.name] = self._tensor_map(p, tensors[p.tensor_map[0]], device.index)
        sym = art.symbolic
        args = tuple(numpy.int32(size) if sym is not None and name == sym.var
                     else numpy.uint64(tensors[name].data_ptr()) for name in art.param_order)
        grid = art.grid if sym is None else sym.grid_at(size)
        with cupy.cuda.Device(device.index), _cupy_stream(torch.cuda.current_stream(device).cuda_stream):
            kernel(grid, art.block, args, shared_mem=art.dynamic_smem_bytes)
        return {p.name: tensors[p.name] for p in art.outputs}

    def launcher(self, device: int, out_shapes: Sequence[Sequence[int] | None] | None = None,
                 size: int | None = None) -> Callable[..., tuple[torch.Tensor, ...]]:
        """A launch that re-checks nothing, for a caller whose tensors ``launch`` has checked once and whose
        shapes, dtypes, device and layout cannot change (a compiled graph's operands, fixed by its guards):
        ``run(*inputs)`` takes the inputs in ``artefact.inputs`` order and returns new outputs in
        ``artefact.outputs`` order.  Why: ``launch``'s checks and dict building cost more host time than
        the kernel takes at small shapes (the launch-bound regime of a fused model without a CUDA graph);
        here the argument list is a plan made once (workspace pointers fixed, tensor maps looked up per
        call since they follow their tensor's address) and the launch goes to the driver directly.  Only the
        inputs' addresses are read: any contiguous tensors of the right sizes will do; ``out_shapes`` gives
        an output another shape of its element count (None: the artefact's).  A symbolic kernel's launcher
        is made for one run-time ``size`` (in its range): its grid, size argument and output shapes are those
        of that size, and its inputs must have that size too (a caller with another makes another launcher)."""
        import numpy
        import torch

        art = self.artefact
        sym = art.symbolic
        if sym is not None and (size is None or not sym.lo <= size <= sym.hi):
            raise KernelLaunchError(f"{art.kernel_name}: a kernel with a run-time size (dim {sym.dim!r}) makes a "
                                    f"launcher for one size in [{sym.lo}, {sym.hi}], got size={size}")
        if sym is None and size is not None:
            raise KernelLaunchError(f"{art.kernel_name}: its sizes are fixed; it takes no size={size}")
        kernel = self._kernel(device)
        dev = torch.device("cuda", device)
        if art.scratch and device not in self._scratch:
            self._scratch[device] = {p.name: torch.zeros(p.shape, dtype=torch_dtype(p.dtype), device=dev)
                                     for p in art.scratch}
        scratch = self._scratch.get(device, {})
        slot = {p.name: i for i, p in enumerate(art.inputs)}
        slot |= {p.name: len(art.inputs) + i for i, p in enumerate(art.outputs)}
        maps = {p.name: p for p in art.params if p.tensor_map is not None}
        shaped = list(out_shapes or [None] * len(art.outputs))
        own = {p.name: p.shape if sym is None else sym.shape_at(p, size) for p in art.outputs}
        outs = [(tuple(s) if s is not None else own[p.name], torch_dtype(p.dtype)) for p, s in zip(art.outputs, shaped)]
        for (shape, _), p in zip(outs, art.outputs):
            if math.prod(shape) != math.prod(own[p.name]):
                raise KernelLaunchError(f"{art.kernel_name}: output {p.name} {list(own[p.name])} cannot be given the "
                                        f"shape {list(shape)}")
        u64 = numpy.uint64
        # the argument list: ("t", slot) a tensor's address, ("m", param, slot) a tensor map of one, or a
        # fixed address (a workspace: zeroed once and kept)
        plan: list[Any] = []
        for name in art.param_order:  # (every parameter is 8 bytes: a pointer, or a tensor map's address)
            if name in maps:  # (with the mapped tensor's own shape: a caller may pass it flat; a symbolic
                mapped = maps[name].tensor_map[0]  # kernel's at its size: TMA zero-fills the rows past it)
                shape = art.param(mapped).shape if sym is None else sym.shape_at(art.param(mapped), size)
                plan.append(("m", maps[name], slot[mapped], shape))
            elif name in scratch:
                plan.append(scratch[name].data_ptr())
            elif sym is not None and name == sym.var:  # by value: the driver reads its 4 bytes (little-endian)
                plan.append(size)
            else:
                plan.append(("t", slot[name]))
        fixed = all(not isinstance(a, tuple) or a[0] == "t" for a in plan)
        grid, block, smem = art.grid if sym is None else sym.grid_at(size), art.block, art.dynamic_smem_bytes
        by_value = {i for i, name in enumerate(art.param_order) if sym is not None and name == sym.var}
        empty = torch.empty
        direct = _direct_launch(kernel, grid, block, smem, len(plan), art.grid_dependency_wait and pdl_enabled())
        raw_stream = _raw_stream()
        function = [getattr(kernel, "kernel", None)]  # cupy's Function: takes the stream as an argument

        def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            result = tuple(empty(shape, dtype=dt, device=dev) for shape, dt in outs)
            tensors = (*inputs, *result)
            if fixed:
                args = [tensors[a[1]].data_ptr() if isinstance(a, tuple) else a for a in plan]
            else:
                args = [a if not isinstance(a, tuple) else tensors[a[1]].data_ptr() if a[0] == "t"
                        else self._tensor_map(a[1], tensors[a[2]].view(a[3]), device).data_ptr() for a in plan]
            if direct is not None:
                direct(args, raw_stream(device))
                return result
            args = tuple(numpy.int32(a) if i in by_value else u64(a) for i, a in enumerate(args))
            stream = _cupy_stream(raw_stream(device))
            if function[0] is not None:
                try:
                    function[0](grid, block, args, smem, stream)
                    return result
                except TypeError:  # a cupy whose Function takes no stream: the context manager below
                    function[0] = None
            with stream:
                kernel(grid, block, args, shared_mem=smem)
            return result

        return run

    def _tensor_map(self, p: ParamSpec, t: torch.Tensor, device: int) -> torch.Tensor:
        """``p``'s tensor map of ``t``, encoded once per tensor address (a few kept per kernel)."""
        import torch

        from .tensormap import TensorMapError, encode_im2col, encode_tiled

        def make() -> torch.Tensor:
            _, box, swizzle = p.tensor_map
            try:
                if p.tensor_map_im2col is not None:
                    return encode_im2col(t, box[0], box[1], *p.tensor_map_im2col, swizzle,
                                         p.tensor_map_im2col_stride)
                return encode_tiled(t, box, swizzle, p.tensor_map_dims)
            except TensorMapError as e:
                raise KernelLaunchError(f"{self.artefact.kernel_name}: tensor map {p.name!r} of "
                                        f"{p.tensor_map[0]!r}: {e}") from None

        def fence() -> torch.cuda.Event:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
            return ev

        capturing = torch.cuda.is_current_stream_capturing()
        # the shape is in the key: a symbolic kernel's tensors of two sizes may share an address and strides
        m = self._maps.get((p.name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), device), make,
                           None if capturing else fence)
        if capturing:  # a replay reads it by address: never free it
            _GRAPHED_MAPS.setdefault(m.data_ptr(), m)
        return m

    def _size(self, inputs: Mapping[str, Any]) -> int | None:
        """A symbolic kernel's run-time size, read from the inputs' shapes (``SymbolicSpec.size_of``: they must
        agree, and the size lie in the kernel's range; ``KernelLaunchError`` naming both otherwise)."""
        sym = self.artefact.symbolic
        if sym is None:
            return None
        shapes = {n: tuple(getattr(t, "shape", ())) for n, t in inputs.items()}
        try:
            return sym.size_of(shapes, self.artefact.kernel_name)
        except SizeRangeError as exc:
            raise KernelLaunchError(str(exc)) from None

    def _bind(self, inputs: Mapping[str, torch.Tensor], outputs: dict[str, torch.Tensor],
              size: int | None = None) -> dict[str, torch.Tensor]:
        """Match tensors to params by name, allocate missing outputs, and check every tensor (a symbolic
        kernel's at its run-time ``size``)."""
        import torch

        art = self.artefact

        def shape(p: ParamSpec) -> tuple[int, ...]:
            return p.shape if art.symbolic is None or size is None else art.symbolic.shape_at(p, size)

        in_names = {p.name for p in art.inputs}
        out_names = {p.name for p in art.outputs}
        for what, names, allowed in (("input", inputs, in_names), ("output", outputs, out_names)):
            bad = sorted(set(names) - allowed)
            if bad:
                raise KernelLaunchError(f"{art.kernel_name}: {bad} are not {what}s; its {what}s are {sorted(allowed)}")
        missing = sorted(in_names - set(inputs))
        if missing:
            raise KernelLaunchError(f"{art.kernel_name}: missing inputs {missing}")
        given = {**inputs, **outputs}
        first = next(iter(given.values()))
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cuda")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        for name, t in given.items():
            _check_tensor(art.kernel_name, art.param(name), t, device, shape(art.param(name)))
        for p in art.outputs:
            if p.name not in given:
                given[p.name] = torch.empty(shape(p), dtype=torch_dtype(p.dtype), device=device)
        return given


class _StreamHandle:
    """A raw CUDA stream handle exposed through the ``__cuda_stream__`` protocol cupy reads."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


_STREAMS: dict[tuple[int, int], Any] = {}


def _cupy_stream(ptr: int) -> Any:
    """A cupy view of torch's stream ``ptr`` on the current device, so kernels order with torch work.

    Cached per (device, handle): wrapping is a pure view, and launches are on the hot path of timing.
    """
    import cupy

    key = (cupy.cuda.runtime.getDevice(), ptr)
    stream = _STREAMS.get(key)
    if stream is None:
        if hasattr(cupy.cuda.Stream, "from_external"):  # cupy >= 14; ExternalStream is deprecated there
            stream = cupy.cuda.Stream.from_external(_StreamHandle(ptr))
        else:
            stream = cupy.cuda.ExternalStream(ptr, key[0])
        _STREAMS[key] = stream
    return stream


class _LaunchAttr(ctypes.Structure):
    """``CUlaunchAttribute``: an id, then a 64-byte value union (8-byte aligned)."""

    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``
PROGRAMMATIC_STREAM_SERIALIZATION = 6


@functools.cache
def _launch_ex() -> Any:
    """The driver's ``cuLaunchKernelEx`` (CUDA 12+), or None."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def pdl_enabled() -> bool:
    """Whether kernels that wait for the grid before them (``grid_dependency_wait``) launch programmatically
    dependent: on unless ``SPACEFUSION_PDL=0``."""
    return os.environ.get("SPACEFUSION_PDL", "1").strip() != "0"


def _capturing() -> Callable[[], bool]:
    """Whether the current stream is capturing a CUDA graph (torch's cheapest check)."""
    import torch

    return getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)


def _direct_launch(kernel: Any, grid: Sequence[int], block: Sequence[int], smem: int,
                   count: int, dependent: bool = False,
                   capturing: Callable[[], bool] | None = None) -> Callable[[list[int], int], None] | None:
    """``go(addresses, stream)``: ``cuLaunchKernel`` through cupy's driver binding with a parameter block
    made once (``count`` 8-byte values and the pointer array to them; the driver copies the values at
    launch, so the block is reused); None where cupy lacks the binding or the handle.  Why: cupy's
    ``Function.__call__`` converts every argument on every call, which dominates a fused call's host time.
    ``dependent``: while a CUDA graph is being captured (``capturing``), ``cuLaunchKernelEx`` with
    programmatic stream serialization, so the kernel (which waits for the grid before it first thing) starts
    while that grid drains instead of after it: SD 1.5's UNet graph 7639 -> 7536 us on the H100.  Outside a
    capture the plain launch: the ctypes call costs about 3 us more host time, which a model launched
    kernel by kernel pays in full (the UNet without a graph went 22994 -> 25075 us)."""
    try:
        from cupy.cuda import driver

        launch, f = driver.launchKernel, int(getattr(kernel, "kernel", kernel).ptr)  # RawKernel -> Function
    except (ImportError, AttributeError):
        return None
    values = (ctypes.c_uint64 * max(count, 1))()
    pointers = (ctypes.c_void_p * max(count, 1))(*[ctypes.addressof(values) + 8 * i for i in range(count)])
    params, dims = ctypes.addressof(pointers), (*grid, *block)
    ex = _launch_ex() if dependent else None
    if ex is not None:
        attr = _LaunchAttr(PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1
        cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem, None,
                            ctypes.pointer(attr), 1)
        at = ctypes.addressof(cfg)
        in_capture = capturing if capturing is not None else _capturing()

        def go_ex(addresses: list[int], stream: int) -> None:
            values[:count] = addresses
            if not in_capture():
                launch(f, *dims, smem, stream, params, 0)
                return
            cfg.stream = stream
            rc = ex(at, f, params, None)
            if rc:
                raise KernelLaunchError(f"cuLaunchKernelEx failed with CUresult {rc}")

        go_ex.keep = (values, pointers, attr, cfg)  # type: ignore[attr-defined]
        return go_ex

    def go(addresses: list[int], stream: int) -> None:
        values[:count] = addresses
        launch(f, *dims, smem, stream, params, 0)

    go.keep = (values, pointers)  # type: ignore[attr-defined]
    return go


def _raw_stream() -> Callable[[int], int]:
    """The current torch stream's handle on a device, by torch's cheapest call (the one Inductor's
    launchers use), else through the Stream object."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


def _check_tensor(kernel: str, p: ParamSpec, t: Any, device: torch.device,
                  shape: tuple[int, ...] | None = None) -> None:
    """``t`` is a tensor ``p`` takes; ``shape``: the one expected (a symbolic kernel's at its size), else ``p``'s."""
    import torch

    shape = p.shape if shape is None else shape
    where = f"{kernel}: param {p.name!r} ({p.role})"
    if not isinstance(t, torch.Tensor):
        raise KernelLaunchError(f"{where} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise KernelLaunchError(f"{where} is on {t.device}, expected a CUDA tensor")
    if t.device != device:
        raise KernelLaunchError(f"{where} is on {t.device} but other tensors are on {device}")
    if t.dtype != torch_dtype(p.dtype):
        raise KernelLaunchError(f"{where} has dtype {t.dtype}, expected {p.dtype}")
    if tuple(t.shape) != shape:
        raise KernelLaunchError(f"{where} has shape {list(t.shape)}, expected {list(shape)}")
    if not t.is_contiguous():
        raise KernelLaunchError(f"{where} is not contiguous (strides {t.stride()}); call .contiguous()")
    if t.data_ptr() % POINTER_ALIGNMENT:
        raise KernelLaunchError(f"{where} data pointer is not {POINTER_ALIGNMENT}-byte aligned; pass a fresh tensor")


def load_kernel(folder: str | Path, **kwargs: Any) -> CudaKernel:
    """Shorthand for ``CudaKernel(KernelArtefact.load(folder), **kwargs)``."""
    return CudaKernel(KernelArtefact.load(folder), **kwargs)
