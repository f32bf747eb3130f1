"""A prior for the tuner's first round: a ranker learned from every committed measurement.

With an empty database the tuner orders its first batch by the analytical model alone.  On shapes
nobody hand-tuned its estimates often tie: memory-bound decoders sit on the DRAM roofline whatever
their step, and knobs the per-step model does not see (``reload_a``, ``early_scores``, 64- against
128-row tiles at d = 80) leave dozens of candidates within a percent.  The key order then picked
the first candidate, 1.1-1.4x slower than the round's best on 7 of 12 such H100 shapes.

The prior is the XGBoost ranker of ``search.learned`` trained on the committed H100 records of
other workloads (calibration sweeps, tuner rounds, the unseen-shapes rounds).  Across workloads it
ranks worse than the analytical model (mean Spearman 0.55 against 0.70-0.97), so it only orders
candidates whose estimates are within ``TIE`` of each other: the analytical model decides, the
prior breaks its ties.  Left out per shape, this put the first pick within 10% of the measured
best on 9 of the 12 unseen shapes instead of 5 (``tests/test_prior.py``).

The model ships as xgboost's own JSON (``search/data/prior_<hw>.json`` + sidecar, never a pickle),
rebuilt from the records by ``experiments/tuning/train_prior.py``.  Each machine's own prior is used where one
ships (``prior_for``); a GPU without one is ranked with the H100's, which scores the candidates as they
would be on the H100 (its features are the H100's numbers) and says so in its ``why``.
"""

from __future__ import annotations

import json
import lzma
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from schedulers.hardware import H100, HardwareModel, preset_of_device
from schedulers.schedule import Schedule
from search.learned import LearnedCostModel
from search.records import MeasureResult

#: estimates within this ratio of each other count as a tie the prior breaks
TIE = 0.01
#: candidates (the best estimates first) the prior scores: features cost 2-10 ms each
PRIOR_CANDIDATES = 256
DATA = Path(__file__).resolve().parent / "data"


def prior_path(hw: HardwareModel) -> Path:
    """Where ``hw``'s prior ships: named after its preset (a queried device's model, "NVIDIA H200", is the
    H200's)."""
    return DATA / f"prior_{(preset_of_device(hw.name) or hw).name.lower()}.json"


@lru_cache(maxsize=4)
def load_prior(hw: HardwareModel) -> LearnedCostModel | None:
    """The shipped prior of ``hw`` itself (None where none ships; ``prior_for`` falls back); read once per
    process (0.7 MB of xgboost JSON), not once per tuned workload."""
    path = prior_path(hw)
    return LearnedCostModel.load(path) if path.is_file() else None


@dataclass(frozen=True)
class PriorChoice:
    """The prior that breaks ``hw``'s ties: ``model`` (None: none, the key order breaks them), the machine it
    was trained on (``trained_on``), and why that one."""

    model: LearnedCostModel | None
    trained_on: str | None
    why: str


#: the prior a GPU without one of its own is ranked with
FALLBACK = H100


@lru_cache(maxsize=8)
def prior_for(hw: HardwareModel) -> PriorChoice:
    """``hw``'s own prior where one ships; else, for a GPU, the ``FALLBACK``'s (the H100's), with the reason;
    else none."""
    own = load_prior(hw)
    if own is not None:
        n = own.meta.get("num_records")
        return PriorChoice(own, hw.name, f"the {hw.name}'s own prior" + (f" ({n} records)" if n else ""))
    fallback = load_prior(FALLBACK) if hw.kind == "gpu" and hw.name != FALLBACK.name else None
    if fallback is not None:
        return PriorChoice(fallback, FALLBACK.name, f"no prior of the {hw.name} ships (none in {DATA.name}/): the "
                                                    f"{FALLBACK.name}'s, which scores ties with the "
                                                    f"{FALLBACK.name}'s numbers")
    return PriorChoice(None, None, f"no prior of the {hw.name} ships: ties go by key")


