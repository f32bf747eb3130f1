"""The lowering's compile-time shortcuts change nothing of what is emitted.

A warp-tile program declares each buffer at the footprint it uses, so the CUDA lowering skips TVM's
``CompactBufferAllocation`` for it (``lower.build._pass_context``'s ``exact_buffers``): the pass's region
analysis was 3.4 of the 4.0 s TVM's pipeline spent on BERT-base's masked attention.  Here the source and the
launch metadata must be the same with the pass and without it, over one case of each family of warp-tile
program: mma.sync (causal), wgmma with TMA, a split of the rows, a producer warpgroup, pingpong, a
convolution's implicit GEMM, a norm prologue.
"""

from __future__ import annotations

import pytest

from experiments.mma_cases import _schedule
from spacefusion.lower.build import _compile_lowered, _tvm
from spacefusion.lower.mma import build_warp_tile

#: one case of each family (``experiments.mma_cases``); all 122 warp-tile cases there were checked the same way
#: once (2-core CPU: TVM's pipeline 409 s with the pass, 123 s without; causal attention 4.7 s -> 0.5 s)
CASES = ["causal", "mt2_split2", "attention_wgmma_tma", "gemm_sigmoid_pingpong", "gemm_gated_ws",
         "conv3x3_res_im2col", "gemm_rms_nk_wgmma"]


@pytest.mark.parametrize("name", CASES)
def test_skipping_compact_buffer_allocation_emits_the_same_kernel(name: str) -> None:
    s = _schedule(name)
    assert s.warp_tile is not None
    mod = _tvm().IRModule({"main": build_warp_tile(s, None)})
    full = _compile_lowered(s, mod, "sm_90a", "warp-tile", None, exact_buffers=False)
    fast = _compile_lowered(s, mod, "sm_90a", "warp-tile", None, exact_buffers=True)
    assert fast.source == full.source
    assert fast.meta == full.meta
