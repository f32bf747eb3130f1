"""Kernel artefact loading/validation (CPU), import-lightness of the GPU runtime, and one GPU smoke test."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spacefusion.runtime.artefact import EM_CUDA, FORMAT_TAG, ArtefactError, KernelArtefact, check_cubin
from spacefusion.runtime.timing import percentile, summarize

REPO_ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("tvm", "islpy", "xgboost", "sympy")

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(128) main_kernel(float* __restrict__ O, float* __restrict__ S,
                                                               float* __restrict__ V) {
  O[threadIdx.x] = S[threadIdx.x] + V[threadIdx.x];
}
"""


def _meta(**override: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "format": FORMAT_TAG,
        "kernel_name": "main_kernel",
        "arch": "sm_90a",
        "grid": [4, 1, 1],
        "block": [128, 1, 1],
        "dynamic_smem_bytes": 0,
        "params": [
            {"name": "S", "shape": [64, 128], "dtype": "float16", "role": "input"},
            {"name": "V", "shape": [128, 32], "dtype": "float16", "role": "input"},
            {"name": "O", "shape": [64, 32], "dtype": "float16", "role": "output"},
        ],
        "param_order": ["O", "S", "V"],
        "workload": {"name": "softmax_gemm", "shape": {"m": 64, "l": 128, "n": 32}, "dtype": "float16"},
    }
    meta.update(override)
    return meta


def _write(folder: Path, meta: Any, source: str = SOURCE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernel.cu").write_text(source)
    (folder / "kernel.json").write_text(json.dumps(meta))
    return folder


def _elf(machine: int = EM_CUDA, elf_class: int = 2, shnum: int = 0, size: int = 64) -> bytes:
    """A bare ELF64 header (section headers at byte 64, ``shnum`` of 64 bytes each), padded to ``size``."""
    head = b"\x7fELF" + bytes([elf_class, 1, 1]) + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 2, machine, 1, 0, 0, 64,
                                                                        0, 64, 0, 0, 64, shnum, 0)
    return head.ljust(size, b"\0")


def _param(name: str, **override: Any) -> list[dict[str, Any]]:
    params = _meta()["params"]
    return [{**p, **override} if p["name"] == name else p for p in params]


def test_load_valid_artefact(tmp_path: Path) -> None:
    art = KernelArtefact.load(_write(tmp_path / "a", _meta(grid=[4], block=[128, 1])))
    assert art.kernel_name == "main_kernel"
    assert art.grid == (4, 1, 1) and art.block == (128, 1, 1)
    assert [p.name for p in art.ordered_params] == ["O", "S", "V"]
    assert [p.name for p in art.inputs] == ["S", "V"] and [p.name for p in art.outputs] == ["O"]
    assert art.param("V").shape == (128, 32) and art.param("V").numel == 128 * 32
    assert art.workload["name"] == "softmax_gemm"
    assert art.cubin_path is None
    with pytest.raises(KeyError, match="no param 'X'"):
        art.param("X")


def test_save_round_trips_and_fills_format_tag(tmp_path: Path) -> None:
    meta = _meta()
    del meta["format"]
    art = KernelArtefact.save(tmp_path / "b", SOURCE, meta, cubin=_elf())
    assert art.cubin == "kernel.cubin" and art.cubin_path == tmp_path / "b" / "kernel.cubin"
    assert json.loads((tmp_path / "b" / "kernel.json").read_text())["format"] == FORMAT_TAG
    assert KernelArtefact.load(tmp_path / "b") == art
    assert art.to_meta() == {**_meta(), "cubin": "kernel.cubin"}


def test_nvcc_flags_round_trip(tmp_path: Path) -> None:
    """The flags a kernel was built with travel in kernel.json, so a GPU-side rebuild uses them."""
    art = KernelArtefact.load(_write(tmp_path / "f", _meta(nvcc_flags=["-ftz=true", "-prec-div=false"])))
    assert art.nvcc_flags == ("-ftz=true", "-prec-div=false")
    assert art.to_meta()["nvcc_flags"] == ["-ftz=true", "-prec-div=false"]
    assert "nvcc_flags" not in KernelArtefact.load(_write(tmp_path / "g", _meta())).to_meta()


