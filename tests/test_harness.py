"""The comparison harness (experiments/harness.py): workload table, arithmetic, artefact matching; CPU only."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "harness.py"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def harness() -> ModuleType:
    return _load("_harness_under_test", SCRIPT)


@pytest.fixture(scope="module")
def hwl(harness: ModuleType) -> ModuleType:
    return harness.hwl


# ---- the workload table ---------------------------------------------------------------------------


def test_table_holds_the_issue_shapes(hwl: ModuleType) -> None:
    shapes = {w.key: (w.kind, tuple(w.shape.values()), w.causal, w.dtype) for w in hwl.WORKLOADS}
    assert shapes == {
        "mha_bert": ("attention", (32, 12, 512, 512, 64), False, "float16"),
        "mha_vit": ("attention", (16, 16, 197, 197, 64), False, "float16"),
        "mha_llama": ("attention", (4, 32, 2048, 2048, 128), False, "float16"),
        "mha_causal": ("attention", (4, 32, 2048, 2048, 128), True, "float16"),
        "softmax_gemm": ("softmax_gemm", (4096, 4096, 64), False, "float16"),
        "layernorm": ("residual_layernorm", (16384, 4096), False, "float16"),
        "gemm_sigmoid": ("gemm_sigmoid", (8192, 8192, 1024), False, "float16"),
        "gemm": ("gemm", (8192, 8192, 1024), False, "float16"),
        "mha_decode": ("attention", (1, 32, 64, 8192, 128), False, "float16"),
    }
    assert hwl.BY_KEY["gemm"].reference_for == "gemm_sigmoid"
    assert not hwl.BY_KEY["gemm"].wants_artefact


def test_attention_flops_and_bytes_by_hand(hwl: ModuleType) -> None:
    bert = hwl.BY_KEY["mha_bert"]
    # 4 * 32 * 12 * 512 * 512 * 64; Q, K, V, O each 32*12*512*64 fp16 elements
    assert bert.flops == 25_769_803_776
    assert bert.nbytes == 4 * 12_582_912 * 2 == 100_663_296
    assert bert.roofline == "compute"
    assert math.isclose(bert.scale, 0.125)


def test_causal_halves_flops(hwl: ModuleType) -> None:
    llama, causal = hwl.BY_KEY["mha_llama"], hwl.BY_KEY["mha_causal"]
    assert llama.flops == 274_877_906_944  # 4 * 4 * 32 * 2048 * 2048 * 128
    assert causal.flops == llama.flops // 2 == 137_438_953_472
    assert causal.nbytes == llama.nbytes  # the same tensors are read and written


def test_memory_and_gemm_workloads_by_hand(hwl: ModuleType) -> None:
    sg, ln, gs, g = (hwl.BY_KEY[k] for k in ("softmax_gemm", "layernorm", "gemm_sigmoid", "gemm"))
    assert sg.flops == 2 * 4096 * 4096 * 64 == 2_147_483_648
    assert sg.nbytes == (4096 * 4096 + 4096 * 64 + 4096 * 64) * 2 == 34_603_008
    assert ln.flops == 8 * 16384 * 4096
    assert ln.nbytes == (3 * 16384 * 4096 + 2 * 4096) * 2 == 402_669_568  # X, R, Y + W, B
    assert gs.flops == g.flops == 137_438_953_472
    assert gs.nbytes == (8192 * 1024 * 2 + 8192 + 8192 * 8192) * 2 == 167_788_544
    assert g.nbytes == gs.nbytes - 8192 * 2  # no bias
    assert (sg.roofline, ln.roofline, gs.roofline, g.roofline) == ("memory", "memory", "compute", "compute")


def test_every_workload_names_a_roofline(hwl: ModuleType) -> None:
    for w in hwl.WORKLOADS:
        assert w.roofline in hwl.ROOFLINES
        d = w.describe()
        assert d["roofline"] == w.roofline and d["flops"] == w.flops and d["bytes"] == w.nbytes
        json.dumps(d)


def test_bad_workloads_are_refused(hwl: ModuleType) -> None:
    with pytest.raises(ValueError, match="dims"):
        hwl.Workload("x", "x", "attention", {"b": 1, "h": 1, "m": 1, "d": 1})
    with pytest.raises(ValueError, match="causal"):
        hwl.Workload("x", "x", "gemm", {"m": 1, "n": 1, "k": 1}, causal=True)
    with pytest.raises(KeyError, match="nope"):
        hwl.select(["mha_bert", "nope"])
    assert [w.key for w in hwl.select(["gemm", "mha_bert"])] == ["mha_bert", "gemm"]


# ---- roofline and speedup arithmetic ------------------------------------------------------------


def test_tflops_and_gbps(harness: ModuleType) -> None:
    assert harness.tflops(1e12, 1e6) == pytest.approx(1.0)  # 1e12 FLOPs in a second
    assert harness.tflops(25_769_803_776, 100.0) == pytest.approx(257.69803776)
    assert harness.gbps(3.35e12, 1e6) == pytest.approx(3350.0)
    assert harness.gbps(402_669_568, 200.0) == pytest.approx(2013.34784)


def test_roofline_fraction(harness: ModuleType) -> None:
    # 1e12 FLOPs in 10 ms = 100 TFLOP/s of a 1000 TFLOP/s peak
    assert harness.roofline_fraction("compute", 1e12, 0, 1e4, 1000e12, 3.35e12) == pytest.approx(0.1)
    # 1e9 bytes in 1 ms = 1 TB/s of 3.35 TB/s
    assert harness.roofline_fraction("memory", 0, 1e9, 1e3, 1000e12, 3.35e12) == pytest.approx(1 / 3.35)
    with pytest.raises(ValueError, match="roofline"):
        harness.roofline_fraction("l2", 1, 1, 1, 1, 1)


def _row(workload: str, system: str, us: float | None, status: str = "ok", reference_for: str | None = None):
    return {"workload": workload, "system": system, "median_us": us, "status": status,
            "reference_for": reference_for}


def test_speedups(harness: ModuleType) -> None:
    rows = [
        _row("gemm_sigmoid", "spacefusion", 100.0),
        _row("gemm_sigmoid", "eager", 250.0),
        _row("gemm_sigmoid", "torch.compile", 50.0),
        _row("gemm", "eager", 80.0, reference_for="gemm_sigmoid"),
        _row("mha_bert", "spacefusion", 400.0),
        _row("mha_bert", "sdpa_flash", 20.0),
        _row("mha_bert", "sdpa_cudnn", None, status="error"),
        _row("mha_bert", "eager", 1.0, status="failed"),  # failed the check: never a baseline
        _row("mha_vit", "spacefusion", None, status="no artefact"),
        _row("mha_vit", "eager", 30.0),
    ]
    table = harness.speedups(rows)
    assert table == {
        "gemm_sigmoid": {"eager": 2.5, "torch.compile": 0.5, "gemm_eager": 0.8},
        "mha_bert": {"sdpa_flash": 0.05},
    }
    harness.attach_speedups(rows)
    assert rows[0]["speedups"] == table["gemm_sigmoid"]
    assert rows[8]["speedups"] == {}
    assert "speedups" not in rows[1]
    header, records = harness.csv_table(rows)
    assert header[: len(harness.CSV_COLUMNS)] == list(harness.CSV_COLUMNS)
    assert {"speedup_vs_eager", "speedup_vs_torch.compile", "speedup_vs_gemm_eager",
            "speedup_vs_sdpa_flash"} <= set(header)
    assert records[0]["speedup_vs_gemm_eager"] == 0.8 and records[1]["speedup_vs_eager"] == ""


def test_add_metrics_picks_the_roofline(harness: ModuleType, hwl: ModuleType) -> None:
    bert, ln = hwl.BY_KEY["mha_bert"], hwl.BY_KEY["layernorm"]
    row = harness.add_metrics({**harness.new_row(bert, "eager"), "status": "ok", "median_us": 100.0},
                              bert, 1000e12, 3.35e12)
    assert row["perf_unit"] == "TFLOP/s" and row["perf"] == pytest.approx(257.69803776)
    assert row["roofline_fraction"] == pytest.approx(0.25769803776)
    row = harness.add_metrics({**harness.new_row(ln, "eager"), "status": "ok", "median_us": 200.0},
                              ln, 1000e12, 3.35e12)
    assert row["perf_unit"] == "GB/s" and row["perf"] == pytest.approx(2013.34784)
    assert row["roofline_fraction"] == pytest.approx(2013.34784e9 / 3.35e12)
    row = harness.add_metrics({**harness.new_row(ln, "eager"), "status": "failed"}, ln, 1000e12, 3.35e12)
    assert row["perf"] is None and row["roofline_fraction"] is None


def test_budget_iters(harness: ModuleType) -> None:
    assert harness.budget_iters(0.5, 10, 100, None) == (10, 100)
    assert harness.budget_iters(1e-4, 10, 100, 5.0) == (10, 100)  # fits: unchanged
    assert harness.budget_iters(0.5, 10, 100, 5.0) == (3, 10)
    assert harness.budget_iters(3.0, 10, 100, 5.0) == (1, 5)  # never fewer than 5 runs


def test_scripts_check_outputs_by_the_one_rule(harness: ModuleType, hwl: ModuleType) -> None:
    """The harness and run_artefacts_gpu.py keep no tolerance table: both check through smg/tolerance.py,
    loaded by file path (numpy only), with each workload's dtype and reduction length."""
    from smg import tolerance

    gpu_script = _load("_run_artefacts_gpu_for_harness", REPO / "experiments" / "run_artefacts_gpu.py")
    for mod in (harness, gpu_script):
        assert not hasattr(mod, "ATOL") and not hasattr(mod, "tolerance")
        assert mod.tolerance_module().RULE == tolerance.RULE
        loaded = mod.tolerance_module().tolerance("float16", 64)
        assert loaded.as_dict() == tolerance.tolerance("float16", 64).as_dict()
    assert [hwl.BY_KEY[k].reduction_length for k in ("mha_llama", "softmax_gemm", "layernorm", "gemm")] == \
        [2048, 4096, 4096, 1024]


