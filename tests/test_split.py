"""Split reductions: a reduction cut across blocks and combined by the derived update functions."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spacefusion
from schedulers.errors import TemporalSliceError
from schedulers.hardware import H100
from schedulers.split import PARTIAL_WARPS_PER_SM, decide_split, split_reduction
from schedulers.temporal import plan_temporal
from smg import patterns
from smg.reference import evaluate
from spacefusion.frontend.backends import LLVMBackend
from spacefusion.frontend.sequence import links


def _run_split(smg, dim: str, parts: int, seed: int = 0) -> tuple[dict, dict]:
    """(the unsplit reference's outputs, the two split graphs' outputs) on one random input."""
    rng = np.random.default_rng(seed)
    ins = {k: (rng.standard_normal(smg.shape(k)) * 3 + 1).astype(np.float32) for k in smg.inputs}
    sp = split_reduction(smg, dim, parts)
    acc = evaluate(sp.partial, {k: ins[k].reshape(sp.partial.shape(k)) for k in sp.partial.inputs})
    link = links(sp)
    got = evaluate(sp.combine, {k: acc[link[k]] if k in link else ins[k] for k in sp.combine.inputs})
    # the three kernels that run (the combine cut in two, coefficients hoisted, dims folded) agree
    env = dict(ins)
    for i, k in enumerate(sp.kernels):
        out = evaluate(k, {n: env[n].reshape(k.shape(n)) for n in k.inputs})
        env |= {(f"{n}_p" if i == 0 else n): v for n, v in out.items()}
    for o in smg.outputs:
        np.testing.assert_allclose(env[o].reshape(got[o].shape), got[o], rtol=1e-9, atol=1e-9)
    return evaluate(smg, ins), got


@pytest.mark.parametrize("make,dim", [
    (lambda: patterns.softmax(4, 512), "n"),  # max then a sum carried by exp(m_old - m_new): flash-decoding's combine
    (lambda: patterns.rmsnorm(3, 256), "n"),  # a streamed X**2 recomputed from the input in each kernel
    (lambda: patterns.layernorm(2, 384), "n"),  # a centred variance: Chan's parallel update
])
def test_split_chains_match_the_unsplit_graph(make, dim) -> None:
    ref, got = _run_split(make(), dim, 8)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-9, atol=1e-9)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 2), groups=st.sampled_from([1, 2, 4]), cg=st.sampled_from([1, 3, 8]),
       pixels=st.sampled_from([16, 48, 96]), parts=st.sampled_from([2, 4, 8]),
       act=st.sampled_from(["none", "silu"]), shift=st.booleans())
def test_group_norm_split_matches_torch(n, groups, cg, pixels, parts, act, shift) -> None:
    """``shift``: of ``X + E[n, g, c]`` (a ResNet block's time embedding added before its GroupNorm)."""
    smg = patterns.group_norm(n, pixels, groups, groups * cg, act, shift=shift)
    ref, got = _run_split(smg, "s", parts, seed=pixels + parts)
    rng = np.random.default_rng(pixels + parts)  # the inputs _run_split drew, in the SMG's input order
    x = (rng.standard_normal((n, pixels, groups, cg)) * 3 + 1)
    if shift:
        x = x + (rng.standard_normal((n, groups, cg)) * 3 + 1)[:, None]
    w, b = rng.standard_normal((groups, cg)) * 3 + 1, rng.standard_normal((groups, cg)) * 3 + 1
    # torch's GroupNorm on the NCHW image (pixels as one spatial dim): the pattern's own meaning
    t = F.group_norm(torch.from_numpy(x).reshape(n, pixels, groups * cg).permute(0, 2, 1), groups,
                     torch.from_numpy(w).reshape(-1), torch.from_numpy(b).reshape(-1), eps=1e-5)
    t = (F.silu(t) if act == "silu" else t).permute(0, 2, 1).reshape(n, pixels, groups, cg).numpy()
    np.testing.assert_allclose(ref["Y"], t, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["Y"], ref["Y"], rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("pixels,cg", [(512 * 512, 4), (3 * 4096, 12), (64 * 64, 16)])
def test_update_functions_derive_at_large_group_sizes(pixels: int, cg: int) -> None:
    """A mean's 1/N is ~1e-6 at a VAE group's 1M elements: the derivative basis (N^-2 terms) must neither
    vanish against an absolute tolerance nor round to a nearby fraction that breaks nilpotency (before
    the fix: 'changes the accumulator when nothing changed' at N = 2^20)."""
    plan = plan_temporal(patterns.group_norm(1, pixels, 32, 32 * cg, "silu", dtype="float16"), "s")
    assert [u.state for u in plan.states] == ["N_sum", "N_sqsum", "N_sqsum__d1", "N_sqsum__d2"]


def test_the_split_is_chosen_for_idle_sms_and_refused_with_reasons() -> None:
    vae = patterns.group_norm(1, 512 * 512, 32, 128, "silu", dtype="float16")
    got = decide_split(vae, H100)
    assert not isinstance(got, str), got
    assert got.dim == "s" and got.parts * 32 >= 2 * H100.num_sms and "32 independent reductions" in got.reason
    assert got.partial.shape("X") == (1, got.parts, 512 * 512 // got.parts, 32, 4)
    # a partial state per thread: the most parts up to PARTIAL_WARPS_PER_SM warps of loads an SM (1024 chunks of
    # 256 pixels; 256 chunks read 67 MB at 1.24 TB/s on the H100, 1024 at 2.1)
    assert got.parts == 1024 and 2 * got.parts * 32 * 4 > PARTIAL_WARPS_PER_SM * 32 * H100.num_sms
    # the second pass cuts the pixels: the combined statistics are recomputed per block (cheaply)
    from schedulers.spatial import analyse_spatial
    s = next(d for d in analyse_spatial(got.combine) if d.dim == "s")
    assert s.cut and "cheap to recompute" in s.reason
    full = decide_split(patterns.group_norm(16, 64 * 64, 32, 512, dtype="float16"), H100)
    assert isinstance(full, str) and "fill" in full
    short = decide_split(patterns.group_norm(2, 16 * 16, 32, 1280, "silu", dtype="float16", shift=True), H100)
    assert not isinstance(short, str) and short.parts == 32, short  # strided group rows: split into short chunks
    # a row with no streamed element-wise tile (no time embedding's add) stays one kernel up to twice as long
    plain = decide_split(patterns.group_norm(2, 16 * 16, 32, 1280, "silu", dtype="float16"), H100)
    assert isinstance(plain, str) and "10240 elements (at most 10240): one kernel" in plain, plain
    assert not isinstance(decide_split(patterns.group_norm(2, 32 * 32, 32, 640, "silu", dtype="float16"), H100), str)
    # rows of up to ONE_KERNEL_MAX_ROW elements stay one kernel (a block a row), idle SMs or not
    small = decide_split(patterns.group_norm(2, 8 * 8, 32, 1280, "silu", dtype="float16"), H100)
    assert isinstance(small, str) and "2560 elements (at most 10240): one kernel" in small, small
    assert not isinstance(decide_split(patterns.group_norm(2, 8 * 8, 32, 1280, "silu", dtype="float16"), H100,
                                       one_kernel_max_row=0), str)
    decode = decide_split(patterns.rmsnorm(1, 4096, "float16"), H100)  # one contiguous row: one kernel
    assert isinstance(decode, str) and "one kernel" in decode, decode
    gemm = decide_split(patterns.gemm_epilogue(16, 64, 8192, "relu", True, "float16"), H100)
    assert isinstance(gemm, str) and "contraction" in gemm
    with pytest.raises(TemporalSliceError, match="equal chunks"):
        split_reduction(vae, "s", 7)


class _Decoder(nn.Module):
    """The VAE decoder's resnet half-block: GroupNorm -> SiLU -> conv, and a GroupNorm without SiLU."""

    def __init__(self) -> None:
        super().__init__()
        self.n1 = nn.GroupNorm(4, 16, eps=1e-6)
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.n2 = nn.GroupNorm(2, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n2(self.conv(F.silu(self.n1(x)))) + 1.0


def test_group_norm_through_dynamo_is_split_and_matches_eager() -> None:
    torch.manual_seed(0)
    model = _Decoder().eval()
    for n in (model.n1, model.n2):
        n.weight.data.uniform_(0.5, 1.5)
        n.bias.data.uniform_(-0.5, 0.5)
    x = torch.randn(1, 16, 32, 32) * 2 + 0.5
    small = dataclasses.replace(H100, name="small", num_sms=32)  # 4 and 2 groups leave it idle
    backend = LLVMBackend(split_hw=small)
    backend.split_kw = {"min_chunk": 64, "one_kernel_max_row": 0}  # rows of 4096 and 8192 elements: split too
    with torch.no_grad():
        compiled = spacefusion.compile(model, target=backend)
        got = compiled(x)
        ref = model(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    labels = sorted(s.label for p in compiled.spacefusion.partitions for s in p.subgraphs)
    assert labels == ["conv 3x3/s1 1x16x32x32 -> 16 float32", "group_norm + silu 1x16x32x32 /4 float32",
                      "group_norm 1x16x32x32 /2 float32"], labels
    assert sum("split into" in why for why in backend.splits.values()) == 2, backend.splits
    text = str(compiled.spacefusion.partitions[0])
    assert text.count("as 3 kernels: ") == 2 and "independent reductions would leave" in text, text


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_group_norm_split_on_gpu_kernels(mode: str | None, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 on the GPU (TVM builds each first pick): a 1x64x128x128 image's 32 groups leave the H100 idle, so
    both GroupNorms run as their three kernels, launch by launch or in the CUDA graph; against eager fp16,
    within a few times eager fp16's own error against float32."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(nn.GroupNorm(32, 64), nn.SiLU(), nn.Conv2d(64, 64, 3, padding=1), nn.GroupNorm(32, 64))
    model = model.eval().cuda().to(memory_format=torch.channels_last)
    x = (torch.randn(1, 64, 128, 128, device="cuda") * 2 + 0.5).to(memory_format=torch.channels_last)
    with torch.no_grad():
        exact = model(x)
        model.half()
        eager = model(x.half())
        compiled = spacefusion.compile(model, mode=mode, measure=False)
        got = compiled(x.half()).clone()
    text = str(compiled.spacefusion)
    assert text.count("as 3 kernels: ") == 2, text
    eager_err = (eager.float() - exact).abs().max().item()
    ours = (got.float() - exact).abs().max().item()
    assert ours <= 4 * eager_err + 1e-3, f"fused fp16 off by {ours}, eager fp16 by {eager_err}\n{text}"


def test_a_saved_split_of_another_rule_is_derived_again(tmp_path) -> None:
    """``split.json`` pins the split an export derived; one written under another rule is not trusted."""
    import json

    from schedulers.split import SplitReduction
    from spacefusion.frontend.backends import CudaBackend

    smg = patterns.group_norm(1, 512 * 512, 32, 128, "silu", dtype="float16")
    backend = CudaBackend(tmp_path, load=False)
    first = backend.split_of(smg)
    path = tmp_path / smg.key[:16] / "split.json"
    assert first is not None and path.is_file()
    saved = json.loads(path.read_text())
    assert SplitReduction.from_dict(smg, saved).kernels == first.kernels
    stale = dict(saved, rule=saved["rule"] - 1, parts=32)
    path.write_text(json.dumps(stale))
    with pytest.raises(ValueError, match="rule"):
        SplitReduction.from_dict(smg, stale)
    again = CudaBackend(tmp_path, load=False).split_of(smg)
    assert again.parts == first.parts and json.loads(path.read_text())["rule"] == saved["rule"]


def test_a_missing_kernel_after_another_rules_split_says_so(tmp_path) -> None:
    """An export whose split.json is another rule's was split where this code keeps one kernel (8x8x1280: rows
    of 2560 elements, one kernel since rule 4): the load-only machine finds no kernel, and says why."""
    import json

    from schedulers.split import SPLIT_RULE
    from spacefusion.frontend.backends import CudaBackend
    from spacefusion.frontend.errors import FrontendError

    smg = patterns.group_norm(2, 64, 32, 1280, "silu", dtype="float16")
    old = dict(split_reduction(smg, "s", 8).to_dict(), rule=SPLIT_RULE - 1)
    (tmp_path / smg.key[:16]).mkdir(parents=True)
    (tmp_path / smg.key[:16] / "split.json").write_text(json.dumps(old))
    with pytest.raises(FrontendError, match=f"split.json was not used: a split decided by rule {SPLIT_RULE - 1}.*"
                                            "export the model again"):
        CudaBackend(tmp_path).compile(smg)


@pytest.mark.parametrize("step", [None, 8])
def test_a_stats_kernel_in_one_step_or_several_matches(step) -> None:
    """The stats kernel's derived auxiliary accumulators (``N_sqsum__d1``...) feed only carries into later steps:
    with the whole chunk dim in one step the lowering leaves them out, and the totals still match."""
    from smg.reference import check_numerics, random_inputs
    from spacefusion.api import build, schedule

    g = patterns.group_norm(1, 256, 4, 8, act="silu")
    stats = split_reduction(g, "s", 16).kernels[1]
    serial = "s_part"
    s = schedule(stats, serial=serial, step=step or stats.dim_sizes[serial])
    assert any(u.space for u in s.plan.states) and (s.num_steps == 1) == (step is None)
    # the stats kernel's inputs as the partial kernel makes them from one image: random partial sums would
    # give negative variances (NaN in the reference, where NaN then only matched NaN)
    img = random_inputs(g, seed=3)
    first = split_reduction(g, "s", 16).kernels[0]  # the same memory seen with its dims merged and split
    partial = evaluate(first, {"X": img["X"].reshape(first.shape("X"))})
    x = {n: (partial[n.removesuffix("_p")] if n.endswith("_p") else img[n]).reshape(stats.shape(n))
         .astype(stats.space(n).dtype) for n in stats.inputs}
    ref = evaluate(stats, x)
    assert all(np.isfinite(v).all() for v in ref.values())
    err, why = check_numerics(stats, ref, build(s, "llvm")(x))
    assert why is None, why


def test_stats_lanes_spread_over_chunks_and_channels_beyond_a_step() -> None:
    """A stats kernel reduces (chunks x channels) per group: its lanes may outnumber a step's positions,
    since the lowering spreads them over both (``schedule.lane_spread``).  A reduction over one dim keeps
    lanes at most a step (more would idle)."""
    from search.space import SearchSpace

    stats = decide_split(patterns.group_norm(2, 1024, 32, 640, "silu", dtype="float16"), H100).kernels[1]
    wide = [s for s in SearchSpace(stats, H100).candidates() if not s.tensor_cores and s.lanes > s.step]
    assert wide and all(s.lanes <= s.step * stats.dim_sizes[({"s_part", "c_part"} - {s.serial}).pop()]
                        for s in wide)
    ln = patterns.residual_layernorm(16, 768, "float16")
    assert all(s.lanes <= s.step for s in SearchSpace(ln, H100).candidates() if not s.tensor_cores)


def test_the_partial_computes_a_streamed_tile_once() -> None:
    """``X + E`` (the time embedding's add) is a map of the partial that every state's body reads, not
    re-expanded into each body: each element is then loaded once, not once per state."""
    smg = patterns.group_norm(2, 64 * 64, 32, 320, "silu", dtype="float16", shift=True)
    got = decide_split(smg, H100)
    assert not isinstance(got, str)
    partial = got.partial
    tile = next(op for op in partial.ops if op.out == "T")
    assert {a.space for a in tile.inputs} == {"X", "E"}
    readers = [op for op in partial.ops if any(a.space in ("X", "E") for a in op.inputs)]
    assert readers == [tile], [op.out for op in readers]


def test_a_decision_to_keep_one_kernel_is_recorded_and_read_back(tmp_path, monkeypatch) -> None:
    """A warm compile reads the recorded decision instead of deriving the norm's update functions again; a
    record made for another machine, rule or chunk setting is decided again."""
    import json

    from schedulers.hardware import H100, get_hardware
    from spacefusion.frontend.backends import CudaBackend

    smg = patterns.layernorm(1024, 768, dtype="float16")
    first = CudaBackend(tmp_path, load=False)
    assert first.split_of(smg) is None
    path = tmp_path / smg.key[:16] / "split.json"
    record = json.loads(path.read_text())
    assert record["hw"] == H100.name and record["one kernel"] == first.splits[smg.key]

    def refuse(*_a, **_k):
        raise AssertionError("decided again")

    monkeypatch.setattr("spacefusion.frontend.backends.decide_split", refuse)
    warm = CudaBackend(tmp_path, load=False)
    assert warm.split_of(smg) is None and warm.splits[smg.key] == first.splits[smg.key]
    other = CudaBackend(tmp_path, load=False, split_hw=get_hardware("H200"))
    with pytest.raises(AssertionError, match="decided again"):
        other.split_of(smg)
    path.write_text(json.dumps(dict(record, rule=record["rule"] - 1)))
    with pytest.raises(AssertionError, match="decided again"):
        CudaBackend(tmp_path, load=False).split_of(smg)