def test_grid_dependency_wait_round_trips_and_is_checked(tmp_path: Path) -> None:
    """Only a kernel that says it waits for the grid before it may be launched programmatically dependent."""
    art = KernelArtefact.load(_write(tmp_path / "f", _meta(grid_dependency_wait=True)))
    assert art.grid_dependency_wait and art.to_meta()["grid_dependency_wait"] is True
    plain = KernelArtefact.load(_write(tmp_path / "g", _meta()))
    assert not plain.grid_dependency_wait and "grid_dependency_wait" not in plain.to_meta()
    with pytest.raises(ArtefactError, match="grid_dependency_wait must be true or false"):
        KernelArtefact.load(_write(tmp_path / "h", _meta(grid_dependency_wait="yes")))


def test_inout_params_are_passed_like_inputs_and_stand_for_outputs(tmp_path: Path) -> None:
    """A tensor the kernel writes in place (role inout: a KV cache, ``lower.stores``) is passed by the caller
    like an input and never allocated; a kernel whose only writes are such needs no output."""
    params = [p if p["name"] != "O" else {**p, "role": "inout"} for p in _meta()["params"]]
    art = KernelArtefact.load(_write(tmp_path / "io", _meta(params=params)))
    assert [p.name for p in art.outputs] == [] and "O" in {p.name for p in art.inputs}


def test_scratch_params_are_the_launchers(tmp_path: Path) -> None:
    """A workspace param (role scratch) is neither an input nor an output: the launcher keeps it."""
    params = [*_meta()["params"], {"name": "ws", "shape": [4, 8], "dtype": "int32", "role": "scratch"}]
    art = KernelArtefact.load(_write(tmp_path / "s", _meta(params=params, param_order=["O", "S", "V", "ws"])))
    assert [p.name for p in art.scratch] == ["ws"]
    assert "ws" not in {p.name for p in (*art.inputs, *art.outputs)}
    from spacefusion.runtime.gpu import CudaKernel, KernelLaunchError

    with pytest.raises(KernelLaunchError, match=r"\['ws'\] are workspaces or tensor maps the launcher builds"):
        CudaKernel(art)(S=None, V=None, ws=None)


def _tmap(**override: Any) -> dict[str, Any]:
    return {"name": "S__tmap", "shape": [128], "dtype": "uint8", "role": "tensormap",
            "tensor_map": {"tensor": "S", "box": [64, 32], "swizzle": 128}} | override


def test_tensormap_params_name_their_tensor(tmp_path: Path) -> None:
    """A tensormap param is a uint8[128] descriptor of an input the launcher encodes; the input it
    maps may be absent from the kernel's params (read only through the map)."""
    params = [*_meta()["params"], _tmap()]
    art = KernelArtefact.load(_write(tmp_path / "t", _meta(params=params, param_order=["O", "S__tmap", "V"])))
    (m,) = [p for p in art.params if p.role == "tensormap"]
    assert m.tensor_map == ("S", (64, 32), 128) and m.to_json()["tensor_map"]["box"] == [64, 32]
    assert [p.name for p in art.inputs] == ["S", "V"]
    for bad, match in [(_tmap(tensor_map=None), "needs tensor_map"),
                       (_tmap(tensor_map={"tensor": "X", "box": [64, 32], "swizzle": 128}), "describes 'X'"),
                       (_tmap(tensor_map={"tensor": "S", "box": [64, 512], "swizzle": 128}), "1..256"),
                       (_tmap(tensor_map={"tensor": "S", "box": [64, 32], "swizzle": 96}), "swizzle 96"),
                       (_tmap(shape=[64]), "uint8\\[128\\]")]:
        with pytest.raises(ArtefactError, match=match):
            KernelArtefact.load(_write(tmp_path / "b", _meta(params=[*_meta()["params"], bad],
                                                             param_order=["O", "S__tmap", "V"])))
    with pytest.raises(ArtefactError, match="has a tensor_map; only tensormap params"):
        KernelArtefact.load(_write(tmp_path / "c", _meta(params=_param("S", tensor_map={"tensor": "S"}))))


