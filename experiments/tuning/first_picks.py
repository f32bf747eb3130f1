#!/usr/bin/env python3
"""The tuner's first pick on every committed measured round, as the current cost model orders it.

Usage:  python experiments/tuning/first_picks.py [--art .art] [--json OUT]

A round is a set of candidates of one workload timed on the H100: the unseen-shapes rounds
(``experiments/results/unseen_shapes*_h100.json``, 8 each, the harness's attention shapes among them), the
BERT/ViT subgraph rounds (``experiments/tuning/e2e_rounds_h100.json``, 8 each; their schedules are read from the batch
manifests under ``--art``, skipped when absent) and the tuning runs of ``h100_records.json`` (every
candidate measured there).  Each round's candidates are ordered as the tuner orders its first batch
(``search.prior.first_round_order``: the analytical estimate, its ties broken by the shipped prior);
the table gives the measured time of the pick it puts first, of the round's committed first pick (the
manifest's rank 0; none for the records) and of the round's best.  An unseen-shapes candidate whose
schedule is neither in a committed record nor under ``--art`` is rebuilt from the knobs its results row
keeps where that gives the same schedule key, else left out of its round (without ``--art``: 10 CUDA-core
explorations of the five odd-head-dim rounds, 100-10000x slower than the picks).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "experiments" / "results"
TUNING = ROOT / "experiments" / "tuning"


def _schedule_index(art: Path | None) -> dict[str, dict]:
    """schedule key -> schedule JSON from the committed record files (and the batch manifests under ``art``)."""
    out: dict[str, dict] = {}
    files = sorted(TUNING.glob("*records*.json"))
    if art is not None and art.is_dir():
        files += sorted(art.rglob("manifest.json"))
    for f in files:
        data = json.loads(f.read_text())
        for r in data.get("records", ()):
            out.setdefault(r["result"]["schedule_key"], r["schedule"])
        for c in data.get("candidates", ()):
            out.setdefault(c["schedule_key"], c["schedule"])
    return out


Round = tuple[str, dict[str, dict], dict[str, float], str | None]


def _rebuilt(shape: str, knobs: dict, key: str) -> dict | None:
    """The schedule JSON of an unseen-shapes row from the knobs its results file keeps, if that rebuilds the
    same schedule (its key): the re-run rounds of odd head dims left no records or manifest behind; their
    tensor-core picks rebuild, their CUDA-core explorations (other thread dims) do not."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import unseen_shapes as U

    from spacefusion.api import schedule

    k = dict(knobs)
    tiles, step = dict(map(tuple, k.pop("block"))), k.pop("step")
    try:
        s = schedule(U.smg_of(U.BY_KEY[shape]), tiles=tiles, step=step, **k)
    except Exception:  # noqa: BLE001 - knobs the schedule builder does not take
        return None
    return s.to_dict() if s.key == key else None


def rounds(art: Path | None) -> Iterator[Round]:
    """(name, key -> schedule JSON, key -> median us of the ok ones, committed first key or None)."""
    index = _schedule_index(art)
    for f in ("unseen_shapes_h100.json", "unseen_shapes_validation_h100.json", "unseen_shapes_harness_h100.json"):
        for e in json.loads((RESULTS / f).read_text())["shapes"]:
            k = e["shape"]["key"]
            rows = [r for r in e["rows"] if r["system"] == "spacefusion"]
            for r in rows:
                if r["schedule_key"] not in index:
                    found = _rebuilt(k, r["schedule"], r["schedule_key"])
                    if found is not None:
                        index[r["schedule_key"]] = found
            rows = [r for r in rows if r["schedule_key"] in index]
            yield (k, {r["schedule_key"]: index[r["schedule_key"]] for r in rows},
                   {r["schedule_key"]: r["median_us"] for r in rows if r.get("status") == "ok"},
                   next(r["schedule_key"] for r in rows if r["rank"] == 0))
    for r in json.loads((TUNING / "e2e_rounds_h100.json").read_text())["rounds"]:
        keys = [x["schedule_key"] for x in r["results"]]
        if not all(k in index for k in keys):
            continue  # the batch manifests are not at hand
        dims = "x".join(str(d["size"]) for d in r["workload"]["dims"])
        yield (f"e2e {r['workload']['name']} {dims}", {k: index[k] for k in keys},
               {x["schedule_key"]: x["latencies_us"][0] for x in r["results"] if x.get("error") is None
                and x.get("latencies_us")}, keys[0])
    data = json.loads((TUNING / "h100_records.json").read_text())
    groups: dict[str, list[dict]] = {}
    for r in data["records"]:
        groups.setdefault(f"{r['workload']} {r['tuning_key'][:8]}", []).append(r)
    for name, recs in groups.items():
        yield (f"records {name}", {r["result"]["schedule_key"]: r["schedule"] for r in recs},
               {r["result"]["schedule_key"]: min(r["result"]["latencies_us"]) for r in recs
                if r["result"].get("error") is None}, None)


def first_picks(art: Path | None) -> list[dict]:
    from spacefusion.api import H100, Schedule, estimate
    from spacefusion.tuning import first_round_order, load_prior

    prior = load_prior(H100)
    out = []
    for name, scheds, med, committed in rounds(art):
        cands = {k: Schedule.from_json(json.dumps(d)) for k, d in scheds.items()}
        est = {k: estimate(s, H100) for k, s in cands.items()}
        first = first_round_order(cands, est, prior)[0]
        out.append({"round": name, "first": first, "first_us": med.get(first),
                    "committed_us": med.get(committed) if committed else None, "best_us": min(med.values()),
                    "estimates": {k: round(v, 3) for k, v in est.items()}})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--art", type=Path, default=ROOT / ".art", help="batch manifests of the e2e rounds")
    ap.add_argument("--json", type=Path, help="write the picks here")
    args = ap.parse_args(argv)
    picks = first_picks(args.art)
    print(f"{'round':<34} {'first us':>9} {'committed':>9} {'best us':>9} {'first/best':>10}")
    for p in picks:
        c = f"{p['committed_us']:9.1f}" if p["committed_us"] is not None else f"{'-':>9}"
        f = f"{p['first_us']:9.1f}" if p["first_us"] is not None else f"{'failed':>9}"
        ratio = p["first_us"] / p["best_us"] if p["first_us"] is not None else float("nan")
        print(f"{p['round']:<34} {f} {c} {p['best_us']:9.1f} {ratio:10.3f}")
    if args.json:
        args.json.write_text(json.dumps(picks, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
