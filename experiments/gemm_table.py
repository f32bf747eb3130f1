#!/usr/bin/env python3
"""Issue 57's GEMM table: spacefusion's fp16 GEMM ``Y = A @ W.T`` (W [n, k], as ``nn.Linear`` stores it: the
form the frontend fuses every linear layer into) beside cuBLAS's, on the issue's (M x N x K) shapes.

Two steps, two machines:

    python experiments/gemm_table.py build ART [--shapes KEY ...] [--ranked 3] [--hw h200]   # where TVM runs
    python experiments/gemm_table.py run ART --out R.json                                    # on the GPU

``build`` lowers, for each shape, the GEMM's SMG (``patterns.gemm_epilogue(m, n, k, "none", False, "float16",
"nk")``) as the analytical model's first pick for the named hardware model (``spacefusion.api.first_pick``;
the H200's by default) and the next distinct configurations of its ranking (``norm_gemm.distinct_picks``),
each into ``ART/<shape>/<label>`` with a cubin, and ``ART/<shape>/manifest.json``.  ``run`` checks every
candidate and cuBLAS (``torch.mm(A, W.t())``, which is ``F.linear``'s GEMM) against the float32 product
(``smg/tolerance.py``'s rule; cuBLAS with the baseline's slack), then times those that match as CUDA-graph
replays with CUDA events, L2 flushed by a read between runs, the systems taking turns ``--repeats`` times
(``norm_gemm.time_rows``), and reports each one's median, TFLOP/s (2 M N K per run) and the first pick's
speed-up over cuBLAS.  One failing candidate never loses the others; the JSON is rewritten after each shape.

On the GPU (about 1-2 minutes for the whole table with the defaults):

    python experiments/gemm_table.py run ART --out experiments/results/gemm_table_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

FORMAT = "spacefusion-gemm-table/1"
DTYPE = "float16"
#: the issue's (M, N, K): Qwen2-0.5B's stacked k/v (2 x 128), BERT-base's q, Qwen2's q/o, 6000 rows of a 512-wide
#: layer, GPT-2's stacked q/k/v, Qwen2's down and gate+up projections at 1024 tokens, and the large square
SHAPES: dict[str, tuple[int, int, int]] = {f"{m}x{n}x{k}": (m, n, k) for m, n, k in (
    (1024, 256, 896), (1024, 768, 768), (1024, 896, 896), (6000, 512, 512), (1024, 2304, 768),
    (1024, 896, 4864), (1024, 9728, 896), (8192, 8192, 8192))}
RANKED = 3  # candidates per shape: the first pick and the next distinct ones of the model's order
CUBLAS = "cublas"


def smg_of(key: str) -> Any:
    """The plain GEMM of a shape, W [n, k]."""
    from spacefusion.api import patterns

    m, n, k = SHAPES[key]
    return patterns.gemm_epilogue(m, n, k, "none", False, DTYPE, "nk")


# ---- build (where TVM runs) -----------------------------------------------------------------------


def candidates(key: str, hw: Any, count: int = RANKED) -> list[tuple[str, Any]]:
    """(label, schedule): ``first_pick`` for ``hw`` as "first", then the next distinct configurations of the
    analytical model's ranking for ``hw`` ("ranked1", ...), ``count`` in all."""
    from norm_gemm import distinct_picks

    from spacefusion.api import first_pick

    smg = smg_of(key)
    return distinct_picks(smg, hw, count, first=first_pick(smg, hw))


def build(art: Path, keys: list[str], hw_name: str = "h200", count: int = RANKED) -> int:
    """Lower each shape's candidates into ``art/<shape>/<label>`` (cubins for sm_90a) with a manifest; a
    candidate that fails to build is recorded with its error and the others still built."""
    from unseen_shapes import _knobs

    from spacefusion.api import build as lower
    from spacefusion.api import estimate, hardware

    hw = hardware(hw_name)
    for key in keys:
        t0 = time.perf_counter()
        folder = art / key
        rows = []
        for label, s in candidates(key, hw, count):
            row: dict[str, Any] = {"label": label, "schedule_key": s.key, "estimate_us": round(estimate(s, hw), 2),
                                   "blocks": s.num_blocks, "threads": s.threads, "artefact": label,
                                   "knobs": _knobs(json.loads(s.to_json()))}
            try:
                lower(s, "cuda:sm_90a").save(folder / label, compile_cubin=True)
            except Exception as exc:  # the others still get built; the run reports this one's error
                row.update(artefact=None, error=f"{type(exc).__name__}: {exc}"[:600])
            rows.append(row)
            print(f"{key}/{label}: {row['estimate_us']} us on the {hw.name}, {s.num_blocks} x {s.threads}, "
                  f"{row['knobs']}", flush=True)
        m, n, k = SHAPES[key]
        manifest = {"format": FORMAT, "hardware": hw.name,
                    "shape": {"key": key, "m": m, "n": n, "k": k, "dtype": DTYPE, "w_layout": "nk"},
                    "build_s": round(time.perf_counter() - t0, 1), "candidates": rows}
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