def test_table_and_json_cleaning(harness: ModuleType, hwl: ModuleType, tmp_path: Path) -> None:
    w = hwl.BY_KEY["softmax_gemm"]
    ok = harness.add_metrics({**harness.new_row(w, "eager"), "status": "ok", "median_us": 70.0, "p10_us": 69.0,
                              "p90_us": 72.0, "max_abs_err": 1e-3}, w, 1e15, 3.35e12)
    bad = {**harness.new_row(w, "spacefusion"), "status": "failed", "error": "numerics: nan", "max_abs_err": math.nan}
    harness.add_metrics(bad, w, 1e15, 3.35e12)
    text = harness.format_table([bad, ok])
    assert "softmax_gemm" in text and "numerics: nan" in text and "GB/s" in text
    out = tmp_path / "r.json"
    harness.write_results({"rows": [bad, ok]}, out, tmp_path / "r.csv")
    data = json.loads(out.read_text())
    assert data["rows"][0]["max_abs_err"] is None
    assert (tmp_path / "r.csv").read_text().splitlines()[0].startswith("workload,label,shape")


# ---- artefact matching ----------------------------------------------------------------------------


def _artefact_module() -> ModuleType:
    return _load("_harness_test_artefact", REPO / "spacefusion" / "runtime" / "artefact.py")


