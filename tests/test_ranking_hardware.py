"""Which machine's numbers rank a kernel (issue 57): the GPU in hand's preset, a model the caller gives, or a
reported default, never a silent H100; each machine's kernels in a folder of their own; each machine's prior.
No GPU is needed: the device is named by monkeypatching torch's answers."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from schedulers.hardware import (
    A100,
    CPU_STAND_IN,
    DEFAULT_GPU,
    H100,
    H200,
    NPU,
    HardwareChoice,
    choose_hardware,
    preset_of_device,
)
from smg import patterns
from spacefusion.frontend import dynamo, machine
from spacefusion.frontend.backends import HARDWARE_FILE, CudaBackend, recorded_hardware
from spacefusion.frontend.errors import FrontendError


def _gpu(monkeypatch: pytest.MonkeyPatch, name: str | None, capability: tuple[int, int] | None = (9, 0)) -> None:
    """torch answers as a machine with the GPU ``name`` (None: no GPU); nothing is initialised."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: name is not None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(machine, "_LOGGED", set())  # each test sees its own default's log line


# ---------------------------------------------------------------------- choosing the model


@pytest.mark.parametrize("device, want, defaulted", [
    (("NVIDIA H200", (9, 0)), H200, False),
    (("NVIDIA H100 80GB HBM3", (9, 0)), H100, False),
    (("NVIDIA H100 PCIe", (9, 0)), H100, False),
    (("NVIDIA A100-SXM4-80GB", (8, 0)), A100, False),
    (("Some GPU 9000", (9, 0)), H100, False),  # no preset by name: by compute capability, said so
    (("Some GPU 8600", (8, 6)), DEFAULT_GPU, True),  # neither: the default, marked
    (None, DEFAULT_GPU, True),  # no GPU here
])
def test_the_model_is_the_devices_preset_else_a_marked_default(device, want, defaulted: bool) -> None:
    got = choose_hardware(None, device)
    assert got.model is want and got.defaulted is defaulted
    if device is None:
        assert "no CUDA GPU here" in got.why
    elif "Some GPU 9000" in device[0]:
        assert "compute capability 9.0" in got.why
    assert choose_hardware("h200", device) == HardwareChoice(H200, "given")  # a given model always wins
    assert choose_hardware(A100, device).model is A100


def test_the_preset_of_a_device_name_by_capability_only_where_asked() -> None:
    assert preset_of_device("Some GPU 9000") is None  # a measurement's key is never guessed
    assert preset_of_device("Some GPU 9000", (9, 0)) is H100
    assert preset_of_device("NVIDIA H200", (9, 0)) is H200


def test_a_default_is_logged_once_per_reason(monkeypatch, caplog) -> None:
    _gpu(monkeypatch, None)
    with caplog.at_level(logging.WARNING, logger="spacefusion"):
        assert machine.ranking_hardware().model is DEFAULT_GPU
        machine.ranking_hardware()
        _gpu(monkeypatch, "NVIDIA H200")
        assert machine.ranking_hardware().model is H200  # no default: nothing to say
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "ranks CUDA kernels for the H100: no CUDA GPU here" in lines[0], lines


# ---------------------------------------------------------------------- an H200 ranks with its own numbers


def _spy_on_ranking(monkeypatch: pytest.MonkeyPatch) -> list:
    """The hardware every estimate of a first pick is made for."""
    import search.cost as cost

    seen: list = []
    real = cost.estimate_us

    def spy(s, hw, *a, **k):
        seen.append(hw)
        return real(s, hw, *a, **k)

    monkeypatch.setattr(cost, "estimate_us", spy)
    return seen


@pytest.mark.parametrize("name, want", [("NVIDIA H200", H200), ("NVIDIA H100 80GB HBM3", H100)])
def test_the_cuda_targets_first_picks_rank_with_the_gpu_in_hands_numbers(tmp_path, monkeypatch, name, want) -> None:
    """``spacefusion.compile(model)`` on an H200: the backend, its split decisions and every estimate of its
    first picks use the H200's 4.8 TB/s, not the H100's 3.35; its kernels go to the H200's own folder."""
    from spacefusion.frontend import schedules

    _gpu(monkeypatch, name)
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    monkeypatch.setattr(schedules, "_RANKED", type(schedules._RANKED)())  # nothing ranked before counts
    backend = dynamo.kernel_backend("cuda")
    assert backend.hardware.model is want and backend.split_hw is want and not backend.hardware.defaulted
    assert backend.folder == tmp_path / "kernels" / want.name.lower()
    seen = _spy_on_ranking(monkeypatch)
    backend.schedule_for(patterns.layernorm(1024, 768, dtype="float16"))
    assert seen and {hw.dram_bandwidth_bytes_per_s for hw in seen} == {want.dram_bandwidth_bytes_per_s}
    assert dynamo.device_hardware() is want


