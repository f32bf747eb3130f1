"""Seeded tuning runs whose every record is fixed: what ``tests/test_tuning_parts.py`` compares ``tune`` against.

The runner is a stand-in with a latency that is a function of the schedule key (and a failure for one key
in eight), and the builder builds nothing, so a run depends only on the tuner: the space, the ranking (the
analytical model, the prior's tie breaks, the XGBoost model fitted on the records), the seeded exploration
and the database bookkeeping.  A real runner's latencies vary from run to run, and after the first batch the
learned model's picks vary with them, so no two runs of it can be compared record by record.

``python tests/tuner_golden.py`` rewrites ``tests/data/tuner_golden.json``: run it at a commit whose tuner is
the reference (``tune`` before issue 60 took it apart: ec6c3e1), never to make a changed tuner pass.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from schedulers.hardware import H100
from search.database import TuningDatabase
from search.records import MeasureInput, MeasureResult
from search.tuner import tune
from smg import patterns as P
from smg.ir import SMG

GOLDEN = Path(__file__).resolve().parent / "data" / "tuner_golden.json"


def latency_of(key: str) -> float:
    """The stand-in runner's latency of a schedule: fixed by its key, spread over 1..997 us."""
    return float(int(key[:6], 16) % 997 + 1)


class KeyedRunner:
    """Measures nothing: each candidate's latency is ``latency_of`` its key; one key in eight fails."""

    name = "keyed"

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        self.batches.append([i.key for i in inputs])
        return [MeasureResult(i.key, i.target, (), None, "run: injected failure") if i.key[-1] in "07"
                else MeasureResult(i.key, i.target, (latency_of(i.key),), 0.0) for i in inputs]


class NoBuilder:
    """Builds nothing (the stand-in runner needs no kernel); its flag keys the database."""

    name = "none"
    flags = ("golden",)

    def build(self, schedule: Any, target: str) -> Any:
        raise NotImplementedError("the golden runs build nothing")

    def target_kind(self, target: str) -> str:
        return "llvm" if target.startswith("llvm") else "cuda"

    def prebuild(self, inputs: list[MeasureInput], workers: int) -> float:
        return 0.0


#: name -> (graph, target): a CPU run (the analytical model, then XGBoost) and a GPU one (the prior breaks ties)
CASES: dict[str, tuple[SMG, str]] = {
    "layernorm_llvm": (P.layernorm(32, 256), "llvm"),
    "gemm_sigmoid_cuda": (P.gemm_epilogue(256, 256, 128, "sigmoid", True, "float16"), "cuda:sm_90a"),
}
TRIALS, BATCH, SEED = 24, 8, 3


def run_case(name: str, db_path: Path, **tune_kw: Any) -> dict[str, Any]:
    """Tune case ``name`` from an empty database at ``db_path``; the batches measured, every record (oldest
    first) and the summary's counts and best."""
    smg, target = CASES[name]
    runner = KeyedRunner()
    s = tune(smg, runner, hw=H100, target=target, db=db_path, trials=TRIALS, batch=BATCH, seed=SEED,
             progress=False, builder=NoBuilder(), **tune_kw)
    with TuningDatabase(db_path) as db:
        records = [[sch.key, res.median_us if res.ok else None, res.error] for sch, res in db.records(s.key)]
    return {"key": s.key, "batches": runner.batches, "records": records, "measured": s.measured,
            "failed": s.failed, "best": None if s.best is None else s.best.key,
            "learned_n": s.learned.get("n"), "analytical_n": s.analytical.get("n")}


def main() -> None:
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            out[name] = run_case(name, Path(tmp) / f"{name}.db")
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)


if __name__ == "__main__":
    main()
