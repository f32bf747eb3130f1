"""RoPE as an SMG (``patterns.rope``): rotate-half as two shifts under zero padding, scheduled as an
element-wise graph along its rows, built for llvm (checked against numpy) and CUDA (compiled), and the
search's first pick at LLaMA-2-7B's prefill shape."""

from __future__ import annotations

import re
import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from schedulers.errors import ScheduleError
from schedulers.hardware import H100
from schedulers.schedule import Schedule, make_schedule
from schedulers.spatial import analyse_spatial, elementwise_serial
from search.cost import estimate
from smg import patterns
from smg.ops import Builder
from smg.reference import evaluate, random_inputs, reduction_length
from smg.tolerance import assert_close
from spacefusion.api import build
from spacefusion.frontend.schedules import model_pick, ranked


def _hf_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """HF's ``q * cos + rotate_half(q) * sin`` on [b, h, s, d] with [1 or b, s, d] tables."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None] + rot * sin[:, None]


def _bhsd(x: np.ndarray, layout: str) -> np.ndarray:
    return x.transpose(0, 2, 1, 3) if layout == "bshd" else x


def _tables(t: np.ndarray, tables: str) -> np.ndarray:
    return t if tables == "per_batch" else t[None]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("tables", ["shared", "per_batch"])
def test_pattern_is_hf_rotate_half(layout: str, tables: str) -> None:
    g = patterns.rope(2, 5, 3, 8, tables=tables, dtype="float32", layout=layout)
    ins = random_inputs(g, seed=1)
    got = _bhsd(evaluate(g, ins)["Y"], layout)
    want = _hf_rope(_bhsd(ins["X"].astype(np.float64), layout), _tables(ins["Cos"], tables),
                    _tables(ins["Sin"], tables))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert g.space("X").dims == (("b", "s", "h", "j") if layout == "bshd" else ("b", "h", "s", "j"))


def test_pattern_refuses_odd_head_dims_and_unknown_options() -> None:
    from smg.errors import ShapeError

    with pytest.raises(ShapeError, match="odd"):
        patterns.rope(1, 4, 2, 7)
    with pytest.raises(ValueError, match="tables"):
        patterns.rope(1, 4, 2, 8, tables="per_head")
    with pytest.raises(ValueError, match="layout"):
        patterns.rope(1, 4, 2, 8, layout="sbhd")


@pytest.mark.parametrize("offset", [-3, 2, 5])
def test_shift_reads_zero_outside_the_dim(offset: int) -> None:
    g = Builder("shifted", "float32")
    x = g.input("X", {"m": 3, "n": 6})
    smg = g.build(g.shift(x, "n", offset, name="Y"))
    ins = random_inputs(smg)
    want = np.zeros((3, 6))
    for j in range(6):
        if 0 <= j + offset < 6:
            want[:, j] = ins["X"][:, j + offset]
    np.testing.assert_array_equal(evaluate(smg, ins)["Y"], want)


def test_shift_refusals() -> None:
    g = Builder("shifted", "float32")
    x = g.input("X", {"m": 3, "n": 6})
    with pytest.raises(ValueError, match="by 0"):
        g.shift(x, "n", 0)
    with pytest.raises(Exception, match="cannot shift"):
        g.shift(x, "k", 1)


# -- scheduling an element-wise graph ---------------------------------------------------------------

def test_elementwise_graph_streams_its_rows() -> None:
    """No op reduces: the outputs' innermost dim (the head dim) is the serial dim, kept whole by the
    spatial slicer; no states; the gathers (shifts) are streamed and the output is inlined into its store."""
    g = patterns.rope(1, 8, 4, 16, layout="bshd")
    assert elementwise_serial(g) == "j"
    dec = {d.dim: d for d in analyse_spatial(g)}
    assert not dec["j"].cut and "element-wise" in dec["j"].reason
    assert all(dec[d].cut for d in "bsh")
    s = make_schedule(g, step=16)
    assert s.serial == "j" and "j" not in s.tiles
    assert s.plan.states == () and s.plan.streamed == ("Xlo", "Xhi") and s.plan.inlined == ("Y",)
    assert s.plan.second_pass == ("Y",) and dict(s.plan.finalize)["Y"].count("Cos") == 1
    assert Schedule.from_json(s.to_json()).key == s.key


def test_graphs_with_reductions_keep_their_serial_rule() -> None:
    assert elementwise_serial(patterns.rmsnorm(4, 8)) is None
    g = Builder("two_rows", "float32")
    a, b = g.input("A", {"m": 2, "n": 4}), g.input("B", {"m": 2, "k": 3})
    two = g.build(g.unary("exp", a, name="Ea"), g.unary("exp", b, name="Eb"))
    assert elementwise_serial(two) is None  # outputs ending in different dims: no row to stream
    with pytest.raises(ScheduleError, match="no reduced dim"):
        make_schedule(two)


def _check_llvm(g, **kw) -> None:
    ins = random_inputs(g, seed=3)
    out = build(make_schedule(g, **kw), "llvm")(ins)
    for name, want in evaluate(g, ins).items():
        assert_close(out[name], want, g.space(name).dtype, reduction_length(g), name)  # smg/tolerance.py


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("kw", [
    dict(step=16), dict(step=4), dict(step=16, tiles={"h": 2, "s": 4}),  # one step, a partial tile, tails
    dict(step=16, vector=4),  # shifts of 8 = two vectors: wide shifted runs, zeros outside
    dict(step=8, vector=8),  # a vector per step, two steps a row
    dict(step=16, vector=2, lanes=2),
])
def test_llvm_build_matches_numpy(layout: str, kw: dict) -> None:
    _check_llvm(patterns.rope(2, 5, 3, 16, tables="per_batch", dtype="float16", layout=layout), **kw)


@pytest.mark.parametrize("offset,vector", [(4, 4), (-8, 4), (3, 4), (2, 1)])
def test_llvm_shift_along_the_serial_dim(offset: int, vector: int) -> None:
    """Offsets that are whole vectors take the wide path (a run wholly inside or outside the row), the
    others the element-wise gather; both read zero outside."""
    g = Builder("shift_add", "float32")
    x, r = g.input("X", {"m": 5, "n": 12}), g.input("R", {"m": 5, "n": 12})
    smg = g.build(g.binary("add", g.shift(x, "n", offset, name="Xs"), r, name="Y"))
    _check_llvm(smg, step=12, vector=vector, tiles={"m": 2})


def test_llvm_shift_along_a_cut_dim() -> None:
    g = Builder("shift_rows", "float32")
    x = g.input("X", {"m": 7, "n": 8})
    _check_llvm(g.build(g.map("2*Xs", g.shift(x, "m", -2, name="Xs"), name="Y")), step=8, tiles={"m": 4})


# -- the search and the CUDA build at LLaMA-2-7B's prefill shape -------------------------------------------

#: b=1, s=2048, 32 heads of 128, fp16, as the LLaMA partition binds Q (bshd: the projection's memory)
LLAMA = dict(batch=1, seq=2048, heads=32, head_dim=128, dtype="float16", layout="bshd")


@cache
def _llama_pick() -> Schedule:
    return ranked(patterns.rope(**LLAMA), H100)[0]


def test_first_pick_is_memory_bound_whole_rows_and_16_byte_vectors() -> None:
    s = _llama_pick()
    g = s.smg
    assert s.serial == "j" and "j" not in s.tiles and s.warp_tile is None
    assert s.vector * 2 == 16 and s.lanes * s.vector <= s.step  # 16-byte fp16 runs along the row
    assert s.num_blocks >= H100.num_sms
    e = estimate(s, H100)
    # every element read once (X, cos, sin) and written once: the shifted reads are the same rows
    elems = 2 * 2048 * 32 * 128 + 2 * 2048 * 128
    assert e.bytes == pytest.approx(2 * elems)
    assert e.memory_s > e.compute_s and e.us < 1.5 * (2 * elems / H100.dram_bandwidth_bytes_per_s * 1e6 + 2)
    assert g.key == patterns.rope(**LLAMA).key


def test_first_pick_builds_for_sm90a_with_wide_shifted_reads() -> None:
    s = _llama_pick()
    pick, tried = model_pick(s.smg, H100, build=lambda c: build(c, "cuda:sm_90a"))
    assert pick.key == s.key and tried == 1
    src = build(s, "cuda:sm_90a").source.split("__global__")[-1]
    # X read at j - 64 and j + 64 as 16-byte runs, zeros where the run lies outside the row
    assert re.search(r"\*\(uint4\*\)\(X_ptr \+ \([^;]*- 64\)\)", src)
    assert re.search(r"\*\(uint4\*\)\(X_ptr \+ \([^;]*\+ 64\)\)", src)
    assert src.count("make_uint4") >= 2
    assert re.search(r"\*\(uint4\*\)\(Y_ptr", src)


@pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").is_file(),
                    reason="nvcc not installed")
def test_first_pick_compiles_to_a_cubin(tmp_path: Path) -> None:
    art = build(_llama_pick(), "cuda:sm_90a")
    assert art.save(tmp_path / "rope", compile_cubin=True).joinpath("kernel.cubin").stat().st_size > 0


def test_interpreter_runs_plain_elementwise_graphs_and_refuses_gathers() -> None:
    """The numpy schedule interpreter follows an element-wise schedule (no states, one pass); RoPE's shifted
    reads it cannot slice per block, and it says so (the llvm kernel is the check there)."""
    from schedulers.interpreter import interpret

    g = Builder("scaled_exp", "float32")
    x, w = g.input("X", {"m": 5, "n": 12}), g.input("W", {"n": 12})
    smg = g.build(g.binary("mul", g.unary("exp", x, name="E"), w, name="Y"))
    s = make_schedule(smg, step=4, tiles={"m": 2})
    ins = random_inputs(smg)
    np.testing.assert_allclose(interpret(s, ins)["Y"], evaluate(smg, ins)["Y"], rtol=1e-12)
    _check_llvm(smg, step=4, tiles={"m": 2})
    with pytest.raises(ScheduleError, match="check the llvm kernel"):
        interpret(make_schedule(patterns.rope(1, 2, 2, 8), step=8), random_inputs(patterns.rope(1, 2, 2, 8)))