def test_tensor_map_arguments_follow_the_driver_rules() -> None:
    """Dims and strides innermost first; the driver's rules checked before it is called."""
    from spacefusion.runtime.tensormap import TensorMapError, tiled_args

    assert tiled_args((8192, 1024), (1024, 1), 2, (64, 128), 128) == ([1024, 8192], [2048], [64, 128])
    for args, match in [(((64, 64), (1, 64), 2, (64, 64), 128), "innermost dim has stride 64"),
                        (((64, 60), (60, 1), 2, (32, 64), 128), "multiples of 16"),
                        (((64, 64), (64, 1), 2, (128, 64), 128), "wider than the 128 B swizzle"),
                        (((64, 64), (64, 1), 2, (64, 300), 128), "1..256"),
                        (((64, 64), (64, 1), 2, (64,), 128), "one box size per dim")]:
        with pytest.raises(TensorMapError, match=match):
            tiled_args(*args)


def test_save_validates_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ArtefactError, match="param_order"):
        KernelArtefact.save(tmp_path / "c", SOURCE, _meta(param_order=["S", "V"]))
    assert not (tmp_path / "c").exists()


def test_artefact_error_is_value_error() -> None:
    assert issubclass(ArtefactError, ValueError)


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        (_meta(format="spacefusion-kernel/0"), "format tag"),
        ([1, 2], "JSON object"),
        ({k: v for k, v in _meta().items() if k != "grid"}, "lacks required key 'grid'"),
        (_meta(param_order=["O", "S"]), r"param_order .*missing \['V'\]"),
        (_meta(param_order=["O", "S", "V", "Q"]), r"unknown \['Q'\]"),
        (_meta(param_order=["O", "S", "S", "V"]), "param_order"),
        (_meta(params=_param("V", shape=[128, -32])), "'V' has bad shape"),
        (_meta(params=_param("V", shape=[])), "'V' has bad shape"),
        (_meta(params=_param("V", shape=[128, 32.0])), "'V' has bad shape"),
        (_meta(params=_param("V", shape=[True, 32])), "'V' has bad shape"),
        (_meta(params=_param("V", shape="128x32")), "'V' has bad shape"),
        (_meta(params=_param("S", dtype="float8")), "'S' has unsupported dtype"),
        (_meta(params=_param("S", role="inplace")), "'S' has role"),
        (_meta(params=_param("O", role="input")), "no param has role 'output'"),
        (_meta(params=[*_meta()["params"], _meta()["params"][0]]), "duplicate param names"),
        (_meta(params=[]), "params must be a non-empty list"),
        (_meta(block=[1024, 2, 1]), "2048 threads"),
        (_meta(grid=[0, 1, 1]), "grid must be"),
        (_meta(grid=[1, 1, 1, 1]), "grid must be"),
        (_meta(dynamic_smem_bytes=-1), "dynamic_smem_bytes"),
        (_meta(arch="90a"), "arch"),
        (_meta(kernel_name="main kernel"), "kernel_name"),
        (_meta(cubin="../x.cubin"), "cubin"),
        (_meta(workload=[1]), "workload"),
        (_meta(nvcc_flags="-ftz=true"), "nvcc_flags"),
        (_meta(nvcc_flags=["ftz"]), "nvcc_flags"),
    ],
)
def test_invalid_metadata_is_rejected(tmp_path: Path, meta: Any, match: str) -> None:
    with pytest.raises(ArtefactError, match=match):
        KernelArtefact.load(_write(tmp_path / "bad", meta))


def test_missing_files_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(ArtefactError, match="does not exist"):
        KernelArtefact.load(tmp_path / "nowhere")
    folder = _write(tmp_path / "x", _meta())
    (folder / "kernel.cu").unlink()
    with pytest.raises(ArtefactError, match="missing kernel.cu"):
        KernelArtefact.load(folder)
    (folder / "kernel.json").unlink()
    with pytest.raises(ArtefactError, match="missing kernel.json"):
        KernelArtefact.load(folder)
    _write(folder, _meta())
    (folder / "kernel.json").write_text("{not json")
    with pytest.raises(ArtefactError, match="not valid JSON"):
        KernelArtefact.load(folder)


def test_kernel_name_must_be_defined_in_source(tmp_path: Path) -> None:
    with pytest.raises(ArtefactError, match="'other_kernel' is not defined in kernel.cu"):
        KernelArtefact.load(_write(tmp_path / "k", _meta(kernel_name="other_kernel")))


