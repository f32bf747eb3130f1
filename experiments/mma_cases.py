"""The warp-tile cases (tensor-core schedules of attention, GEMM + epilogue, convolutions, masks): the test cases of
``tests/test_mma.py`` and the kernels ``experiments/make_case_artefacts.py`` lowers to CUDA artefacts.

Kept here, not in the tests, so that the experiment scripts need not import ``tests`` (the layer rules forbid it);
the tests import it from here.
"""

from __future__ import annotations

from smg.fold import fold_dims
from spacefusion.api import Schedule, gated_gemm, patterns, schedule, workloads

MASK_PADDING = patterns.ScoreMod("Piecewise(({s}, Mask > 0.5), (-1e30, True))", (("Mask", ("b", "l")),),
                                zero_v="Mask")
MASK_BIAS = patterns.ScoreMod("{s} + Bias", (("Bias", ("h", "r", "m", "l")),))
MASK_ALIBI = patterns.ScoreMod("{s} + Slope*(l - m)", (("Slope", ("h",)),))
MASK_SOFTCAP = patterns.ScoreMod("5.0*tanh({s}/5.0)")
#: a sliding window's far edge (with causal: Mistral's), and a band far right of the diagonal (a lower bound
#: that empties the first slices)
MASK_WINDOW = patterns.ScoreMod("Piecewise(({s}, m - l < 100), (-1e30, True))")
MASK_FAR = patterns.ScoreMod("Piecewise(({s}, l - m > 600), (-1e30, True))")

