"""Tensor-core warp-tile programs: recognition, resources, CUDA emission (mma.sync, ldmatrix,
cp.async), nvcc, and on a GPU the numerics against the float64 numpy reference."""

from __future__ import annotations

import re
import shutil
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.mma_cases import CASES, MASK_PADDING, _schedule
from schedulers.errors import ScheduleError
from schedulers.resources import block_resources
from schedulers.schedule import Schedule
from schedulers.warp_tile import (
    BAND,
    EARLY_SCORES_REGS,
    SWIZZLE_ATOM,
    killing_masks,
    lazy_references,
    mask_bound,
    mbarrier_bytes,
    mma_row_sums,
    split_ring,
    staged_output,
    step_range,
    steps_per_row_tile,
    warp_tile_program,
    warp_tile_smem_bytes,
)
from smg import patterns
from smg.reference import evaluate, reduction_length
from smg.tolerance import assert_close
from smg.workloads import softmax_gemm
from spacefusion.api import build, schedule
from spacefusion.frontend.builders import gated_gemm
from spacefusion.lower.mma import row_tile_order, tile_kept


def test_attention_reads_as_a_warp_tile_program() -> None:
    p = warp_tile_program(_schedule("causal"))
    assert (p.row, p.rows, p.batch, p.serial, p.warps) == ("m", 32, ("b", "h"), "l", 2)
    assert p.gemm is not None and (p.gemm.a, p.gemm.b, p.gemm.k, p.gemm.b_trans) == ("Q", "K", "d", False)
    assert p.score_ops == ("Ss", "Sm") and p.tiles_in == ()
    assert [u.state for u in p.row_states] == ["P_max", "P_sum"]
    (gs,) = p.gemm_states
    assert (gs.x, gs.n, gs.factor) == ("V", "n", "exp(-P_max + Sm)")
    assert p.outputs == (("O", "O/P_sum"),)
    # softmax-GEMM has no score GEMM: its S tile is an input staged in the accumulator layout
    q = warp_tile_program(_schedule("softmax_gemm"))
    assert q.gemm is None and q.tiles_in == ("S",)
    # a GEMM + epilogue: A is the staged row operand, Bw the GEMM state's operand over a cut column dim
    r = warp_tile_program(_schedule("gemm_sigmoid"))
    assert (r.row, r.serial, r.tiles_in, r.row_states) == ("m", "k", ("A",), ())
    assert [(g.x, g.n, g.factor, g.n_tile) for g in r.gemm_states] == [("Bw", "n", "A", 64)]


def test_causal_mask_bound_is_derived_from_the_condition() -> None:
    s = _schedule("causal")
    assert mask_bound(s.smg, s.warp_tile) == (1, -1, 0, False)  # l - m <= 0
    assert mask_bound(_schedule("attention").smg, _schedule("attention").warp_tile) is None


def test_warp_tile_resources_and_json() -> None:
    s = _schedule("bf16")
    r = block_resources(s)
    assert s.threads == r.threads == 128  # 4 warps of 16 rows
    # K and V [64, 64+8] in 3 stages, 2 bytes each, then Q [64, 64+8] (loaded alongside their first tiles)
    assert r.shared_bytes == 2 * (2 * 3 * 64 * 72 + 64 * 72)
    back = Schedule.from_json(s.to_json())
    assert back.stages == 3 and back.tensor_cores and back.key == s.key
    assert "stages" not in schedule(patterns.attention(1, 1, 64, 64, 64), tiles={"m": 64}, step=32).to_dict()


@pytest.mark.parametrize("name, out, stride", [("gemm_sigmoid", "Y", 64 + 8), ("attention", "O", 64 + 8),
                                               ("causal_slices4", "O", 64 + 8), ("mt2_split2", "O", None)])
def test_output_tiles_leave_through_shared_memory_in_16_byte_chunks(name, out, stride) -> None:
    """Accumulator outputs are written to the arena in the mma layout (half2 pairs), then stored as
    whole 16-byte chunks of rows; warp groups (split) keep the per-thread stores (group 0 alone
    stores, so no block-wide barrier); the arena is large enough for the staged tile."""
    s = _schedule(name)
    p = s.warp_tile
    staged = staged_output(s, p, out)
    src = build(s, "cuda").source
    assert (staged[1] if staged else None) == stride
    assert (f"*(uint4*)({out}_ptr" in src) == (stride is not None)
    assert ("make_half2" in src) == (stride is not None)
    if stride is not None:
        assert block_resources(s).shared_bytes >= p.rows * stride * 2


def test_fast_division_only_for_values_stored_in_half_precision() -> None:
    """``__fdividef`` (2 ulp, no slow path) where the value is stored as fp16 on the GPU (warp-tile and
    CUDA-core kernels alike); IEEE division elsewhere: fp32 row statistics and outputs, and LLVM kernels."""
    import sympy as sp
    from tvm import tirx

    from spacefusion.lower.exprs import to_tir

    a, b = sp.symbols("a b")
    load = {"a": tirx.Var("a", "float32"), "b": tirx.Var("b", "float32")}.__getitem__
    assert "__fdividef" in str(to_tir(a / b, load, fast_div=True))
    assert "__fdividef" in str(to_tir(1 / (1 + b), load, fast_div=True))
    assert "__fdividef" not in str(to_tir(a / b, load))
    src = build(_schedule("gemm_sigmoid"), "cuda").source
    assert src.count("__fdividef") == src.count("make_half2") * 2  # one per stored element, pairs
    simt = {dt: build(schedule(patterns.attention(1, 2, 64, 64, 64, dtype=dt), tiles={"m": 32}, step=32),
                      "cuda").source for dt in ("float16", "float32")}
    assert "__fdividef" in simt["float16"] and "__fdividef" not in simt["float32"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(tiles={"m": 24}, step=16), "multiple of 16"),
    (dict(tiles={"m": 48}, step=16, warps=2), "divide the 48-row tile"),
    (dict(tiles={"m": 32}, step=24), "step 24"),
    (dict(tiles={"m": 32}, step=32, lanes=4), "lanes apply to CUDA-core kernels"),
])
def test_warp_tile_refusals_name_the_problem(kwargs, match) -> None:
    with pytest.raises(ScheduleError, match=match):
        schedule(patterns.attention(1, 2, 64, 64, 64), serial="l", tensor_cores=True, **kwargs)


def test_split_groups_threads_rings_and_merge() -> None:
    s = _schedule("causal_split4")
    p = s.warp_tile
    assert p.warp.split == 4 and s.threads == 4 * 4 * 32  # 4 groups of 4 row warps
    # each group its own K and V ring (2 stages of [32, 64+8]), then Q [64, 64+8]; the hand-over of
    # 3 groups: P_max, P_sum (2 rows a thread) and O (8 column tiles x 4) per thread, fp32, is smaller
    assert p.merge_floats() == 2 + 2 + 32
    assert block_resources(s).shared_bytes == max(2 * 2 * 4 * 2 * 32 * 72 + 2 * 64 * 72, 3 * 128 * 36 * 4)
    back = Schedule.from_json(s.to_json())
    assert back.split == 4 and back.key == s.key and "split" not in _schedule("causal").to_dict()


def test_slices_grid_workspace_and_merge() -> None:
    """slices multiply the grid; the kernel takes a partials workspace and per-tile arrival counts
    (scratch params), fences, counts itself done with atomicAdd and merges from L2 (__ldcg)."""
    s = _schedule("softmax_gemm_slices3")
    p = s.warp_tile
    assert s.num_blocks == 4 * 3 and p.warp.slices == 3 and p.threads == 64
    art = build(s, "cuda")
    params = {q["name"]: q for q in art.meta["params"]}
    assert params["sf_partials"] == {"name": "sf_partials", "shape": [12, p.merge_floats(), 64],
                                     "dtype": "float32", "role": "scratch"}
    assert params["sf_arrivals"]["shape"] == [4] and params["sf_arrivals"]["role"] == "scratch"
    src = art.source
    assert "atomicAdd" in src and "__ldcg" in src and src.count("__threadfence()") == 2
    assert art.meta["grid"] == [12, 1, 1]
    back = Schedule.from_json(s.to_json())
    assert back.slices == 3 and back.key == s.key
    assert "slices" not in _schedule("softmax_gemm").to_dict()  # absent at the default: old keys hold


def test_cost_model_prefers_slices_only_for_small_grids() -> None:
    """32 row tiles of decoding attention leave 100 SMs idle: slices win in the analytical model
    (measured on the H100: 172 -> 76 us); BERT's 3072 row tiles only pay for the partials."""
    from schedulers.hardware import H100
    from search.cost import estimate_us

    def us(g, sl: int) -> float:
        return estimate_us(schedule(g, tiles={"m": 64}, step=64, tensor_cores=True, stages=2, slices=sl), H100)

    decode = patterns.attention(1, 32, 64, 8192, 128, dtype="float16")
    bert = patterns.attention(32, 12, 512, 512, 64, dtype="float16")
    assert us(decode, 8) < 0.5 * us(decode, 1)
    assert us(bert, 4) > us(bert, 1)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"slices": 40}, "slices 40 must be 1..32 blocks"),
    ({"slices": 0}, "slices 0 must be"),
])
def test_slices_refusals(kwargs, match) -> None:
    with pytest.raises(ScheduleError, match=match):
        schedule(softmax_gemm(128, 4096, 64), tiles={"m": 32}, step=64, tensor_cores=True, stages=2, **kwargs)