def test_cuda_kernel_constructs_without_gpu_stack(tmp_path: Path) -> None:
    from spacefusion.runtime.gpu import CudaKernel

    kernel = CudaKernel(_write(tmp_path / "k", _meta()))
    assert kernel.backend is None and "main_kernel" in repr(kernel)


def test_timing_summary_statistics() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 10) == pytest.approx(1.0)
    res = summarize([float(x) for x in range(100, 0, -1)])
    assert res.iters == 100 and res.median_us == 50.5
    assert res.p10_us == pytest.approx(10.9) and res.p90_us == pytest.approx(90.1)
    assert res.as_dict()["median_us"] == 50.5


def test_timing_refuses_unknown_flush_mode_before_touching_a_gpu() -> None:
    from spacefusion.runtime.timing import DEFAULT_FLUSH, FLUSH_MODES, time_cuda

    assert DEFAULT_FLUSH == "read" and set(FLUSH_MODES) == {"read", "write"}
    with pytest.raises(ValueError, match="unknown L2 flush mode 'dirty'.*read, write"):
        time_cuda(lambda: None, flush="dirty")


def _modules_after(code: str) -> dict[str, bool]:
    watched = HEAVY + ("torch", "cupy")
    probe = f"{code}\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {watched!r}}}))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=60
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_runtime_imports_no_heavy_dependencies() -> None:
    loaded = _modules_after(
        f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "import spacefusion.runtime, spacefusion.runtime.gpu, spacefusion.runtime.timing"
    )
    assert not any(loaded.values()), loaded


def test_gpu_script_imports_runtime_as_the_package() -> None:
    script = REPO_ROOT / "experiments" / "run_artefacts_gpu.py"
    loaded = _modules_after(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('run_artefacts_gpu', {str(script)!r})\n"
        "mod = sys.modules['run_artefacts_gpu'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "gpu = mod.runtime_module('gpu'); mod.runtime_module('timing')\n"
        "assert gpu.CudaKernel.__module__ == 'spacefusion.runtime.gpu'\n"
        "assert not any(m.startswith(('spacefusion.lower', 'spacefusion.frontend', 'spacefusion.api')) "
        "for m in sys.modules)"
    )
    assert not any(loaded.values()), loaded


VADD_SOURCE = r"""
extern "C" __global__ void vadd(const float* __restrict__ B, float* __restrict__ C,
                                const float* __restrict__ A) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 1000) C[i] = A[i] + 2.0f * B[i];
}

extern "C" __global__ void smem_copy(const float* __restrict__ A, float* __restrict__ C) {
  extern __shared__ float buf[];  // 64 KB dynamic: needs the opt-in attribute
  for (int i = threadIdx.x; i < 16384; i += blockDim.x) buf[i] = A[i];
  __syncthreads();
  for (int i = threadIdx.x; i < 16384; i += blockDim.x) C[i] = buf[16383 - i];
}
"""


