"""experiments/multi_gpu_tune.py, the 1-GPU against all-GPUs tuning comparison: run end to end on the CPU
(``--cpu 2``: 1 and 2 llvm worker processes on a toy block), its comparison's arithmetic, and the utilisation
sampler's parsing of nvidia-smi's lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import multi_gpu_tune as M  # noqa: E402


def test_the_comparison_runs_on_the_cpu_and_writes_every_field(tmp_path, capsys, monkeypatch) -> None:
    """The whole comparison on 1 and 2 worker processes; their runner is the golden runs' (a latency fixed by
    the key, nothing built), so the test is the script's, not TVM's (tests/test_pools.py measures llvm)."""
    from tests.tuner_golden import KeyedRunner

    monkeypatch.setattr(M, "CPU_INNER", KeyedRunner)
    out = tmp_path / "r.json"
    assert M.main(["--cpu", "2", "--trials", "2", "--batch", "2", "--workers", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["format"] == M.FORMAT and r["device"] == "cpu" and [x["workers"] for x in r["runs"]] == [1, 2]
    for run in r["runs"]:
        assert run["engine"] == "ProcessRunner" and run["wall_s"] > 0 and run["utilisation"] == {}
        assert len(run["subgraphs"]) == 2 and all(s["measured"] == 2 for s in run["subgraphs"])
        assert sum(run["candidates_per_worker"].values()) == 4
    assert set(r["runs"][1]["candidates_per_worker"]) == {"worker 0", "worker 1"}
    (c,) = r["compare"]["runs"]
    assert c["workers"] == [1, 2] and c["subgraphs"] == 2 and c["same_best"] == 2  # seeded, a latency per key
    assert "1 -> 2: " in capsys.readouterr().out


def test_the_comparison_says_speedup_and_the_bests_ratio() -> None:
    def run(n, wall, bests):
        return {"workers": n, "wall_s": wall, "subgraphs": [{"label": k, "key": k, "best": b, "best_us": us}
                                                              for k, (b, us) in bests.items()]}

    one = run(1, 100.0, {"a": ("x", 10.0), "b": ("y", 4.0)})
    eight = run(8, 20.0, {"a": ("x", 10.0), "b": ("z", 3.0)})
    (c,) = M.compare([one, eight])["runs"]
    assert c["speedup"] == 5.0 and c["same_best"] == 1 and c["best_ratio_geomean"] == round(0.75 ** 0.5, 4)


def test_the_sampler_reads_nvidia_smis_lines() -> None:
    class Lines:
        stdout = iter(["0, 97\n", "1, 0\n", "0, 99\n", "1, 50\n", "garbage\n"])

    u = M.Utilisation()
    u.proc = Lines()  # type: ignore[assignment]
    u._read()
    u.proc = None
    assert u.stop() == {"0": {"mean_pct": 98.0, "max_pct": 99.0, "busy_share": 1.0, "samples": 2},
                        "1": {"mean_pct": 25.0, "max_pct": 50.0, "busy_share": 0.5, "samples": 2}}