def test_a_first_pick_differs_where_the_machines_numbers_do() -> None:
    """The H200 is the H100 with 4.8 TB/s of DRAM instead of 3.35.  A 64-row fp16 projection, 4096 x 4096 (a
    decode step's), reads its weight once whatever the tiles, so its candidates' estimates are bound by
    traffic: the H100's first pick is more than the 1% of a tie slower on the H200 than the H200's own, which
    the H100 ranks in its first tie group."""
    from search.cost import estimate_us
    from search.prior import TIE

    smg = patterns.gemm_epilogue(64, 4096, 4096, "none", False, dtype="float16")
    h100, h200 = dynamo.first_pick(smg, H100), dynamo.first_pick(smg, H200)
    assert h100.key != h200.key
    assert estimate_us(h100, H200) > (1 + TIE) * estimate_us(h200, H200)
    assert estimate_us(h200, H100) <= (1 + TIE) * estimate_us(h100, H100)


def test_an_explicit_model_wins_over_the_gpu_in_hand(tmp_path, monkeypatch) -> None:
    _gpu(monkeypatch, "NVIDIA H200")
    backend = CudaBackend(tmp_path, hardware="h100", load=False)
    assert backend.hardware == HardwareChoice(H100, "given") and backend.split_hw is H100
    assert CudaBackend(tmp_path / "b", hardware=H100, split_hw=None, load=False).split_hw is None


# ---------------------------------------------------------------------- a CPU-only export reports its default


def test_an_export_on_a_cpu_machine_reports_the_default_it_ranked_for(tmp_path, monkeypatch, caplog) -> None:
    """No GPU here: the first picks are the H100's, and the report, ``hardware.json``, each ``timing.json``
    and a log line say so; naming the H200 ranks for it instead."""
    _gpu(monkeypatch, None)
    model, x = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU()).eval(), torch.randn(16, 32)
    with caplog.at_level(logging.WARNING, logger="spacefusion"):
        backend = dynamo.export_cuda(model, tmp_path / "a", x)
    assert any("no CUDA GPU here" in r.getMessage() for r in caplog.records)
    choice = backend.kernels.hardware
    assert choice.model is DEFAULT_GPU and choice.defaulted
    assert "ranked for the H100 (no CUDA GPU here: the H100 preset by default" in str(backend), str(backend)
    record = json.loads((tmp_path / "a" / HARDWARE_FILE).read_text())
    assert record["hardware"] == "H100" and record["defaulted"] is True and "no CUDA GPU" in record["why"]
    timings = [json.loads(p.read_text()) for p in (tmp_path / "a").glob("*/timing.json")]
    assert timings and all(t["ranked_for"] == choice.to_dict() for t in timings)

    named = dynamo.export_cuda(model, tmp_path / "b", x, hardware="H200")
    assert named.kernels.hardware == HardwareChoice(H200, "given")
    assert "ranked for the H200 (given)" in str(named)
    assert recorded_hardware(tmp_path / "b")[0] == H200


# ---------------------------------------------------------------------- the kernel cache, keyed by the machine


def test_each_machine_has_its_own_kernel_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    root = dynamo.kernel_cache()
    assert root == tmp_path / "kernels"  # the root, as before
    assert dynamo.kernel_cache(H100) == root / "h100" and dynamo.kernel_cache(H200) == root / "h200"
    smg = patterns.layernorm(64, 96, dtype="float16")
    h100, h200 = (CudaBackend(dynamo.kernel_cache(hw), hardware=hw, load=False) for hw in (H100, H200))
    assert h100.artefact_dir(smg) != h200.artefact_dir(smg)  # an H100's first pick is never an H200's


def test_a_folder_ranked_for_another_machine_is_not_built_into_and_loads_as_it_is(tmp_path, monkeypatch,
                                                                                   caplog) -> None:
    """A folder records the machine its decisions were ranked for as soon as one is written.  A backend that
    builds for another machine refuses it (its artefacts are named by the SMG alone, so they would be served
    or mixed); one that only loads takes the folder's machine as its own and says so; a damaged record is
    named."""
    smg = patterns.layernorm(1024, 768, dtype="float16")
    first = CudaBackend(tmp_path, hardware=H100, load=False)
    first.split_of(smg)  # a decision: the folder now says whose
    assert recorded_hardware(tmp_path)[0] == H100
    assert json.loads((tmp_path / smg.key[:16] / "split.json").read_text())["hw"] == "H100"

    with pytest.raises(FrontendError, match="ranked for the H100.*builds for the H200"):
        CudaBackend(tmp_path, hardware=H200, build_missing=True, load=False)
    assert CudaBackend(tmp_path, hardware=H100, build_missing=True, load=False).hardware.model is H100
    _gpu(monkeypatch, "NVIDIA H200")
    with caplog.at_level(logging.WARNING, logger="spacefusion"):
        loader = CudaBackend(tmp_path)  # the GPU machine loading an H100 export
    assert loader.hardware.model is H100 and loader.split_hw is H100 and "recorded" in loader.hardware.why
    assert any("ranked for the H100" in r.getMessage() and "H200" in r.getMessage() for r in caplog.records)

    (tmp_path / HARDWARE_FILE).write_text("[1]")
    with pytest.raises(FrontendError, match="hardware.json is not a hardware record"):
        CudaBackend(tmp_path, load=False)