def test_split_and_slices_leave_every_groups_part_in_the_workspace() -> None:
    """Warp groups in blocks that slice the steps: each group's part goes to the global workspace
    (none through the arena), and group 0 of the last block merges slices x groups parts."""
    s = _schedule("softmax_gemm_split2_slices3")
    p = s.warp_tile
    art = build(s, "cuda")
    shapes = {q["name"]: q["shape"] for q in art.meta["params"]}
    tiles = -(-100 // 32)
    assert shapes["sf_partials"] == [tiles * 3 * 2, p.merge_floats(), 32 * p.warps]
    assert art.meta["block"] == [64 * 2, 1, 1] and art.meta["grid"] == [tiles * 3, 1, 1]
    plain = schedule(s.smg, tiles=s.tiles, serial=s.serial, step=s.step, tensor_cores=True, stages=2, slices=3,
                     lazy_rescale=True, mma_row_sums=True)
    assert art.meta["dynamic_smem_bytes"] == 2 * build(plain, "cuda").meta["dynamic_smem_bytes"]  # two rings


def test_slices_need_tensor_cores_and_steps() -> None:
    with pytest.raises(ScheduleError, match="apply to tensor-core warp-tile kernels"):
        schedule(softmax_gemm(128, 256, 64), tiles={"m": 32}, step=64, slices=2)
    with pytest.raises(ScheduleError, match="at most the 2 steps"):
        schedule(softmax_gemm(128, 128, 64), tiles={"m": 32}, step=64, tensor_cores=True, slices=4)


def test_split_refusals() -> None:
    with pytest.raises(ScheduleError, match="split 3 must be"):
        schedule(patterns.attention(1, 2, 64, 64, 64), tiles={"m": 32}, step=32, tensor_cores=True, split=3)
    with pytest.raises(ScheduleError, match="split set: .* apply to tensor-core warp-tile kernels"):
        schedule(patterns.attention(1, 2, 64, 64, 64), tiles={"m": 32}, step=32, split=2)


def test_reload_a_keeps_q_in_shared_memory_and_frees_registers() -> None:
    """Q's fragments are read in the loop next to K's, from its tile after the K/V ring, and the
    registers that held them for the whole loop are free."""
    s = _schedule("mt2_reload_d128")
    held = schedule(patterns.attention(1, 2, 128, 192, 128), tiles={"m": 128}, step=32, tensor_cores=True,
                    stages=2, warps=4)
    assert s.warp_tile.warp.reload_a and not held.warp_tile.warp.reload_a and s.warp_tile.warp_mtiles == 2
    ring = 2 * 2 * (32 * (128 + 8)) * 2  # K and V, 2 stages of [32, 128+8] fp16
    q = 128 * (128 + 8) * 2
    assert block_resources(held).shared_bytes == block_resources(s).shared_bytes == ring + q
    # 2 tiles x 128 / 4 = 64 registers of held Q fragments are free (the k slices read in the loop are
    # transient, like K's: warp_tile_registers counts neither): the model's spill (nvcc: 284 bytes at
    # LLaMA's step 64) is gone
    assert block_resources(held).local_floats - block_resources(s).local_floats == 64
    assert block_resources(held).spills and not block_resources(s).spills
    src = build(s, "cuda").source
    loop = src[src.index("for (int"):]  # the A tile's fragments are read inside the step loop
    assert loop.count("ldmatrix.sync.aligned.m8n8.x4.shared") > 0
    back = Schedule.from_json(s.to_json())
    assert back.reload_a and back.key == s.key and back.key != held.key
    assert "reload_a" not in held.to_dict()


def test_summary_names_the_warp_tile_knobs() -> None:
    """``str(schedule)`` (and so Jupyter's text view) says how the tensor-core kernel is laid out."""
    text = str(_schedule("mt2_reload_d128"))
    assert "tensor cores: 4 warps x 2 16-row mma tiles, 2-stage cp.async ring, Q re-read from shared memory" in text
    text = str(_schedule("decode_slices8"))
    assert "Q held in registers, 8 blocks per row tile splitting the steps" in text
    assert "tensor cores" not in str(schedule(patterns.attention(1, 2, 64, 64, 64), tiles={"m": 32}, step=32))


@pytest.mark.parametrize("name, stages", [("causal_early", 3), ("softmax_gemm_early", 2)])
def test_early_scores_waits_for_score_operands_then_the_second_gemms(name, stages) -> None:
    """Two cp.async groups per step: the loop top waits until only V of this step and the later
    steps' groups are pending; before P @ V all but the step just issued are done."""
    s = _schedule(name)
    plain = schedule(s.smg, tiles=s.tiles, serial=s.serial, step=s.step, tensor_cores=True, stages=stages)
    src, before = build(s, "cuda").source, build(plain, "cuda").source
    top, mid = f"wait_group_{2 * (stages - 1) - 1}();", f"wait_group_{2 * (stages - 1)}();"
    assert mid in src[src.index(top):]  # in the step loop, the second after the first
    assert f"wait_group_{stages - 2}();" in before and top not in before
    assert src.count("__syncthreads") > before.count("__syncthreads")
    assert src.count("commit_group();") == 2 * before.count("commit_group();") - (1 if "Q_ptr" in src else 0)
    back = Schedule.from_json(s.to_json())
    assert back.early_scores and back.key == s.key != plain.key and "early_scores" not in plain.to_dict()
    assert "score operands waited for before the second GEMM's" in str(s)
    # the same tiles; the second group's addresses and wait take registers (nvcc corpus: 9-11)
    early, one = block_resources(s), block_resources(plain)
    assert early.shared_bytes == one.shared_bytes and early.threads == one.threads
    assert early.registers_estimate == one.registers_estimate + EARLY_SCORES_REGS


def test_early_scores_refusals() -> None:
    att = patterns.attention(1, 2, 64, 64, 64)
    with pytest.raises(ScheduleError, match="early_scores needs a ring of 2.* stages and no warp groups"):
        schedule(att, tiles={"m": 32}, step=32, tensor_cores=True, early_scores=True)
    with pytest.raises(ScheduleError, match=r"stages 2, split 2\)"):
        schedule(att, tiles={"m": 64}, step=32, tensor_cores=True, stages=2, split=2, early_scores=True)
    with pytest.raises(ScheduleError, match="apply to tensor-core warp-tile kernels"):
        schedule(att, tiles={"m": 32}, step=32, early_scores=True)


def test_search_space_offers_early_scores_with_a_ring_and_no_warp_groups() -> None:
    from schedulers.hardware import H100
    from search.space import SearchSpace

    knobs = [k for k in SearchSpace(softmax_gemm(128, 256, 64), H100, max_step=64).knobs() if k.tensor_cores]
    early = [k for k in knobs if k.early_scores]
    assert early and all(k.stages > 1 and k.split == 1 for k in early)
    assert any(k.stages > 1 and k.split == 1 and not k.early_scores for k in knobs)


def test_lazy_references_are_derived_from_the_carries_and_outputs() -> None:
    """The row max is a reference: its readers rescale by exp(m_old - m_new) and O / l does not
    change with it; with the output O alone (no normalisation) it would, so nothing is lazy."""
    import dataclasses
    import math

    s = _schedule("attention")
    assert lazy_references(s.plan) == {"P_max": pytest.approx(math.log(256))}
    assert lazy_references(_schedule("softmax_gemm").plan) == {"P_max": pytest.approx(math.log(256))}
    assert lazy_references(dataclasses.replace(s.plan, finalize=(("O", "O"),))) == {}
    assert lazy_references(_schedule("gemm_sigmoid").plan) == {}


def test_lazy_rescale_votes_and_skips_the_accumulator_rescale() -> None:
    s = _schedule("causal_lazy")
    plain = schedule(s.smg, tiles=s.tiles, serial=s.serial, step=s.step, tensor_cores=True, stages=2, warps=2,
                     reload_a=True)
    src, before = build(s, "cuda").source, build(plain, "cuda").source
    assert "__any_sync" in src and "__any_sync" not in before
    assert src.count("0x1.62e42fefa39efp+2f") == 2 * 2 * 2  # ln 256, per row (2 tiles x 2) and step copy
    assert "P_max kept within 5.55" in str(s)
    _check_knob(s, plain, "lazy_rescale", "lazy_rescale keeps a running max.*'gemm_sigmoid' has none")


def _check_knob(s: Schedule, plain: Schedule, knob: str, refusal: str) -> None:
    """A boolean knob's schedule reads back from its JSON with its own key, the knob absent from the
    plain schedule's JSON; the sigmoid GEMM (no such state) and CUDA cores refuse it, naming why."""
    back = Schedule.from_json(s.to_json())
    assert getattr(back, knob) and back.key == s.key != plain.key and knob not in plain.to_dict()
    with pytest.raises(ScheduleError, match=refusal):
        schedule(patterns.gemm_epilogue(64, 64, 64, "sigmoid", True, "float16"), tiles={"m": 64, "n": 64},
                 serial="k", step=32, tensor_cores=True, stages=2, **{knob: True})
    with pytest.raises(ScheduleError, match="apply to tensor-core warp-tile kernels"):
        schedule(patterns.attention(1, 2, 64, 64, 64), tiles={"m": 32}, step=32, **{knob: True})


def test_mma_row_sums_are_derived_from_the_gemm_factor() -> None:
    """The row sum whose body is the second GEMM's factor tile (attention's l = sum P) is P @ 1;
    a sum that a GEMM state reads, or one over another tile, is not."""
    import dataclasses

    p = warp_tile_program(_schedule("attention"))
    assert mma_row_sums(p.row_states, p.gemm_states) == {"P_sum": "O"}
    assert p.row_sums == ()  # derived always, used on request
    (u_max, u_sum), (gs,) = p.row_states, p.gemm_states
    other = dataclasses.replace(u_sum, body=f"2*({u_sum.body})")
    assert mma_row_sums((u_max, other), p.gemm_states) == {}
    reads = dataclasses.replace(gs, update=dataclasses.replace(gs.update, carry=f"{gs.update.carry}*P_sum__old"))
    assert mma_row_sums(p.row_states, (reads,)) == {}
    r = warp_tile_program(_schedule("gemm_sigmoid"))
    assert mma_row_sums(r.row_states, r.gemm_states) == {}


def test_mma_row_sums_replace_the_adds_and_shuffles() -> None:
    s = _schedule("causal_rowsums")
    plain = schedule(s.smg, tiles=s.tiles, serial=s.serial, step=s.step, tensor_cores=True, stages=2, warps=2,
                     reload_a=True, lazy_rescale=True)
    src, before = build(s, "cuda").source, build(plain, "cuda").source
    mt, kslices = s.warp_tile.warp_mtiles, s.step // 16
    # one n8 mma per k slice and 16-row tile, in both copies of the step (masked and kept)
    assert src.count("mma.sync.aligned") - before.count("mma.sync.aligned") == 2 * mt * kslices
    # the row sums' quad shuffles are gone; the row max keeps its two per row
    assert src.count("__shfl_xor_sync") == before.count("__shfl_xor_sync") // 2
    assert "P_sum summed on tensor cores with O" in str(s)
    _check_knob(s, plain, "mma_row_sums", "mma_row_sums sums a row statistic.*'gemm_sigmoid' has no sum state")


def test_search_space_offers_mma_row_sums_where_a_row_sum_exists() -> None:
    from schedulers.hardware import H100
    from search.space import SearchSpace

    sp = SearchSpace(softmax_gemm(128, 256, 64), H100, max_step=64)
    knobs = [k for k in sp.knobs() if k.tensor_cores]
    assert knobs and all(k.mma_row_sums for k in knobs)
    assert all(s.mma_row_sums for s in sp.candidates() if s.tensor_cores)
    g = SearchSpace(patterns.gemm_epilogue(64, 64, 64, "sigmoid", True, "float16"), H100, max_step=64)
    assert not any(k.mma_row_sums for k in g.knobs())


def test_wgmma_reads_both_operands_from_swizzled_shared_tiles() -> None:
    """The GEMM on warpgroup MMA: one wgmma.mma_async m64nNk16 per k16 slice and 64-row half, the
    descriptors naming 128 B-swizzled tiles (layout type 1 in bits 62-63), the cp.async writes
    fenced for the async proxy, and rows owned per warpgroup; a ring of 3+ leaves one group in
    flight (wait_group 1), a ring of 2 waits for each step's."""
    s = _schedule("gemm_sigmoid_wgmma")
    art = build(s, "cuda")
    src = art.source
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16" in src and "ldmatrix" not in src
    assert "fence.proxy.async.shared::cta" in src and "wgmma.commit_group.sync.aligned" in src
    calls = re.findall(r"tvm_builtin_ptx_wgmma_f16_ss_mma_async\w*\(_ptr", src)
    assert len(calls) == (s.step // 16) * (128 // 64)
    assert art.meta["lowering"].startswith("tensorcore-wgmma")
    assert "wgmma.wait_group.sync.aligned 0" in src and "wgmma.wait_group.sync.aligned 1" not in src
    lag = build(_schedule("gemm_sigmoid_wgmma_2wg"), "cuda").source
    assert "wgmma.wait_group.sync.aligned 1" in lag and "m64n256k16" in lag
    back = Schedule.from_json(s.to_json())
    assert back.wgmma and back.key == s.key and "wgmma" not in _schedule("gemm_sigmoid").to_dict()
    assert s.warp_tile.hopper.wgmma and "wgmma" in s.to_dict() and "GEMMs on warpgroup MMA" in str(s)


def test_wgmma_is_refused_for_a_target_without_it() -> None:
    with pytest.raises(ScheduleError, match="wgmma .* sm_90a only; the target is sm_80"):
        build(_schedule("attention_wgmma"), "cuda:sm_80")


def test_wgmma_runs_both_attention_gemms() -> None:
    """Attention on warpgroup MMA: P @ V in the rs form (P's mma.sync A fragments packed into its 4
    registers per k16 slice and 16-row tile, V swizzled in shared memory, no ldmatrix.trans), and
    the score GEMM with K swizzled in 64-wide bands of d and Q from its swizzled tile (reload_a, the
    ss form) or from registers (held, the rs form); the row sums' ones-mma stays on mma.sync."""
    s = _schedule("causal_wgmma_mt2")
    p = s.warp_tile
    src = build(s, "cuda").source
    assert not p.wgmma_ss and "__pack_half2" in src and "ldmatrix" not in src
    kslices = s.step // 16  # P @ V: one per k16 slice of the step, 16-row tile and copy of the step
    assert len(re.findall(r"wgmma_f16_rs_mma_async\w*\(_ptr", src)) == 2 * kslices * p.warp_mtiles
    assert len(re.findall(r"wgmma_f16_ss_mma_async\w*m64n64k16\w*\(_ptr", src)) == 2 * (128 // 16) * p.warp_mtiles
    assert "mma.sync.aligned.m16n8k16" in src  # the row sums
    from schedulers.warp_tile import smem_layout, wgmma_swizzled

    assert wgmma_swizzled(p) == ("K", "Q", "V") and smem_layout(s, p)["V"] == (2, 64, 128)
    held = build(_schedule("attention_wgmma"), "cuda").source  # Q held: ldmatrix once, rs scores
    assert "ldmatrix" in held and "wgmma_f16_ss" not in held


def test_wgmma_takes_head_dims_of_a_partial_band() -> None:
    """d = 112 (one band and a partial one of 48 columns): K, Q and V are allocated in whole bands
    (padded_band) but only their 112 columns are loaded; the score GEMM issues the 7 k16 slices that
    exist (4 in band 0, 3 in band 1) and P @ V is one m64n112k16 per k16 slice of the step."""
    from schedulers.warp_tile import smem_layout, tile_columns

    s = _schedule("causal_wgmma_d112_2wg")
    p = s.warp_tile
    layout, cols = smem_layout(s, p), tile_columns(s, p)
    assert layout["K"] == (2, 64, 128) and layout["V"] == (2, 64, 128) and layout["Q"] == (1, 128, 128)
    assert cols == {"Q": 112, "K": 112, "V": 112}
    src = build(s, "cuda").source
    copies = 2  # the step with and without the causal mask
    assert len(re.findall(r"wgmma_f16_ss_mma_async\w*m64n64k16\w*\(_ptr", src)) == copies * 7 * p.warp_mtiles
    assert len(re.findall(r"wgmma_f16_rs_mma_async\w*m64n112k16\w*\(_ptr", src)) == copies * 4 * p.warp_mtiles
    # the arena holds the padded bands: 128 columns of K and V per ring slot, of Q once
    assert warp_tile_smem_bytes(s, p) >= 2 * (2 * 64 * 128 + 2 * 64 * 128 + 128 * 128)


def test_a_producer_stores_a_partial_last_output_band() -> None:
    """d = 80 with a producer warpgroup: the output leaves in a 64-column band and a 16-column one."""
    src = build(_schedule("causal_ws_d80"), "cuda").source
    assert "m64n80k16" in src and "cp.async.bulk.tensor.4d" in src
    assert len(re.findall(r"\(uint4\*\)\(O_ptr", src)) == 2  # one 16-byte chunk store per band


@given(cols=st.integers(1, 16).map(lambda c: 16 * c), rows=st.sampled_from([8, 32, 64, 128]))
@settings(max_examples=60, deadline=None)
def test_padded_band_holds_the_columns_in_distinct_chunks(cols, rows) -> None:
    """A swizzled tile of ``cols`` columns padded to whole bands: its chunks land inside the padded
    tile, each on its own 16 bytes, and the padding is less than one band."""
    from schedulers.warp_tile import SWIZZLE_COLS, padded_band, swizzled_128b

    width = padded_band(cols)
    assert width % SWIZZLE_COLS == 0 and cols <= width < cols + SWIZZLE_COLS
    offs = [swizzled_128b(r, j, rows) for r in range(rows) for j in range(cols // 8)]
    assert len(set(offs)) == len(offs) and all(0 <= o <= rows * width - 8 for o in offs)


def test_a_head_dim_off_the_mma_k_runs_padded_on_chip() -> None:
    """d = 40: the score GEMM runs K as 48 (3 k16 slices) over zero columns 40..47 of Q and K in shared memory,
    which the block writes once before the loop (no load writes them); P @ V computes 48 columns and stores
    the 40 that exist.  Global memory is read and written at 40.  With TMA, K's band arrives zero-filled
    and only Q's pad is written.  d = 36 (rows of 72 bytes) cannot be loaded in 16-byte chunks: refused."""
    from schedulers.warp_tile import smem_layout, tile_columns

    s = _schedule("attention_d40")
    p = s.warp_tile
    assert (p.gemm.kd, p.gemm.kp) == (40, 48)
    assert [(g.n_tile, g.pad) for g in p.gemm_states] == [(48, 8)]
    assert smem_layout(s, p) == {"Q": (1, 64, 56), "K": (2, 32, 56), "V": (2, 32, 56)}
    assert tile_columns(s, p) == {"Q": 40, "K": 40, "V": 48}
    zero_store = r"\(uint4\*\)\(_ptr \+ [^;]*\) = make_uint4\(__pack_half2\(__float2half_rn\(0x0p\+0f"
    assert len(re.findall(zero_store, build(s, "cuda").source)) == 2  # Q's pad, and K's in both ring slots
    tsrc = build(_schedule("attention_wgmma_tma_d40"), "cuda").source
    assert "cp.async.bulk.tensor" in tsrc and len(re.findall(zero_store, tsrc)) == 1  # Q's alone
    with pytest.raises(ScheduleError, match="'d' = 36 must be a multiple of 8"):
        schedule(patterns.attention(1, 2, 128, 128, 36), tiles={"m": 64}, step=64, tensor_cores=True, stages=2)


@given(rows=st.sampled_from([64, 128, 256]), bands=st.integers(1, 4))
@settings(max_examples=30, deadline=None)
def test_swizzled_128b_is_a_permutation_of_the_tile_chunks(rows, bands) -> None:
    """Every 16-byte chunk of a [rows, 64 * bands] tile lands on its own chunk of the tile, and the
    8 chunks of a row within an atom cover its 128 B (the XOR only permutes inside the row)."""
    from schedulers.warp_tile import swizzled_128b

    offs = [swizzled_128b(r, j, rows) for r in range(rows) for j in range(8 * bands)]
    assert sorted(offs) == [8 * i for i in range(rows * 8 * bands)]
    for r in range(rows):
        row = sorted(swizzled_128b(r, j, rows) for j in range(8))
        assert row == list(range(row[0], row[0] + 64, 8))


@pytest.mark.parametrize(("graph", "kwargs", "match"), [
    ("gemm", {"step": 32}, "the step 32 must be 64"),
    ("gemm", {"tiles": {"m": 128, "n": 96}}, "96 columns per block must be a multiple of 64"),
    ("gemm", {"warps": 2}, "one or two warpgroups"),
    ("gemm", {"split": 2}, "no split or early_scores"),
    ("attention", {"early_scores": True}, "no split or early_scores"),
    ("gemm_tail", {}, "divide 'k' = 200"),
])
def test_wgmma_refusals(graph, kwargs, match) -> None:
    g = {"attention": lambda: patterns.attention(1, 2, 128, 128, 64),
         "gemm": lambda: patterns.gemm_epilogue(256, 256, 256, "sigmoid", True, "float16"),
         "gemm_tail": lambda: patterns.gemm_epilogue(256, 256, 200, "sigmoid", True, "float16")}[graph]()
    opts = {"tiles": {"m": 128, "n": 128} if graph != "attention" else {"m": 64}, "step": 64,
            "serial": "k" if graph != "attention" else "l"} | kwargs
    with pytest.raises(ScheduleError, match=match):
        schedule(g, tensor_cores=True, stages=2, wgmma=True, **opts)


def test_search_reaches_tensor_core_tiles_beyond_the_thread_limit_with_wgmma_on_hopper() -> None:
    """The GEMM's 128 x 128 tile (16384 elements, 128 threads) is in the space, on warpgroup MMA
    where make_schedule takes it, and on mma.sync for a target without it (A100)."""
    from schedulers.hardware import A100, H100
    from schedulers.options import DEEP_PRODUCER_STAGES, GEMM_STAGES, PRODUCER_STAGES
    from search.space import SearchSpace

    g = patterns.gemm_epilogue(1024, 1024, 256, "sigmoid", True, "float16")
    tiles = {(s.tiles["m"], s.tiles["n"], s.step, s.wgmma) for s in SearchSpace(g, H100).candidates()
             if s.tensor_cores}
    assert (128, 128, 64, True) in tiles and not any(w and step != 64 for _, _, step, w in tiles)
    assert not any(s.wgmma for s in SearchSpace(g, A100).candidates())
    # TMA loads come with every unsliced wgmma GEMM candidate on sm_90 (one block per tile), and nowhere
    # else; blocks slicing the steps come both by TMA and by cp.async
    cands = [s for s in SearchSpace(g, H100).candidates() if s.tensor_cores]
    assert all(s.tma == s.wgmma for s in cands if s.slices == 1) and any(s.tma for s in cands)
    sliced = {(s.tiles["m"], s.tiles["n"], s.stages, s.slices, s.tma) for s in cands if s.slices > 1 and s.wgmma}
    assert any(k[-1] for k in sliced) and all((*k[:-1], not k[-1]) in sliced for k in sliced if k[2] > 1)
    att = SearchSpace(patterns.attention(1, 2, 128, 128, 64), H100, max_step=64)
    assert not any(k.tma for k in att.knobs())  # attention's K/V by TMA measured a wash: a user's choice
    # a producer warpgroup only with TMA, rings of 2..8 slots, persistent over the SMs where the tiles outnumber them
    ws = [s for s in cands if s.producer]
    rings = {*PRODUCER_STAGES, *DEEP_PRODUCER_STAGES}  # the deeper ones on this grid of 64-256 tiles
    assert ws and all(s.tma and s.stages >= 2 for s in ws) and {s.stages for s in ws} == rings
    # a GEMM's deeper cp.async / TMA rings in blocks taking a row tile's steps whole or halved; not attention's
    deep = [s for s in cands if not s.producer and s.stages in GEMM_STAGES]
    assert deep and all(s.split == 1 and s.slices <= 2 for s in deep) and {s.slices for s in deep} == {1, 2}
    assert not any(k.stages in GEMM_STAGES for k in att.knobs())
    assert {s.persistent for s in ws} == {0, H100.num_sms} and all(s.num_tiles > s.persistent for s in ws)
    assert not any(k.producer for k in att.knobs())


def test_reload_a_refusals() -> None:
    with pytest.raises(ScheduleError, match="reload_a re-reads the A operand.*'softmax_gemm' has no such GEMM"):
        schedule(softmax_gemm(128, 256, 64), tiles={"m": 32}, step=64, tensor_cores=True, reload_a=True)
    with pytest.raises(ScheduleError, match="apply to tensor-core warp-tile kernels"):
        schedule(patterns.attention(1, 2, 64, 64, 64), tiles={"m": 32}, step=32, reload_a=True)


def test_search_space_offers_reload_a_only_with_a_first_gemm() -> None:
    from schedulers.hardware import H100
    from search.space import SearchSpace

    def reloads(g) -> set[bool]:
        sp = SearchSpace(g, H100, max_step=64)
        return {k.reload_a for k in sp.knobs() if k.tensor_cores}

    assert reloads(patterns.attention(1, 2, 128, 128, 128, dtype="float16")) == {False, True}
    assert reloads(softmax_gemm(128, 256, 64)) == {False}


def test_pipeline_knobs_on_a_wmma_only_gemm_are_refused() -> None:
    g = patterns.gemm_epilogue(64, 64, 64, "relu", False, "float16")
    with pytest.raises(ScheduleError, match="stages/warps/split/slices need a warp-tile program.*multiple of 16"):
        schedule(g, tiles={"m": 8, "n": 64}, serial="k", step=32, tensor_cores=True, stages=2)
    assert schedule(g, tiles={"m": 8, "n": 64}, serial="k", step=32, tensor_cores=True).warp_tile is None


def test_float32_and_stages_without_tensor_cores_are_refused() -> None:
    with pytest.raises(ScheduleError, match="tensor cores take"):
        schedule(patterns.attention(1, 2, 64, 64, 64, dtype="float32"), tiles={"m": 32}, step=32, tensor_cores=True)
    with pytest.raises(ScheduleError, match="apply to tensor-core warp-tile kernels"):
        schedule(patterns.attention(1, 2, 64, 64, 64), tiles={"m": 32}, step=32, stages=2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_warp_tile_cuda_uses_mma_ldmatrix_cp_async(name, tmp_path) -> None:
    s = _schedule(name)
    art = build(s, "cuda")
    src = art.source
    if s.wgmma:  # every GEMM on the warpgroup MMA; ldmatrix only for a Q held in registers
        p = s.warp_tile
        assert "wgmma.mma_async.sync.aligned" in src and "ldmatrix.sync.aligned.m8n8.x4.trans" not in src
        # ldmatrix only for a Q held in registers, a staged score tile (Softmax-GEMM's S) or the A tile of
        # the ss form's row states (a norm before the GEMM)
        held_q = p.gemm is not None and not p.warp.reload_a
        assert ("ldmatrix" in src) == (held_q or (bool(p.tiles_in) and not p.wgmma_ss)
                                       or (p.wgmma_ss and bool(p.row_states)))
    else:
        assert "mma.sync.aligned.m16n8k16.row.col.f32" in src and "ldmatrix.sync.aligned.m8n8.x4" in src
        # x [L, n] is transposed by ldmatrix; a K-major x [n, L] (nn.Linear's weight as stored) is not
        trans = any(not g.k_major for g in s.warp_tile.gemm_states)
        assert ("ldmatrix.sync.aligned.m8n8.x4.trans" in src) == trans
    if s.tma:  # the ring by TMA (the A tile and B's bands), waited for on mbarriers
        assert re.search(r"cp\.async\.bulk\.tensor\.[24]d", src) and "mbarrier.try_wait.parity" in src
    else:
        assert "cp.async.cg.shared.global" in src and "cp.async.wait_group" in src
    assert len(re.findall(r"__global__ void[^;]*\{", src)) == 1
    assert art.meta["block"] == [s.threads, 1, 1] and art.meta["grid"] == [s.num_blocks, 1, 1]
    assert art.meta["dynamic_smem_bytes"] > 0
    if shutil.which("nvcc"):
        assert (art.save(tmp_path / name) / "kernel.cubin").stat().st_size > 0


@given(a=st.sampled_from([-3, -2, -1, 1, 2, 3]), b=st.integers(-3, 3), c=st.integers(-6, 6), strict=st.booleans(),
       l0=st.integers(0, 20), step=st.integers(1, 8), r_lo=st.integers(0, 20), rows=st.integers(1, 8))
@settings(max_examples=300, deadline=None)
def test_tile_kept_is_exact_on_every_element(a, b, c, strict, l0, step, r_lo, rows) -> None:
    """The kept-tile test that lets a step skip the mask holds iff every element of the tile is kept."""
    kept = all((a * L + b * R + c < 0) if strict else (a * L + b * R + c <= 0)
               for L in range(l0, l0 + step) for R in range(r_lo, r_lo + rows))
    assert tile_kept((a, b, c, strict), l0, step, r_lo, r_lo + rows - 1) == kept


@given(st.integers(1, 40), st.booleans())
@settings(max_examples=100, deadline=None)
def test_row_tile_order_alternates_heavy_and_light(count, heavy_last) -> None:
    """A permutation of the row tiles that starts at the heavy end and alternates ends."""
    order = [row_tile_order(i, count, heavy_last) for i in range(count)]
    assert sorted(order) == list(range(count))
    heavy = count - 1 if heavy_last else 0
    assert order[0] == heavy
    work = [t if heavy_last else count - 1 - t for t in order]  # monotone stand-in for the steps
    assert all(work[i] > work[i + 1] for i in range(0, count - 1, 2))  # heavy then light


def test_causal_blocks_take_row_tiles_in_heavy_light_order() -> None:
    """The row tile is picked by the block index's parity where a killing mask bounds the steps."""
    causal = build(_schedule("causal"), "cuda").source
    plain = build(_schedule("attention"), "cuda").source
    assert "% 2) == 0) ? (3 - " in causal and "% 2) == 0) ?" not in plain  # 4 row tiles: 3, 0, 2, 1


def test_kept_tiles_run_an_unmasked_step() -> None:
    """Causal steps below the diagonal run a copy of the step without the mask's select, with the
    score scaling folded into exp2 (log2 e * 0.125); diagonal steps keep the mask and (s - m) * log2 e."""
    s = _schedule("causal")
    src = build(s, "cuda").source
    # step j of 16 columns is kept for rows 32*tile.. when 16*j + 15 <= 32*tile (the tile: heavy/light order)
    kept = re.findall(r"if \(\(\(v_\d+ \* 16\) - \([^\n]*\) \* 32\)\) < -15\)", src)
    assert len(kept) == 1, re.findall(r"if \([^\n]*< -\d+\)", src)[:3]
    head, tail = src.split(kept[0], 1)
    assert "0x1.71547652b82fep-3" in tail  # 0.125 * log2(e), folded into the kept step's FFMA
    assert "-0x1.93e5939a08ceap+99" in tail  # the masked step's -1e30 fill, in the other branch


def test_score_scaling_folds_into_exp_and_max() -> None:
    """``s = 0.125 * qk`` is not materialised: the row max reduces qk and scales once per row,
    and exp(s - m) is exp2(qk * (0.125 log2 e) - m log2 e), one FFMA per element; the kernel is
    built with -ftz (one MUFU per exp2f), recorded in its metadata."""
    s = _schedule("attention")
    art = build(s, "cuda")
    src = art.source
    assert "0x1.71547652b82fep-3f" in src  # 0.125 * log2(e), folded by sympy, not by nvcc
    assert src.count("0x1p-3f") == 2 * s.warp_tile.warp_mtiles  # only the max's once-per-row scaling
    assert art.meta["nvcc_flags"] == ["-ftz=true"]
    # a mask's -1e30 fill can make s and m equal sentinels: then exp takes (s - m) first, exactly 0
    causal = build(_schedule("causal_split4"), "cuda").source
    # (folding comes back on the steps the mask keeps whole: test_kept_tiles_run_an_unmasked_step)
    assert ") * 0x1.71547652b82fep+0f/*1.442695e+00*/))" in causal  # exp2((s - m) * log2 e)


def _gpu_kernel(name: str, tmp_path) -> tuple[Schedule, Any, Any, dict[str, np.ndarray]]:
    """(schedule, torch, the kernel, seeded standard-normal inputs rounded to the input dtype, in float64);
    skips without a GPU, torch or cupy."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from spacefusion.runtime.gpu import CudaKernel

    s = _schedule(name)
    kernel = CudaKernel(build(s, "cuda").save(tmp_path / name))
    rng = np.random.default_rng(0)
    dtype = getattr(torch, s.smg.space(s.smg.inputs[0]).dtype)
    xs = {n: torch.from_numpy(rng.standard_normal(s.smg.shape(n))).to(dtype) for n in s.smg.inputs}
    return s, torch, kernel, {n: v.double().numpy() for n, v in xs.items()}


_BOUND = st.tuples(st.sampled_from([-2, -1, 1, 2]), st.integers(-2, 2), st.integers(-40, 40), st.booleans())


@given(bounds=st.lists(_BOUND, max_size=3), r_lo=st.integers(0, 40), rows=st.integers(1, 12),
       step=st.integers(1, 9), length=st.integers(1, 60))
@settings(max_examples=400, deadline=None)
def test_step_range_covers_every_kept_element(bounds, r_lo, rows, step, length) -> None:
    """The steps a row tile runs hold every element its killing masks keep; a tile with a row that keeps
    nothing runs them all (that row averages over every L); one causal bound and one window edge give the
    exact range."""
    def keeps(L: int, R: int) -> bool:
        return all((a * L + b * R + c < 0) if s else (a * L + b * R + c <= 0) for a, b, c, s in bounds)

    total = -(-length // step)
    rows_kept = [[L for L in range(length) if keeps(L, R)] for R in range(r_lo, r_lo + rows)]
    lo, hi = step_range(bounds, r_lo, r_lo + rows - 1, step, length)
    assert 0 <= lo < hi <= total
    if not all(rows_kept):
        assert (lo, hi) == (0, total)
        return
    need_lo = min(r[0] for r in rows_kept) // step
    need_hi = max(r[-1] for r in rows_kept) // step + 1
    assert lo <= need_lo and hi >= need_hi
    ones = [b for b in bounds if abs(b[0]) == 1]
    if len(bounds) == 2 and len(ones) == 2 and bounds[0][0] != bounds[1][0]:
        assert (lo, hi) == (need_lo, need_hi)


def test_a_windows_leading_steps_are_skipped() -> None:
    """Causal with a 100-key window (steps of 32, rows of 64): each row tile runs only the steps from its
    first row's window start to its last row's diagonal, and the search sees the same counts."""
    s = _schedule("mask_window_causal")
    assert [b for _, b in killing_masks(s.smg, s.warp_tile)] == [(-1, 1, -100, True), (1, -1, 0, False)]
    expect = [(max(0, 64 * i - 99) // 32, min(299, 64 * i + 63) // 32 + 1) for i in range(5)]
    assert steps_per_row_tile(s, s.warp_tile) == [hi - lo for lo, hi in expect]
    assert [hi - lo for lo, hi in expect] == [2, 4, 6, 6, 6]


def _launch(torch, kernel, s: Schedule, xs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    dtype = getattr(torch, s.smg.space(s.smg.inputs[0]).dtype)
    out = kernel.launch({n: torch.from_numpy(v).to("cuda", dtype) for n, v in xs.items()})
    return {n: v.double().cpu().numpy() for n, v in out.items()}


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_warp_tile_kernel_matches_numpy_on_gpu(name, tmp_path) -> None:
    s, torch, kernel, xs = _gpu_kernel(name, tmp_path)
    out = _launch(torch, kernel, s, xs)
    ref = evaluate(s.smg, xs)
    for n, v in out.items():  # the one rule (smg/tolerance.py): a correctly rounded output passes at any size
        assert_close(v, ref[n], s.smg.space(n).dtype, reduction_length(s.smg), name=n)


def test_padding_masks_read_from_an_input_bound_the_steps() -> None:
    """A padding mask over (b, l) whose input also zeroes P @ V's factor (zero_v) is scanned by each warp
    for its first and last kept key and their count; not a bias, nor a padding mask beside causal (a row that
    keeps nothing then averages over every key, so every step runs).  The steps inside a dense run of kept
    keys run a copy of the step that reads no mask."""
    from schedulers.warp_tile import column_masks

    s = _schedule("mask_padding_skip")
    assert column_masks(s.smg, s.warp_tile) == [("Smod0", "Mask", 0.5, True)]
    src = build(s, "cuda").source
    plain = build(_schedule("attention"), "cuda").source
    # the scan's 5 x (first, last, count), and the step twice (its row reductions' shuffles): as is, and the
    # copy that the steps inside a dense run of kept keys take (no mask read, no select)
    assert "Mask" in src and src.count("__shfl_xor_sync") == 15 + 2 * plain.count("__shfl_xor_sync")
    for other in ("mask_bias_bshd_gqa", "mask_window_causal", "attention"):
        t = _schedule(other)
        assert column_masks(t.smg, t.warp_tile) == [], other
    causal = schedule(patterns.attention(1, 2, 100, 100, 64, causal=True, mods=(MASK_PADDING,)), tiles={"m": 32},
                      step=32, tensor_cores=True, stages=2)
    assert column_masks(causal.smg, causal.warp_tile) == []


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["mask_padding_skip", "mask_padding_skip_slices3"])
def test_padding_mask_skips_the_steps_of_dropped_keys_on_gpu(name, tmp_path) -> None:
    """Sequences that keep no key (every step runs; their rows give 0), a prefix of 37 keys (its first step
    inside the dense run: unmasked), keys 100..169 but 130..135 (steps before and after skipped, the run not
    dense: every step masked), all 300 (every whole step unmasked): the same as the unfused reference."""
    s, torch, kernel, xs = _gpu_kernel(name, tmp_path)
    keep = np.zeros((4, 300))
    keep[1, :37] = 1
    keep[2, 100:170] = 1
    keep[2, 130:136] = 0
    keep[3] = 1
    xs["Mask"] = keep
    out = _launch(torch, kernel, s, xs)
    ref = evaluate(s.smg, xs)
    assert not np.any(ref["O"][0])  # the sequence that keeps nothing: zeros, as SDPA gives
    for n, v in out.items():
        assert_close(v, ref[n], s.smg.space(n).dtype, reduction_length(s.smg), name=n)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gemm_wgmma_tma_slices2", "gemm_relu_wgmma_tma_bf16_2wg"])  # fp16, bf16
def test_the_check_catches_a_bias_dropped_on_one_column_on_gpu(name, tmp_path) -> None:
    """A planted error on the GPU: the kernel gets the bias with one column's entry zeroed, which is what an
    epilogue that drops the bias on that column computes, and is checked against the reference of the real
    bias (1.0 there, a typical entry).  The correct run passes the rule; this one fails it, at that column."""
    s, torch, kernel, xs = _gpu_kernel(name, tmp_path)
    col = 37
    xs["bias"][col] = 1.0
    ref = evaluate(s.smg, xs)
    (out_name,) = s.smg.outputs
    dtype, k = s.smg.space(out_name).dtype, reduction_length(s.smg)
    assert_close(_launch(torch, kernel, s, xs)[out_name], ref[out_name], dtype, k)
    dropped = {**xs, "bias": xs["bias"].copy()}
    dropped["bias"][col] = 0.0
    got = _launch(torch, kernel, s, dropped)[out_name]
    with pytest.raises(AssertionError, match=rf"elements over atol \+ rtol\*\|ref\|.*worst at \(\d+, {col}\)"):
        assert_close(got, ref[out_name], dtype, k)
    others = np.arange(ref[out_name].shape[1]) != col
    assert_close(got[:, others], ref[out_name][:, others], dtype, k)  # every other column is still right


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("name", ["attention", "gemm_sigmoid", "softmax_gemm_slices3", "mt2_reload_d128",
                                  "gemm_gated_wgmma_2wg"])
def test_register_estimate_bounds_what_nvcc_allocates(name, tmp_path) -> None:
    """The resource model's registers per thread (what occupancy and pruning use) are within 32 of nvcc's
    count for the kernel, and no false spills (tests/test_warp_tile_registers.py holds the bounds, and the
    occupancy they give, over the 534 kernels of the committed corpus; Softmax-GEMM on mma.sync, 16 over
    nvcc's 72 here, is the form the estimate overshoots most)."""
    import subprocess

    from spacefusion.lower.build import NVCC_FLAGS

    s = _schedule(name)
    art = build(s, "cuda")
    folder = art.save(tmp_path / name, compile_cubin=False)
    out = subprocess.run(["nvcc", "-cubin", f"-arch={art.meta['arch']}", *NVCC_FLAGS, *art.meta["nvcc_flags"],
                          "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"), str(folder / "kernel.cu")],
                         capture_output=True, text=True, check=True)
    used = int(re.search(r"Used (\d+) registers", out.stderr).group(1))
    r = block_resources(s)
    est = r.registers_per_thread
    assert abs(est - used) <= 32, (used, est)
    assert not r.spills


def test_tma_loads_the_gemm_tiles() -> None:
    """With ``tma`` thread 0 loads each step's A tile and B's 64-column bands by cp.async.bulk.tensor
    against tensor maps the launcher builds (uint8[128] params naming their tensor, box and swizzle),
    an mbarrier per ring slot counting the bytes: no cp.async for the ring; A and B are passed only
    through their maps."""
    s = _schedule("gemm_sigmoid_wgmma_tma")
    art = build(s, "cuda")
    src, meta = art.source, art.meta
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes" in src
    assert src.count("tvm_builtin_ptx_mbarrier_init_init_shared_b64(") == 1 + s.stages  # definition + slots
    assert "cp.async.cg.shared.global" not in src and "mbarrier.try_wait.parity" in src
    maps = {p["name"]: p["tensor_map"] for p in meta["params"] if p["role"] == "tensormap"}
    assert maps == {"A__tmap": {"tensor": "A", "box": [64, 128], "swizzle": 128},
                    "Bw__tmap": {"tensor": "Bw", "box": [64, 64], "swizzle": 128}}
    assert sorted(meta["param_order"]) == ["A__tmap", "Bw__tmap", "Y", "bias"]
    assert "TMA" in meta["lowering"] and "tiles loaded by TMA" in str(s)
    plain = _schedule("gemm_sigmoid_wgmma")
    assert meta["dynamic_smem_bytes"] == build(plain, "cuda").meta["dynamic_smem_bytes"] + 8 * s.stages
    back = Schedule.from_json(s.to_json())
    assert back.tma and back.key == s.key != plain.key and "tma" not in plain.to_dict()
    bands = build(_schedule("gemm_relu_wgmma_tma_bf16_2wg"), "cuda").source
    loads = re.findall(r"complete_tx__bytes\([^;]*?(A|Bw)__tmap_ptr", bands)
    assert loads.count("Bw") == 4 * 2 and loads.count("A") == 2  # 4 bands of N = 256, prologue + loop
    assert "m64n256k16.f32.bf16.bf16" in bands


def test_producer_warpgroup_feeds_the_ring_without_block_barriers() -> None:
    """With ``producer`` warpgroup 0 issues the TMA loads and the MMA warpgroups hand each slot back
    through its empty mbarrier: the one block-wide barrier is after the mbarriers' init; each MMA
    warpgroup stores its rows band by band behind named barriers of 128 threads; registers move
    from the producer to the two MMA warpgroups.  ``persistent`` launches that many blocks."""
    s = _schedule("gemm_sigmoid_ws_persistent")
    p = s.warp_tile
    art = build(s, "cuda")
    src, meta = art.source, art.meta
    assert meta["grid"] == [3, 1, 1] and s.num_tiles == 4 and meta["block"] == [384, 1, 1] == [s.threads, 1, 1]
    assert src.count("__syncthreads()") == 1
    assert src.count("tvm_builtin_ptx_mbarrier_init_init_shared_b64(") == 1 + 2 * s.stages
    assert "mbarrier.arrive.shared.b64" in src and "wgmma.wait_group.sync.aligned 1" in src
    assert "setmaxnreg.dec.sync.aligned.u32 40" in src and "setmaxnreg.inc.sync.aligned.u32 232" in src
    assert len(re.findall(r"tvm_builtin_ptx_bar_sync_count_sync\([^;]*\(uint\)128\)", src)) == 2 * (256 // BAND)
    # the ring, the staged bands beside it (64 + 8 columns of every row), then two mbarriers per slot
    ring = 2 * (2 * 128 * 64 + 2 * 64 * 256) + 2 * 2 * SWIZZLE_ATOM
    assert meta["dynamic_smem_bytes"] <= warp_tile_smem_bytes(s, p) == ring + 128 * 72 * 2 + 16 * s.stages
    back = Schedule.from_json(s.to_json())
    assert back.producer and back.persistent == 3 and back.key == s.key
    assert "producer warpgroup" in str(s) and "persistent: 3 blocks" in str(s)
    one = build(_schedule("gemm_relu_ws_bf16"), "cuda").source  # one MMA warpgroup: no register moves
    assert "setmaxnreg" not in one and "m64n128k16.f32.bf16.bf16" in one


def test_producer_warpgroup_feeds_attentions_k_v_ring() -> None:
    """Attention with ``producer`` (FlashAttention-3's structure): warpgroup 0's thread 0 loads K and V
    by TMA into a ring whose K and V parts have their own full and empty mbarriers (only the steps a
    causal row tile needs); the two MMA warpgroups copy Q themselves and meet at a named barrier of
    their 256 threads; each step issues its scores, then the previous step's P @ V, waits for the
    scores alone (wait_group 1), and the warpgroups take turns through a pair of named barriers; no
    block-wide barrier past the mbarriers' init, each warpgroup's output bands behind its own."""
    s = _schedule("causal_ws")
    p = s.warp_tile
    src = build(s, "cuda").source
    assert p.hopper.producer and split_ring(p) and p.threads == 384 and s.num_blocks == 2 * 2
    assert src.count("__syncthreads()") == 1 and "setmaxnreg.inc.sync.aligned.u32 232" in src
    assert src.count("tvm_builtin_ptx_mbarrier_init_init_shared_b64(") == 1 + 4 * s.stages  # (+ its definition)
    assert warp_tile_smem_bytes(s, p) % 8 == 0 and mbarrier_bytes(p) == 32 * s.stages
    assert re.search(r"tvm_builtin_ptx_bar_sync_count_sync\(\(uint\)3, \(uint\)256\)", src)
    # Q's barrier, then each step's turn (step 0 peeled, the loop, each with and without the mask)
    assert len(re.findall(r"bar_sync_count_sync\([^;]*\(uint\)256\)", src)) >= 1 + 2
    assert src.count("tvm_builtin_ptx_bar_arrive_arrive(") >= 1 + 2  # warpgroup 1 lets 0 go first; every step passes
    assert "cp.async.cg.shared.global" in src and re.search(r"cp\.async\.bulk\.tensor\.4d", src)
    assert "wgmma_wait_group_wait_group_sync_aligned_1();" in src  # the scores alone, the previous P @ V running on
    assert len(re.findall(r"tvm_builtin_ptx_bar_sync_count_sync\([^;]*\(uint\)128\)", src)) == 2 * (128 // BAND)
    one = build(_schedule("attention_ws_1wg"), "cuda").source  # one MMA warpgroup: no register moves, no turns
    assert "setmaxnreg" not in one and "tvm_builtin_ptx_bar_arrive" not in one
    with pytest.raises(ScheduleError, match="producer: the MMA warpgroups.*slices 2"):
        schedule(patterns.attention(1, 2, 64, 256, 64), tiles={"m": 64}, step=64, tensor_cores=True, stages=2,
                 wgmma=True, tma=True, producer=True, slices=2)
    with pytest.raises(ScheduleError, match="producer feeds a plain GEMM.*'softmax_gemm' has no score GEMM"):
        schedule(softmax_gemm(256, 512, 64), tiles={"m": 64}, step=64, tensor_cores=True, stages=2, wgmma=True,
                 tma=True, producer=True)
    with pytest.raises(ScheduleError, match="persistent blocks loop over a plain GEMM's tiles"):
        schedule(patterns.attention(1, 2, 256, 256, 64), tiles={"m": 64}, step=64, tensor_cores=True, stages=2,
                 wgmma=True, tma=True, producer=True, persistent=2)


def test_warp_specialised_attention_registers_and_search() -> None:
    """Two MMA warpgroups beside a producer launch with 168 registers a thread and may hold 232 after
    ``setmaxnreg``: LLaMA's 184 (ptxas needs 200 and spills 44 B at 192) fit one block per SM.  The search offers the
    structure (8 warps, a 2-slot ring, no row sums on tensor cores) over long rows only, and its
    model puts LLaMA's steps of 128 before those of 64 (the measured order)."""
    from schedulers.hardware import H100
    from schedulers.options import FA3_MIN_SERIAL
    from search.cost import estimate_us
    from search.space import SearchSpace

    s = schedule(patterns.attention(1, 2, 256, 2048, 128), tiles={"m": 128}, step=128, tensor_cores=True, stages=2,
                 warps=8, reload_a=True, wgmma=True, tma=True, producer=True)
    r = block_resources(s)
    assert r.registers_per_thread == 168 and r.register_cap == 232 and 168 < r.registers_estimate <= 232
    assert not r.spills and H100.occupancy_blocks_per_sm(r.shared_bytes, r.threads, r.registers_per_thread) == 1
    long_rows = SearchSpace(patterns.attention(1, 2, 128, FA3_MIN_SERIAL, 128, dtype="float16"), H100).candidates()
    fa3 = [c for c in long_rows if c.producer]
    assert fa3 and all(c.warps == 8 and c.stages == 2 and not c.mma_row_sums and c.step >= 64 for c in fa3)
    llama = {step: schedule(patterns.attention(4, 32, 2048, 2048, 128), tiles={"m": 128}, step=step,
                            tensor_cores=True, stages=2, warps=8, reload_a=True, wgmma=True, tma=True, producer=True)
             for step in (64, 128)}
    assert estimate_us(llama[128], H100) < estimate_us(llama[64], H100)  # 451 against 550-572 us measured
    short = SearchSpace(patterns.attention(1, 2, 128, FA3_MIN_SERIAL // 2, 128, dtype="float16"), H100).candidates()
    assert not any(c.producer for c in short)


def test_pingpong_warpgroups_take_turns_on_alternate_tiles() -> None:
    """With ``pingpong`` a persistent block has two MMA warpgroups of one tile each: 128 + 2 x 128
    threads, a staging area and named barrier each, and an order mbarrier each by which the other
    lets it start its next main loop."""
    s = _schedule("gemm_sigmoid_pingpong")
    p = s.warp_tile
    art = build(s, "cuda")
    src = art.source
    assert p.mma_groups == 2 and p.warps == 4 and art.meta["block"] == [384, 1, 1] and art.meta["grid"] == [5, 1, 1]
    assert src.count("tvm_builtin_ptx_mbarrier_init_init_shared_b64(") == 1 + 2 * s.stages + 2
    assert "setmaxnreg.inc.sync.aligned.u32 232" in src and src.count("__syncthreads()") == 1
    ring = 2 * (64 * 64 + 64 * 128) * 2 + 2 * 2 * SWIZZLE_ATOM
    assert warp_tile_smem_bytes(s, p) == ring + 2 * 64 * 72 * 2 + 16 * s.stages + 16
    assert Schedule.from_json(s.to_json()).pingpong and "pingpong" in s.to_dict()
    assert "two MMA warpgroups taking turns" in str(s)


def test_fast_math_puts_tanh_and_the_logistic_on_tanh_approx() -> None:
    """``fast_math``: a sigmoid epilogue is 0.5 - 0.5 tanh(z / 2) on tanh.approx.f32 (no exp2f, no
    division), a tanh epilogue that instruction instead of tanhf; off, the source is unchanged."""
    sig = build(_schedule("gemm_sigmoid_fast_math"), "cuda").source
    assert "tanh.approx.f32" in sig and "exp2f" not in sig and "__fdividef" not in sig
    plain = build(_schedule("gemm_sigmoid_wgmma"), "cuda").source
    assert "tanh.approx" not in plain and "exp2f" in plain and "__fdividef" in plain
    th = build(_schedule("gemm_tanh_pingpong_fast_math"), "cuda").source
    assert "tanh.approx.f32" in th and "tanhf(" not in th  # (the preamble names tanhf in a macro)
    assert "tanh and logistics on tanh.approx.f32" in str(_schedule("gemm_sigmoid_fast_math"))
    with pytest.raises(ScheduleError, match="apply to tensor-core warp-tile kernels"):
        schedule(patterns.gemm_epilogue(64, 64, 64, "tanh", True, "float16"), tiles={"m": 64, "n": 64},
                 serial="k", step=64, fast_math=True)


@pytest.mark.parametrize("expr, z", [("1/(1 + exp(-(x + b)))", "-x - b"), ("1/(exp(y) + 1)", "y"),
                                     ("1/(2 + exp(y))", None), ("1/(1 + y)", None), ("exp(y)", None)])
def test_logistic_denominators_are_recognised(expr, z) -> None:
    import sympy as sp

    from smg.expr import logistic_arg, parse

    e = parse(expr)
    found = logistic_arg(e.base) if isinstance(e, sp.Pow) else logistic_arg(e)
    assert (found is None) if z is None else sp.simplify(found - parse(z)) == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"tma": True, "producer": True, "pingpong": True}, "pingpong gives a persistent block.*persistent 0"),
    ({"tma": True, "producer": True, "persistent": 2, "pingpong": True, "warps": 8}, "8 warps per tile"),
    ({"producer": True}, "producer gives the TMA loads.*tma=False"),
    ({"tma": True, "producer": True, "stages": 1}, "ring of 2\\+ stages.*stages 1"),
    ({"tma": True, "persistent": 2}, "persistent blocks loop over the tiles.*needs producer=True"),
    ({"tma": True, "producer": True, "persistent": 4}, "persistent 4 blocks must be fewer than the 4 tiles"),
])
def test_producer_and_persistent_refusals(kwargs, match) -> None:
    opts = {"stages": 2} | kwargs
    with pytest.raises(ScheduleError, match=match):
        schedule(patterns.gemm_epilogue(256, 256, 128, "relu", True, "float16"), tiles={"m": 128, "n": 128},
                 serial="k", step=64, tensor_cores=True, wgmma=True, **opts)
    with pytest.raises(ScheduleError, match="apply to tensor-core warp-tile kernels"):
        schedule(patterns.gemm_epilogue(64, 64, 64, "relu", True, "float16"), tiles={"m": 64, "n": 64},
                 serial="k", step=64, persistent=2)


def test_tma_is_refused_where_the_ring_is_not_wgmmas() -> None:
    with pytest.raises(ScheduleError, match="tma loads the ring.*cannot: its tiles are not wgmma's"):  # mma.sync
        _ = schedule(patterns.gemm_epilogue(64, 64, 64, "relu", True, "float16"), tiles={"m": 64, "n": 64},
                     serial="k", step=64, tensor_cores=True, stages=2, tma=True)
    with pytest.raises(ScheduleError, match="tma loads the ring.*the step 32 is not whole 64-column bands"):
        _ = schedule(softmax_gemm(100, 296, 64), tiles={"m": 64}, step=32, tensor_cores=True, stages=2,
                     wgmma=True, tma=True)
    # blocks slicing a plain GEMM's steps load theirs by TMA too (each from its first step's coordinates)
    s = schedule(patterns.gemm_epilogue(64, 64, 256, "relu", True, "float16"), tiles={"m": 64, "n": 64},
                 serial="k", step=64, tensor_cores=True, stages=2, wgmma=True, tma=True, slices=2)
    assert s.tma and s.slices == 2 and s.num_blocks == 2


def test_tma_loads_attentions_k_and_v_bands() -> None:
    """Attention's ring by TMA: thread 0 loads K's d-bands and V's n-bands of [step, 64] against 4-d
    tensor maps (box [64, step, 1, 1]: one head's rows, zeros past L); the Q tile still by cp.async,
    waited for before the loop; no cp.async in the ring."""
    s = _schedule("causal_wgmma_tma")
    art = build(s, "cuda")
    src, meta = art.source, art.meta
    maps = {p["name"]: p["tensor_map"] for p in meta["params"] if p["role"] == "tensormap"}
    assert maps == {"K__tmap": {"tensor": "K", "box": [64, 64, 1, 1], "swizzle": 128},
                    "V__tmap": {"tensor": "V", "box": [64, 64, 1, 1], "swizzle": 128}}
    loads = re.findall(r"4d_shared__cluster_global_mbarrier__complete_tx__bytes\([^;]*?(K|V)__tmap_ptr", src)
    assert loads.count("K") == 2 * 2 and loads.count("V") == 2 * 2  # d = n = 128: 2 bands, prologue + loop
    assert "cp.async.cg.shared.global" in src  # Q, once
    assert "TMA" in meta["lowering"]
    sg = _schedule("softmax_gemm_wgmma_tma_slices3")  # S's [rows, 64] bands along L, V's [step, 64] along n
    sg_maps = {p["name"]: p["tensor_map"]["box"] for p in build(sg, "cuda").meta["params"] if p["role"] == "tensormap"}
    assert sg_maps == {"S__tmap": [64, 64], "V__tmap": [64, 64]} and "cp.async.cg" not in build(sg, "cuda").source


def test_gated_gemm_runs_both_gemm_states_on_wgmma_over_one_a_tile() -> None:
    """LLaMA's gated MLP input ``silu(X @ Wg) * (X @ Wu)`` on warpgroup MMA: the SMG's two GEMM states
    (G, U) share their factor X, so a ring slot holds X's [rows, 64] band and each state's [64, n_tile]
    B tile (all 128 B-swizzled), each k16 slice issues one wgmma per state and 64-row half into that
    state's accumulator, and the epilogue reads both at one element index.  Nothing names the graph."""
    from schedulers.warp_tile import smem_layout, tile_columns, wgmma_swizzled

    s = _schedule("gemm_gated_wgmma")
    p = s.warp_tile
    assert p.wgmma_ss and p.tiles_in == ("X",)
    assert [(g.update.state, g.x, g.factor, g.n_tile) for g in p.gemm_states] == [("G", "Wg", "X", 64),
                                                                                  ("U", "Wu", "X", 64)]
    assert smem_layout(s, p) == {"X": (3, 128, 64), "Wg": (3, 64, 64), "Wu": (3, 64, 64)}
    assert tile_columns(s, p) == {"X": 64, "Wg": 64, "Wu": 64} and wgmma_swizzled(p) == ("X", "Wg", "Wu")
    assert warp_tile_smem_bytes(s, p) == 2 * 3 * (128 * 64 + 2 * 64 * 64) + 3 * SWIZZLE_ATOM * 2
    src = build(s, "cuda").source
    calls = re.findall(r"wgmma_f16_ss_mma_async\w*m64n64k16\w*\(_ptr", src)
    assert len(calls) == (s.step // 16) * 2 * (128 // 64)  # k16 slices x states x 64-row halves
    assert src.count("cp.async.cg.shared.global") >= 1 and "wgmma.wait_group.sync.aligned 1" in src  # 3-ring lag
    two = build(_schedule("gemm_gated_wgmma_2wg"), "cuda").source  # two warpgroups, one 64-row half each
    assert len(re.findall(r"wgmma_f16_ss_mma_async\w*m64n128k16\w*\(_ptr", two)) == (64 // 16) * 2


def test_gated_gemm_tma_and_producer_load_every_tile_of_a_slot() -> None:
    """By TMA one mbarrier per slot counts X's band and both B tiles (64 x 64 + 2 x 64 x 128 halves); a
    producer warpgroup loads all three into each slot it gets back; persistent and pingpong as for a GEMM."""
    s = _schedule("gemm_gated_wgmma_tma_bf16")
    art = build(s, "cuda")
    src = art.source
    maps = {q["name"]: q["tensor_map"] for q in art.meta["params"] if q["role"] == "tensormap"}
    assert maps == {"X__tmap": {"tensor": "X", "box": [64, 64], "swizzle": 128},
                    "Wg__tmap": {"tensor": "Wg", "box": [64, 64], "swizzle": 128},
                    "Wu__tmap": {"tensor": "Wu", "box": [64, 64], "swizzle": 128}}
    assert "(uint)40960)" in src and "m64n128k16.f32.bf16.bf16" in src
    loads = re.findall(r"complete_tx__bytes\([^;]*?(X|Wg|Wu)__tmap_ptr", src)
    assert loads.count("Wg") == loads.count("Wu") == 2 * loads.count("X") == 2 * 2  # 2 bands; prologue + loop
    ws = _schedule("gemm_gated_ws")
    wsrc = build(ws, "cuda").source
    wl = re.findall(r"complete_tx__bytes\([^;]*?(X|Wg|Wu)__tmap_ptr", wsrc)
    assert (wl.count("X"), wl.count("Wg"), wl.count("Wu")) == (1, 2, 2) and "(uint)49152)" in wsrc
    assert "setmaxnreg.inc.sync.aligned.u32 232" in wsrc and wsrc.count("__syncthreads()") == 1
    pp = _schedule("gemm_gated_pingpong_bf16")
    assert pp.warp_tile.mma_groups == 2 and build(pp, "cuda").meta["grid"] == [5, 1, 1]


def test_gated_gemm_registers_count_both_accumulators() -> None:
    """Two accumulators of 64 x n_tile per warpgroup: a 128 x 128 gated tile on two MMA warpgroups holds as
    many accumulator registers as a 128 x 256 plain GEMM (128 floats a thread), plus the second state's
    descriptors; on one warpgroup it holds 256 and is over the 255 (the model charges the spills)."""
    from schedulers.warp_tile import WGMMA_STATE_REGS

    gated, plain = _schedule("gemm_gated_wgmma_2wg"), _schedule("gemm_sigmoid_wgmma_2wg")
    assert plain.tiles == {"m": 128, "n": 256} and gated.tiles == {"m": 128, "n": 128}
    assert block_resources(gated).registers_estimate == block_resources(plain).registers_estimate + WGMMA_STATE_REGS
    assert block_resources(plain).registers_estimate == 40 + 128
    one = schedule(gated.smg, tiles={"m": 128, "n": 128}, serial="k", step=64, tensor_cores=True, stages=2, wgmma=True)
    assert block_resources(one).registers_estimate == 40 + 2 * 2 * 64 + WGMMA_STATE_REGS and block_resources(one).spills
    r = block_resources(_schedule("gemm_gated_ws"))  # setmaxnreg: 232 for the MMA warpgroups, no spill
    assert r.register_cap == 232 and r.registers_per_thread == 168 and not r.spills


def test_cost_model_charges_both_gemms_of_a_gated_gemm() -> None:
    """The gated GEMM at LLaMA's shape against one GEMM of the same shape on the same knobs: twice the
    FLOPs and tensor time, X plus both B tiles through L2 and shared memory per step, one output tile
    stored; its estimate is near twice the GEMM's, and far below the mma.sync schedule it replaced."""
    from schedulers.hardware import H100
    from search.cost import estimate, estimate_us
    from search.warp_tile_cost import _output_columns, step_cost

    knobs = {"tiles": {"m": 128, "n": 128}, "serial": "k", "step": 64, "tensor_cores": True, "stages": 4,
             "warps": 8, "wgmma": True, "tma": True, "producer": True}
    gated = schedule(gated_gemm(2048, 11008, 4096, "silu", "float16"), **knobs)
    plain = schedule(patterns.gemm_epilogue(2048, 11008, 4096, "silu", False, "float16"), **knobs)
    cg, cp = step_cost(gated, H100), step_cost(plain, H100)
    assert cg.tensor_s == pytest.approx(2 * cp.tensor_s) and cg.l2_s == pytest.approx(1.5 * cp.l2_s)
    assert estimate(gated, H100).flops == pytest.approx(2 * estimate(plain, H100).flops)
    assert _output_columns(gated, gated.warp_tile) == _output_columns(plain, plain.warp_tile) == 128
    ratio = estimate_us(gated, H100) / estimate_us(plain, H100)
    assert 1.5 < ratio < 2.2, ratio  # the GEMM alone waits more on its loads per FLOP
    old = schedule(gated.smg, tiles={"m": 128, "n": 64}, serial="k", step=32, tensor_cores=True, stages=3)
    assert estimate_us(gated, H100) < 0.6 * estimate_us(old, H100)  # mma.sync: 1174 us measured on the H100


def test_search_offers_gated_gemms_on_wgmma_and_ranks_one_first() -> None:
    """On sm_90 the gated SMG's candidates include wgmma with TMA, a producer warpgroup, persistent and
    pingpong variants (none on the A100); for LLaMA's shape (2048 x 11008 x 4096) the first pick is a
    wgmma schedule (it was mma.sync on 2752 blocks of 128 threads: 1174 us on the H100)."""
    from schedulers.hardware import A100, H100
    from search.space import SearchSpace
    from spacefusion.frontend.schedules import ranked

    g = gated_gemm(1024, 2816, 256, "silu", "float16")  # more tiles than SMs: persistent grids offered
    wg = [s for s in SearchSpace(g, H100, max_step=64).candidates() if s.wgmma]
    assert all(len(s.warp_tile.gemm_states) == 2 for s in wg)
    assert {(s.tma, s.producer, bool(s.persistent), s.pingpong) for s in wg} >= {
        (True, False, False, False), (True, True, False, False), (True, True, True, False), (True, True, True, True)}
    assert not any(s.wgmma for s in SearchSpace(g, A100, max_step=64).candidates())
    first = ranked(gated_gemm(2048, 11008, 4096, "silu", "float16"))[0]
    assert first.wgmma and first.tma and len(first.warp_tile.gemm_states) == 2
    assert not block_resources(first).spills


@pytest.mark.parametrize(("mnk", "kwargs", "match"), [
    ((256, 256, 256), {"step": 32}, "wgmma: the step 32 must be 64"),
    ((256, 256, 200), {}, "divide 'k' = 200"),
    ((256, 192, 256), {"tiles": {"m": 128, "n": 96}}, "96 columns per block must be a multiple of 64"),
    ((256, 256, 256), {"split": 2}, "no split or early_scores"),
])
def test_gated_gemm_wgmma_refusals(mnk, kwargs, match) -> None:
    opts = {"tiles": {"m": 128, "n": 128}, "serial": "k", "step": 64, "stages": 2, "warps": 8} | kwargs
    with pytest.raises(ScheduleError, match=match):
        schedule(gated_gemm(*mnk, "silu", "float16"), tensor_cores=True, wgmma=True, **opts)


def test_fast_erf_and_tanh_are_within_their_stated_error() -> None:
    """``lower.exprs.erf_fast``'s formula (A&S 7.1.26, its constants as the lowering uses them) and
    ``tanh_fast``'s in float32: within 1e-6 of erf and tanh, odd, saturating to 1."""
    import math

    from spacefusion.lower.exprs import ERF_A, ERF_P, LOG2E

    x = np.linspace(-6.0, 6.0, 100001, dtype=np.float32)
    a = np.abs(x)
    t = np.float32(1.0) / (np.float32(1.0) + np.float32(ERF_P) * a)
    poly = np.float32(ERF_A[-1])
    for c in reversed(ERF_A[:-1]):
        poly = poly * t + np.float32(c)
    y = np.copysign(np.float32(1.0) - poly * t * np.exp2(a * a * np.float32(-LOG2E)), x)
    want = np.array([math.erf(float(v)) for v in x])
    assert np.abs(y - want).max() < 1e-6
    x = np.linspace(-60.0, 60.0, 100001, dtype=np.float32)
    with np.errstate(over="ignore"):  # exp overflows to inf for large |x|: 2 / inf = 0, tanh 1
        e = np.exp2(np.abs(x) * np.float32(2.0 * LOG2E))
        y = np.copysign(np.float32(1.0) - np.float32(2.0) / (np.float32(1.0) + e), x)
    assert np.abs(y - np.tanh(x.astype(np.float64))).max() < 1e-6 and y[-1] == 1.0 and y[0] == -1.0


def test_a_16_bit_gelu_epilogue_uses_the_fast_erf() -> None:
    """A GEMM + GELU stored in fp16 evaluates erf by ``erf_fast`` (a reciprocal, FMAs, one ex2), not CUDA's
    two-branch ``erff``, whose dependent chain was the epilogue's time (BERT's 1024 x 3072 x 768: 29.0 ->
    16.3 us on the H100); numerics: the gelu cases of ``test_warp_tile_kernel_matches_numpy_on_gpu``."""
    src = build(_schedule("gemm_wgmma_tma_slices3_gelu"), "cuda").source
    assert "erff(" not in src and "__fdividef" in src and "exp2f(" in src
    src = build(_schedule("gemm_wgmma_gelu_tanh"), "cuda").source  # GELU-tanh: tanhf likewise
    assert "tanhf(" not in src and "tanh.approx" not in src and "__fdividef" in src
