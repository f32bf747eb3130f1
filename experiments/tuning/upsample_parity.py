#!/usr/bin/env python3
"""Upsample -> Conv by output parity against the conv over the upsampled read (SD 1.5's upsampling convs).

Usage:
    python experiments/tuning/upsample_parity.py export ART [--top 4]       # here (TVM): the offline batch
    python3 -m spacefusion.runtime.batch ART --out R.json --iters 50       # on the GPU machine
    python experiments/tuning/upsample_parity.py table ART R.json [--records OUT]

Each upsampling conv of the SD 1.5 VAE decoder (batch 1) and UNet (batch 2) is built both ways: the
parity form (``patterns.upsample_conv2d``: four merged 2x2 windows of the small image) and the plain
form (``patterns.conv2d(upsample=2)``: the 3x3 window read through ``floor(y / 2)``).  The batch holds each
form's ``--top`` candidates in the tuner's first-round order (rank 0 is the first pick), so the two are
timed in one run; the batch checks every kernel against the numpy reference before timing it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

#: (model, batch, small h = w, c_in, c_out) of SD 1.5's Upsample2D convs (3x3, pad 1, bias, fp16)
SHAPES = [("VAE", 1, 64, 512, 512), ("VAE", 1, 128, 512, 512), ("VAE", 1, 256, 256, 256),
          ("UNet", 2, 8, 1280, 1280), ("UNet", 2, 16, 1280, 1280), ("UNet", 2, 32, 640, 640)]


def _smgs(batch: int, size: int, c: int, co: int):
    from spacefusion.api import patterns

    return {"parity": patterns.upsample_conv2d(batch, size, size, c, co, 3, 1, dtype="float16"),
            "plain": patterns.conv2d(batch, size, size, c, co, 3, 1, 1, upsample=2, dtype="float16")}


def export(art: Path, top: int) -> None:
    from spacefusion.api import candidates
    from spacefusion.tuning import MeasureInput, export_batch

    inputs, labels = [], []
    for model, b, size, c, co in SHAPES:
        for form, g in _smgs(b, size, c, co).items():
            for rank, s in enumerate(candidates(g)[:top]):
                inputs.append(MeasureInput(s, "cuda:sm_90a"))
                labels.append({"model": model, "shape": [b, size, c, co], "form": form, "rank": rank,
                               "workload_key": g.key, "schedule_key": s.key})
    export_batch(inputs, art)
    (art / "labels.json").write_text(json.dumps(labels, indent=1) + "\n")
    print(f"{len(inputs)} candidates in {art}")


def table(art: Path, results: Path, records: Path | None) -> None:
    labels = json.loads((art / "labels.json").read_text())
    from spacefusion.tuning import MeasureResult

    whole = json.loads(results.read_text())
    raw = whole["results"]
    res = [MeasureResult.from_dict(r) for r in raw]
    rows: dict[tuple, dict] = {}
    for lab, r in zip(labels, res, strict=True):
        us = r.median_us if r.ok else None
        key = (lab["model"], tuple(lab["shape"]))
        rows.setdefault(key, {}).setdefault(lab["form"], []).append((lab["rank"], us, r.error))
    print("| conv (batch x small size x c_in -> c_out, 2x upsampled) | plain first pick | plain best | "
          "parity first pick | parity best | plain pick / parity pick |")
    print("|---|---|---|---|---|---|")
    for (model, (b, size, c, co)), forms in rows.items():
        def pick(form: str, forms: dict = forms) -> tuple[float | None, float | None]:
            got = sorted(forms.get(form, []))
            first = got[0][1] if got else None
            ok = [u for _, u, _ in got if u is not None]
            return first, (min(ok) if ok else None)

        (p0, pb), (q0, qb) = pick("plain"), pick("parity")
        ratio = f"{p0 / q0:.2f}x" if p0 and q0 else "-"
        f = lambda v: f"{v:.1f}" if v else "failed"  # noqa: E731
        print(f"| {model} {b}x{size}x{size}x{c} -> {co} | {f(p0)} | {f(pb)} | {f(q0)} | {f(qb)} | {ratio} |")
    if records is not None:
        meta = {k: v for k, v in whole.items() if k not in ("results", "format")}
        records.write_text(json.dumps({"format": "spacefusion-upsample-parity/1", **meta, "labels": labels,
                                       "results": raw}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("art", type=Path)
    e.add_argument("--top", type=int, default=4)
    t = sub.add_parser("table")
    t.add_argument("art", type=Path)
    t.add_argument("results", type=Path)
    t.add_argument("--records", type=Path, default=None)
    a = ap.parse_args()
    if a.cmd == "export":
        export(a.art, a.top)
    else:
        table(a.art, a.results, a.records)


if __name__ == "__main__":
    main()