def _save(folder: Path, workload: dict, params: dict[str, list[int]], outputs: tuple[str, ...]) -> Path:
    art = _artefact_module()
    meta = {
        "kernel_name": "main_kernel", "arch": "sm_90a", "grid": [4], "block": [64],
        "params": [{"name": n, "shape": s, "dtype": "float16", "role": "output" if n in outputs else "input"}
                   for n, s in params.items()],
        "param_order": list(params), "workload": workload,
    }
    art.KernelArtefact.save(folder, 'extern "C" __global__ void main_kernel(half* Q) {}\n', meta)
    return folder


def _attn_params(b: int, h: int, m: int, l: int, d: int) -> dict[str, list[int]]:  # noqa: E741
    return {"Q": [b, h, m, d], "K": [b, h, l, d], "V": [b, h, l, d], "O": [b, h, m, d]}


def test_match_artefacts(hwl: ModuleType, tmp_path: Path) -> None:
    bert = _save(tmp_path / "arts" / "a_bert", {"name": "mha", "scale": "0.125", "dtype": "float16",
                 "shape": {"b": 32, "h": 12, "m": 512, "d": 64, "l": 512, "n": 64}},
                 _attn_params(32, 12, 512, 512, 64), ("O",))
    causal = _save(tmp_path / "arts" / "b_causal", {"name": "attention", "scale": repr(1 / math.sqrt(128)),
                   "causal": "True", "kv_heads": "32", "dtype": "float16",
                   "shape": {"b": 4, "h": 32, "m": 2048, "d": 128, "l": 2048, "n": 128}},
                   _attn_params(4, 32, 2048, 2048, 128), ("O",))
    other = _save(tmp_path / "arts" / "c_small", {"name": "mha", "scale": "0.125", "dtype": "float16",
                  "shape": {"b": 2, "h": 8, "m": 64, "d": 64, "l": 64, "n": 64}},
                  _attn_params(2, 8, 64, 64, 64), ("O",))
    dup = _save(tmp_path / "d_bert_again", {"name": "mha", "scale": "0.125", "dtype": "float16",
                "shape": {"b": 32, "h": 12, "m": 512, "d": 64, "l": 512, "n": 64}},
                _attn_params(32, 12, 512, 512, 64), ("O",))
    ln = _save(tmp_path / "e_ln", {"name": "residual_layernorm", "dtype": "float16",
               "shape": {"m": 16384, "n": 4096}},
               {"X": [16384, 4096], "R": [16384, 4096], "W": [4096], "B": [4096], "Y": [16384, 4096]}, ("Y",))

    folders = hwl.artefact_folders([tmp_path / "arts", dup, ln])  # a folder of artefacts, then single ones
    assert folders == [bert, causal, other, dup, ln]
    chosen, unused = hwl.match_artefacts(hwl.WORKLOADS, folders)
    assert chosen["mha_bert"] == bert
    assert chosen["mha_causal"] == causal
    assert chosen["mha_llama"] is None  # a causal kernel is not the non-causal workload
    assert chosen["layernorm"] == ln
    assert chosen["mha_vit"] is None and chosen["softmax_gemm"] is None and chosen["gemm_sigmoid"] is None
    assert "gemm" not in chosen  # the reference GEMM row has no spacefusion kernel
    why = {Path(u["path"]).name: u["why"] for u in unused}
    assert why["c_small"] == "matches no selected workload"
    assert why["d_bert_again"].startswith("duplicate")

    # only the selected workloads are matched; the rest say "no artefact"
    chosen, unused = hwl.match_artefacts(hwl.select(["mha_vit", "softmax_gemm"]), folders)
    assert chosen == {"mha_vit": None, "softmax_gemm": None}
    assert len(unused) == 5


