"""Build a Schedule with TVM: run it on the CPU (llvm) or emit CUDA + launch metadata."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import unicodedata
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from schedulers.errors import ScheduleError
from schedulers.hardware import PRESETS, HardwareModel
from schedulers.resources import shared_bytes
from schedulers.schedule import Schedule
from schedulers.warp_tile import tma_maps
from smg.errors import ShapeError, SpaceFusionError
from spacefusion.lower import cluster, loads, stores
from spacefusion.lower.fingerprint import code_fingerprint
from spacefusion.lower.symbolic import SymbolicDim, symbolic_key, symbolic_meta
from spacefusion.lower.symbolic import check as check_symbolic
from spacefusion.lower.tir import build_primfunc, signature

CUDA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")


class UnknownTargetError(SpaceFusionError, ValueError):
    """The target is neither llvm nor a known CUDA architecture."""


def parse_target(target: str) -> tuple[str, str | None]:
    """``"llvm"`` | ``"cuda"`` | ``"cuda:sm_80"`` | ``"sm_90a"`` -> (kind, arch)."""
    t = target.strip().lower()
    if t in ("llvm", "cpu"):
        return "llvm", None
    if t == "cuda":
        return "cuda", "sm_90a"
    arch = t.split(":", 1)[1] if t.startswith("cuda:") else t
    if arch in CUDA_ARCHS:
        return "cuda", arch
    raise UnknownTargetError(
        f"unknown target {target!r}; use 'llvm', 'cuda', or 'cuda:<arch>' with arch in {CUDA_ARCHS}"
    )


def _tvm():
    """Import TVM lazily; its NVRTC path looks for CUDA next to nvcc unless CUDA_PATH is set.  Where TVM
    compiles CUDA itself (a GPU machine), its compile callback first gets our device helpers (``_with_helpers``)."""
    if Path("/usr/local/cuda-13.0").exists():
        os.environ.setdefault("CUDA_PATH", "/usr/local/cuda-13.0")
    import tvm

    _hook_cuda_compile()
    return tvm


@functools.cache
def _hook_cuda_compile() -> None:
    """Wrap TVM's ``tvm_callback_cuda_compile`` (once) so the source it compiles defines the device functions
    our kernels call that TVM does not emit; without it a GPU machine's TVM build fails on an undefined name."""
    import tvm_ffi

    orig = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    if orig is not None:
        tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_with_helpers(orig), override=True)


def compile_with_helpers(orig: Callable[..., object]) -> Callable[..., object]:
    """``orig`` (a CUDA compile callback) called on the source with our device helpers defined."""

    def compile_cuda(code: str, *rest: object) -> object:
        return orig(_with_helpers(code), *rest)

    return compile_cuda


@dataclass
class CpuKernel:
    """A schedule compiled for the CPU by TVM's llvm backend."""

    schedule: Schedule
    module: object

    def _args(self, inputs: dict[str, np.ndarray]) -> tuple[list, dict[str, object], list[Callable[[], None]]]:
        """(the kernel's arguments, its outputs by name, what to run after the call): inputs copied in,
        outputs allocated, a parameter written in place (``lower.stores``) passed as the caller's array."""
        tvm = _tvm()
        args, outs, after = [], {}, []
        for name, shape, dtype, role in signature(self.schedule).params:
            if role in ("input", stores.INOUT) and name not in inputs:
                raise KeyError(f"missing input {name!r}")
            if role == stores.INOUT:
                arg, back = stores.in_place(tvm, inputs[name], shape, dtype)
                args.append(arg)
                after.append(back)
                continue
            if role == "input":
                arr = np.ascontiguousarray(inputs[name], dtype=dtype)
                if arr.shape != shape:
                    raise ShapeError(f"input {name!r} has shape {arr.shape}, the kernel expects {shape}")
            else:
                arr = np.zeros(shape, dtype)
            args.append(tvm.runtime.tensor(arr))
            if role == "output":
                outs[name] = args[-1]
        return args, outs, after

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args, outs, after = self._args(inputs)
        self.module["main"](*args)
        for back in after:
            back()
        return {k: v.numpy() for k, v in outs.items()}

    def launcher(self, inputs: dict[str, np.ndarray]) -> Callable[[], object]:
        """A zero-argument call on tensors bound once, so a timing excludes the numpy <-> TVM copies."""
        args, _, _ = self._args(inputs)
        main = self.module["main"]
        return lambda: main(*args)


