"""Hardware models: presets, serialisation, roofline, occupancy, block checks and device query."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import types

import pytest

from schedulers.hardware import (
    H100,
    NPU,
    PRESETS,
    V100,
    ZERO_ALLOWED_FIELDS,
    HardwareError,
    HardwareModel,
    ResourceError,
    from_device,
    get_hardware,
)

KiB = 1024


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_fields_positive_frozen_and_round_trip(name: str) -> None:
    hw = PRESETS[name]
    for f in dataclasses.fields(hw):
        v = getattr(hw, f.name)
        if isinstance(v, int | float):
            assert v >= 0 if f.name in ZERO_ALLOWED_FIELDS else v > 0, f.name
    assert all(p > 0 for _, p in hw.peak_flops_per_s + hw.peak_simt_flops_per_s)
    assert hw.source and hw.kind in ("gpu", "npu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        hw.num_sms = 1  # type: ignore[misc]
    assert HardwareModel.from_dict(hw.to_dict()) == hw
    assert HardwareModel.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw
    assert hash(HardwareModel.from_dict(hw.to_dict())) == hash(hw)


def test_fingerprint_is_content_based_and_stable() -> None:
    prints = {name: hw.fingerprint for name, hw in PRESETS.items()}
    for name, fp in prints.items():
        hw = PRESETS[name]
        assert len(fp) == 64 and all(c in "0123456789abcdef" for c in fp)
        assert hw.fingerprint == fp
        blob = json.dumps(hw.to_dict(), sort_keys=True, separators=(",", ":"))
        assert hashlib.sha256(blob.encode()).hexdigest() == fp
    assert len(set(prints.values())) == len(prints)
    assert dataclasses.replace(H100, clock_hz=H100.clock_hz).fingerprint == H100.fingerprint


def test_get_hardware_aliases_and_unknown_name() -> None:
    for alias in ("h100", "H100", "h100-sxm", "H100_SXM5", "NVIDIA H100"):
        assert get_hardware(alias) is H100
    assert get_hardware("a100").name == "A100" and get_hardware("V100").name == "V100"
    assert get_hardware("h200").dram_bandwidth_bytes_per_s == 4.8e12
    assert get_hardware("npu") is NPU and NPU.kind == "npu"
    assert get_hardware(H100) is H100
    with pytest.raises(HardwareError) as e:
        get_hardware("tpu-v9")
    assert "tpu-v9" in str(e.value)
    assert all(k in str(e.value) for k in PRESETS)


def test_ridge_points() -> None:
    assert NPU.ridge_point("int8") == pytest.approx(200.0)
    assert H100.ridge_point("float16") == pytest.approx(989.4e12 / 3.35e12)
    assert H100.ridge_point("fp16") == H100.ridge_point("float16")


def test_peak_flops_missing_dtype_names_dtype_and_known() -> None:
    assert H100.peak_flops("float32", tensor_core=False) == 66.9e12
    with pytest.raises(HardwareError) as e:
        V100.peak_flops("bfloat16")
    assert "bfloat16" in str(e.value) and "float16" in str(e.value)
    with pytest.raises(HardwareError, match="tf32"):
        H100.peak_flops("float32")


def test_roofline_takes_the_slower_of_compute_and_memory() -> None:
    # compute bound: 1e15 FLOP at 989.4 TFLOP/s vs 1 GB at 3.35 TB/s
    assert H100.roofline_time_s(1e15, 1e9, "float16") == pytest.approx(1e15 / 989.4e12)
    # memory bound: 1e9 FLOP vs 3.35e10 B -> 10 ms
    assert H100.roofline_time_s(1e9, 3.35e10, "float16") == pytest.approx(1e-2)
    # NPU int8 at the ridge point: both terms equal
    assert NPU.roofline_time_s(200e12, 1e12, "int8") == pytest.approx(1.0)


def test_check_block_fits_and_names_the_resource() -> None:
    assert H100.check_block(32 * KiB, 256, regs_per_thread=64) is None
    assert H100.check_block(200 * KiB, 256, dynamic=True) is None
    with pytest.raises(ResourceError) as e:
        H100.check_block(80 * KiB, 128)
    msg = str(e.value)
    assert msg.startswith("shared memory") and "80.0 KiB" in msg and "48.0 KiB" in msg and "227.0 KiB" in msg
    with pytest.raises(ResourceError, match="^shared memory"):
        H100.check_block(228 * KiB, 128, dynamic=True)
    with pytest.raises(ResourceError, match="^threads.*2048.*1024"):
        H100.check_block(0, 2048)
    with pytest.raises(ResourceError, match="^registers.*300.*255"):
        H100.check_block(0, 128, regs_per_thread=300)
    with pytest.raises(ResourceError, match="^registers.*65536"):
        H100.check_block(0, 1024, regs_per_thread=128)
    with pytest.raises(ResourceError, match="^shared memory.*96.0 KiB"):
        NPU.check_block(100 * KiB, 1)
    assert NPU.check_block(96 * KiB, 1) is None
    assert issubclass(ResourceError, HardwareError) and issubclass(HardwareError, ValueError)


def test_occupancy() -> None:
    assert H100.occupancy_blocks_per_sm(0, 128, 32) == 16  # threads: 2048 / 128
    assert H100.occupancy_blocks_per_sm(0, 32, 0) == 32  # max blocks per SM
    assert H100.occupancy_blocks_per_sm(100 * KiB, 128, 32) == 2
    assert H100.occupancy_blocks_per_sm(300 * KiB, 128, 32) == 0
    assert H100.occupancy_blocks_per_sm(0, 256, 128) == 2  # registers: 65536 / (256 x 128)
    assert H100.occupancy_blocks_per_sm(0, 2048, 0) == 0
    assert NPU.occupancy_blocks_per_sm(64 * KiB, 128) == 1
    assert NPU.occupancy_blocks_per_sm(97 * KiB, 1) == 0


def test_waves() -> None:
    assert H100.waves(132 * 2, 2) == 1
    assert H100.waves(132 * 2 + 1, 2) == 2
    assert H100.waves(0, 4) == 0
    with pytest.raises(HardwareError):
        H100.waves(10, 0)


def test_from_dict_rejects_missing_and_unknown_fields() -> None:
    d = H100.to_dict()
    del d["num_sms"]
    with pytest.raises(HardwareError, match="num_sms"):
        HardwareModel.from_dict(d)
    with pytest.raises(HardwareError, match="bogus"):
        HardwareModel.from_dict({**H100.to_dict(), "bogus": 1})
    with pytest.raises(HardwareError, match="kind"):
        HardwareModel.from_dict({**H100.to_dict(), "kind": "tpu"})


def _fake_cupy(props: dict, count: int = 1) -> types.ModuleType:
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: count,
        getDeviceProperties=lambda i: props,
        deviceGetAttribute=lambda attr, i: {13: 1980000, 36: 2619000, 37: 5120}[attr],
    )
    mod = types.ModuleType("cupy")
    mod.cuda = types.SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    return mod


_H100_PROPS = {
    "name": b"NVIDIA H100 80GB HBM3", "major": 9, "minor": 0, "multiProcessorCount": 132,
    "sharedMemPerMultiprocessor": 233472, "sharedMemPerBlockOptin": 232448, "sharedMemPerBlock": 49152,
    "reservedSharedMemPerBlock": 1024, "regsPerMultiprocessor": 65536, "regsPerBlock": 65536,
    "maxThreadsPerBlock": 1024, "maxThreadsPerMultiProcessor": 2048, "maxBlocksPerMultiProcessor": 32,
    "warpSize": 32, "l2CacheSize": 52428800, "totalGlobalMem": 85045346304,
}


def test_from_device_with_fake_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(_H100_PROPS))  # clocks come via deviceGetAttribute
    hw = from_device()
    assert hw.name == "NVIDIA H100 80GB HBM3" and hw.arch == "sm_90a" and hw.num_sms == 132
    assert hw.clock_hz == 1.98e9
    assert hw.dram_bandwidth_bytes_per_s == pytest.approx(2.619e9 * 2 * 5120 / 8)
    assert hw.peak_flops("float16") == H100.peak_flops("float16")
    assert hw.mma_shapes == H100.mma_shapes and hw.source.startswith("queried from device")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy({**_H100_PROPS, "name": b"NVIDIA H100 PCIe",
                                                         "multiProcessorCount": 114, "clockRate": 1755000}))
    assert from_device().peak_flops("float16") == pytest.approx(989.4e12 * 114 * 1.755 / (132 * 1.98))


def test_from_device_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(_H100_PROPS, count=0))
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(HardwareError, match="no CUDA device"):
        from_device()


def test_import_is_stdlib_only() -> None:
    src = open(sys.modules[HardwareModel.__module__].__file__).read()
    top = [line for line in src.splitlines() if line.startswith(("import ", "from "))]
    assert all(m.split()[1].split(".")[0] in sys.stdlib_module_names | {"__future__"} for m in top), top


@pytest.mark.cuda
def test_from_device_on_real_gpu() -> None:
    pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    hw = from_device()
    assert hw.num_sms > 0 and hw.smem_per_block_bytes >= hw.smem_static_per_block_bytes > 0
    assert hw.dram_bandwidth_bytes_per_s > 0 and math.isfinite(hw.clock_hz)
    assert HardwareModel.from_dict(hw.to_dict()) == hw
    print(json.dumps(hw.to_dict(), indent=1))


def test_from_device_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    props = types.SimpleNamespace(
        name="NVIDIA A100-SXM4-80GB", major=8, minor=0, multi_processor_count=108, total_memory=85 * 10**9,
        shared_memory_per_multiprocessor=167936, shared_memory_per_block_optin=166912, shared_memory_per_block=49152,
        regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, warp_size=32, L2_cache_size=41943040,
    )
    cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,
                                 get_device_properties=lambda i: props)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    hw = from_device()
    assert hw.arch == "sm_80" and hw.num_sms == 108 and hw.peak_flops("bfloat16") == 312e12
    assert "via torch" in hw.source and "clock_hz" in hw.source and "max_threads_per_block" in hw.source
    assert hw.clock_hz == 1.41e9 and hw.dram_bandwidth_bytes_per_s == 2039e9
