"""Seconds of each distinct fused SMG's first-pick ranking in a cold compile (issue 55, item 3).

Captures each model of ``dynamo_gpu.MODELS`` as its export does (meta tensors: nothing runs), then ranks every
distinct SMG as the export's first pick does (``api.candidates(smg, H100, head=5)``: the first five of the
order, what ``schedules.model_pick`` builds from) in this process with an empty ranking cache, and prints
the seconds per SMG and their sum.  ``--json`` writes them with the first five schedule keys, so two runs (two
checkouts) can be compared for speed and for picks.  What it leaves out: TVM's lowering and nvcc (an export's
``timing.json`` has them per SMG), and the export's pool of worker processes.

    PYTHONPATH=. python experiments/cold_pick_times.py clip_text_8x77 convnext_t_hf_32x224 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from experiments import dynamo_gpu as dg  # noqa: E402

#: ConvNeXt-T through transformers (torchvision's is the table's, where torchvision is installed): the default
#: ConvNextConfig is ConvNeXt-T's (depths 3/3/9/3, widths 96..768)
dg.MODELS.setdefault("convnext_t_hf_32x224", ("ConvNextConfig", "ConvNextModel", {}, "pixels", 32, 224))


def pick_times(name: str, head: int = 5) -> dict[str, Any]:
    """``name``'s distinct SMGs: label, count in the model, seconds of the ranking and its first ``head`` keys."""
    from spacefusion.api import H100, candidates
    from spacefusion.tuning import captured_partitions

    torch._dynamo.reset()
    model, x = dg.build(name, "meta")
    smgs: dict[str, Any] = {}
    for part in captured_partitions(model, **x):
        for sub in part.subgraphs:
            entry = smgs.setdefault(sub.smg.key, {"label": sub.label, "smg": sub.smg, "count": 0})
            entry["count"] += 1
    out = {}
    for key, e in smgs.items():
        t = time.perf_counter()
        order = candidates(e["smg"], H100, head=head)
        out[key] = {"label": e["label"], "count": e["count"], "s": round(time.perf_counter() - t, 3),
                    "head": [s.key for s in order]}
        print(f"  {e['label'][:60]:60s} {out[key]['s']:7.2f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", choices=list(dg.MODELS))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    res = {}
    for name in args.models:
        print(name, flush=True)
        res[name] = pick_times(name)
        print(f"{name}: {len(res[name])} distinct SMGs, ranked in {sum(r['s'] for r in res[name].values()):.1f} s",
              flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