#: TVM's pass that shrinks each allocation to the region its body touches (off for ``exact_buffers``)
COMPACT_PASS = "s_tir.CompactBufferAllocation"


def _pass_context(tvm, own_barriers: bool = False, symbolic: bool = False, exact_buffers: bool = False):
    """TVM 0.27's StorageRewrite merges two live local buffers of a one-step kernel (MHA with
    the whole row in one step gave wrong results on llvm and on the H100); our buffers are sized
    exactly already, so the pass is off.  ``own_barriers``: the kernel orders its shared memory by
    mbarriers and named barriers of one warpgroup (``producer``), which TVM's barrier planner does not
    know; it would put a block-wide barrier inside a warpgroup's branch, so it is off too.  ``symbolic``: the
    kernel takes a run-time size, and TIR's common-subexpression pass would let-bind an expression of it
    (``ceil(size / rows)``) outside the kernel, which the host/device split then makes a kernel parameter the
    launcher knows nothing of (``cse_v7``): off (nvcc eliminates the device's common subexpressions itself).
    ``exact_buffers``: the function allocates every buffer at the footprint it uses (a warp-tile program: each
    thread's fragments and the block's shared tiles are declared at their size, nothing to shrink), so
    ``CompactBufferAllocation`` has nothing to do; its region analysis grows with the unrolled body and took
    3.4 of the pipeline's 4.0 s for BERT-base's masked attention (2-core CPU), so it is off: the CUDA source is
    the same with it and without (``tests/test_compile_speed.py``)."""
    off = ["s_tir.ThreadSync"] if own_barriers else []
    if exact_buffers:
        off.append(COMPACT_PASS)
    config = {"tirx.disable_storage_rewrite": True} | ({"tirx.disable_cse_tir": True} if symbolic else {})
    return tvm.transform.PassContext(config=config, disabled_pass=off)


def build_llvm(s: Schedule) -> CpuKernel:
    tvm = _tvm()
    f = build_primfunc(s, "llvm")
    with _pass_context(tvm):
        ex = tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target({"kind": "llvm"}))
    return CpuKernel(s, ex)


