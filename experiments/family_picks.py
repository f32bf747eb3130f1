#!/usr/bin/env python3
"""First picks of a new sequence length taken from the family's ranking at another (``frontend.families``),
against the full ranking at that length: BERT-base's SMGs, analytical estimates, on the CPU.

    python experiments/family_picks.py --base 128 --lengths 64 77 100 200 37 16 --out r.json

The SMGs are BERT-base's (batch 8, fp16) as the frontend captures them at each length (meta tensors,
nothing built).  Each SMG of the base length is ranked in full inside a family folder of its own; each SMG
of another length is then picked twice: by the full ranking (``schedules.model_pick``, no family) and as a
graph with symbolic sizes is (``families.transferring(folder, True)``: from the nearest ranked sizes within
``families.NEAR``, else ranked in full).  The record per SMG: both picks' analytical estimates for the
machine (``--hardware``), whether they are the same schedule, the seconds each pick took, and which sizes
the transferred pick came from.  What it does not say: the kernels' measured times (the estimates rank; a
GPU run of the session loop measures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH = 8


def smgs_at(length: int) -> list[Any]:
    """BERT-base's distinct SMGs at ``BATCH`` x ``length`` (fp16), as the frontend partitions it."""
    import torch
    import transformers

    from spacefusion.tuning import captured_partitions

    torch._dynamo.reset()
    with torch.device("meta"):
        model = transformers.BertModel(transformers.BertConfig()).eval().half()
    ids = torch.zeros(BATCH, length, dtype=torch.long, device="meta")
    out: dict[str, Any] = {}
    for p in captured_partitions(model, input_ids=ids):
        for s in p.subgraphs:
            out.setdefault(s.smg.key, s.smg)
    return list(out.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=int, default=128, help="the length whose SMGs are ranked in full first")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 77, 100, 200, 37, 16])
    ap.add_argument("--hardware", default="H100", help="the machine the picks are ranked for (a preset's name)")
    ap.add_argument("--out", type=Path, default=Path("family_picks.json"))
    args = ap.parse_args(argv)

    from spacefusion.api import estimate, get_hardware, model_pick
    from spacefusion.frontend import families

    hw = get_hardware(args.hardware)
    folder = Path(tempfile.mkdtemp(prefix="sf-families-"))
    base = smgs_at(args.base)
    with families.transferring(folder, False):
        for smg in base:
            model_pick(smg, hw)
    known = {s.key for s in base}
    rows: list[dict[str, Any]] = []
    for length in args.lengths:
        for smg in smgs_at(length):
            if smg.key in known:
                continue
            t = time.perf_counter()
            full = model_pick(smg, hw)[0]
            full_s = time.perf_counter() - t
            families.ORIGIN.pop(smg.key, None)
            with families.transferring(folder, True):
                t = time.perf_counter()
                got = model_pick(smg, hw)[0]
                got_s = time.perf_counter() - t
            est_full, est_got = estimate(full, hw), estimate(got, hw)
            rows.append({"length": length, "name": smg.name, "sizes": smg.dim_sizes,
                         "picked_from_sizes": families.ORIGIN.get(smg.key), "full_s": round(full_s, 3),
                         "transfer_s": round(got_s, 3), "full_us": est_full, "transfer_us": est_got,
                         "ratio": est_got / est_full, "same": full.key == got.key})
            print(json.dumps(rows[-1]), flush=True)
    moved = [r for r in rows if r["picked_from_sizes"] is not None]
    summary = {"smgs": len(rows), "transferred": len(moved), "same_pick": sum(r["same"] for r in moved),
               "ratio_max": max((r["ratio"] for r in moved), default=None),
               "ratio_geomean": statistics.geometric_mean([r["ratio"] for r in moved]) if moved else None,
               "full_s": round(sum(r["full_s"] for r in moved), 2),
               "transfer_s": round(sum(r["transfer_s"] for r in moved), 2)}
    args.out.write_text(json.dumps({"hardware": hw.name, "base": args.base, "batch": BATCH, "near": families.NEAR,
                                    "summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