def test_match_checks_flags_and_params(hwl: ModuleType) -> None:
    llama = hwl.BY_KEY["mha_llama"]
    meta = {"workload": {"name": "attention", "causal": "False", "kv_heads": "32", "scale": repr(1 / math.sqrt(128)),
                         "shape": {"b": 4, "h": 32, "m": 2048, "d": 128, "l": 2048, "n": 128}},
            "params": [{"name": n, "shape": s, "dtype": "float16"}
                       for n, s in _attn_params(4, 32, 2048, 2048, 128).items()]}
    assert llama.matches(meta)
    assert not llama.matches({**meta, "workload": {**meta["workload"], "kv_heads": "8"}})  # GQA
    assert not llama.matches({**meta, "workload": {**meta["workload"], "scale": "1.0"}})
    assert not llama.matches({**meta, "workload": {**meta["workload"], "dtype": "float32"}})
    assert not llama.matches({**meta, "params": meta["params"][:3]})
    gs = hwl.BY_KEY["gemm_sigmoid"]
    gmeta = {"workload": {"name": "gemm_sigmoid", "shape": {"m": 8192, "k": 1024, "n": 8192}},
             "params": [{"name": "A", "shape": [8192, 1024]}, {"name": "Bw", "shape": [1024, 8192]},
                        {"name": "bias", "shape": [8192]}, {"name": "Y", "shape": [8192, 8192]}]}
    assert gs.matches(gmeta)
    assert not gs.matches({**gmeta, "params": [p for p in gmeta["params"] if p["name"] != "bias"]})
    assert not hwl.BY_KEY["gemm"].matches(gmeta)
    sg = hwl.BY_KEY["softmax_gemm"]
    smeta = {"workload": {"name": "softmax_gemm", "shape": {"m": 4096, "l": 4096, "n": 64}},
             "params": [{"name": "S", "shape": [4096, 4096]}, {"name": "V", "shape": [4096, 64]},
                        {"name": "O", "shape": [4096, 64]}]}
    assert sg.matches(smeta)
    # a sliced kernel's workspaces (role scratch) are the launcher's, not the workload's
    ws = [{"name": "sf_partials", "shape": [256, 40, 128], "dtype": "float32", "role": "scratch"},
          {"name": "sf_arrivals", "shape": [64], "dtype": "int32", "role": "scratch"}]
    assert sg.matches({**smeta, "params": smeta["params"] + ws})
    assert not sg.matches({**smeta, "params": smeta["params"] + [{**ws[1], "role": "input"}]})
    # so are a TMA kernel's tensor maps
    tm = {"name": "S__tmap", "shape": [128], "dtype": "uint8", "role": "tensormap",
          "tensor_map": {"tensor": "S", "box": [64, 64], "swizzle": 128}}
    assert sg.matches({**smeta, "params": smeta["params"] + [tm]})


