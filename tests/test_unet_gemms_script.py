"""experiments/tuning/unet_gemms.py: the candidate batch it measures, the records it commits, and the
round plumbing's filing of measurements under the machine that took them (``batch_rounds.add_to_db``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "tuning"))

import batch_rounds  # noqa: E402
import unet_gemms  # noqa: E402


def _gemm():
    from smg import patterns

    return patterns.gemm_epilogue(64, 64, 64, act="none", dtype="float16")


def test_the_batch_starts_with_the_tuners_order_then_one_pick_per_family() -> None:
    from spacefusion.frontend.schedules import ranked

    g = _gemm()
    got = unet_gemms.candidates(g, 2, 6)
    order = ranked(g)
    assert [s.key for _, s in got[:2]] == [s.key for s in order[:2]]
    fams = [unet_gemms.family(s) for why, s in got[2:]]
    assert fams and len(got) <= 6 and len(set(fams)) == len(fams)
    assert not set(fams) & {unet_gemms.family(s) for _, s in got[:2]}
    assert len({s.key for _, s in got}) == len(got)


@pytest.mark.parametrize("name, smgs", [("unet_gemms_h200", 38), ("unet_attention_norms_h200", 16),
                                        ("unet_gated_forms_h200", 4), ("unet_residual_forms_h200", 4),
                                        ("unet_attention_variants_h200", 8), ("unet_patch_conv_variants_h200", 14),
                                        ("unet_stacked_variants_h200", 10), ("unet_conv_variants_residual_h200", 8),
                                        ("unet_conv_variants_h200", 14)])
def test_the_committed_rounds_are_checked_records_of_the_machine_named(name: str, smgs: int) -> None:
    from search.prior import read_json, read_records
    from search.records import MeasureResult

    path = ROOT / "experiments" / "tuning" / f"{name}.json.xz"
    data = read_json(path)
    assert data["format"] == "spacefusion-records/1" and "H200" in data["device"]
    assert len(read_records(path)[0]) == len(data["records"])  # the prior's reader takes the .xz too
    by_smg: dict[str, list] = {}
    for r in data["records"]:
        by_smg.setdefault(r["tuning_key"], []).append(r)
    assert len(by_smg) == smgs and len(data["records"]) >= 2 * smgs
    for rows in by_smg.values():
        assert rows[0]["label"]["why"] == "rank 0"
        # every kernel that built matched the numpy reference before it was timed (the batch's check); the
        # rest were refused at build, with the reason (a deeper ring past shared memory)
        for r in rows:
            res = MeasureResult.from_dict(r["result"])
            assert (res.ok and r["result"]["max_abs_err"] is not None) or res.error.startswith("build: ")


def _round(tmp_path: Path, device: str) -> tuple[Path, dict]:
    """A one-candidate round folder (manifest only) and its results, as ``run`` writes them."""
    from search.records import MeasureResult
    from smg.serialize import smg_to_dict
    from spacefusion.frontend.schedules import ranked
    from spacefusion.runtime.batch import MANIFEST_FORMAT

    s = ranked(_gemm())[0]
    art = tmp_path / "art"
    art.mkdir()
    entry = {"index": 0, "schedule_key": s.key, "target": "cuda:sm_90a", "artefact": s.key, "seed": 0,
             "schedule": s.to_dict(), "workload": smg_to_dict(s.smg), "workload_key": s.smg.key, "error": None}
    (art / "manifest.json").write_text(json.dumps({"format": MANIFEST_FORMAT, "candidates": [entry]}))
    res = MeasureResult(schedule_key=s.key, target="cuda:sm_90a", latencies_us=(9.0, 10.0, 11.0), max_abs_err=0.0)
    whole = {"format": "spacefusion-batch-results/1", "device": device, "results": [res.to_dict()], "baseline": []}
    return art, whole


def test_a_round_is_filed_under_the_machine_it_was_measured_on(tmp_path: Path) -> None:
    from schedulers.hardware import H100, H200
    from search.database import TuningDatabase, tuning_key
    from spacefusion.lower.build import COMPILE_FLAGS

    art, whole = _round(tmp_path, "NVIDIA H200")  # as spacefusion.runtime.batch names the device
    db = tmp_path / "t.db"
    batch_rounds.add_to_db(art, whole, db, "baseline")
    g = _gemm()
    with TuningDatabase(db, readonly=True) as opened:
        assert opened.best(tuning_key(g, H200, "cuda:sm_90a", COMPILE_FLAGS)) is not None
        assert opened.best(tuning_key(g, H100, "cuda:sm_90a", COMPILE_FLAGS)) is None


def test_a_round_of_an_unknown_machine_is_refused_by_name(tmp_path: Path) -> None:
    art, whole = _round(tmp_path, "Some GPU 9000")
    with pytest.raises(SystemExit, match="'Some GPU 9000' has no hardware preset: its measurements"):
        batch_rounds.add_to_db(art, whole, tmp_path / "t.db", "baseline")
    assert not (tmp_path / "t.db").exists()


def test_variants_vary_the_first_picks_knobs_on_its_tile() -> None:
    from spacefusion.frontend.schedules import ranked

    first = next(s for s in ranked(_gemm()) if s.tensor_cores)
    got = unet_gemms.variants(first, 5)
    assert got and len(got) <= 5 and len({s.key for _, s in got} | {first.key}) == len(got) + 1
    assert all(s.block == first.block and s.tensor_cores for _, s in got)
    assert {(s.step, s.stages) for _, s in got} - {(first.step, first.stages)}
    assert all(why.startswith("rank 0 with step ") for why, _ in got)


def test_a_float_scales_a_knob_and_nearest_changes_fewest_knobs_first() -> None:
    from spacefusion.frontend.schedules import ranked

    first = next(s for s in ranked(_gemm()) if s.tensor_cores)
    kept = unet_gemms.variants(first, 50, {"step": (1.0,), "stages": (2, 3, 4)})
    assert kept and all(s.step == first.step and s.stages in (2, 3, 4) for _, s in kept)
    got = unet_gemms.variants(first, 50, {"step": (0.5, 1.0), "stages": (2, 3, 4)}, nearest=True, name="best")
    changed = [(s.step != first.step) + (s.stages != first.stages) for _, s in got]
    assert changed == sorted(changed) and all(why.startswith("best with step ") for why, _ in got)