def read_json(path: Path | str) -> Any:
    """A committed JSON file, xz-compressed where its name ends ``.xz`` (the larger tuning rounds)."""
    path = Path(path)
    if path.suffix == ".xz":
        with lzma.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def read_records(path: Path, device: str = "H100") -> tuple[list[Schedule], list[MeasureResult], list[str]]:
    """Schedules, results and groups (workload + tuning key) of a ``spacefusion-records/1`` file, of
    ``warp_tile_calibration.json`` (rows of schedule, workload and median), or of the models' tuning rounds
    (``spacefusion-e2e-rounds/2``: each round's SMG stored once; the rounds of ``device`` only, a preset's
    name that the round's device name holds)."""
    data = read_json(path)
    scheds, res, groups = [], [], []
    if "rounds" in data:
        for rnd in data["rounds"]:
            if device.upper() not in rnd["device"].upper() or "schedules" not in rnd:
                continue
            dims = "x".join(f"{d['name']}{d['size']}" for d in rnd["workload"]["dims"])
            for r in rnd["results"]:
                s = Schedule.from_json(json.dumps({**rnd["schedules"][r["schedule_key"]], "smg": rnd["smg"]}))
                scheds.append(s)
                res.append(MeasureResult.from_dict(r))
                groups.append(f"e2e_{rnd['workload']['name']}_{dims}:{rnd['round']}")
    elif "records" in data:
        for r in data["records"]:
            s = Schedule.from_json(json.dumps(r["schedule"]))
            scheds.append(s)
            res.append(MeasureResult.from_dict(r["result"]))
            groups.append(f"{r['workload']}:{r.get('tuning_key', '')}")
    else:
        for r in data["rows"]:
            s = Schedule.from_json(json.dumps(r["schedule"]))
            scheds.append(s)
            res.append(MeasureResult(s.key, "cuda:sm_90a", (float(r["median_us"]),)))
            groups.append(f"calibration:{r['workload']}")
    return scheds, res, groups


def train_prior(hw: HardwareModel, files: Iterable[Path], exclude: Sequence[str] = ()) -> LearnedCostModel:
    """A ranker on every record of ``files`` (the rounds of ``hw``'s device where a file holds several
    machines') whose group names none of ``exclude`` (held-out workloads)."""
    scheds: list[Schedule] = []
    res: list[MeasureResult] = []
    groups: list[str] = []
    for f in files:
        s, r, g = read_records(f, hw.name)
        keep = [i for i, gi in enumerate(g) if not any(gi.startswith(f"{x}:") for x in exclude)]
        scheds += [s[i] for i in keep]
        res += [r[i] for i in keep]
        groups += [g[i] for i in keep]
    model = LearnedCostModel(hw)
    model.fit(scheds, res, groups)
    return model


def tie_groups(estimates: Sequence[float]) -> list[int]:
    """Group ids of ascending ``estimates``: a group takes every estimate within ``1 + TIE`` of its first
    (the ties the prior breaks); the next estimate beyond that starts the next group."""
    out, start, gid = [], None, -1
    for e in estimates:
        if start is None or e > start * (1 + TIE):
            start, gid = e, gid + 1
        out.append(gid)
    return out


def first_round_order(cands: dict[str, Schedule], est: dict[str, float],
                      prior: LearnedCostModel | None) -> list[str]:
    """Candidate keys best first: by estimate, ties (one of ``tie_groups``) by the prior, then by key.
    Only the ``PRIOR_CANDIDATES`` best estimates are scored; the rest keep the estimate's order."""
    keys = sorted(cands, key=lambda k: (est[k], k))
    if prior is None or not prior.is_trained or not keys:
        return keys
    head, tail = keys[:PRIOR_CANDIDATES], keys[PRIOR_CANDIDATES:]
    score = dict(zip(head, prior.predict([cands[k] for k in head])))
    group = dict(zip(head, tie_groups([est[k] for k in head])))
    return sorted(head, key=lambda k: (group[k], score[k], k)) + tail
