#!/usr/bin/env python3
"""Lower the issue-3 fusion patterns to CUDA artefacts for the GPU runner (needs TVM, no GPU).

Usage:  python experiments/make_pattern_artefacts.py OUT_DIR [--only NAME ...] [--small | --mma]

Each artefact is the sm_90a CUDA source, launch metadata and cubin of one schedule; copy OUT_DIR
to the GPU machine and run ``experiments/run_artefacts_gpu.py OUT_DIR/*`` there.  ``--small``
writes verification sizes (tails, multi-dim tiles, cooperative tiles) instead of the issue's
realistic shapes; ``--mma`` writes tensor-core warp-tile kernels (mma.sync/ldmatrix/cp.async),
verification sizes and the issue's MHA/Softmax-GEMM shapes.
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
#: name -> (graph, tiles, step, recompute); the issue's realistic shapes
REALISTIC = {
    "residual_layernorm_16384x4096": (lambda: P.residual_layernorm(16384, 4096, H), {"m": 64}, 64, False),
    "softmax_16384x4096": (lambda: P.softmax(16384, 4096, H), {"m": 64}, 64, False),
    "gemm_sigmoid_8192x8192x1024": (lambda: P.gemm_epilogue(8192, 8192, 1024, "sigmoid", True, H),
                                    {"m": 16, "n": 64}, 32, False),
    "mlp_4096x1024x4096": (lambda: P.mlp(4096, 1024, 4096, 4096, dtype=H), {"m": 16, "n": 64}, 16, True),
    "causal_attention_4x32x2048x128": (lambda: P.attention(4, 32, 2048, 2048, 128, causal=True, dtype=H),
                                       {"m": 64}, 32, False),
    "gqa_4x32q8kv_2048x128": (lambda: P.attention(4, 32, 2048, 2048, 128, kv_heads=8, dtype=H),
                              {"r": 4, "m": 32}, 32, False),
}
#: small sizes that exercise tails, multi-dim block tiles and cooperative (block-shared) tiles
SMALL = {
    "small_residual_layernorm": (lambda: P.residual_layernorm(100, 300, H), {"m": 16}, 64, False),
    "small_softmax": (lambda: P.softmax(100, 300, H), {"m": 16}, 64, False),
    "small_rmsnorm": (lambda: P.rmsnorm(100, 300, H), {"m": 16}, 300, False),
    "small_gemm_sigmoid": (lambda: P.gemm_epilogue(100, 72, 40, "sigmoid", True, H), {"m": 8, "n": 16}, 16, False),
    "small_gemm_silu": (lambda: P.gemm_epilogue(100, 72, 40, "silu", False, H), {"m": 4, "n": 32}, 8, False),
    "small_gemm_layernorm": (lambda: P.gemm_layernorm(64, 256, 64, H), {"m": 16}, 256, False),
    "small_mlp": (lambda: P.mlp(37, 40, 50, 24, dtype=H), {"m": 4, "n": 8}, 8, True),
    "small_causal": (lambda: P.attention(1, 2, 70, 70, 64, causal=True, dtype=H), {"m": 32}, 16, False),
    "small_gqa": (lambda: P.attention(1, 8, 50, 60, 64, kv_heads=2, dtype=H), {"r": 4, "m": 16}, 16, False),
    "small_vae_block": (lambda: P.vae_decoder_block(2, 3, 4, 5, 6, 2, dtype=H), {"n": 2}, 4, False),
    "vae_block_1x16x16_32x32_g4": (lambda: P.vae_decoder_block(1, 16, 16, 32, 32, 4, dtype=H),
                                   {"n": 1, "g": 4}, 8, True),
}

#: tensor-core warp-tile schedules: name -> (graph, tiles, step, make_schedule options)
TC = {"tensor_cores": True}
MMA = {
    "mma_small_attention_tails": (lambda: P.attention(2, 3, 70, 90, 64, dtype=H), {"m": 32}, 32, TC | {"stages": 2}),
    "mma_small_causal": (lambda: P.attention(1, 2, 100, 100, 64, causal=True, dtype=H), {"m": 32}, 16, TC),
    "mma_small_causal_rect": (lambda: P.attention(1, 2, 64, 200, 128, causal=True, dtype=H), {"m": 16}, 32,
                              TC | {"stages": 3}),
    "mma_small_gqa_d80": (lambda: P.attention(1, 8, 50, 60, 80, kv_heads=2, dtype=H), {"m": 16}, 16,
                          TC | {"stages": 2}),
    "mma_small_bf16": (lambda: P.attention(1, 4, 128, 128, 64, dtype="bfloat16"), {"m": 64}, 64, TC | {"stages": 2}),
    "mma_small_softmax_gemm": (lambda: W.softmax_gemm(100, 136, 32, dtype=H), {"m": 32}, 32, TC | {"stages": 2}),
    "mma_small_gemm_sigmoid": (lambda: P.gemm_epilogue(200, 200, 96, "sigmoid", True, H), {"m": 64, "n": 64}, 32,
                               TC | {"stages": 2}),
    "mma_mha_bert": (lambda: P.attention(32, 12, 512, 512, 64, dtype=H), {"m": 64}, 64, TC | {"stages": 2}),
    "mma_mha_vit": (lambda: P.attention(16, 16, 197, 197, 64, dtype=H), {"m": 64}, 64, TC | {"stages": 2}),
    "mma_mha_llama": (lambda: P.attention(4, 32, 2048, 2048, 128, dtype=H), {"m": 64}, 64, TC | {"stages": 2}),
    "mma_causal_llama": (lambda: P.attention(4, 32, 2048, 2048, 128, causal=True, dtype=H), {"m": 64}, 64,
                         TC | {"stages": 2}),
    "mma_softmax_gemm": (lambda: W.softmax_gemm(4096, 4096, 64, dtype=H), {"m": 32}, 128, TC | {"stages": 3}),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--mma", action="store_true")
    args = ap.parse_args(argv)
    table = MMA if args.mma else SMALL if args.small else REALISTIC
    for name, (mk, tiles, step, extra) in table.items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        g = mk()
        serial = "y" if g.name == "vae_decoder_block" else None
        opts = extra if isinstance(extra, dict) else {"recompute": extra}
        if serial is None and args.mma:
            serial = "k" if g.name.startswith("gemm") else "l"
        s = make_schedule(g, tiles, serial=serial, step=step, **opts)
        build(s, "cuda").save(args.out / name)
        print(f"{name}: grid {s.num_blocks} x {s.threads} threads, serial {s.serial} step {s.step} "
              f"({s.num_steps} steps), {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
