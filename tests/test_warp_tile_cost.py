"""The per-step model of tensor-core warp-tile programs (``search.warp_tile_cost``) on its own."""

from __future__ import annotations

import pytest

from schedulers.hardware import H100
from schedulers.schedule import make_schedule
from search.cost import estimate_us
from search.warp_tile_cost import step_cost
from smg import patterns as P

H = "float16"


def _attn(b: int = 8, stages: int = 2, **opts):
    return make_schedule(P.attention(b, 12, 512, 512, 64, dtype=H), {"m": 128}, serial="l", step=64,
                         tensor_cores=True, stages=stages, warps=4, **opts)


def test_one_stage_exposes_the_load_latency() -> None:
    one, two = step_cost(_attn(stages=1), H100), step_cost(_attn(stages=2), H100)
    assert one.latency_s > two.latency_s
    assert one.units == two.units  # the same work per step


def test_wgmma_runs_the_tensor_work_faster() -> None:
    sync, wg = step_cost(_attn(), H100), step_cost(_attn(wgmma=True), H100)
    assert wg.tensor_s < sync.tensor_s
    assert wg.smem_s < sync.smem_s  # a 64-row half reads each tile once, not every warp
    assert estimate_us(_attn(wgmma=True), H100) < estimate_us(_attn(), H100)


def test_a_producer_warpgroup_and_a_persistent_grid_run_faster() -> None:
    """A producer warpgroup drops the block barrier and keeps the tensor pipe fed; a persistent
    block has the next tile's loads under way during the epilogue (and no partial last wave)."""
    g = P.gemm_epilogue(8192, 8192, 1024, "sigmoid", True, H)

    def gemm(**opts):
        return make_schedule(g, {"m": 128, "n": 256}, serial="k", step=64, tensor_cores=True, stages=4, warps=8,
                             wgmma=True, tma=True, **opts)

    plain, ws, pers = gemm(), gemm(producer=True), gemm(producer=True, persistent=132)
    a, b = step_cost(plain, H100), step_cost(ws, H100)
    assert b.tensor_s < a.tensor_s and b.latency_s < a.latency_s
    assert estimate_us(pers, H100) < estimate_us(ws, H100) < estimate_us(plain, H100)


def test_fast_math_pays_one_sfu_op_per_sigmoid_or_tanh() -> None:
    from search.warp_tile_cost import TANHF_OPS, _ops
    from smg.expr import parse

    sig, th = parse("1/(1 + exp(-(Y + b)))"), parse("tanh(Y)")
    assert _ops([sig])[1] == 2 and _ops([sig], fast_math=True)[1] == 1
    assert _ops([th]) == (1 + TANHF_OPS, 0) and _ops([th], fast_math=True) == (0, 1)


def test_row_sums_move_the_sum_to_the_tensor_cores() -> None:
    plain, rs = step_cost(_attn(), H100), step_cost(_attn(mma_row_sums=True), H100)
    assert rs.simt_s < plain.simt_s and rs.tensor_s > plain.tensor_s


@pytest.mark.parametrize("b", [1, 4, 16])
def test_more_batches_take_longer(b: int) -> None:
    """Never faster with twice the blocks; as fast while both fit one wave (48 and 96 blocks)."""
    one, two = estimate_us(_attn(b), H100), estimate_us(_attn(2 * b), H100)
    assert one == two if b == 1 else one < two


def test_the_gemm_epilogue_pays_its_exps_once_per_output() -> None:
    g = P.gemm_epilogue(4096, 4096, 1024, "sigmoid", True, H)
    s = make_schedule(g, {"m": 128, "n": 128}, serial="k", step=64, tensor_cores=True, stages=2, wgmma=True)
    c = step_cost(s, H100)
    assert c.sfu_s == 0 and c.simt_s == 0  # nothing element-wise inside the K loop
    plain = make_schedule(P.gemm_epilogue(4096, 4096, 1024, "none", False, H), {"m": 128, "n": 128},
                          serial="k", step=64, tensor_cores=True, stages=2, wgmma=True)
    assert step_cost(plain, H100).fixed_s < c.fixed_s


def test_causal_blocks_run_half_the_steps() -> None:
    """Row tiles of a causal mask stop at their diagonal: 1..32 steps of 64 for 32 row tiles of 64."""
    from schedulers.warp_tile import steps_per_row_tile

    def mk(causal: bool):
        return make_schedule(P.attention(4, 32, 2048, 2048, 128, causal=causal, dtype=H), {"m": 64}, serial="l",
                             step=64, tensor_cores=True, stages=2, warps=4, wgmma=True, reload_a=True)

    causal, full = mk(True), mk(False)
    assert steps_per_row_tile(causal, causal.warp_tile) == list(range(1, 33))
    assert steps_per_row_tile(full, full.warp_tile) == [32] * 32
    ratio = estimate_us(causal, H100) / estimate_us(full, H100)
    assert 0.45 < ratio < 0.6  # half the steps, plus the per-block prologue and epilogue


def test_wgmma_accumulators_beyond_the_register_file_are_charged() -> None:
    """128 x 256 on one warpgroup needs 256 accumulators a thread (estimate 296 registers): on the H100
    it spilled around every wgmma and ran 4.2 ms against 261 us for 128 x 128."""
    from schedulers.resources import block_resources

    g = P.gemm_epilogue(8192, 8192, 1024, "sigmoid", True, H)

    def mk(n: int):
        return make_schedule(g, {"m": 128, "n": n}, serial="k", step=64, tensor_cores=True, stages=2, warps=4,
                             wgmma=True)

    assert block_resources(mk(256)).registers_estimate > 255 >= block_resources(mk(128)).registers_estimate
    assert estimate_us(mk(256), H100) > 5 * estimate_us(mk(128), H100)


def test_a_padded_band_costs_only_the_head_dim_it_holds() -> None:
    """d = 96 on wgmma: K and V sit in whole 128-column bands (padded_band), but only 96 columns are
    loaded and read, so the step's shared-memory and L2 traffic is 3/4 of d = 128's."""
    def cost(d: int):
        g = P.attention(8, 12, 512, 512, d, dtype=H)
        return step_cost(make_schedule(g, {"m": 128}, serial="l", step=64, tensor_cores=True, stages=2, warps=4,
                                       wgmma=True), H100)

    d96, d128 = cost(96), cost(128)
    assert d96.l2_s == pytest.approx(0.75 * d128.l2_s)
    assert d96.smem_s == pytest.approx(0.75 * d128.smem_s)
