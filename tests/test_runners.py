"""Measurement runners: numerics before timing, failures as results, the offline GPU batch, Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from schedulers.schedule import Schedule, make_schedule
from search.records import MeasureInput, MeasureResult
from smg.patterns import layernorm
from smg.reference import check_numerics, evaluate, random_inputs, reduction_length
from smg.serialize import smg_from_dict
from smg.tolerance import rms, scale, tolerance
from smg.workloads import gemm, mha
from spacefusion.runners import (
    LLVMRunner,
    LocalGPURunner,
    OfflineBatchRunner,
    RayRunner,
    TVMBuilder,
    export_batch,
    import_batch,
)
from spacefusion.runtime import batch as gpu_batch

REPO = Path(__file__).resolve().parents[1]


class _Builder(TVMBuilder):
    """TVM's builder with its ``build`` replaced: how a test hands the runner a wrong or failing kernel."""

    def __init__(self, build) -> None:
        self._build = build

    def build(self, schedule, target):
        return self._build(schedule, target)


@pytest.fixture(scope="module")
def schedules() -> list[Schedule]:
    return [
        make_schedule(gemm(32, 32, 16), tiles={"n": 8}, step=4),
        make_schedule(layernorm(8, 40)),
        make_schedule(gemm(32, 32, 16), tiles={"n": 16}, step=8),
    ]


@pytest.fixture(scope="module")
def llvm_results(schedules) -> list[MeasureResult]:
    return LLVMRunner(repeats=3, warmup=1).measure([MeasureInput(s, "llvm") for s in schedules])


# ---- LLVM ---------------------------------------------------------------------------------------


def test_llvm_runner_checks_and_times_in_input_order(schedules, llvm_results) -> None:
    assert [r.schedule_key for r in llvm_results] == [s.key for s in schedules]
    for r in llvm_results:
        assert r.ok, r.error
        assert r.target == "llvm" and len(r.latencies_us) == 3 and all(x > 0 for x in r.latencies_us)
        assert r.max_abs_err is not None and r.max_abs_err < 1e-4
        meta = dict(r.meta)
        assert meta["runner"] == "llvm" and meta["repeats"] == 3 and meta["warmup"] == 1 and meta["build_s"] > 0
        assert MeasureResult.from_dict(json.loads(r.to_json())) == r  # JSON round trip, as the database stores it


def test_wrong_kernel_is_caught_before_timing(schedules) -> None:
    calls = []
    real = TVMBuilder().build

    def off_by_one(s, target):
        kern = real(s, target)

        def wrong(inputs):
            calls.append(1)
            return {k: v + 1 for k, v in kern(inputs).items()}

        return wrong

    (r,) = LLVMRunner(repeats=3, builder=_Builder(off_by_one)).measure([MeasureInput(schedules[0], "llvm")])
    assert r.error is not None and r.error.startswith("numerics: output 'C': 1024 of 1024 elements over"), r.error
    assert "atol + rtol*|ref|" in r.error and r.latencies_us == () and not r.ok
    assert r.max_abs_err == pytest.approx(1.0, abs=1e-4)
    assert len(calls) == 1  # checked once, never warmed up or timed


def test_build_failure_is_a_result_and_the_others_are_measured(schedules) -> None:
    real = TVMBuilder().build
    bad = schedules[1].key

    def flaky(s, target):
        if s.key == bad:
            raise RuntimeError("simulated lowering failure")
        return real(s, target)

    inputs = [MeasureInput(s, "llvm") for s in schedules[:2]] + [MeasureInput(schedules[0], "cuda:sm_90a")]
    ok, failed, wrong_target = LLVMRunner(repeats=2, builder=_Builder(flaky)).measure(inputs)
    assert ok.ok
    assert failed.error == "build: RuntimeError: simulated lowering failure" and failed.latencies_us == ()
    assert wrong_target.error is not None and wrong_target.error.startswith("target:")


