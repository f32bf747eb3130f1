#!/usr/bin/env python3
"""The search's layout decision for each NCHW chain of a ``conv_chains.py`` run, against what that run measured.

    python experiments/conv_layouts.py R.json --out L.json   # anywhere the cost model is (CPU)

For each chain measured with its image NCHW (``conv_chains.NCHW``), ``spacefusion.frontend.layouts`` decides
between reading the image where it lies and copying it channels-last first, on the hardware model of the run's
device.  Beside it are the run's own times of both paths, each as its first pick (what an export builds from an
empty database) and as the best candidate measured: the NCHW kernel, and torch's copy to channels-last plus the
channels-last twin's kernel.  The decision is right where it names the faster path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
FORMAT = "spacefusion-conv-layouts/1"


def hardware_of(device: str) -> Any:
    from spacefusion.api import H100, H200

    for hw in (H200, H100):
        if hw.name in device:
            return hw
    raise SystemExit(f"no hardware model for device {device!r}: the layouts are decided on H100 or H200 models")


def decide(results: Path) -> dict[str, Any]:
    import conv_chains

    from spacefusion.frontend.layouts import NCHW_MARGIN, choose_layout

    run = json.loads(results.read_text())
    hw = hardware_of(run["device"])
    chains = {e["chain"]["key"]: e for e in run["chains"]}
    out: dict[str, Any] = {"format": FORMAT, "measured": str(results), "device": run["device"], "hardware": hw.name,
                           "margin": NCHW_MARGIN, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "chains": []}
    for key, entry in chains.items():
        c = conv_chains.BY_KEY.get(key)
        twin = chains.get(key.removesuffix("_nchw"))
        if c is None or c.layout != "nchw" or twin is None:
            continue
        t0 = time.perf_counter()
        nhwc = conv_chains.BY_KEY[twin["chain"]["key"]]
        choice = choose_layout(conv_chains.smg_of(c), conv_chains.smg_of(nhwc), hw)
        ours, other = conv_chains.summarize(entry), conv_chains.summarize(twin)
        nf, nb, cf, cb = ours["first_us"], ours["best_us"], other["first_us"], other["best_us"]
        copy = ours.get("transpose_to_nhwc_us")
        row = {"key": key, "choice": choice.to_dict(), "reason": choice.reason,
               "decide_s": round(time.perf_counter() - t0, 1), "nchw_first_us": nf, "nchw_best_us": nb,
               "copy_us": copy, "nhwc_first_us": cf, "nhwc_best_us": cb}
        if None not in (nf, cf, copy):
            faster = "nchw" if nf < copy + cf else "nhwc"
            row.update(faster_first=faster, right=faster == choice.layout)
        if None not in (nb, cb, copy):
            row["faster_best"] = "nchw" if nb < copy + cb else "nhwc"
        out["chains"].append(row)
        print(format_row(row), flush=True)
    return out


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_row(r: dict[str, Any]) -> str:
    ch = r["choice"]
    return (f"{r['key']:<20} picks {ch['layout']} (model: {ch['nchw_us']:.1f} NCHW vs {ch['copy_us']:.1f} + "
            f"{ch['nhwc_us']:.1f}) | measured first picks: NCHW {_f(r['nchw_first_us'])} vs {_f(r['copy_us'])} + "
            f"{_f(r['nhwc_first_us'])}; best: {_f(r['nchw_best_us'])} vs {_f(r['copy_us'])} + "
            f"{_f(r['nhwc_best_us'])} -> {'right' if r.get('right') else 'WRONG' if 'right' in r else '?'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", type=Path, help="a conv_chains.py run with NCHW chains and their NHWC twins")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    got = decide(a.results)
    if a.out:
        a.out.write_text(json.dumps(got, indent=1) + "\n")
    return 0 if all(r.get("right", True) for r in got["chains"]) else 1


if __name__ == "__main__":
    sys.exit(main())
