"""The first pick of row norms is the kernel a hand-writer would write: a row or a few per block, lanes
across the row, 16-byte vectors, enough blocks for the SMs (``search.simt_memory``), and it builds.

The shapes are the whole-model runs' norms (LLaMA-7B's residual RMSNorm with the sum kept, BERT's and
ViT's residual LayerNorm) and plain norms of other widths, down to a decoder's 8 rows.
"""

from __future__ import annotations

import re
import shutil
from functools import cache

import numpy as np
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from schedulers.hardware import H100
from schedulers.schedule import Schedule, make_schedule
from search.cost import _uncoalesced_bytes, estimate_us
from search.simt_memory import dram_bandwidth
from smg.ir import SMG
from smg.reference import evaluate, random_inputs
from spacefusion.api import build
from spacefusion.frontend import builders
from spacefusion.frontend.schedules import ranked

#: name -> builders.norm arguments (kind, rows, width, residual, keep_sum, dtype, eps)
NORMS = {
    "llama_residual_rmsnorm": ("rmsnorm", 2048, 4096, True, True, "float16", 1e-6),
    "bert_residual_layernorm": ("layernorm", 1024, 768, True, True, "float16", 1e-12),
    "vit_residual_layernorm": ("layernorm", 1576, 768, True, True, "float16", 1e-12),
    "llama_rmsnorm": ("rmsnorm", 2048, 4096, False, False, "float16", 1e-6),
    "bert_layernorm": ("layernorm", 1024, 768, False, False, "float16", 1e-12),
    "layernorm_4096x5120": ("layernorm", 4096, 5120, False, False, "float16", 1e-5),
    "rmsnorm_decode_8x4096": ("rmsnorm", 8, 4096, False, False, "float16", 1e-6),
}
#: blocks a grid needs to leave at most 4 of the H100's 132 SMs idle (ties with a block on every SM:
#: the busiest SM holds as many rows either way)
FULL_GRID = 128


@cache
def first_pick(name: str) -> Schedule:
    return ranked(builders.norm(*NORMS[name]), H100)[0]


def _rows(name: str) -> int:
    return NORMS[name][1]


@pytest.mark.parametrize("name", list(NORMS))
def test_first_pick_is_lane_parallel_vectorised_and_fills_the_gpu(name: str) -> None:
    s = first_pick(name)
    assert s.warp_tile is None and s.lanes > 1, s
    item = np.dtype(NORMS[name][5]).itemsize
    assert s.vector * item == 16, s  # 16-byte loads and stores
    assert s.lanes * s.vector <= s.step and _uncoalesced_bytes(s) == 0
    assert s.num_blocks >= min(FULL_GRID, _rows(name)), (s.num_blocks, s)
    assert s.threads >= 32  # whole warps
    if NORMS[name][3]:  # the residual sum T is streamed: kept on chip, the row in one step
        assert s.num_steps == 1, s


@pytest.mark.parametrize("name", ["llama_residual_rmsnorm", "bert_residual_layernorm", "vit_residual_layernorm"])
def test_old_picks_rank_behind(name: str) -> None:
    """The picks of the whole-model runs (32-row blocks of 8 lanes; LLaMA's scalar, in steps of 128)
    and the reverted probe's (8 rows x 32 lanes, scalar) estimate slower than the new first pick."""
    g = builders.norm(*NORMS[name])
    n = g.dim_sizes["n"]
    old = make_schedule(g, {"m": 32}, serial="n", step=128 if n == 4096 else n, lanes=8,
                        vector=1 if n == 4096 else 8, hw=H100)
    probe = make_schedule(g, {"m": 8}, serial="n", step=n, lanes=32, hw=H100)
    best = estimate_us(first_pick(name), H100)
    assert estimate_us(old, H100) > 1.3 * best
    assert estimate_us(probe, H100) > 1.3 * best


def test_vectors_keep_more_bytes_in_flight_than_scalars() -> None:
    """Same schedule, scalar against 16-byte loads: the model no longer ties them."""
    g = builders.norm(*NORMS["bert_residual_layernorm"])
    kw = dict(serial="n", step=768, lanes=32, hw=H100, levels={"W": "global", "B": "global"})
    scalar, vec = (make_schedule(g, {"m": 8}, vector=v, **kw) for v in (1, 8))
    assert dram_bandwidth(vec, H100, 4, 256) > 4 * dram_bandwidth(scalar, H100, 4, 256)
    assert estimate_us(scalar, H100) > 2 * estimate_us(vec, H100)


def test_few_blocks_leave_bandwidth_unused() -> None:
    """BERT's 1024 rows in blocks of 32 use 32 of the 132 SMs: about half the bandwidth of 256 blocks."""
    g = builders.norm(*NORMS["bert_residual_layernorm"])
    kw = dict(serial="n", step=768, lanes=32, vector=8, hw=H100)
    few, many = make_schedule(g, {"m": 32}, **kw), make_schedule(g, {"m": 4}, **kw)
    assert few.num_blocks == 32 and many.num_blocks == 256
    assert dram_bandwidth(few, H100, 1, few.threads) < 0.6 * dram_bandwidth(many, H100, 8, many.threads)


@pytest.mark.parametrize("name", list(NORMS))
def test_first_pick_builds_for_hopper(name: str, tmp_path) -> None:
    art = build(first_pick(name), "cuda:sm_90a")
    assert re.search(r"\*\(uint4\*\)\(X_ptr", art.source)  # 16-byte loads of the row
    if shutil.which("nvcc"):
        assert art.save(tmp_path / name).joinpath("kernel.cubin").stat().st_size > 0


def _small(name: str, rows: int) -> SMG:
    kind, _, n, residual, keep, dtype, eps = NORMS[name]
    return builders.norm(kind, rows, n, residual, keep, dtype, eps)


@pytest.mark.parametrize("name", list(NORMS))
@seed(20261125)
@settings(max_examples=3, deadline=None)
@given(rows=st.integers(1, 24))
def test_first_pick_knobs_on_few_rows_match_the_reference(name: str, rows: int) -> None:
    """The first pick's knobs on a graph of a few rows (tails where the tile does not divide them),
    built for llvm, against the numpy reference."""
    s = first_pick(name)
    g = _small(name, rows)
    levels = {n: lvl for n, lvl in s.memory if n in g.inputs}
    small = make_schedule(g, {"m": min(s.tiles["m"], rows)}, serial=s.serial, step=s.step, lanes=s.lanes,
                          vector=s.vector, levels=levels, hw=H100)
    x = random_inputs(g, seed=rows)
    got = build(small, "llvm")(x)
    for k, want in evaluate(g, x).items():
        err = np.abs(got[k].astype(np.float64) - want).max()
        assert err < 2e-2 * max(1.0, float(np.abs(want).max())), (k, err)
