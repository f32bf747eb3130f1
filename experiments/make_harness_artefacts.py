#!/usr/bin/env python3
"""Lower the comparison harness's workloads to CUDA artefacts (needs TVM, no GPU).

Usage:  python experiments/make_harness_artefacts.py OUT_DIR [--only KEY ...]

One schedule per workload of ``experiments/harness_workloads.py``: the best of the tile sweeps
measured on the H100 (``experiments/results/history/mma_sweep_h100.json``, ``results/history/sweep2_h100.json``;
rows x step x stages x warps x split/slices, lanes x vector; ``results/history/slices_h100.json``).
Attention, Softmax-GEMM and the GEMM epilogue are tensor-core warp-tile programs (BERT with two
16-row tiles per warp; LLaMA's and the causal shape warp-specialised like FlashAttention-3; Softmax-GEMM
and decoding attention with blocks slicing the steps);
LayerNorm(x+r) is the CUDA-core kernel with the row on chip in one step, 256 lanes (8 warps) per
row and 16-byte vector accesses.  Then, on the GPU machine:
``python experiments/harness.py OUT_DIR --out results.json --csv results.csv``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spacefusion.api import (
    build,  # noqa: E402
    make_schedule,
)
from spacefusion.api import patterns as P
from spacefusion.api import workloads as W

H = "float16"
TC = {"tensor_cores": True}
#: harness key -> (graph, tiles, serial, step, make_schedule options)
# mma_row_sums (the row sum of P as P @ 1 on tensor cores), interleaved 3-4 times on the H100: causal
# 486 -> 447 us, BERT 98.5 -> 96.4, ViT 26.8 -> 24.8, Softmax-GEMM 25.2 -> 24.0; LLaMA and decode tie
# (experiments/results/history/rowsums_h100.json); it is on wherever the graph has such a row sum.
# wgmma, interleaved twice (experiments/results/history/wgmma_h100.json): P @ V alone on warpgroup MMA (P in
# registers): causal 448 -> 421 us, LLaMA 786 -> 736, ViT 26.5 -> 23.7, BERT 94.4 -> 93.4; then the
# score GEMM too: causal 423 -> 321, LLaMA 700 -> 551, ViT 23.0 -> 20.7, BERT 93.2 -> 85.7; not with slices
SCHEDULES = {
    # 64-row blocks (one 16-row tile per warp, twice the blocks): found by the calibration sweep
    # (experiments/tuning/warp_tile_calibration.json), then interleaved 3 times: 71.7-72.9 us against
    # 86.4-96.4 for 128 rows with lazy_rescale (the schedule before); lazy_rescale on 73.0-74.0
    # (experiments/results/history/bert_rows_h100.json); Q re-read from shared memory (reload_a, the tuner's
    # pick): 71.0-72.0 against 71.8-73.5 us, 4 of 4 interleaved pairs
    "mha_bert": (lambda: P.attention(32, 12, 512, 512, 64, dtype=H), {"m": 64}, "l", 64,
                 TC | {"stages": 2, "warps": 4, "reload_a": True, "mma_row_sums": True, "wgmma": True}),
    "mha_vit": (lambda: P.attention(16, 16, 197, 197, 64, dtype=H), {"m": 64}, "l", 32,
                TC | {"stages": 2, "mma_row_sums": True, "wgmma": True}),
    # (the kernel before: one warpgroup of two 16-row tiles per warp, Q re-read from shared memory; lazy_rescale:
    # 803.5 against 828.5 us, 6 pairs, all better)
    # a producer warpgroup feeding K and V apart (TMA) to two MMA warpgroups of 64 rows that overlap each
    # step's softmax with the previous step's P @ V and take turns at the tensor cores (FlashAttention-3's
    # structure), steps of 128 in a 2-slot ring, the row sum on the SIMT cores (mma.sync's row sums stall
    # the async wgmma pipe): 450.7-455.1 us against 512-551 for the 64-row-step kernel before, interleaved
    # 3 times; with the row sums on tensor cores 529-535 (experiments/results/history/fa3_attention_h100.json)
    "mha_llama": (lambda: P.attention(4, 32, 2048, 2048, 128, dtype=H), {"m": 128}, "l", 128,
                  TC | {"stages": 2, "warps": 8, "reload_a": True, "lazy_rescale": True, "wgmma": True, "tma": True,
                         "producer": True}),
    # (the kernel before: the row max kept within ln 256 (lazy_rescale): 483-489 against 487-501 us; BERT and
    # decode lose with it: experiments/results/history/epilogue_h100.json, lazy_rescale_*)
    # the same as LLaMA's: 277.9-282.3 us against 323.8-325.1, interleaved 3 times
    "mha_causal": (lambda: P.attention(4, 32, 2048, 2048, 128, causal=True, dtype=H), {"m": 128}, "l", 128,
                   TC | {"stages": 2, "warps": 8, "reload_a": True, "lazy_rescale": True, "wgmma": True, "tma": True,
                         "producer": True}),
    # S waited for apart from V: 24.4 against 26.1 us, interleaved 4 times; a loss of 1-3% on the
    # attention kernels (experiments/results/history/epilogue_h100.json, early_scores_*); lazy_rescale: 24.9
    # against 25.3 us
    # P @ V on wgmma (which has no early_scores): 21.1/21.7 against 23.8-24.0 us, interleaved 3 times
    # (one glitched pair; experiments/results/history/wgmma_h100.json, slices_skew_ab3)
    # S and V by TMA in a 3-ring (S in swizzled bands that ldmatrix reads): 20.3/20.4 against 20.9/20.9 us
    # (2-stage TMA 21.5-22.3, 3-stage cp.async 21.6/22.3; experiments/results/history/tma_softmax_gemm_h100.json)
    "softmax_gemm": (lambda: W.softmax_gemm(4096, 4096, 64, dtype=H), {"m": 64}, "l", 128,
                     TC | {"stages": 3, "slices": 4, "lazy_rescale": True, "mma_row_sums": True, "wgmma": True,
                           "tma": True}),
    "layernorm": (lambda: P.residual_layernorm(16384, 4096, H), {"m": 1}, "n", 4096, {"lanes": 256, "vector": 8}),
    # warpgroup MMA (wgmma) from 128 B-swizzled tiles: 262.5-263.7 us against 442-452 for mma.sync (step
    # 32, 4 stages); 128 x 256 tiles on two warpgroups 268.5-269.8 (experiments/results/history/wgmma_h100.json)
    # its tiles loaded by TMA (tensor maps, mbarriers): 253.2 us against 265.6-269.5 with cp.async, twice
    # interleaved (experiments/results/history/tma_h100.json)
    # a producer warpgroup feeding a 4-slot TMA ring, 128 x 256 tiles on two MMA warpgroups, one persistent
    # block per SM (the H100's 132): 220.2/221.2 us against 249.0/250.1 for the 128 x 128 TMA schedule,
    # interleaved twice; the plain GEMM 202.8 against 243.4 (experiments/results/history/producer_h100.json).
    # The sigmoid on tanh.approx (fast_math, one SFU op an element): 206.4/209.3 against 219.9/220.8 us, the
    # plain GEMM 201.4/201.1, the max error against torch the same (2.7e-4); two MMA warpgroups taking turns
    # (pingpong, 64 x 256 tiles): 208.9/216.1 (experiments/results/history/fast_math_h100.json)
    "gemm_sigmoid": (lambda: P.gemm_epilogue(8192, 8192, 1024, "sigmoid", True, H), {"m": 128, "n": 256}, "k", 64,
                     TC | {"stages": 4, "warps": 8, "wgmma": True, "tma": True, "producer": True, "persistent": 132,
                           "fast_math": True}),
    # 32 row tiles only: 4 blocks per row tile each take 1/4 of the KV steps, the last merges; the
    # tuner's best of 48 measured (experiments/tuning/raw/attention_decode_round*.json)
    "mha_decode": (lambda: P.attention(1, 32, 64, 8192, 128, dtype=H), {"m": 64}, "l", 32,
                   TC | {"stages": 3, "slices": 4, "mma_row_sums": True}),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args(argv)
    for key, (mk, tiles, serial, step, opts) in SCHEDULES.items():
        if args.only and key not in args.only:
            continue
        t0 = time.perf_counter()
        lower_to(make_schedule(mk(), tiles, serial=serial, step=step, **opts), args.out / key, t0)
    return 0


def lower_to(s, folder: Path, t0: float) -> None:
    """Build ``s`` for CUDA into ``folder`` and say what came out (``t0``: when its work began)."""
    art = build(s, "cuda")
    art.save(folder)
    print(f"{folder.name}: {art.meta.get('lowering', 'cuda-core')}, grid {art.meta['grid'][0]} x "
          f"{art.meta['block'][0]} threads, {s.num_steps} steps of {s.step}, {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    raise SystemExit(main())