def test_check_numerics_tolerance_and_non_finite() -> None:
    """check_numerics applies smg/tolerance.py's rule to every output, for the output's dtype."""
    g = layernorm(4, 8)
    ref = evaluate(g, random_inputs(g, 0))
    assert check_numerics(g, ref, ref) == (0.0, None)
    tol = tolerance("float32", reduction_length(g))
    atol = tol.atol(rms(ref["Y"]))  # the smallest atol of any element: rows larger than the whole get more
    err, msg = check_numerics(g, ref, {"Y": ref["Y"] + 0.5 * atol})
    assert msg is None and err == pytest.approx(0.5 * atol)
    off = ref["Y"].copy()
    off[1, 2] += 2 * tol.bound(off[1, 2], scale(ref["Y"])[1, 0])  # one element off
    err, msg = check_numerics(g, ref, {"Y": off})
    assert msg is not None and msg.startswith("numerics: output 'Y': 1 of 32 elements over atol + rtol*|ref|")
    assert "worst at (1, 2)" in msg
    nan = ref["Y"].copy()
    nan[0, 0] = np.nan
    assert check_numerics(g, ref, {"Y": nan}) == (None, "numerics: output 'Y' has non-finite values where the "
                                                         "reference is finite (or differs where it is not)")
    assert check_numerics(g, ref, {})[1].startswith("numerics: kernel returned no output 'Y'")
    fp16 = layernorm(4, 8, dtype="float16")
    rounded = {"Y": ref["Y"].astype(np.float16)}
    assert check_numerics(fp16, ref, rounded)[1] is None  # correctly rounded to fp16: passes
    assert check_numerics(g, ref, rounded)[1] is not None  # the same values as an fp32 output: too far


# ---- local GPU ----------------------------------------------------------------------------------


def test_local_gpu_runner_without_gpu_gives_clear_errors(monkeypatch, schedules) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # as on a machine without torch
    inputs = [MeasureInput(s, "cuda:sm_90a") for s in schedules[:2]]
    results = LocalGPURunner().measure(inputs)
    assert [r.schedule_key for r in results] == [i.key for i in inputs]
    for r in results:
        assert not r.ok and r.latencies_us == ()
        assert r.error is not None and r.error.startswith("no GPU: torch is not installed")


@pytest.mark.cuda
def test_local_gpu_runner_on_gpu(schedules) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    pytest.importorskip("tvm")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
    inputs = [MeasureInput(s, f"cuda:{arch}") for s in schedules]
    results = LocalGPURunner(warmup=2, iters=10).measure(inputs)
    assert [r.schedule_key for r in results] == [s.key for s in schedules]
    for r in results:
        assert r.ok, r.error
        assert r.median_us > 0 and r.max_abs_err is not None and r.max_abs_err < 1e-3
        assert dict(r.meta)["backend"] in ("cubin", "nvcc", "nvrtc")


# ---- offline batch ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batch(tmp_path_factory, schedules) -> tuple[Path, list[MeasureInput]]:
    # 256 KB of K/V tiles: over even the opt-in (dynamic) shared-memory limit
    too_big = make_schedule(mha(1, 1, 1024, 1024, 128, dtype="float32"), tiles={"m": 64}, step=256)
    inputs = [MeasureInput(schedules[0], "cuda:sm_90a"), MeasureInput(too_big, "cuda:sm_90a"),
              MeasureInput(schedules[1], "cuda:sm_80"), MeasureInput(schedules[0], "cuda:sm_80")]
    folder = export_batch(inputs, tmp_path_factory.mktemp("batch"), seed=7, cubin=False)
    return folder, inputs


