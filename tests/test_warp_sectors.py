"""The CUDA-core model's L1 sector term (``search.simt_memory.warp_sectors``): a warp load whose 32 addresses
spread over more 32-byte sectors than its bytes need costs L1 time.  Judged on the committed H100 rounds of the
split GroupNorm's partial kernel (experiments/tuning/raw/groupnorm_round_h100/: 8 candidates each, checked
against the reference before they were timed, L2 flushed), where lanes along the strided pixels read 8 bytes a
sector and measured 1.4x slower than a warp along the contiguous channels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import search.simt_memory as sm
from schedulers.hardware import H100
from schedulers.schedule import Schedule, make_schedule
from schedulers.split import split_reduction
from search.cost import estimate_us
from search.metrics import top1_slowdown
from smg import patterns
from smg.fold import fold_all

ROUNDS = Path(__file__).resolve().parents[1] / "experiments" / "tuning" / "raw" / "groupnorm_round_h100"


def _round(name: str) -> list[tuple[Schedule, float]]:
    manifest = json.loads((ROUNDS / f"{name}.manifest.json").read_text())
    results = json.loads((ROUNDS / f"{name}.json").read_text())["results"]
    out = []
    for cand, res in zip(manifest["candidates"], results, strict=True):
        assert cand["schedule_key"] == res["schedule_key"]
        if res["latencies_us"] and not res["error"]:
            out.append((Schedule.from_json(json.dumps(cand["schedule"])), min(res["latencies_us"])))
    return out


def _partial(pixels: int = 4096, channels: int = 320):
    g = patterns.group_norm(2, pixels, 32, channels, act="silu", dtype="float16")
    return fold_all(split_reduction(g, "s", 32).partial)


def test_a_warp_along_contiguous_channels_reads_whole_sectors():
    k = _partial()  # X [s_part, s2, c]: c contiguous
    along = make_schedule(k, tiles={"s_part": 1, "c": 64}, serial="s2", step=16, thread_dim="c")
    assert sm.warp_sectors(along, "X") == (2, 64)  # 32 lanes x 2 bytes, two sectors
    lanes = make_schedule(k, tiles={"s_part": 1, "c": 64}, serial="s2", step=16, thread_dim="c", lanes=8)
    assert sm.warp_sectors(lanes, "X") == (8, 64)  # 8 pixel rows x 4 channels: 8 bytes a sector
    narrow = make_schedule(k, tiles={"s_part": 4, "c": 8}, serial="s2", step=16, thread_dim="c")
    assert sm.warp_sectors(narrow, "X") == (4, 64)  # 4 chunk rows x 8 channels


def test_the_sector_term_charges_only_the_strided_lanes(monkeypatch):
    k = _partial()
    along = make_schedule(k, tiles={"s_part": 1, "c": 64}, serial="s2", step=16, thread_dim="c")
    lanes = make_schedule(k, tiles={"s_part": 1, "c": 64}, serial="s2", step=16, thread_dim="c", lanes=8)
    with_term = estimate_us(along, H100), estimate_us(lanes, H100)
    monkeypatch.setattr(sm, "L1_SECTORS_PER_CLK", float("inf"))
    assert estimate_us(along, H100) == with_term[0]
    # 6 extra sectors (8 where 2 would do) for each 64-byte warp load of a 5.2 MB image, an SM clock each
    assert with_term[1] - estimate_us(lanes, H100) == pytest.approx(5.24e6 / 64 * 6 / (132 * 1.98e9) * 1e6, rel=0.01)


@pytest.mark.parametrize("name", ["512x512x128_partial", "256x256x256_partial"])
def test_the_model_picks_near_the_best_of_each_measured_partial_round(name, monkeypatch):
    rnd = _round(name)
    est, meas = [estimate_us(s, H100) for s, _ in rnd], [m for _, m in rnd]
    assert top1_slowdown(est, meas) <= 1.05 if name.startswith("512") else top1_slowdown(est, meas) <= 1.6
    if name.startswith("512"):  # without the term every warp shape ties and the first key wins: 55.6 us, 1.18x
        monkeypatch.setattr(sm, "L1_SECTORS_PER_CLK", float("inf"))
        flat = [estimate_us(s, H100) for s, _ in rnd]
        assert top1_slowdown(flat, meas) > 1.15


def _stats(pixels: int, channels: int):
    g = patterns.group_norm(1, pixels, 32, channels, act="silu", dtype="float16")
    return split_reduction(g, "s", 64).kernels[1]  # reads N_sum_p [n, s_part, g, c_part]: c_part innermost


def test_stats_lanes_spread_over_the_chunks_and_channels():
    """A stats kernel's lanes over the chunks alone read one float from each group's row of channels; spread
    over (chunk, channel) (``schedule.lane_spread``, as ``lower.tir`` emits it) consecutive lanes read
    consecutive channels."""
    from schedulers.schedule import lane_spread

    k = _stats(128 * 128, 512)  # 16 channels a group
    s = make_schedule(k, tiles={"n": 1, "g": 1}, serial="s_part", step=64, thread_dim="g", lanes=32)
    assert lane_spread(s, ("c_part",), k.space("N_sum_p").dims) == ("s_part", "c_part")
    assert sm.warp_sectors(s, "N_sum_p") == (4, 128)  # 2 chunks x 16 channels of 4 bytes
    one = make_schedule(k, tiles={"n": 1, "g": 1}, serial="s_part", step=64, thread_dim="g")
    assert lane_spread(one, ("c_part",), k.space("N_sum_p").dims) is None


def test_a_spread_stats_kernel_builds_for_cuda(tmp_path):
    """The spread form lowers and nvcc compiles it (its numerics are checked on the GPU: the cuda tests of
    tests/test_split.py and experiments/run_artefacts_gpu.py)."""
    import shutil

    from spacefusion.api import build

    k = _stats(64 * 64, 320)  # 10 channels a group: the flattened tail is guarded
    s = make_schedule(k, tiles={"n": 1, "g": 1}, serial="s_part", step=64, thread_dim="g", lanes=32)
    art = build(s, "cuda")
    assert "% 10" in art.source or "%10" in art.source  # the lane's channel: its flattened index mod 10
    if shutil.which("nvcc"):
        art.save(tmp_path / "k", compile_cubin=True)
        assert (tmp_path / "k" / "kernel.cubin").is_file()


def test_the_model_reads_spread_lanes_as_coalesced():
    """Where the lanes spread onto the innermost dim the device traffic is not charged whole sectors per
    element; one thread per group looping over the channels still is."""
    from search.cost import _uncoalesced_reads

    k = _stats(128 * 128, 512)
    spread = make_schedule(k, tiles={"n": 1, "g": 1}, serial="s_part", step=64, thread_dim="g", lanes=32)
    alone = make_schedule(k, tiles={"n": 1, "g": 2}, serial="s_part", step=64, thread_dim="g")
    assert "N_sum_p" not in _uncoalesced_reads(spread)
    assert "N_sum_p" in _uncoalesced_reads(alone)