# ---- the script on a machine without torch ---------------------------------------------------------


def test_help_runs_without_torch() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--no-compile" in proc.stdout and "mha_llama" in proc.stdout


def test_import_pulls_no_heavy_modules() -> None:
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('h', {str(SCRIPT)!r})\n"
        "mod = sys.modules['h'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "mod.runtime_module('timing'); mod.load_hardware_module()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'tvm', 'islpy', 'xgboost', 'sympy') "
        "or m.startswith(('spacefusion.lower', 'spacefusion.api', 'schedulers.schedule', 'smg.ir'))]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_hardware_model_falls_back_to_h100(harness: ModuleType) -> None:
    info = harness.hardware_info("float16")
    assert info["peak_flops_per_s"] > 0 and info["dram_bandwidth_bytes_per_s"] > 0
    if not info["from_device"]:  # no GPU here: the H100 preset
        assert info["name"] == "H100"
        assert info["peak_flops_per_s"] == pytest.approx(989.4e12)
        assert info["dram_bandwidth_bytes_per_s"] == pytest.approx(3.35e12)


def test_repeats_take_the_median_of_medians(harness: ModuleType) -> None:
    row = {"status": None, "repeats": [{"median_us": m, "p10_us": m - 1, "p90_us": m + p90, "iters": 100}
                                       for m, p90 in ((10.0, 1.0), (30.0, 300.0), (12.0, 2.0))]}
    harness.summarize_repeats(row)
    assert row["status"] == "ok" and row["median_us"] == 12.0
    assert (row["p10_us"], row["p90_us"]) == (11.0, 14.0)  # the middle repeat's, not the slow one's
    assert row["spread"] == 3.0 and len(row["repeats"]) == 3
    even = {"status": None, "repeats": [{"median_us": m, "p10_us": m - 1, "p90_us": m + 1, "iters": 100}
                                        for m in (10.0, 14.0)]}
    harness.summarize_repeats(even)
    assert even["median_us"] == 12.0 and even["p90_us"] == 11.0
    one = {"status": None, "repeats": [{"median_us": 5.0, "p10_us": 4.0, "p90_us": 6.0, "iters": 100}]}
    harness.summarize_repeats(one)
    assert one["median_us"] == 5.0 and "repeats" not in one and "spread" not in one
    failed = {"status": "failed", "repeats": None}
    harness.summarize_repeats(failed)
    assert failed["status"] == "failed" and failed.get("median_us") is None


def test_repeats_below_one_are_refused() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--repeats", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "--repeats must be at least 1" in r.stderr