def test_export_batch_writes_manifest_and_artefacts(batch) -> None:
    from spacefusion.runtime.artefact import KernelArtefact

    folder, inputs = batch
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == "spacefusion-batch/1" and manifest["seed"] == 7
    cands = manifest["candidates"]
    assert [(c["schedule_key"], c["target"]) for c in cands] == [(i.key, i.target) for i in inputs]
    ok0, big, norm, ok0_sm80 = cands
    assert big["artefact"] is None and "shared memory" in big["error"] and big["error"].startswith("build:")
    assert ok0["artefact"] == inputs[0].key and ok0_sm80["artefact"] == f"{inputs[0].key}-sm_80"
    for c, inp in zip((ok0, norm, ok0_sm80), (inputs[0], inputs[2], inputs[3])):
        art = KernelArtefact.load(folder / c["artefact"])  # the TVM-free runtime accepts it
        assert art.arch == inp.target.split(":")[1] and c["error"] is None and c["seed"] == 7
        assert smg_from_dict(c["workload"]).key == c["workload_key"] == inp.schedule.smg.key
        assert Schedule.from_json(json.dumps(c["schedule"])).key == inp.key


def test_measure_command_rejects_a_bad_manifest(tmp_path, capsys) -> None:
    assert gpu_batch.main([str(tmp_path)]) == 2
    assert "no manifest" in capsys.readouterr().err
    (tmp_path / "manifest.json").write_text('{"format": "something-else"}')
    assert gpu_batch.main([str(tmp_path)]) == 2
    assert "expected 'spacefusion-batch/1'" in capsys.readouterr().err