@dataclass(frozen=True)
class CudaArtefact:
    """CUDA source plus everything a TVM-free runner needs to launch it."""

    source: str
    meta: dict

    def save(self, folder: str | Path, compile_cubin: bool = True, cache: str | Path | None = "default") -> Path:
        """Write kernel.cu + kernel.json (+ kernel.cubin).  Cubins are cached by the sha256 of
        (source, arch, nvcc flags): an identical kernel is never compiled twice."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "kernel.cu").write_text(self.source)
        meta = dict(self.meta)
        meta.setdefault("code", code_fingerprint())  # the code that built it (a cache keyed by SMG rebuilds on change)
        if compile_cubin and shutil.which("nvcc"):
            out = folder / "kernel.cubin"
            extra = tuple(meta.get("nvcc_flags", ()))
            cached = _cubin_cache(cache, self.source, meta["arch"], extra)
            if cached is not None and cached.is_file():
                shutil.copyfile(cached, out)
            else:
                nvcc_cubin(folder / "kernel.cu", out, meta["arch"], extra)
                if cached is not None:
                    _keep_cubin(out, cached)
            meta["cubin"] = "kernel.cubin"
        (folder / "kernel.json").write_text(json.dumps(meta, indent=1))
        return folder


NVCC_FLAGS = ("-O3", "-diag-suppress=177,1046")
#: the warp-tile kernels' flags (kept in kernel.json, so every compile path uses them): exp2f becomes
#: one ex2.approx.ftz (no denormal range fix-up around each MUFU), as in FlashAttention's
#: --use_fast_math build; numerics are checked as ever.  -prec-div=false is left out: it made the
#: sigmoid GEMM epilogue slower on the H100 (measured: docs/results.md, 'Tried and not kept')
WARP_TILE_FLAGS = ("-ftz=true",)
#: everything besides the schedule that decides the kernel: part of the tuning database key
COMPILE_FLAGS = (*NVCC_FLAGS, "tirx.disable_storage_rewrite", *WARP_TILE_FLAGS)


def _cubin_cache(cache: str | Path | None, source: str, arch: str, extra: tuple[str, ...] = ()) -> Path | None:
    if cache is None:
        return None
    root = Path(os.environ.get("SPACEFUSION_CUBIN_CACHE", Path.home() / ".cache" / "spacefusion" / "cubins")
                ) if cache == "default" else Path(cache)
    digest = hashlib.sha256("\0".join([source, arch, *NVCC_FLAGS, *extra]).encode()).hexdigest()
    return root / f"{digest}.cubin"


def _keep_cubin(out: Path, cached: Path) -> None:
    """Copy a built cubin into the cubin cache, atomically (parallel builders never see half a cubin).  The
    cache only saves time: where it cannot be written (a read-only HOME, a full disk) the build goes on
    without it, and a warning names the folder and ``SPACEFUSION_CUBIN_CACHE``; the artefact is complete
    either way (before, the error left kernel.cu and kernel.cubin without their kernel.json)."""
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, tmp)
        os.replace(tmp, cached)
    except OSError as exc:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        warnings.warn(f"the cubin cache {cached.parent} cannot be written ({exc.strerror or exc}); built without "
                      f"caching it: set SPACEFUSION_CUBIN_CACHE to a writable folder to keep cubins between builds",
                      RuntimeWarning, stacklevel=3)


def nvcc_cubin(src: Path, out: Path, arch: str, extra: tuple[str, ...] = ()) -> None:
    """Compile CUDA source to a cubin; raise with nvcc's message on failure."""
    cmd = ["nvcc", "-cubin", f"-arch={arch}", *NVCC_FLAGS, *extra, "-o", str(out), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed for {src}:\n{res.stderr[-3000:]}")


_SIG = re.compile(r'extern "C" __global__ void (?:__cluster_dims__\([\d, ]+\) )?(?:__launch_bounds__\((\d+)\) )?'
                  r'(\w+)\(([^)]*)\)')


def c_identifier(name: str, limit: int = 40) -> str:
    """``name`` as an ASCII C identifier fragment (deterministic, at most ``limit`` characters): ASCII
    letters, digits and ``_`` kept, other ASCII characters ``_`` (as before, so existing symbols and cached
    cubins are unchanged), an accented letter its base letter (NFKD: ö is o) and any other character
    ``u<hex code point>`` (ß is udf, 注 u6ce8).  Why: nvcc refuses a universal character in a device
    entity's name (a graph named "größe" or "注意"), and Python's ``\\w`` matches those letters.  Two names
    that map alike still get distinct kernels: ``kernel_symbol`` appends the schedule key, which covers
    the SMG's own name."""
    out = []
    for ch in name:
        if ch.isascii():
            out.append(ch if ch.isalnum() or ch == "_" else "_")
            continue
        base = unicodedata.normalize("NFKD", ch).encode("ascii", "ignore").decode("ascii")
        out.append(base if base.isalnum() else f"u{ord(ch):x}")
    return "".join(out)[:limit]


def kernel_symbol(s: Schedule) -> str:
    """The kernel's name in the source, ``sf_<smg name>_<schedule key>``: TVM calls every kernel
    ``main_kernel``, so profiles of a fused model (``nsys``, ``ncu``, ``torch.profiler``) could not tell
    its kernels apart; this name says which SMG and which schedule each launch is.  The SMG's name is
    made an ASCII C identifier (``c_identifier``); the user's own name stays in the artefact's
    ``workload.name`` for display."""
    return "sf_" + c_identifier(s.smg.name) + "_" + s.key[:10]


def _renamed(src: str, old: str, s: Schedule, symbolic: SymbolicDim | None = None) -> tuple[str, str]:
    """``src`` with its one kernel ``old`` renamed to ``kernel_symbol(s)`` (a whole-word replacement); a
    symbolic kernel's name ends in ``_dyn_<its key>`` (``symbolic.symbolic_key``), never a static kernel's."""
    new = kernel_symbol(s) if symbolic is None else f"{kernel_symbol(s)}_dyn_{symbolic_key(s, symbolic)[:8]}"
    return re.sub(rf"\b{re.escape(old)}\b", new, src), new


_LAUNCH = re.compile(r'launch_thread\("((?:blockIdx|threadIdx)\.[xyz])", (\d+)\)')
_DYN = re.compile(r'alloc_buffer\(\((\d+),\), "(\w+)", scope="shared\.dyn"')  # merged (uint8) or one buffer


def _check_params(s: Schedule, sig, order: list[str]) -> dict[str, dict]:
    """The kernel's parameters (``order``, from TVM's source) are the schedule's tensors, less any
    read only through its tensor map; returns the tensor maps by param."""
    maps = tma_maps(s, s.warp_tile) if s.warp_tile is not None else {}
    mapped = {m["tensor"] for m in maps.values()}
    if sorted(order) != sorted(p[0] for p in sig.params if p[0] in order or p[0] not in mapped):
        raise RuntimeError(f"kernel parameters {order} do not match the schedule's tensors")
    return maps


def _with_helpers(src: str) -> str:
    """``src`` with the device functions its kernel calls that TVM does not emit (TMA im2col loads, a
    cluster's barrier and distributed shared-memory loads), each defined once before the kernel."""
    from spacefusion.lower.mma_tma import IM2COL_LOAD, IM2COL_SOURCE

    for name, source in ((IM2COL_LOAD, IM2COL_SOURCE), (cluster.SYNC, cluster.SOURCE)):
        if name in src and f"void {name}(" not in src:
            at = src.index('extern "C" __global__')
            src = src[:at] + source + src[at:]
    return src


#: first in a kernel for sm_90+: wait until the grid before it on the stream has finished and its writes are
#: visible.  A launch with programmatic stream serialization (the runtime's, where ``grid_dependency_wait``) may
#: then start this kernel while that one drains; launched plainly, the wait is a no-op
GRID_WAIT = 'asm volatile("griddepcontrol.wait;" ::: "memory");'


def _wait_for_previous_grid(src: str, arch: str) -> tuple[str, bool]:
    """``src`` with ``GRID_WAIT`` as its kernel's first statement where ``arch`` has it (sm_90+), and whether."""
    if int(re.sub(r"\D", "", arch)) < 90:
        return src, False
    for m in _SIG.finditer(src):  # the definition, not a forward declaration
        body = re.compile(r"\s*\{").match(src, m.end())
        if body is not None:
            return src[:body.end()] + "\n  " + GRID_WAIT + src[body.end():], True
    return src, False


def _compile_lowered(s: Schedule, mod, arch: str, lowering: str, symbolic: SymbolicDim | None = None,
                     exact_buffers: bool = False) -> CudaArtefact:
    """Compile a scheduled IRModule; grid, block and dynamic shared memory are read from the
    lowered device function, so the metadata is what TVM emitted, not what we meant.  With ``symbolic`` the
    kernel takes the row count as its argument: the grid recorded is the one at the SMG's size (TVM's is an
    expression of the argument), the run-time rule ``symbolic_meta``'s."""
    tvm = _tvm()
    from tvm.tirx.build import split_host_device_mods, tir_to_runtime

    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    host = tvm.target.Target({"kind": "llvm"})
    # ``tvm.compile``'s steps (``tirx.build``), with the pipeline run once: the lowered device function gives the
    # launch metadata and the codegen the source.  Running it apart for the metadata, then again inside
    # ``tvm.compile``, took half of a warp-specialised attention kernel's 66 s build
    with _pass_context(tvm, own_barriers=s.producer, symbolic=symbolic is not None, exact_buffers=exact_buffers):
        bound = tvm.tirx.transform.BindTarget(target.with_host(host))(mod)
        pipeline, finalize_host, finalize_device = tvm.tirx.get_default_tir_pipeline(target)
        host_mod, device = split_host_device_mods(pipeline(bound))
        lib = tir_to_runtime(finalize_host()(host_mod), {t: finalize_device()(d) for t, d in device.items()}, host)
        src = lib.imports[0].inspect_source()
    fns = [f for dm in device.values() for f in dm.functions.values()]
    if len(fns) != 1:
        raise ScheduleError(f"the {lowering} lowering of {s.smg.name!r} gave {len(fns)} kernels, not one",
                            code="build.kernels")
    text = str(fns[0])
    dims = {k: int(v) for k, v in _LAUNCH.findall(text)}
    m = _SIG.search(src)
    if m is None:
        raise RuntimeError(f"no __global__ kernel in TVM's {lowering} output")
    src, kname = _renamed(src, m.group(2), s, symbolic)
    src, waits = _wait_for_previous_grid(_with_helpers(src), arch)
    order = [p.strip().split()[-1].removesuffix("_ptr") for p in m.group(3).split(",")]
    sig = signature(s)
    maps = _check_params(s, sig, [n for n in order if symbolic is None or n != symbolic.var])
    if symbolic is not None:  # the launch's grid along x is an expression of the argument
        dims["blockIdx.x"] = s.num_blocks
    dyn = sum(int(n) * tvm.runtime.DataType(dt).bits // 8 for n, dt in _DYN.findall(text))
    hw = hardware_for(arch)
    if dyn > hw.smem_per_block_bytes - hw.smem_reserved_per_block_bytes:
        raise ScheduleError(f"{lowering} kernel needs {dyn} B of shared memory per block; {hw.name} allows "
                            f"{hw.smem_per_block_bytes - hw.smem_reserved_per_block_bytes} B",
                            code="build.shared_memory")
    meta = {
        "format": "spacefusion-kernel/1", "kernel_name": kname, "arch": arch,
        "grid": [dims.get(f"blockIdx.{a}", 1) for a in "xyz"],
        "block": [dims.get(f"threadIdx.{a}", 1) for a in "xyz"],
        "dynamic_smem_bytes": dyn, "static_smem_bytes": 0, "param_order": order, "lowering": lowering,
        "grid_dependency_wait": waits,
        "params": [{"name": n, "shape": list(sh), "dtype": dt, "role": r} | (
            {"tensor_map": maps[n]} if n in maps else {}) for n, sh, dt, r in sig.params],
        "schedule_key": s.key,
        "workload": dict(s.smg.attrs) | {"name": s.smg.name, "shape": s.smg.dim_sizes,
                                        "dtype": s.smg.space(s.smg.outputs[0]).dtype},
    }
    if symbolic is not None:
        meta = symbolic_meta(meta, s, symbolic)
    return CudaArtefact(src, meta)


def _build_tensorcore(s: Schedule, arch: str, symbolic: SymbolicDim | None = None) -> CudaArtefact:
    """The tensor-core kernel of ``s``: its warp-tile program (with ``symbolic``, a run-time row count,
    which ``symbolic.check`` has accepted), else TVM's WMMA tensorizer."""
    tvm = _tvm()
    if s.warp_tile is not None:
        from spacefusion.lower.mma import build_warp_tile

        mod = tvm.IRModule({"main": build_warp_tile(s, symbolic)})
        loads = "TMA (cp.async.bulk.tensor, mbarriers)" if s.warp_tile.hopper.tma else "cp.async"
        what = (f"tensorcore-wgmma (warp-tile program: wgmma.mma_async on 128 B-swizzled tiles, {loads})"
                if s.warp_tile.hopper.wgmma else "tensorcore-mma (warp-tile program: mma.sync, ldmatrix, cp.async)")
        art = _compile_lowered(s, mod, arch, what, symbolic, exact_buffers=True)
        return CudaArtefact(art.source, art.meta | {"nvcc_flags": list(WARP_TILE_FLAGS)})
    from spacefusion.lower.tensorcore import build_tensorcore

    return _compile_lowered(s, build_tensorcore(s, arch), arch, "tensorcore-wmma (TVM MatmulTensorization)")


def _capability(arch: str) -> int:
    """``sm_90a`` -> 90, ``sm_86`` -> 86; ValueError naming an arch that is not ``sm_<digits>[a]``."""
    digits = arch.removeprefix("sm_").rstrip("a")
    if not arch.startswith("sm_") or not digits.isdigit():
        raise ValueError(f"CUDA arch {arch!r} is not sm_<compute capability> (sm_80, sm_90a, ...)")
    return int(digits)


def hardware_for(arch: str) -> HardwareModel:
    """The hardware model whose limits (shared memory, threads) a kernel for ``arch`` is checked against: the
    preset of that arch (sm_90a: the H100, whose limits the H200 shares), else the preset of the nearest
    compute capability below it (sm_86, sm_89: the A100's); ValueError for an arch below every preset's."""
    cc = _capability(arch)
    gpus = sorted(((_capability(hw.arch), hw) for hw in PRESETS.values() if hw.kind == "gpu" and hw.arch),
                  key=lambda pair: pair[0])  # stable: the H100 before the H200 at sm_90
    below = [c for c, _ in gpus if c <= cc]
    if not below:
        raise ValueError(f"no hardware preset for CUDA arch {arch!r}: the oldest is {gpus[0][1].arch} "
                         f"({gpus[0][1].name})")
    return next(hw for c, hw in gpus if c == below[-1])


#: the most elements a tensor of a CUDA kernel may have: the kernels index with 32-bit integers
MAX_INDEX = 2**31 - 1
#: the most blocks of a grid's x dimension (CUDA's limit), where every kernel puts its blocks
MAX_GRID_X = 2**31 - 1


def check_index_range(s: Schedule) -> None:
    """Refuse, naming the tensor or the grid, what 32-bit indices or CUDA's grid cannot address (TVM raised
    an int32 literal error from inside its passes; a grid of 2^34 blocks was written and never launched)."""
    for space in s.smg.spaces:
        n = math.prod(s.smg.shape(space.name))
        if n > MAX_INDEX:
            raise ShapeError(f"{s.smg.name}: space {space.name!r} {s.smg.shape(space.name)} has {n} elements; the CUDA "
                             f"kernels index with 32-bit integers (at most {MAX_INDEX} elements a tensor): split it")
    if s.num_blocks > MAX_GRID_X:
        raise ScheduleError(f"{s.smg.name}: {s.num_blocks} blocks; a CUDA grid has at most {MAX_GRID_X}: use larger "
                            f"tiles or split the work", code="build.grid")


def check_target(s: Schedule, arch: str) -> None:
    """Refuse a knob that ``arch`` cannot run (wgmma and a producer warpgroup but on sm_90a, TMA and clusters
    before sm_90), by the option groups' own rules (``check_target``, with ``HardwareModel.capabilities``):
    the search and ``make_schedule`` refuse the same for their hardware model before a schedule is built, so
    this is the safety net for a schedule made for another target (a file, another machine's record)."""
    caps = hardware_for(arch).capabilities(arch)
    for bad in (s.hopper.check_target(caps), s.simt.check_target(caps)):
        if bad is not None:
            raise ScheduleError.rejected(bad)


def build_cuda(s: Schedule, arch: str = "sm_90a", symbolic: SymbolicDim | None = None) -> CudaArtefact:
    """Lower ``s`` to CUDA for ``arch`` and record grid, block and parameter order.  With ``symbolic``
    (``lower.symbolic``) the kernel takes that dim's size as its int argument and the metadata says how
    (``symbolic_meta``): a ``spacefusion-kernel/2`` artefact, which a runtime that knows only /1 refuses."""
    check_index_range(s)
    check_target(s, arch)
    if symbolic is not None:
        check_symbolic(s, symbolic)  # before anything is built: the tensor-core path is refused here
    stores.check(s)  # indexed stores: element-wise kernels only (never a tensor-core epilogue, unchecked here)
    loads.check(s)  # indexed loads: CUDA-core kernels only (a warp tile copies contiguous operand tiles)
    if s.tensor_cores:
        return _build_tensorcore(s, arch, symbolic)
    smem = shared_bytes(s)
    hw = hardware_for(arch)
    # above the static limit the tiles go to dynamic shared memory (opt-in at launch); each
    # merged buffer is counted rounded up to 128 B, an upper bound of TVM's aligned layout
    dynamic = smem > hw.smem_static_per_block_bytes
    dyn_bytes = shared_bytes(s, align=128) if dynamic else 0
    usable = hw.smem_per_block_bytes - hw.smem_reserved_per_block_bytes
    if dyn_bytes > usable:
        raise ScheduleError(
            f"step {s.step} on {s.serial!r} needs {dyn_bytes} B of shared memory per block, over the "
            f"{usable} B {hw.name} allows (dynamic, opted in); use a smaller step or tile", code="build.shared_memory"
        )
    if s.threads > hw.max_threads_per_block:
        raise ScheduleError(f"{s.threads} threads per block; {hw.name} allows {hw.max_threads_per_block}",
                            code="build.threads")
    tvm = _tvm()
    f = build_primfunc(s, "cuda", dynamic_smem=dynamic, symbolic=symbolic)
    with _pass_context(tvm, symbolic=symbolic is not None):  # no let-bound size expression made a parameter
        ex = tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target({"kind": "cuda", "arch": arch}))
    src = ex.mod.imports[0].inspect_source()
    m = _SIG.search(src)
    if m is None:
        raise RuntimeError("no __global__ kernel found in TVM's CUDA output")
    bounds, kname, plist = m.groups()
    src, kname = _renamed(src, kname, s, symbolic)
    src, waits = _wait_for_previous_grid(cluster.with_cluster(_with_helpers(src), s.cluster), arch)
    order = [p.strip().split()[-1].removesuffix("_ptr") for p in plist.split(",")]
    sig = signature(s)
    _check_params(s, sig, [n for n in order if symbolic is None or n != symbolic.var])
    if bounds is not None and int(bounds) != s.threads:
        raise RuntimeError(f"kernel launch bounds {bounds} != schedule threads {s.threads}")
    meta = {
        "format": "spacefusion-kernel/1",
        "kernel_name": kname,
        "arch": arch,
        "grid": [s.num_blocks, 1, 1],
        "block": [s.threads, 1, 1],
        "dynamic_smem_bytes": dyn_bytes,
        "static_smem_bytes": 0 if dynamic else smem, "grid_dependency_wait": waits,
        **({"cluster": [s.cluster, 1, 1]} if s.cluster > 1 else {}),
        "params": [{"name": n, "shape": list(sh), "dtype": dt, "role": r} for n, sh, dt, r in sig.params],
        "param_order": order,
        "schedule_key": s.key,
        "workload": dict(s.smg.attrs) | {"name": s.smg.name, "shape": s.smg.dim_sizes,
                                        "dtype": s.smg.space(s.smg.outputs[0]).dtype},
    }
    if symbolic is not None:
        meta = symbolic_meta(meta, s, symbolic)
    return CudaArtefact(src, meta)
