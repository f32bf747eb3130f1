#!/usr/bin/env python3
"""How the L2 flush between timed runs moves memory-bound timings (GPU machine, no TVM needed).

Usage:  python experiments/flush_study.py [SOFTMAX_GEMM_ARTEFACT] --out flush.json

Times, under each flush mode of ``timing.time_cuda`` ("read": clean lines, "write": dirty lines),
three torch kernels over the 4096x4096 fp16 matrix of the Softmax-GEMM workload (a row max and a
row sum, which read its 32 MB, and a copy, which reads and writes them), a near-empty kernel (the
fixed cost of a timed launch), eager softmax(S) @ V and, given its artefact, the spacefusion
kernel (checked against torch first). A write flush leaves L2 full of dirty lines whose write-back
the next kernel pays for: the difference between the two columns.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_runtime import compare_tensors, runtime_module  # noqa: E402

SHAPE = (4096, 4096, 64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artefact", nargs="?", type=Path, help="a softmax_gemm 4096x4096x64 artefact folder")
    ap.add_argument("--out", type=Path, default=Path("flush_study.json"))
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args(argv)

    import torch

    timing = runtime_module("timing")
    m, l, d = SHAPE
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = torch.randn(m, l, dtype=torch.float16, device="cuda", generator=gen)
    v = torch.randn(l, d, dtype=torch.float16, device="cuda", generator=gen)
    tiny = torch.empty(1, device="cuda")
    systems = {
        "row max (reads S)": lambda: s.amax(-1),
        "row sum (reads S)": lambda: s.sum(-1),
        "copy (reads + writes S)": lambda: s.clone(),
        "empty kernel": lambda: tiny.zero_(),
        "eager softmax(S) @ V": lambda: torch.softmax(s, -1) @ v,
    }
    if args.artefact is not None:
        art_mod, gpu = runtime_module("artefact"), runtime_module("gpu")
        kernel = gpu.CudaKernel(art_mod.KernelArtefact.load(args.artefact))
        kernel.compile()
        out = torch.full((m, d), float("nan"), dtype=torch.float16, device="cuda")
        kernel.launch({"S": s, "V": v}, {"O": out})
        check = compare_tensors(out, torch.softmax(s.float(), -1) @ v.float(), "float16", l, "O")
        if not check.ok:
            print(f"spacefusion kernel is wrong ({check.problem}); not timed", file=sys.stderr)
            return 1
        systems["spacefusion"] = lambda: kernel.launch({"S": s, "V": v}, {"O": out})
    rows = []
    for name, fn in systems.items():
        row = {"system": name}
        for mode in timing.FLUSH_MODES:
            row[mode] = timing.time_cuda(fn, warmup=10, iters=args.iters, flush=mode).as_dict()
        rows.append(row)
        print(f"{name:26s} read {row['read']['median_us']:7.2f} us   write {row['write']['median_us']:7.2f} us")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": SHAPE,
              "bytes_of_S": m * l * 2, "timer": "time_cuda (CUDA events, median)", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