# ---- run (GPU: torch + cupy, no TVM) ----------------------------------------------------------------


def tflops(shape: dict[str, Any], us: float) -> float:
    """TFLOP/s of one GEMM of ``shape`` (2 M N K FLOPs) done in ``us`` microseconds."""
    return 2 * shape["m"] * shape["n"] * shape["k"] / us / 1e6


def run(art: Path, out_path: Path, keys: list[str], warmup: int, iters: int, repeats: int) -> int:
    import torch
    from norm_gemm import FLUSH, _check, _kernel_fn, time_rows

    result: dict[str, Any] = {"format": FORMAT, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "warmup": warmup, "iters": iters,
                              "repeats": repeats, "l2_flush": FLUSH, "shapes": []}
    for key in keys:
        manifest = json.loads((art / key / "manifest.json").read_text())
        shape = manifest["shape"]
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(shape["m"], shape["k"], generator=gen, device="cuda").half()
        w = (torch.randn(shape["n"], shape["k"], generator=gen, device="cuda") / shape["k"] ** 0.5).half()
        ref = a.float() @ w.float().t()
        rows: list[dict[str, Any]] = []
        for c in manifest["candidates"]:
            row = {"system": "spacefusion", **{f: c.get(f) for f in ("label", "estimate_us", "knobs", "schedule_key",
                                                                     "blocks", "threads")}}
            try:
                if not c.get("artefact"):
                    raise ValueError(c.get("error") or "no artefact")
                fn, out, info = _kernel_fn(art / key / c["artefact"], {"A": a, "Bw": w})
                fn()
                torch.cuda.synchronize()
                row.update(info, max_abs_err=_check(out, ref, shape["k"]), fn=fn)
            except Exception as exc:
                row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:600])
            rows.append(row)
        row = {"system": CUBLAS, "label": CUBLAS}
        try:
            got = torch.mm(a, w.t())
            torch.cuda.synchronize()
            row.update(max_abs_err=_check(got, ref, shape["k"], baseline=True), fn=lambda a=a, w=w: torch.mm(a, w.t()))
        except Exception as exc:
            row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:600])
        rows.append(row)
        del ref
        time_rows(rows, warmup, iters, repeats)
        for r in rows:
            if r.get("median_us"):
                r["tflops"] = round(tflops(shape, r["median_us"]), 1)
        result["shapes"].append({"shape": shape, "hardware": manifest.get("hardware"), "rows": rows,
                                 "first_vs_cublas": speedup(rows)})
        print(format_shape(shape, rows), flush=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def speedup(rows: list[dict[str, Any]], label: str = "first") -> float | None:
    """cuBLAS's median over the ``label`` candidate's (above 1: ours is faster); None where either is untimed."""
    by = {r.get("label"): r.get("median_us") for r in rows}
    return round(by[CUBLAS] / by[label], 3) if by.get(CUBLAS) and by.get(label) else None


def format_shape(shape: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """One shape's systems: median, TFLOP/s, the candidate's knobs or error, and the first pick against cuBLAS."""
    lines = [f"== {shape['key']} (M x N x K, W [n, k], {shape['dtype']})"]
    for r in rows:
        us = f"{r['median_us']:9.1f} us {r['tflops']:6.1f} TFLOP/s" if r.get("median_us") else f"{'-':>27}"
        what = (f"est {r.get('estimate_us')} us, {r.get('blocks')} x {r.get('threads')}, {r.get('knobs')}"
                if r["system"] == "spacefusion" else "")
        lines.append(f"  {r['label']:<8} {us}  {what}{'  ' + r['error'] if r.get('error') else ''}")
    x = speedup(rows)
    if x is not None:
        lines.append(f"  first pick vs cuBLAS: {x:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from gpu_runtime import timing_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("art", type=Path)
    b.add_argument("--shapes", nargs="*", default=None, choices=list(SHAPES))
    b.add_argument("--ranked", type=int, default=RANKED, help="candidates per shape (the first pick included)")
    b.add_argument("--hw", default="h200", help="the hardware model the candidates are ranked for (a preset)")
    r = sub.add_parser("run")
    r.add_argument("art", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--shapes", nargs="*", default=None)
    timing_args(r, warmup=10, iters=100, repeats=3)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "build":
            return build(a.art, a.shapes or list(SHAPES), a.hw, a.ranked)
        keys = a.shapes or [k for k in SHAPES if (a.art / k / "manifest.json").is_file()]
        if not keys:
            raise SystemExit(f"{a.art}: no shape's manifest.json (build it first: gemm_table.py build {a.art})")
        return run(a.art, a.out, keys, a.warmup, a.iters, a.repeats)
    except SystemExit:
        raise
    except Exception:
        traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(main())