def test_the_compiles_seen_marks_are_the_machines_own(tmp_path, monkeypatch) -> None:
    """``seen`` is kept beside each machine's kernels: an H100's warm compile says nothing of an H200's."""
    from spacefusion.frontend.seen import mark, seen

    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    mark(dynamo.writable_kernel_cache(H100), ["model-x"])
    assert seen(dynamo.kernel_cache(H100), "model-x") and not seen(dynamo.kernel_cache(H200), "model-x")


# ---------------------------------------------------------------------- priors


def test_each_machine_ranks_ties_with_its_own_prior_else_the_h100s_with_a_reason() -> None:
    from search.prior import prior_for, prior_path

    own = prior_for(H200)
    assert own.trained_on == "H200" and own.model is not None and own.model.hw == H200
    assert own.model.meta["training"]["num_records"] == own.model.meta["num_records"] > 0
    assert prior_for(H100).trained_on == "H100"
    fallback = prior_for(A100)
    assert fallback.trained_on == "H100" and fallback.model is prior_for(H100).model
    assert "no prior of the A100 ships" in fallback.why and "H100's numbers" in fallback.why
    assert prior_for(NPU).model is None  # not a GPU: no GPU's ranker stands in
    import dataclasses

    assert prior_path(dataclasses.replace(H200, name="NVIDIA H200")) == prior_path(H200)  # a queried device's


# ---------------------------------------------------------------------- the other defaults


def test_the_tuner_files_records_under_the_gpu_in_hand_or_the_stand_in(monkeypatch) -> None:
    import search.tuner as tuner

    assert tuner.tuning_hardware("llvm") is CPU_STAND_IN
    assert tuner.tuning_hardware("cuda:sm_90a", A100) is A100
    monkeypatch.setattr(tuner, "local_device", lambda: ("NVIDIA H200", (9, 0)))
    assert tuner.tuning_hardware("cuda:sm_90a") is H200
    monkeypatch.setattr(tuner, "local_device", lambda: None)
    assert tuner.tuning_hardware("cuda:sm_90a") is DEFAULT_GPU


def test_an_offline_batch_is_filed_under_the_device_it_was_measured_on(tmp_path) -> None:
    from search.records import MeasureResult
    from spacefusion.runners.offline import BatchError, measured_on

    def res(device: str | None) -> MeasureResult:
        return MeasureResult("k", "cuda:sm_90a", (1.0,), meta={"device": device} if device else {})

    assert measured_on([res("NVIDIA H200"), res("NVIDIA H200")], tmp_path) is H200
    assert measured_on([res(None)], tmp_path) is DEFAULT_GPU
    with pytest.raises(BatchError, match="several devices"):
        measured_on([res("NVIDIA H200"), res("NVIDIA H100 80GB HBM3")], tmp_path)
    with pytest.raises(BatchError, match="no hardware preset matches"):
        measured_on([res("Some GPU 9000")], tmp_path)


def test_the_cli_target_defaults_to_the_gpu_in_hand_and_says_why(monkeypatch) -> None:
    import schedulers.hardware as hardware
    from spacefusion.cli import default_target

    assert default_target("llvm")[0] == "llvm"
    monkeypatch.setattr(hardware, "local_device", lambda: ("NVIDIA H200", (9, 0)))
    assert default_target("gpu") == ("h200", "the GPU in hand, NVIDIA H200")
    target, why = default_target("offline")
    assert target == "h100" and "give --target for another" in why


def test_a_kernels_limits_are_its_archs_preset_or_the_nearest_below() -> None:
    from spacefusion.lower.build import hardware_for

    assert hardware_for("sm_90a") is H100 and hardware_for("sm_80") is A100
    assert hardware_for("sm_86") is A100 and hardware_for("sm_100a") is H100
    with pytest.raises(ValueError, match="no hardware preset for CUDA arch 'sm_60'"):
        hardware_for("sm_60")
    with pytest.raises(ValueError, match="is not sm_"):
        hardware_for("gfx90a")


def test_a_schedule_for_no_machine_is_held_to_cudas_thread_limit() -> None:
    from schedulers.errors import ScheduleError
    from schedulers.schedule import THREADS_PER_BLOCK, make_schedule

    smg = patterns.layernorm(4096, 64)
    with pytest.raises(ScheduleError, match=f"at most {THREADS_PER_BLOCK} on any CUDA GPU"):
        make_schedule(smg, tiles={"m": 2048})
    with pytest.raises(ScheduleError, match="at most 1024 on H200"):
        make_schedule(smg, tiles={"m": 2048}, hw=H200)

