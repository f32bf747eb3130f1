"""``spacefusion`` command line: ``demo`` (the embedded default) and ``build``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from smg.errors import SpaceFusionError

TOL = {"float32": 1e-4, "float16": 2e-2}


def _workload(name: str, shape: list[int], dtype: str):
    from smg import workloads

    if name not in workloads.WORKLOADS:
        raise SpaceFusionError(f"unknown workload {name!r}; known: {sorted(workloads.WORKLOADS)}")
    return workloads.WORKLOADS[name](*shape, dtype=dtype)


def verify_llvm(s, seed: int = 0) -> float:
    """Run the TVM llvm kernel and return its max error against the numpy reference."""
    from spacefusion.api import build, evaluate, random_inputs

    x = random_inputs(s.smg, seed)
    got = build(s, "llvm")(x)
    ref = evaluate(s.smg, x)
    return max(float(np.abs(got[k].astype(np.float64) - ref[k]).max()) for k in ref)


def demo(args: argparse.Namespace) -> int:
    from spacefusion.api import build, schedule, traffic

    b, h, sq, skv, d = args.shape
    g = _workload("mha", [b, h, sq, skv, d], args.dtype)
    print(g, end="\n\n")
    s = schedule(g, tiles={"m": min(64, sq)}, step=args.step)
    print(s, end="\n\n")
    t0 = time.perf_counter()
    err = verify_llvm(s)
    ok = err <= TOL[args.dtype]
    print(f"TVM llvm kernel vs unfused numpy reference: max abs error {err:.3e} "
          f"({'OK' if ok else 'MISMATCH'}, tol {TOL[args.dtype]}) [{time.perf_counter() - t0:.1f}s]")
    out = Path(args.out) / "mha_sm_90a"
    art = build(s, "cuda:sm_90a")
    art.save(out)
    cubin = "with cubin (nvcc)" if (out / "kernel.cubin").exists() else "source only (no nvcc)"
    print(f"CUDA for sm_90a written to {out}/ ({cubin}); grid {art.meta['grid']}, "
          f"block {art.meta['block']}, params {art.meta['param_order']}")
    tr = traffic(s)
    print(f"device-memory traffic: fused {tr.fused_bytes / 1e6:.2f} MB vs unfused chain "
          f"{tr.unfused_bytes / 1e6:.2f} MB ({100 * tr.reduction:.1f}% less)")
    return 0 if ok else 1


def build_cmd(args: argparse.Namespace) -> int:
    from spacefusion.api import build, schedule

    g = _workload(args.workload, args.shape, args.dtype)
    tiles = {"m": args.tile_m} if args.tile_m else None
    s = schedule(g, tiles=tiles, step=args.step)
    if args.verify:
        print(f"llvm check: max abs error {verify_llvm(s):.3e}")
    art = build(s, args.target)
    path = art.save(args.out)
    print(f"wrote {path}/kernel.cu and kernel.json (grid {art.meta['grid']}, block {art.meta['block']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spacefusion", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="fuse MHA, verify on llvm, emit CUDA, show traffic")
    d.add_argument("--shape", type=int, nargs=5, default=[1, 2, 197, 197, 64],
                   metavar=("B", "H", "SQ", "SKV", "D"))
    d.add_argument("--dtype", default="float16", choices=sorted(TOL))
    d.add_argument("--step", type=int, default=32)
    d.add_argument("--out", default="spacefusion_out")
    b = sub.add_parser("build", help="build one workload for a target")
    b.add_argument("workload")
    b.add_argument("--shape", type=int, nargs="+", required=True)
    b.add_argument("--dtype", default="float16", choices=sorted(TOL))
    b.add_argument("--target", default="cuda:sm_90a")
    b.add_argument("--tile-m", type=int, default=0)
    b.add_argument("--step", type=int, default=32)
    b.add_argument("--verify", action="store_true")
    b.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        return demo(args) if args.cmd == "demo" else build_cmd(args)
    except (SpaceFusionError, KeyError) as e:
        print(f"spacefusion: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