@pytest.mark.cuda
def test_cuda_kernel_runs_on_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.runtime.gpu import CudaKernel, KernelLaunchError
    from spacefusion.runtime.timing import time_cuda

    monkeypatch.setenv("SPACEFUSION_CUBIN_CACHE", str(tmp_path / "cache"))
    major, minor = torch.cuda.get_device_capability()
    vec = [{"name": n, "shape": [1000], "dtype": "float32", "role": "input"} for n in ("A", "B")]
    meta = _meta(
        kernel_name="vadd",
        arch=f"sm_{major}{minor}",
        grid=[4],
        block=[256],
        params=[*vec, {"name": "C", "shape": [1000], "dtype": "float32", "role": "output"}],
        param_order=["B", "C", "A"],  # not sorted: pointers must follow param_order
        workload={"name": "vadd"},
    )
    kernel = CudaKernel(KernelArtefact.save(tmp_path / "vadd", VADD_SOURCE, meta))
    a = torch.randn(1000, device="cuda")
    b = torch.randn(1000, device="cuda")
    out = kernel.launch({"A": a, "B": b})["C"]
    torch.testing.assert_close(out, a + 2 * b)
    assert kernel.backend == "nvcc"

    c = torch.empty(1000, device="cuda")
    assert kernel(A=a, B=b, C=c)["C"] is c
    torch.testing.assert_close(c, a + 2 * b)
    with pytest.raises(KernelLaunchError, match="'B'.*dtype"):
        kernel(A=a, B=b.half())
    with pytest.raises(KernelLaunchError, match="'A'.*shape"):
        kernel(A=a[:10], B=b)
    with pytest.raises(KernelLaunchError, match="'A'.*not contiguous"):
        kernel(A=torch.randn(2000, device="cuda")[::2], B=b)
    with pytest.raises(KernelLaunchError, match="missing inputs"):
        kernel(A=a)
    assert time_cuda(lambda: kernel(A=a, B=b, C=c), warmup=2, iters=5).median_us > 0

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the launch must join torch's current stream, not cupy's default
        doubled = kernel(A=a, B=b)["C"] * 2
    side.synchronize()
    torch.testing.assert_close(doubled, 2 * (a + 2 * b))

    big = [
        {"name": "A", "shape": [16384], "dtype": "float32", "role": "input"},
        {"name": "C", "shape": [16384], "dtype": "float32", "role": "output"},
    ]
    smem_meta = {**meta, "kernel_name": "smem_copy", "grid": [1], "block": [256], "params": big}
    smem_meta.update(param_order=["A", "C"], dynamic_smem_bytes=64 * 1024)
    smem = CudaKernel(KernelArtefact.save(tmp_path / "smem", VADD_SOURCE, smem_meta))
    x = torch.randn(16384, device="cuda")
    torch.testing.assert_close(smem(A=x)["C"], x.flip(0))


@pytest.mark.cuda
def test_a_graphed_replay_keeps_what_its_launches_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """e2e_subgraphs replaced each system by its graph's replay; the kernel (its cupy module) and the
    inputs the graph reads by address were then freed, and a replay hit an illegal address.  The replay
    now owns them: with every other reference dropped and the memory churned it still computes a + 2b."""
    import gc

    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    sys.path.insert(0, str(REPO_ROOT / "experiments"))
    from e2e_gpu import _graphed

    from spacefusion.runtime.gpu import CudaKernel

    monkeypatch.setenv("SPACEFUSION_CUBIN_CACHE", str(tmp_path / "cache"))
    major, minor = torch.cuda.get_device_capability()
    vec = [{"name": n, "shape": [1000], "dtype": "float32", "role": "input"} for n in ("A", "B")]
    meta = _meta(kernel_name="vadd", arch=f"sm_{major}{minor}", grid=[4], block=[256],
                 params=[*vec, {"name": "C", "shape": [1000], "dtype": "float32", "role": "output"}],
                 param_order=["B", "C", "A"], workload={"name": "vadd"})
    kernel = CudaKernel(KernelArtefact.save(tmp_path / "vadd", VADD_SOURCE, meta))
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(1000, device="cuda", generator=gen) for _ in range(2))
    want = a + 2 * b
    replay = _graphed(lambda x, k=kernel, w=b: k(A=x, B=w)["C"], (a,))  # the only references left
    del kernel, a, b
    gc.collect()
    churn = [torch.full((1000,), 7.0, device="cuda") for _ in range(64)]
    torch.testing.assert_close(replay(), want)
    torch.cuda.synchronize()
    del churn