CASES = {
    "attention": (lambda: patterns.attention(2, 3, 70, 90, 64), {"m": 32}, 32, 2),
    "causal": (lambda: patterns.attention(1, 2, 100, 100, 64, causal=True), {"m": 32}, 16, 1),
    "gqa_d80": (lambda: patterns.attention(1, 8, 50, 60, 80, kv_heads=2), {"m": 16}, 16, 2),
    "bf16": (lambda: patterns.attention(1, 4, 128, 128, 64, dtype="bfloat16"), {"m": 64}, 64, 3),
    "softmax_gemm": (lambda: workloads.softmax_gemm(100, 136, 32), {"m": 32}, 32, 2),
    "gemm_sigmoid": (lambda: patterns.gemm_epilogue(200, 200, 96, "sigmoid", True, "float16"),
                     {"m": 64, "n": 64}, 32, 2),
    # warp groups splitting the serial steps, merged through the derived carries
    "causal_split4": (lambda: patterns.attention(1, 2, 200, 200, 64, causal=True), {"m": 64}, 32, 2, {"split": 4}),
    "mt2_split2": (lambda: patterns.attention(1, 2, 128, 256, 64), {"m": 128}, 32, 2, {"split": 2, "warps": 4}),
    "softmax_gemm_split4": (lambda: workloads.softmax_gemm(100, 296, 64), {"m": 32}, 32, 2, {"split": 4}),
    # blocks slicing the serial steps, the last of a row tile merging from the global workspace
    "causal_slices4": (lambda: patterns.attention(1, 2, 200, 200, 64, causal=True), {"m": 64}, 32, 2,
                       {"slices": 4}),
    "softmax_gemm_slices3": (lambda: workloads.softmax_gemm(100, 296, 64), {"m": 32}, 32, 2, {"slices": 3}),
    "decode_slices8": (lambda: patterns.attention(1, 4, 16, 1024, 128), {"m": 16}, 64, 2, {"slices": 8}),
    # Q re-read from shared memory every step: two 16-row tiles per warp at d = 128; with a mask and tails
    "mt2_reload_d128": (lambda: patterns.attention(1, 2, 128, 192, 128), {"m": 128}, 32, 2,
                        {"warps": 4, "reload_a": True}),
    "causal_reload": (lambda: patterns.attention(1, 2, 100, 120, 64, causal=True), {"m": 64}, 32, 3,
                      {"warps": 2, "reload_a": True}),
    # K waited for apart from V (two cp.async groups per step); with tails and a 3-stage ring
    "causal_early": (lambda: patterns.attention(1, 2, 100, 120, 64, causal=True), {"m": 32}, 32, 3,
                     {"early_scores": True}),
    "softmax_gemm_early": (lambda: workloads.softmax_gemm(100, 136, 32), {"m": 32}, 32, 2, {"early_scores": True}),
    # the row max kept as a reference while within ln 256 (no rescale that step); split merges too
    "causal_lazy": (lambda: patterns.attention(1, 2, 100, 120, 64, causal=True), {"m": 64}, 32, 2,
                    {"warps": 2, "reload_a": True, "lazy_rescale": True}),
    "softmax_gemm_lazy_split2": (lambda: workloads.softmax_gemm(100, 296, 64), {"m": 32}, 32, 2,
                                 {"split": 2, "lazy_rescale": True}),
    # the row sum of P as P @ 1 on tensor cores: with a mask and tails, two tiles per warp, slices
    "causal_rowsums": (lambda: patterns.attention(1, 2, 100, 120, 64, causal=True), {"m": 64}, 32, 2,
                       {"warps": 2, "reload_a": True, "lazy_rescale": True, "mma_row_sums": True}),
    "softmax_gemm_rowsums_slices3": (lambda: workloads.softmax_gemm(100, 296, 64), {"m": 32}, 32, 2,
                                     {"slices": 3, "mma_row_sums": True}),
    # warp groups inside blocks that slice the steps: every group's part goes to the workspace
    "softmax_gemm_split2_slices3": (lambda: workloads.softmax_gemm(100, 296, 64), {"m": 32}, 32, 2,
                                    {"split": 2, "slices": 3, "lazy_rescale": True, "mma_row_sums": True}),
    "causal_split2_slices2": (lambda: patterns.attention(1, 2, 200, 200, 64, causal=True), {"m": 64}, 32, 2,
                              {"split": 2, "slices": 2}),
    # the plain GEMM on warpgroup MMA from core-matrix layouts: row and column tails, bf16 at N = 256
    "gemm_sigmoid_wgmma": (lambda: patterns.gemm_epilogue(200, 200, 128, "sigmoid", True, "float16"),
                           {"m": 128, "n": 64}, 64, 2, {"wgmma": True}),
    "gemm_relu_wgmma_bf16": (lambda: patterns.gemm_epilogue(192, 256, 128, "relu", False, "bfloat16"),
                             {"m": 64, "n": 256}, 64, 3, {"wgmma": True}),
    "gemm_sigmoid_wgmma_2wg": (lambda: patterns.gemm_epilogue(200, 320, 192, "sigmoid", True, "float16"),
                               {"m": 128, "n": 256}, 64, 4, {"wgmma": True, "warps": 8}),
    # the same loaded by TMA: row and column tails (zero-filled boxes), bf16 on two warpgroups in a 3-ring
    "gemm_sigmoid_wgmma_tma": (lambda: patterns.gemm_epilogue(200, 200, 128, "sigmoid", True, "float16"),
                               {"m": 128, "n": 64}, 64, 2, {"wgmma": True, "tma": True}),
    "gemm_relu_wgmma_tma_bf16_2wg": (lambda: patterns.gemm_epilogue(200, 320, 192, "relu", True, "bfloat16"),
                                     {"m": 128, "n": 256}, 64, 3, {"wgmma": True, "tma": True, "warps": 8}),
    # a producer warpgroup feeding the TMA ring: persistent over 4 tiles with 3 blocks (one runs two: the
    # ring's phases carry over), tails; bf16 on one MMA warpgroup, one block per tile
    "gemm_sigmoid_ws_persistent": (lambda: patterns.gemm_epilogue(200, 320, 192, "sigmoid", True, "float16"),
                                   {"m": 128, "n": 256}, 64, 2,
                                   {"wgmma": True, "tma": True, "warps": 8, "producer": True, "persistent": 3}),
    "gemm_relu_ws_bf16": (lambda: patterns.gemm_epilogue(200, 200, 128, "relu", False, "bfloat16"),
                          {"m": 64, "n": 128}, 64, 3, {"wgmma": True, "tma": True, "producer": True}),
    # two MMA warpgroups taking turns on alternate tiles: 12 tiles over 5 blocks (up to 3 each), tails
    "gemm_sigmoid_pingpong": (lambda: patterns.gemm_epilogue(200, 320, 192, "sigmoid", True, "float16"),
                              {"m": 64, "n": 128}, 64, 2,
                              {"wgmma": True, "tma": True, "producer": True, "persistent": 5, "pingpong": True}),
    # tanh on tanh.approx.f32 (fast_math), pingpong, a 3-ring
    "gemm_tanh_pingpong_fast_math": (lambda: patterns.gemm_epilogue(200, 320, 192, "tanh", False, "float16"),
                                     {"m": 64, "n": 128}, 64, 3,
                                     {"wgmma": True, "tma": True, "producer": True, "persistent": 5,
                                      "pingpong": True, "fast_math": True}),
    "gemm_sigmoid_fast_math": (lambda: patterns.gemm_epilogue(200, 200, 128, "sigmoid", True, "float16"),
                               {"m": 128, "n": 64}, 64, 2, {"wgmma": True, "fast_math": True}),
    # attention's K and V by TMA: causal with tails (200 rows), d = 128 (two bands each); ViT-like tails
    "causal_wgmma_tma": (lambda: patterns.attention(1, 2, 200, 200, 128, causal=True), {"m": 128}, 64, 2,
                         {"warps": 4, "reload_a": True, "mma_row_sums": True, "wgmma": True, "tma": True}),
    "attention_wgmma_tma": (lambda: patterns.attention(2, 3, 70, 90, 64), {"m": 64}, 32, 3,
                            {"mma_row_sums": True, "wgmma": True, "tma": True}),
    # Softmax-GEMM's S by TMA into swizzled bands that ldmatrix reads through the XOR; tails, slices
    "softmax_gemm_wgmma_tma_slices3": (lambda: workloads.softmax_gemm(100, 296, 64), {"m": 64}, 64, 3,
                                       {"slices": 3, "lazy_rescale": True, "mma_row_sums": True, "wgmma": True,
                                        "tma": True}),
    # attention's P @ V on warpgroup MMA, P in registers: tails; causal, two 64-row halves, d = 128
    "attention_wgmma": (lambda: patterns.attention(2, 3, 70, 90, 64), {"m": 64}, 32, 2, {"wgmma": True}),
    "attention_wgmma_bf16": (lambda: patterns.attention(1, 4, 200, 300, 128, dtype="bfloat16"), {"m": 128}, 64, 2,
                             {"warps": 4, "reload_a": True, "mma_row_sums": True, "wgmma": True}),
    "causal_wgmma_mt2": (lambda: patterns.attention(1, 2, 200, 200, 128, causal=True), {"m": 128}, 64, 2,
                         {"warps": 4, "reload_a": True, "lazy_rescale": True, "mma_row_sums": True, "wgmma": True}),
    # a producer warpgroup feeding attention's K/V ring: causal with tails on two MMA warpgroups (d = 128,
    # Q re-read), a 3-ring with Q held in registers and tails, one MMA warpgroup (no setmaxnreg)
    "causal_ws": (lambda: patterns.attention(1, 2, 200, 200, 128, causal=True), {"m": 128}, 64, 2,
                  {"warps": 8, "reload_a": True, "lazy_rescale": True, "mma_row_sums": True, "wgmma": True,
                   "tma": True, "producer": True}),
    "attention_ws_3ring": (lambda: patterns.attention(2, 3, 200, 90, 64), {"m": 128}, 32, 3,
                           {"warps": 8, "mma_row_sums": True, "wgmma": True, "tma": True, "producer": True}),
    "attention_ws_1wg": (lambda: patterns.attention(2, 3, 70, 90, 64), {"m": 64}, 32, 2,
                         {"lazy_rescale": True, "wgmma": True, "tma": True, "producer": True}),
    "attention_ws_bf16_gqa": (lambda: patterns.attention(1, 4, 200, 300, 128, kv_heads=2, dtype="bfloat16"),
                              {"m": 128}, 128, 2, {"warps": 8, "reload_a": True, "wgmma": True, "tma": True,
                                                    "producer": True}),
    # head dims that are not whole 64-column bands (padded_band): the last band of K, V (and Q) partial,
    # wgmma N = d for P @ V; Q in registers with tails (d = 96), re-read on two 64-row halves (d = 80),
    # causal on two warpgroups (d = 112), K/V by TMA (zero-filled past d), a producer warpgroup (partial
    # output band), bf16
    "attention_wgmma_d96": (lambda: patterns.attention(2, 3, 70, 90, 96), {"m": 64}, 32, 2, {"wgmma": True}),
    "attention_wgmma_d80_mt2": (lambda: patterns.attention(1, 2, 128, 192, 80), {"m": 128}, 64, 2,
                                {"warps": 4, "reload_a": True, "mma_row_sums": True, "wgmma": True}),
    "causal_wgmma_d112_2wg": (lambda: patterns.attention(1, 2, 200, 200, 112, causal=True), {"m": 128}, 64, 2,
                              {"warps": 8, "reload_a": True, "lazy_rescale": True, "mma_row_sums": True,
                               "wgmma": True}),
    "causal_wgmma_tma_d80": (lambda: patterns.attention(1, 2, 200, 200, 80, causal=True), {"m": 128}, 64, 2,
                             {"warps": 4, "reload_a": True, "mma_row_sums": True, "wgmma": True, "tma": True}),
    "causal_ws_d80": (lambda: patterns.attention(1, 2, 200, 200, 80, causal=True), {"m": 128}, 64, 2,
                      {"warps": 8, "reload_a": True, "wgmma": True, "tma": True, "producer": True}),
    "attention_ws_d96_bf16": (lambda: patterns.attention(1, 4, 200, 300, 96, dtype="bfloat16"), {"m": 128}, 64, 2,
                              {"warps": 8, "mma_row_sums": True, "wgmma": True, "tma": True, "producer": True}),
    "attention_wgmma_d112_bf16": (lambda: patterns.attention(2, 3, 70, 90, 112, dtype="bfloat16"), {"m": 64}, 32, 3,
                                  {"reload_a": True, "wgmma": True}),
    # with slices: the arrival flag's static shared memory moves the arena, the swizzled tiles skew to 1 KB
    "decode_wgmma_slices4": (lambda: patterns.attention(1, 4, 70, 1000, 128), {"m": 64}, 64, 3,
                             {"slices": 4, "mma_row_sums": True, "wgmma": True}),
    "softmax_gemm_wgmma_slices3": (lambda: workloads.softmax_gemm(100, 296, 64), {"m": 64}, 32, 2,
                                   {"slices": 3, "lazy_rescale": True, "mma_row_sums": True, "wgmma": True}),
    # GQA decoding: the query group as the rows of one padded 16-row tile, folded into m (smg.fold) or as
    # the row dim r itself; slices of the KV steps; two queries per head on a padded warpgroup (wgmma)
    "gqa_decode_fold_slices4": (lambda: fold_dims(patterns.attention(2, 8, 1, 300, 128, kv_heads=2), "r", "m"),
                                {"m": 16}, 32, 2, {"slices": 4}),
    "gqa_decode_rows_r": (lambda: patterns.attention(2, 8, 1, 300, 128, kv_heads=2), {"r": 16, "m": 1}, 64, 2,
                          {"slices": 2}),
    "gqa_spec_fold_wgmma": (lambda: fold_dims(patterns.attention(1, 8, 3, 200, 64, kv_heads=2), "r", "m"),
                            {"m": 64}, 32, 2, {"slices": 2, "wgmma": True}),
    # LLaMA's gated MLP input silu(X @ Wg) * (X @ Wu): two GEMM states over one A tile on wgmma, each its
    # own B tile per ring slot and accumulator. cp.async on one warpgroup's two 64-row halves with a row
    # tail in a 3-ring; two warpgroups with row and column tails (N 320 on 128-column tiles)
    "gemm_gated_wgmma": (lambda: gated_gemm(200, 320, 192, "silu", "float16"), {"m": 128, "n": 64}, 64, 3,
                         {"wgmma": True}),
    "gemm_gated_wgmma_2wg": (lambda: gated_gemm(200, 320, 192, "silu", "float16"), {"m": 128, "n": 128}, 64, 2,
                             {"wgmma": True, "warps": 8}),
    # by TMA (X's band and both B tiles counted by one mbarrier per slot): a 64-row tile, bf16, tails
    "gemm_gated_wgmma_tma_bf16": (lambda: gated_gemm(200, 320, 192, "silu", "bfloat16"), {"m": 64, "n": 128}, 64,
                                  3, {"wgmma": True, "tma": True}),
    # a producer warpgroup loading all three tiles of a slot: one block per tile (the LLaMA pick's structure),
    # persistent over 6 tiles with 4 blocks and GELU's gate (GEGLU), pingpong in bf16 over 12 tiles with 5 blocks
    "gemm_gated_ws": (lambda: gated_gemm(200, 320, 192, "silu", "float16"), {"m": 128, "n": 128}, 64, 4,
                      {"wgmma": True, "tma": True, "warps": 8, "producer": True}),
    "gemm_gated_gelu_ws_persistent": (lambda: gated_gemm(200, 320, 256, "gelu", "float16"), {"m": 128, "n": 128},
                                      64, 3, {"wgmma": True, "tma": True, "warps": 8, "producer": True,
                                              "persistent": 4}),
    # diffusers' GEGLU: both halves of one linear with their biases (bg, bu) added before the gate's GELU
    "gemm_gated_bias_gelu_wgmma": (lambda: gated_gemm(200, 320, 192, "gelu", "float16", bias=True),
                                   {"m": 128, "n": 64}, 64, 3, {"wgmma": True}),
    "gemm_gated_bias_gelu_ws": (lambda: gated_gemm(200, 320, 256, "gelu", "float16", bias=True),
                                {"m": 128, "n": 128}, 64, 3,
                                {"wgmma": True, "tma": True, "warps": 8, "producer": True}),
    "gemm_gated_pingpong_bf16": (lambda: gated_gemm(200, 320, 192, "silu", "bfloat16"), {"m": 64, "n": 128}, 64, 2,
                                 {"wgmma": True, "tma": True, "producer": True, "persistent": 5, "pingpong": True}),
    # blocks slicing the k steps (what the search offers a grid smaller than the SMs): both accumulators'
    # partials merged from the workspace
    # TMA rings in blocks slicing the k steps (a deep GEMM with a small output: BERT's FFN output): each
    # block's tensor-map coordinates start at its first step; uneven slices (7 steps in 3), a stacked GEMM
    "gemm_wgmma_tma_slices2": (lambda: patterns.gemm_epilogue(200, 320, 512, "none", True, dtype="float16"),
                               {"m": 128, "n": 128}, 64, 3, {"wgmma": True, "tma": True, "slices": 2, "warps": 8}),
    "gemm_wgmma_tma_slices3_gelu": (lambda: patterns.gemm_epilogue(100, 192, 448, "gelu", True, dtype="float16"),
                                    {"m": 64, "n": 64}, 64, 4, {"wgmma": True, "tma": True, "slices": 3}),
    "gemm_gated_tma_slices2": (lambda: gated_gemm(200, 320, 256, "silu", "float16"), {"m": 128, "n": 64}, 64, 2,
                               {"wgmma": True, "tma": True, "slices": 2}),
    # GPT-2's gelu_new in the epilogue: tanh by ``tanh_fast`` (16-bit output, fast_math off), tails
    "gemm_wgmma_gelu_tanh": (lambda: patterns.gemm_epilogue(200, 320, 192, "gelu_tanh", True, dtype="float16"),
                             {"m": 128, "n": 64}, 64, 2, {"wgmma": True, "tma": True}),
    "gemm_stacked_tma_slices4": (lambda: patterns.gemm_epilogue(64, 128, 512, "none", False, "float16", stack=2),
                                 {"m": 64, "n": 128}, 64, 2, {"wgmma": True, "tma": True, "slices": 4}),
    "gemm_gated_wgmma_slices2": (lambda: gated_gemm(200, 320, 256, "silu", "float16"), {"m": 128, "n": 64}, 64, 2,
                                 {"wgmma": True, "slices": 2}),
    # Q/K/V projections as one stacked GEMM (Y[t, m, n], X broadcast along t, each t a block coordinate):
    # wgmma + TMA (B's 3-d tensor map) with bias and row/column tails, mma.sync with GELU, a producer in bf16
    "gemm_stacked_wgmma_tma": (lambda: patterns.gemm_epilogue(200, 192, 128, "none", True, "float16", stack=3),
                               {"m": 64, "n": 64}, 64, 3, {"wgmma": True, "tma": True}),
    "gemm_stacked_gelu_tails": (lambda: patterns.gemm_epilogue(100, 160, 96, "gelu", True, "float16", stack=2),
                                {"m": 64, "n": 64}, 32, 2),
    "gemm_stacked_ws_bf16": (lambda: patterns.gemm_epilogue(256, 256, 192, "none", False, "bfloat16", stack=3),
                             {"m": 128, "n": 128}, 64, 3, {"wgmma": True, "tma": True, "warps": 8, "producer": True}),
    # attention over the projections' own layout (layout="bshd": Q/O [b, s, h, d], rows h * d apart): every
    # block one (batch, head); mma.sync with tails, GQA (Q [b, m, kv head, member, d]), causal with split
    # groups, wgmma + TMA (K/V tensor maps in (d, l, h, b) order), d = 80 on wgmma, a producer warpgroup,
    # slices, and a GQA decoder's query group as the row dim
    "bshd_attention": (lambda: patterns.attention(2, 3, 70, 90, 64, layout="bshd"), {"m": 32, "h": 1}, 32, 2),
    "bshd_gqa": (lambda: patterns.attention(1, 8, 50, 60, 64, kv_heads=2, layout="bshd"),
                 {"m": 16, "h": 1, "r": 1}, 16, 2),
    "bshd_causal_split2": (lambda: patterns.attention(1, 2, 100, 120, 64, causal=True, layout="bshd"),
                           {"m": 64, "h": 1}, 32, 2, {"split": 2, "lazy_rescale": True, "mma_row_sums": True}),
    "bshd_wgmma_tma": (lambda: patterns.attention(2, 3, 70, 90, 64, layout="bshd"), {"m": 64, "h": 1}, 32, 3,
                       {"mma_row_sums": True, "wgmma": True, "tma": True}),
    "bshd_wgmma_d80": (lambda: patterns.attention(1, 2, 128, 192, 80, layout="bshd"), {"m": 128, "h": 1}, 64, 2,
                       {"warps": 4, "reload_a": True, "mma_row_sums": True, "wgmma": True}),
    "bshd_gqa_causal_wgmma_tma_d80": (lambda: patterns.attention(1, 8, 200, 200, 80, kv_heads=2, causal=True,
                                                                  layout="bshd"),
                                      {"m": 128, "h": 1, "r": 1}, 64, 2,
                                      {"warps": 4, "reload_a": True, "mma_row_sums": True, "wgmma": True,
                                       "tma": True}),
    "bshd_causal_ws": (lambda: patterns.attention(1, 2, 200, 200, 128, causal=True, layout="bshd"),
                       {"m": 128, "h": 1}, 64, 2, {"warps": 8, "reload_a": True, "lazy_rescale": True,
                                                   "mma_row_sums": True, "wgmma": True, "tma": True,
                                                   "producer": True}),
    "bshd_decode_slices8": (lambda: patterns.attention(1, 4, 16, 1024, 128, layout="bshd"), {"m": 16, "h": 1},
                            64, 2, {"slices": 8}),
    "bshd_gqa_decode_rows_r": (lambda: patterns.attention(2, 8, 1, 300, 128, kv_heads=2, layout="bshd"),
                               {"r": 16, "m": 1, "h": 1}, 64, 2, {"slices": 2}),
    # score mods (issue 27): a padding mask read per column from global memory, a full bias staged in the ring,
    # ALiBi's index expression, soft-capping; with tails, GQA, causal, wgmma/TMA
    "mask_padding": (lambda: patterns.attention(2, 3, 70, 90, 64, mods=(MASK_PADDING,)), {"m": 32}, 32, 2),
    "mask_bias_bshd_gqa": (lambda: patterns.attention(1, 8, 50, 64, 64, kv_heads=2, layout="bshd",
                                                      mods=(MASK_BIAS,)), {"m": 16, "h": 1, "r": 1}, 16, 2),
    "mask_alibi_causal": (lambda: patterns.attention(1, 4, 100, 100, 64, causal=True, mods=(MASK_ALIBI,)),
                          {"m": 32}, 16, 1),
    "mask_softcap_wgmma_tma": (lambda: patterns.attention(2, 3, 70, 90, 64, mods=(MASK_SOFTCAP,)), {"m": 64}, 32,
                               3, {"mma_row_sums": True, "wgmma": True, "tma": True}),
    # steps before a window's far edge skipped: on mma.sync, on the producer warpgroup's ring, in slices
    "mask_window_causal": (lambda: patterns.attention(1, 2, 300, 300, 64, causal=True, mods=(MASK_WINDOW,)),
                           {"m": 64}, 32, 2),
    "mask_window_causal_ws": (lambda: patterns.attention(1, 2, 400, 400, 64, causal=True, layout="bshd",
                                                         mods=(MASK_WINDOW,)),
                              {"m": 128, "h": 1}, 64, 2, {"warps": 8, "reload_a": True, "mma_row_sums": True,
                                                          "wgmma": True, "tma": True, "producer": True}),
    "mask_far_band_slices4": (lambda: patterns.attention(1, 2, 64, 1024, 64, mods=(MASK_FAR,)), {"m": 64}, 64, 2,
                              {"slices": 4}),
    # the keys a padding mask drops before each sequence's first kept key and after its last: steps skipped
    # (test_padding_mask_skips_the_steps_of_dropped_keys_on_gpu gives it structured masks)
    "mask_padding_skip": (lambda: patterns.attention(4, 2, 70, 300, 64, mods=(MASK_PADDING,)), {"m": 32}, 32, 2),
    "mask_padding_skip_slices3": (lambda: patterns.attention(4, 2, 70, 300, 64, mods=(MASK_PADDING,)), {"m": 64},
                                  32, 2, {"slices": 3}),
    # head dims that are not multiples of the MMA's k of 16 (issue 28): the contraction run padded (zero
    # columns of Q and K in shared memory, or TMA's zero-filled bands), P @ V over 16 more columns than
    # stored. mma.sync with tails, Q re-read; wgmma causal on two 64-row halves; TMA; a producer
    # warpgroup with GQA; d = 200 in bf16; the projections' own layout (bshd)
    "attention_d40": (lambda: patterns.attention(2, 3, 70, 90, 40), {"m": 64}, 32, 2),
    "attention_d40_reload": (lambda: patterns.attention(2, 3, 70, 90, 40), {"m": 64}, 32, 3,
                             {"warps": 2, "reload_a": True, "lazy_rescale": True}),
    "causal_wgmma_d72_mt2": (lambda: patterns.attention(1, 2, 200, 200, 72, causal=True), {"m": 128}, 64, 2,
                             {"warps": 4, "reload_a": True, "mma_row_sums": True, "wgmma": True}),
    "attention_wgmma_tma_d40": (lambda: patterns.attention(2, 3, 200, 300, 40), {"m": 128}, 64, 2,
                                {"warps": 8, "wgmma": True, "tma": True}),
    "gqa_ws_d24": (lambda: patterns.attention(1, 8, 200, 300, 24, kv_heads=2), {"m": 128}, 64, 2,
                   {"warps": 8, "mma_row_sums": True, "wgmma": True, "tma": True, "producer": True}),
    "attention_wgmma_d200_bf16": (lambda: patterns.attention(1, 2, 100, 130, 200, dtype="bfloat16"), {"m": 64}, 32,
                                  2, {"reload_a": True, "wgmma": True}),
    "bshd_d40": (lambda: patterns.attention(2, 3, 70, 90, 40, layout="bshd"), {"m": 32, "h": 1}, 32, 2),
    # convolutions as implicit GEMMs (issue 28): the im2col tile gathered chunk by chunk, the padding and the
    # rows and columns past the ends zero-filled by cp.async; row tails, a partial last step (c = 40), stride 2
    # with a residual on wgmma, 1x1 in bf16, an Upsample -> Conv read
    "conv3x3_relu": (lambda: patterns.conv2d(2, 10, 12, 32, 64, 3, 1, 1, "relu", dtype="float16"),
                     {"m": 64, "co": 64}, 32, 3),
    "conv3x3_c40_tail": (lambda: patterns.conv2d(1, 9, 7, 40, 32, 3, 1, 1, "none", dtype="float16"),
                         {"m": 32, "co": 32}, 32, 2),
    "conv3x3_s2_res_wgmma": (lambda: patterns.conv2d(2, 9, 9, 64, 64, 3, 2, 1, "relu", residual=True,
                                                     dtype="float16"), {"m": 64, "co": 64}, 64, 3,
                             {"warps": 4, "wgmma": True}),
    "conv1x1_bf16": (lambda: patterns.conv2d(2, 7, 7, 64, 128, 1, 1, 0, "none", dtype="bfloat16"),
                     {"m": 32, "co": 64}, 32, 2),
    "conv_up2_silu": (lambda: patterns.conv2d(1, 6, 6, 32, 64, 3, 1, 1, "silu", upsample=2, dtype="float16"),
                      {"m": 64, "co": 64}, 32, 2),
    # the gathered tile by TMA in im2col mode: tiles straddling image rows and images, the padding and the rows
    # past the end zero-filled by the copy engine; two 64-channel bands a tap; a 5x5 window under a producer
    # warpgroup with persistent blocks taking turns (pingpong)
    "conv3x3_res_im2col": (lambda: patterns.conv2d(2, 9, 11, 128, 64, 3, 1, 1, "relu", residual=True,
                                                   dtype="float16"), {"m": 64, "co": 64}, 64, 3,
                           {"warps": 4, "wgmma": True, "tma": True}),
    "conv5x5_im2col_pingpong": (lambda: patterns.conv2d(2, 12, 10, 64, 128, 5, 1, 2, "silu", dtype="float16"),
                                {"m": 64, "co": 128}, 64, 3,
                                {"wgmma": True, "tma": True, "producer": True, "persistent": 3, "pingpong": True}),
    # strided windows by TMA im2col (the map's traversal stride): a 3x3/2 whose odd image leaves a last input
    # row and column unread, and ResNet's 1x1/2 downsampling under a producer warpgroup
    "conv3x3_s2_res_im2col": (lambda: patterns.conv2d(2, 13, 11, 128, 64, 3, 2, 1, "relu", residual=True,
                                                      dtype="float16"), {"m": 64, "co": 64}, 64, 3,
                              {"warps": 4, "wgmma": True, "tma": True}),
    "conv1x1_s2_im2col_producer": (lambda: patterns.conv2d(2, 14, 14, 64, 128, 1, 2, 0, "none", dtype="float16"),
                                   {"m": 64, "co": 128}, 64, 3, {"wgmma": True, "tma": True, "producer": True}),
    # an Upsample -> Conv by output parity (merged 2x2 windows of the small image, each parity a block
    # coordinate with its own weights, the output interleaved): rows along an image row's pixels (TMA im2col,
    # the box's first pixel shifted by the parity, a row tile past the row's end) and along a column of rows
    "upconv_parity_im2col": (lambda: patterns.upsample_conv2d(2, 5, 12, 128, 64, 3, 1, "silu", residual=True,
                                                              dtype="float16"),
                             {"nh": 1, "a": 1, "b": 1, "j": 64, "co": 64}, 64, 3, {"warps": 4, "wgmma": True,
                                                                                    "tma": True}),
    "upconv_parity_rows_nh": (lambda: patterns.upsample_conv2d(2, 9, 3, 64, 32, 3, 1, "none", dtype="float16"),
                              {"nh": 16, "a": 1, "b": 1, "j": 1, "co": 32}, 32, 2),
    # nn.Linear's weight as stored, B [n, k] (K-major): ldmatrix without .trans on mma.sync, wgmma's B not
    # transposed; tails, bf16, TMA's [64, n_tile] boxes, a producer warpgroup, a gated and a stacked GEMM
    "gemm_nk_sigmoid": (lambda: patterns.gemm_epilogue(200, 200, 96, "sigmoid", True, "float16", b_layout="nk"),
                        {"m": 64, "n": 64}, 32, 2),
    "gemm_nk_relu_wgmma_bf16": (lambda: patterns.gemm_epilogue(192, 256, 128, "relu", False, "bfloat16", "nk"),
                                {"m": 64, "n": 256}, 64, 3, {"wgmma": True}),
    "gemm_nk_wgmma_tma_2wg": (lambda: patterns.gemm_epilogue(200, 320, 192, "sigmoid", True, "float16", "nk"),
                              {"m": 128, "n": 256}, 64, 3, {"wgmma": True, "tma": True, "warps": 8}),
    "gemm_nk_ws_persistent": (lambda: patterns.gemm_epilogue(200, 320, 192, "none", True, "float16", "nk"),
                              {"m": 128, "n": 128}, 64, 3, {"wgmma": True, "tma": True, "warps": 8, "producer": True,
                                                           "persistent": 3}),
    "gemm_gated_nk_wgmma_tma": (lambda: gated_gemm(200, 320, 192, "silu", "float16", "nk"), {"m": 64, "n": 128}, 64,
                                3, {"wgmma": True, "tma": True}),
    "gemm_stacked_nk_gelu": (lambda: patterns.gemm_epilogue(100, 160, 96, "gelu", True, "float16", "nk", stack=2),
                             {"m": 64, "n": 64}, 32, 2),
    # RMSNorm as the prologue of the next GEMM (``norm="rmsnorm"``): the rows' sum of squares read from the
    # GEMM's A tile, 1/rms applied after the loop, the output columns cut (each block recomputes its rows'
    # statistics). mma.sync with tails; wgmma's ss form (ldmatrix beside the async wgmmas) by cp.async, by
    # TMA in slices, under a producer warpgroup, persistent with pingpong; the norm's weight kept apart
    # (its factor G * X computed in registers: wgmma's rs form), W [k, n]; a gated GEMM; decoding rows
    "gemm_rms_nk": (lambda: patterns.gemm_epilogue(200, 320, 200, "none", False, "float16", "nk", norm="rmsnorm"),
                    {"m": 64, "n": 64}, 32, 2, {"recompute": True}),
    "gemm_rms_nk_wgmma": (lambda: patterns.gemm_epilogue(200, 320, 256, "none", True, "float16", "nk",
                                                         norm="rmsnorm"),
                          {"m": 128, "n": 64}, 64, 3, {"wgmma": True, "recompute": True}),
    "gemm_rms_nk_wgmma_tma_slices2": (lambda: patterns.gemm_epilogue(200, 320, 512, "silu", False, "bfloat16", "nk",
                                                                     norm="rmsnorm"),
                                      {"m": 64, "n": 128}, 64, 3,
                                      {"wgmma": True, "tma": True, "slices": 2, "recompute": True}),
    "gemm_rms_nk_ws": (lambda: patterns.gemm_epilogue(200, 320, 256, "none", False, "float16", "nk", norm="rmsnorm"),
                       {"m": 128, "n": 128}, 64, 3, {"wgmma": True, "tma": True, "warps": 8, "producer": True,
                                                    "recompute": True}),
    "gemm_rms_nk_pingpong": (lambda: patterns.gemm_epilogue(200, 320, 192, "none", True, "float16", "nk",
                                                            norm="rmsnorm"),
                             {"m": 64, "n": 128}, 64, 2, {"wgmma": True, "tma": True, "producer": True,
                                                         "persistent": 5, "pingpong": True, "recompute": True}),
    "gemm_rms_weight_nk_rs": (lambda: patterns.gemm_epilogue(200, 320, 200, "none", False, "float16", "nk",
                                                             norm="rmsnorm", norm_weight=True),
                              {"m": 64, "n": 64}, 32, 2, {"wgmma": True, "recompute": True}),
    "gemm_rms_weight_kn": (lambda: patterns.gemm_epilogue(200, 320, 192, "none", False, "float16", "kn",
                                                          norm="rmsnorm", norm_weight=True),
                           {"m": 64, "n": 64}, 32, 2, {"recompute": True}),
    "gemm_gated_rms_nk_wgmma": (lambda: gated_gemm(200, 320, 192, "silu", "float16", "nk", norm="rmsnorm"),
                                {"m": 128, "n": 64}, 64, 3, {"wgmma": True, "recompute": True}),
    # the LLaMA-2-7B pick's structure for its gate/up GEMM: two MMA warpgroups fed by a producer, persistent
    "gemm_gated_rms_nk_ws_persistent": (lambda: gated_gemm(200, 320, 256, "silu", "float16", "nk", norm="rmsnorm"),
                                        {"m": 128, "n": 128}, 64, 3,
                                        {"wgmma": True, "tma": True, "warps": 8, "producer": True, "persistent": 3,
                                         "recompute": True}),
    "gemm_stacked_rms_nk_ws": (lambda: patterns.gemm_epilogue(200, 192, 256, "none", True, "bfloat16", "nk", stack=3,
                                                              norm="rmsnorm"),
                               {"m": 128, "n": 64}, 64, 3, {"wgmma": True, "tma": True, "warps": 8, "producer": True,
                                                           "recompute": True}),
    "gemm_rms_nk_decode": (lambda: patterns.gemm_epilogue(8, 320, 256, "none", True, "float16", "nk", norm="rmsnorm"),
                           {"m": 16, "n": 64}, 32, 2, {"slices": 2, "recompute": True}),
    "gemm_rms_nk_decode_wgmma": (lambda: patterns.gemm_epilogue(8, 320, 256, "none", False, "float16", "nk",
                                                                norm="rmsnorm"),
                                 {"m": 64, "n": 64}, 64, 2, {"wgmma": True, "recompute": True}),
}


def _schedule(name: str) -> Schedule:
    mk, tiles, step, stages, *kw = CASES[name]
    serial = "k" if name.startswith(("gemm", "conv", "upconv")) else "l"
    return schedule(mk(), tiles=tiles, serial=serial, step=step, tensor_cores=True, stages=stages,
                    **(kw[0] if kw else {}))