def test_gpu_runtime_never_imports_tvm_or_the_compiler(batch) -> None:
    """The GPU machine has no TVM, islpy or xgboost: the batch command's reference path and the runtime,
    imported as the installed package, stay clear of them and of the layers that use them."""
    folder, _ = batch
    code = f"""
import json, sys
from pathlib import Path
from spacefusion.runtime import batch as mb, gpu, timing
from spacefusion.runtime.artefact import KernelArtefact
manifest = mb.load_manifest(Path({str(folder)!r}))
c = manifest["candidates"][0]
smg, x, ref = mb.References().get(c["workload"], c["seed"])
from smg.reference import check_numerics
assert check_numerics(smg, ref, ref) == (0.0, None)
KernelArtefact.load({str(folder)!r} + "/" + c["artefact"])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("tvm", "tvm_ffi", "islpy", "schedulers", "xgboost")
               or m.startswith(("spacefusion.lower", "spacefusion.frontend", "spacefusion.api", "spacefusion.runners",
                                "search.tuner", "search.database", "search.space")))
print(json.dumps(heavy))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == []


def test_measure_command_is_installed() -> None:
    """``spacefusion-measure`` is a console script of the package (what OfflineBatchRunner names)."""
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == gpu_batch.COMMAND]
    assert ep.value == "spacefusion.runtime.batch:main"
    assert OfflineBatchRunner("b").command().startswith(f"{gpu_batch.COMMAND} b --out ")


def _gpu_results(inputs: list[MeasureInput], path: Path) -> None:
    """A results file as the GPU command writes it (its records, without needing a GPU)."""
    rows = []
    for i, inp in enumerate(inputs):
        if i % 2:
            rows.append(MeasureResult(inp.key, inp.target, (), 0.5,
                                      "numerics: output 'C': 3 of 1024 elements over atol + rtol*|ref|",
                                      (("runner", gpu_batch.RUNNER),)))
        else:
            rows.append(MeasureResult(inp.key, inp.target, (12.5 + i,), 1e-6, None,
                                      (("p10_us", 12.0), ("runner", gpu_batch.RUNNER))))
    path.write_text(json.dumps({"format": gpu_batch.RESULTS_FORMAT, "device": "fake",
                                "results": [r.to_dict() for r in rows]}))


def test_import_batch_round_trip_and_collect_order(tmp_path, batch) -> None:
    _, inputs = batch
    path = tmp_path / "results.json"
    _gpu_results(inputs, path)
    got = import_batch(path)
    assert [(r.schedule_key, r.target) for r in got] == [(i.key, i.target) for i in inputs]
    assert got[0].ok and got[0].median_us == 12.5 and dict(got[0].meta)["p10_us"] == 12.0
    assert not got[1].ok and got[1].max_abs_err == 0.5 and got[1].error.startswith("numerics")
    rev = list(reversed(inputs))
    assert [r.target for r in OfflineBatchRunner(tmp_path).collect(rev)] == [i.target for i in rev]


@pytest.mark.parametrize("text,match", [
    ("{not json", "not valid JSON"),
    ('{"format": "spacefusion-batch-results/1"}', "'results' list"),
    ('"a string"', "expected a results object"),
    ('[{"format": "spacefusion-record/1", "schedule_key": "k", "target": "llvm"}, {"format": "x"}]', "record 1"),
    ('[{"format": "spacefusion-record/1", "target": "llvm"}]', "record 0 is malformed"),
])
def test_import_batch_rejects_malformed_files(tmp_path, text, match) -> None:
    path = tmp_path / "bad_results.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        import_batch(path)
    assert "bad_results.json" in str(info.value)


def test_offline_runner_exports_then_picks_up_results(tmp_path, schedules) -> None:
    runner = OfflineBatchRunner(tmp_path / "b", cubin=False)
    inputs = [MeasureInput(s, "cuda:sm_90a") for s in schedules[:2]]
    pending = runner.measure(inputs)
    assert all(not r.ok and dict(r.meta)["pending"] for r in pending)
    assert pending[0].error.startswith(f"pending: exported 2 candidates to {tmp_path / 'b'}; measure them on the "
                                       f"GPU machine and import the results (spacefusion-measure {tmp_path / 'b'}")
    assert (tmp_path / "b" / "manifest.json").is_file()
    _gpu_results(inputs, runner.results_path)  # what the GPU machine sends back
    done = runner.measure(inputs)
    assert [r.schedule_key for r in done] == [i.key for i in inputs] and done[0].ok


# ---- Ray ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_runner_matches_llvm_runner(ray_local, schedules, llvm_results) -> None:
    inputs = [MeasureInput(s, "llvm") for s in schedules] + [MeasureInput(schedules[0], "cuda:sm_90a")]
    with RayRunner(num_workers=2) as runner:
        results = runner.measure(inputs)
    assert runner.name == "ray[llvm]"
    assert [r.schedule_key for r in results] == [i.key for i in inputs]
    assert results[-1].error.startswith("target:")  # the inner runner's own error comes back as is
    # A schedule whose JSON does not read back identically is refused rather than measured as another kernel
    # (at the time of writing Schedule.to_json drops plan.second_pass, which layernorm's plan uses).
    lossless = [Schedule.from_json(s.to_json()) == s for s in schedules]
    for r, ref, same in zip(results, llvm_results, lossless):
        if same:
            assert r.ok == ref.ok and r.max_abs_err == pytest.approx(ref.max_abs_err), r.error
            assert dict(r.meta)["via"] == "ray"
        else:
            assert r.error.startswith("schedule: does not survive Schedule.to_json/from_json"), r.error
    assert sum(lossless) >= 2  # the gemm schedules at least go through Ray


def test_ray_runner_without_ray_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install spacefusion\[ray\]"):
        RayRunner()


def test_the_gpu_command_takes_bf16_reference_inputs() -> None:
    """The reference's bf16 inputs are ``ml_dtypes.bfloat16`` arrays, which torch cannot take from numpy: the
    GPU command's bf16 candidates failed with a TypeError before they ran.  Through float32 they arrive exact."""
    import torch

    from smg import patterns

    pytest.importorskip("ml_dtypes")  # numpy's bfloat16 (the GPU machine's numpy has it registered)
    g = patterns.conv2d(1, 5, 5, 64, 64, 1, 1, 0, "none", dtype="bfloat16")
    x = random_inputs(g, 3)["X"]
    assert "bfloat16" in str(x.dtype)
    t = gpu_batch.as_torch(x, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == x.shape
    np.testing.assert_array_equal(t.float().numpy(), x.astype(np.float32))
    h = gpu_batch.as_torch(np.ones((2, 3), np.float16), torch.float16)
    assert h.dtype == torch.float16 and float(h.sum()) == 6.0