class _Fence:
    """A stand-in for a CUDA event: the stream has passed it once ``done``."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_evicted_tensor_maps_live_until_the_stream_passes_the_fence() -> None:
    """Regression: the kernel's map cache was cleared at 64 entries while launches reading the maps were
    still queued; freed, a map's memory went to the next tensor and the TMA unit read garbage (LLaMA-2's
    32 layers: CUDA_ERROR_ILLEGAL_INSTRUCTION).  Evicted maps now stay referenced until a fence recorded at
    eviction has passed, and nothing is evicted under graph capture (fence None)."""
    import weakref

    from spacefusion.runtime.gpu import MapCache

    class Map:  # a device tensor map: its lifetime is what matters
        pass

    cache, fences = MapCache(limit=2), []

    def fence() -> _Fence:
        fences.append(_Fence())
        return fences[-1]

    first = cache.get(("B", 1), Map, fence)
    assert cache.get(("B", 1), Map, fence) is first  # encoded once per address
    alive = weakref.ref(first)
    cache.get(("B", 2), Map, fence)
    del first
    cache.get(("B", 3), Map, fence)  # the third evicts both, behind a fence
    assert len(fences) == 1 and alive() is not None
    cache.get(("B", 3), Map, fence)
    assert alive() is not None  # the stream has not passed the fence: a queued launch may read it
    fences[0].done = True
    cache.get(("B", 3), Map, fence)
    assert alive() is None and set(cache.maps) == {("B", 3)}
    for i in range(4, 8):  # under capture: kept, however many
        cache.get(("B", i), Map, None)
    assert len(cache.maps) == 5 and len(fences) == 1


def test_direct_launch_hands_the_driver_a_block_of_the_addresses(monkeypatch) -> None:
    """The planned launch's parameter block (made once, refilled per call) is what ``cuLaunchKernel`` reads:
    an array of pointers, the i-th to the i-th 8-byte argument; grid, block, shared memory and stream as given."""
    import ctypes
    import sys
    import types

    from spacefusion.runtime.gpu import _direct_launch

    seen: list[tuple] = []

    def launch_kernel(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra) -> None:
        pointers = (ctypes.c_void_p * 3).from_address(params)
        seen.append((f, (gx, gy, gz), (bx, by, bz), smem, stream, extra,
                     [ctypes.c_uint64.from_address(p).value for p in pointers]))

    driver = types.SimpleNamespace(launchKernel=launch_kernel)
    cuda = types.SimpleNamespace(driver=driver)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.driver", driver)
    raw_kernel = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xF00))
    go = _direct_launch(raw_kernel, (132, 1, 1), (384, 1, 1), 1024, 3)
    go([0x7F0000001000, 2**64 - 1, 16], 0xABC)
    go([1, 2, 3], 0)
    assert seen == [(0xF00, (132, 1, 1), (384, 1, 1), 1024, 0xABC, 0, [0x7F0000001000, 2**64 - 1, 16]),
                    (0xF00, (132, 1, 1), (384, 1, 1), 1024, 0, 0, [1, 2, 3])]
    monkeypatch.setitem(sys.modules, "cupy.cuda.driver", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "cupy.cuda", types.SimpleNamespace(driver=types.SimpleNamespace()))
    assert _direct_launch(raw_kernel, (1, 1, 1), (32, 1, 1), 0, 1) is None  # no binding: cupy's own call


def test_a_dependent_launch_hands_cuLaunchKernelEx_the_driver_s_config(monkeypatch) -> None:
    """``dependent``, under graph capture: the launch goes through ``cuLaunchKernelEx`` with one attribute,
    programmatic stream serialization on, in the driver's ``CUlaunchConfig`` layout (stream at byte 32,
    attributes at 40, their count at 48; an attribute is its id, 4 bytes of padding, a 64-byte value); not
    capturing, the plain launch."""
    import ctypes
    import sys
    import types

    from spacefusion.runtime import gpu

    seen: list[tuple] = []

    def launch_ex(cfg, f, params, extra) -> int:
        raw = ctypes.string_at(cfg, 56)
        grid, block = [int.from_bytes(raw[i:i + 4], "little") for i in range(0, 12, 4)], \
            [int.from_bytes(raw[i:i + 4], "little") for i in range(12, 24, 4)]
        smem, stream = int.from_bytes(raw[24:28], "little"), int.from_bytes(raw[32:40], "little")
        attrs, count = int.from_bytes(raw[40:48], "little"), int.from_bytes(raw[48:52], "little")
        attr = ctypes.string_at(attrs, 72)
        pointers = (ctypes.c_void_p * 2).from_address(params)
        seen.append((f, grid, block, smem, stream, count, int.from_bytes(attr[:4], "little"),
                     int.from_bytes(attr[8:12], "little"), [ctypes.c_uint64.from_address(p).value for p in pointers],
                     extra))
        return 0

    plain: list[tuple] = []
    driver = types.SimpleNamespace(launchKernel=lambda *a: plain.append(a))
    cuda = types.SimpleNamespace(driver=driver)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.driver", driver)
    monkeypatch.setattr(gpu, "_launch_ex", lambda: launch_ex)
    raw_kernel = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xF00))
    capture = [True]
    go = gpu._direct_launch(raw_kernel, (132, 2, 1), (384, 1, 1), 4096, 2, dependent=True,
                            capturing=lambda: capture[0])
    go([7, 9], 0xABC)
    assert seen == [(0xF00, [132, 2, 1], [384, 1, 1], 4096, 0xABC, 1, gpu.PROGRAMMATIC_STREAM_SERIALIZATION, 1,
                     [7, 9], None)] and not plain
    capture[0] = False
    go([1, 2], 0xDEF)
    assert len(seen) == 1 and [a[:9] for a in plain] == [(0xF00, 132, 2, 1, 384, 1, 1, 4096, 0xDEF)]
    monkeypatch.setenv("SPACEFUSION_PDL", "0")
    assert not gpu.pdl_enabled()
    monkeypatch.setenv("SPACEFUSION_PDL", "1")
    assert gpu.pdl_enabled()


WAITING_VADD = r"""
extern "C" __global__ void vadd(const float* __restrict__ B, float* __restrict__ C,
                                const float* __restrict__ A) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  for (int j = i; j < (1 << 20); j += gridDim.x * blockDim.x) C[j] = A[j] + 2.0f * B[j];
}
"""


@pytest.mark.cuda
def test_dependent_launches_of_a_waiting_kernel_see_their_predecessors_writes(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain of 64 launches, each reading what the one before wrote: launched plainly, and captured in a
    CUDA graph programmatically dependent (the kernel waits for the grid before it first thing); the last
    output is x + 128 b both ways."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("no CUDA device with griddepcontrol (sm_90+)")
    from spacefusion.runtime import gpu

    monkeypatch.setenv("SPACEFUSION_CUBIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPACEFUSION_PDL", "1")
    assert gpu._launch_ex() is not None
    n = 1 << 20
    vec = [{"name": nm, "shape": [n], "dtype": "float32", "role": "input"} for nm in ("A", "B")]
    major, minor = torch.cuda.get_device_capability()
    meta = _meta(kernel_name="vadd", arch=f"sm_{major}{minor}", grid=[264], block=[256],
                 params=[*vec, {"name": "C", "shape": [n], "dtype": "float32", "role": "output"}],
                 param_order=["B", "C", "A"], workload={"name": "vadd"}, grid_dependency_wait=True)
    kernel = gpu.CudaKernel(KernelArtefact.save(tmp_path / "vadd", WAITING_VADD, meta))
    run = kernel.launcher(0)
    x = torch.randn(n, device="cuda")
    b = torch.randn(n, device="cuda") * 1e-3

    def chain() -> torch.Tensor:
        y = x
        for _ in range(64):
            (y,) = run(y, b)
        return y

    torch.testing.assert_close(chain(), x + 128 * b, rtol=1e-5, atol=1e-5)
    graph = torch.cuda.CUDAGraph()
    chain()
    with torch.cuda.graph(graph):
        out = chain()
    graph.replay()
    torch.testing.assert_close(out, x + 128 * b, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_a_kernel_shorter_than_its_launch_is_timed_without_the_host() -> None:
    """A one-element add from Python: the host needs longer to launch it than the GPU to run it.  Held
    behind a sleep kernel, the timed runs go back to back and the event pair brackets the kernel alone;
    without the hold each run also waits for the host (a model benchmark's ``hold=False``)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.runtime.timing import time_cuda

    x = torch.zeros(1, device="cuda")

    def slow_host() -> None:
        sum(range(20000))  # a launch path as slow as a Python wrapper's
        x.add_(1)

    held = time_cuda(slow_host, warmup=5, iters=50, flush_l2=False).median_us
    paced = time_cuda(slow_host, warmup=5, iters=50, flush_l2=False, hold=False).median_us
    assert held < 20 < paced, (held, paced)


def test_a_deferred_capture_hands_out_slab_slots_in_order_and_falls_back_past_them(monkeypatch) -> None:
    """``tensormap.deferred_copies``' slab: each map encoded while capturing takes the next 128-byte slot (a
    view of the slab allocated before the capture, never memory of the capture's own pool), its copy is kept
    for the block's end; past ``DEFERRED_SLOTS`` or on another device there is no slot (the caller falls back
    to a copy node in the graph)."""
    torch = pytest.importorskip("torch")
    from spacefusion.runtime import tensormap

    monkeypatch.setattr(tensormap, "DEFERRED_SLOTS", 2)
    slab = torch.zeros(2 * tensormap.TENSOR_MAP_BYTES, dtype=torch.uint8)
    state = tensormap._Deferred(slab)
    hosts = [torch.full((tensormap.TENSOR_MAP_BYTES,), i + 1, dtype=torch.uint8) for i in range(3)]
    slots = [state.take(h, torch.device("cpu")) for h in hosts]
    assert slots[2] is None and state.used == 2
    assert [s.data_ptr() - slab.data_ptr() for s in slots[:2]] == [0, tensormap.TENSOR_MAP_BYTES]
    assert [h is p[1] for h, p in zip(hosts, state.pending)] == [True, True]
    assert tensormap._Deferred(torch.zeros(256, dtype=torch.uint8)).take(hosts[0], torch.device("meta")) is None
    for dev, host in state.pending:  # what the block's end does
        dev.copy_(host)
    assert slab.view(2, -1)[:, 0].tolist() == [1, 2]


# ---- cubins: refused by their path when they are not one, before any CUDA call ----------------------------


def _with_cubin(folder: Path, data: bytes | None) -> Path:
    _write(folder, _meta(cubin="kernel.cubin"))
    if data is not None:
        (folder / "kernel.cubin").write_bytes(data)
    return folder


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """cupy (and so any CUDA call) unimportable: what is checked must be checked without the GPU."""
    monkeypatch.setitem(sys.modules, "cupy", None)


@pytest.mark.parametrize("data,problem", [
    (b"this is not a cubin", "not a cubin (no ELF header"),
    (b"", "not a cubin (no ELF header"),
    (b"\x7fELF\x02\x01", "not a complete 64-bit little-endian ELF header"),
    (_elf(elf_class=1), "not a complete 64-bit little-endian ELF header"),
    (_elf(machine=62), "ELF for machine 62, a cubin is EM_CUDA = 190"),
    (_elf(shnum=3), "truncated cubin (its section headers end at byte 256, the file has 64)"),
])
def test_garbage_cubin_is_refused_naming_the_file(tmp_path: Path, no_cuda: None, data: bytes, problem: str) -> None:
    from spacefusion.runtime.gpu import load_kernel

    folder = _with_cubin(tmp_path / "a", data)
    with pytest.raises(ArtefactError) as info:
        load_kernel(folder)
    assert str(info.value).startswith(f"{folder / 'kernel.cubin'}: ") and problem in str(info.value)


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=200).filter(lambda b: not b.startswith(b"\x7fELF")))
def test_any_non_elf_bytes_are_refused(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("c") / "kernel.cubin"
    path.write_bytes(data)
    with pytest.raises(ArtefactError, match=f"{path}: not a cubin"):
        check_cubin(path)


def test_a_well_formed_cubin_header_loads(tmp_path: Path, no_cuda: None) -> None:
    from spacefusion.runtime.gpu import load_kernel

    k = load_kernel(_with_cubin(tmp_path / "a", _elf(shnum=2, size=64 + 128)))
    assert k.artefact.cubin_path == tmp_path / "a" / "kernel.cubin" and k.backend is None


def test_missing_cubin_warns_and_falls_back_to_the_source(tmp_path: Path, no_cuda: None) -> None:
    """The documented fallback (CudaKernel: nvcc, then NVRTC from kernel.cu), no longer silent."""
    from spacefusion.runtime.gpu import load_kernel

    folder = _with_cubin(tmp_path / "a", None)
    with pytest.warns(RuntimeWarning, match=r"kernel.cubin: the cubin kernel.json names is missing; the runtime "
                                            r"will compile kernel.cu instead"):
        k = load_kernel(folder)
    assert k.artefact.cubin == "kernel.cubin" and k.artefact.cubin_path is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KernelArtefact.load(_write(tmp_path / "b", _meta()))  # no cubin named: nothing to warn about


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (compile only, no GPU)")
def test_a_damaged_cached_cubin_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spacefusion.runtime.gpu import compile_cubin

    monkeypatch.setenv("SPACEFUSION_CUBIN_CACHE", str(tmp_path))
    path = compile_cubin(SOURCE, "sm_90a")
    check_cubin(path)
    path.write_bytes(b"garbage")
    assert compile_cubin(SOURCE, "sm_90a") == path
    check_cubin(path)
