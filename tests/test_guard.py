"""T5's fp16 overflow guard (``frontend.guard``) and the barrier cut that schedules it (``schedulers.barrier``).

The guard ``clamp(h, -c, c)``, ``c = where(isinf(h).any(), max - 1000, max)``, is a reduction over every dim
read back along all of them: nothing can be cut into blocks, so the flag is materialised first (a split
reduction whose partial totals the tail re-reduces) and the clamp runs in the kernel of the norm that reads
it.  Checked here against torch's own ops, with and without an overflow in the tensor (the only case where
the clamp changes anything).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spacefusion
from schedulers.barrier import TAIL_PARTS, Barrier, find_barrier, stages
from schedulers.spatial import cuttable
from smg import patterns
from smg.fold import fold_dims, fold_reason
from smg.ops import Builder
from spacefusion.frontend import builders
from spacefusion.frontend.guard import Guard

GUARD = Guard(None, 64504.0, 65504.0, ())  # T5's constants in fp16 (the nodes are not needed to build)


def _torch_guard(h: torch.Tensor) -> torch.Tensor:
    """HF T5's code, as it is written there."""
    c = torch.where(torch.isinf(h).any(), torch.finfo(h.dtype).max - 1000, torch.finfo(h.dtype).max)
    return torch.clamp(h, min=-c, max=c)


class _GuardedNorm(torch.nn.Module):
    """A residual add, T5's guard, and T5's RMSNorm of the result, which is also returned (as T5 passes it on)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = _torch_guard(x + r)
        var = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        y = self.weight * (h * torch.rsqrt(var + 1e-6)).to(self.weight.dtype)
        return y, h


class _GuardOnly(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _torch_guard(x * 2.0) * 0.5


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN equal to NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _overflowing(rows: int, n: int, seed: int, inf: bool) -> torch.Tensor:
    """fp16 rows with values near the clamp bounds (which the guard changes only when an inf is present),
    a NaN, and where ``inf``, one infinity."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g).half()
    x[0, 1], x[1, 2], x[2, 3], x[3, 0] = 64600.0, -65504.0, 64000.0, float("nan")
    if inf:
        x[int(torch.randint(rows, (1,), generator=g)), int(torch.randint(n, (1,), generator=g))] = float("inf")
    return x


def test_the_barrier_is_found_only_where_no_dim_can_be_cut() -> None:
    smg = builders.norm("rmsnorm", 64, 128, False, True, "float16", 1e-6, guard=GUARD)
    assert cuttable(smg) == ()
    b = find_barrier(smg)
    assert isinstance(b, Barrier) and b.state == "F", b
    assert "F reduces over m, n and T reads it back along them" in b.reason
    assert [d.name for d in b.head.dims] == ["n"] and b.head.dim_sizes["n"] == 64 * 128  # folded flat
    assert cuttable(b.tail) == ("m",) and "F" in b.tail.inputs
    for plain in (patterns.rmsnorm(64, 128), patterns.softmax(64, 128)):
        assert isinstance(find_barrier(plain), str)


@pytest.mark.parametrize("rows,n", [(64, 128), (32, 64), (1024, 768)])
def test_the_heads_partial_totals_are_reduced_by_the_tail(rows: int, n: int) -> None:
    """Two kernels: the partial (its chunks of the flat tensor) and the tail, which totals them itself
    before its loop, with as many chunks as still leave its rows to cut (a small graph takes fewer)."""
    b = find_barrier(builders.norm("rmsnorm", rows, n, False, True, "float16", 1e-6, guard=GUARD))
    (partial, rename), (tail, _) = stages(b)
    assert rename == {"F": "F_p"} and partial.outputs == ("F",)
    parts = partial.space("F").dims
    assert len(parts) == 1 and 2 <= partial.dim_sizes[parts[0]] <= TAIL_PARTS
    assert "F_p" in tail.inputs and set(tail.outputs) == {"Y", "T"} and cuttable(tail) == ("m",)
    assert any(op.out == "F" and op.reduce for op in tail.ops)


def test_a_pair_of_dims_reduced_together_folds() -> None:
    g = Builder("flat_max", "float16")
    x = g.input("X", {"m": 8, "n": 16})
    whole = g.build(g.reduce(x, ("m", "n"), "max", name="F"))
    folded = fold_dims(whole, "m", "n")
    assert folded.dim_sizes == {"n": 128} and folded.ops[0].reduce == ("n",)
    g = Builder("row_max", "float16")
    x = g.input("X", {"m": 8, "n": 16})
    assert fold_reason(g.build(g.reduce(x, "n", "max", name="F")), "m", "n") is not None  # rows stay rows


def test_t5_fp16_guard_is_fused_into_its_norms() -> None:
    """T5's encoder in fp16 (the guard is only there in fp16): every guard is fused with the norm after it,
    nothing of it is left to torch, and the model matches eager."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(1)
    cfg = transformers.T5Config(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2, vocab_size=100)
    model = transformers.T5EncoderModel(cfg).eval().half()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    compiled = spacefusion.compile(model, target="reference")
    with torch.no_grad():
        want, got = model(input_ids=ids).last_hidden_state, compiled(input_ids=ids).last_hidden_state
    torch._dynamo.reset()
    report = str(compiled.spacefusion)
    labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
    assert sum(lab.startswith("inf guard + rmsnorm") for lab in labels) == 4, report  # 2 layers x 2 sub-layers
    assert "as 2 kernels: F reduces over m, n" in report, report
    for op in ("torch.isinf", "Tensor.any", "torch.clamp"):
        assert op not in report, report
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("inf", [False, True])
def test_a_guard_without_a_norm_is_fused_alone(inf: bool) -> None:
    torch._dynamo.reset()
    model = _GuardOnly()
    compiled = spacefusion.compile(model, target="reference")
    x = _overflowing(8, 32, 3, inf) / 2
    with torch.no_grad():
        want, got = model(x), compiled(x)
    torch._dynamo.reset()
    labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
    assert labels == ["inf guard 8x32 float16"], str(compiled.spacefusion)
    assert _same(got, want)


@pytest.fixture(scope="module")
def llvm_guarded_norm():
    torch._dynamo.reset()
    model = _GuardedNorm(64).half().eval()
    compiled = spacefusion.compile(model, target="llvm")
    x = _overflowing(32, 64, 0, False)
    with torch.no_grad():
        compiled(x, torch.zeros_like(x))  # built here, once
    yield model, compiled
    torch._dynamo.reset()


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), inf=st.booleans())
def test_guarded_norm_kernels_match_torch(llvm_guarded_norm, seed: int, inf: bool) -> None:
    """TVM's llvm kernels of the residual add (in torch: the add's producer is no GEMM here), the guard and
    the norm: the clamped stream equals torch's bit for bit (NaN included), the norm within fp16 rounding;
    with an inf somewhere, values past 64504 are clamped in every row, without one nothing is."""
    model, compiled = llvm_guarded_norm
    x = _overflowing(32, 64, seed, inf)
    r = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed + 1)).half() / 8
    r[0, 1] = r[1, 2] = r[2, 3] = 0.0
    with torch.no_grad():
        (wy, wh), (gy, gh) = model(x, r), compiled(x, r)
    assert _same(gh, wh)
    assert (gh[0, 1].item() == 64512.0) == inf  # 64504 rounds to 64512 in fp16, as torch's bound does
    finite = wy.isfinite() & gy.isfinite()
    assert torch.equal(finite, wy.isfinite())
    np.testing.assert_allclose(gy[finite].float().numpy(), wy[finite].float().numpy(), rtol=1e-2, atol=1e-2)
    labels = [s.label for p in compiled.spacefusion.partitions for s in p.subgraphs]
    assert any(lab.startswith("inf guard + rmsnorm (clamped kept)") for lab in labels), labels


@pytest.mark.cuda
@pytest.mark.parametrize("inf", [False, True])
def test_guarded_norm_on_gpu_kernels(inf: bool, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on the GPU ("cuda" target, one CUDA graph replay): partial flags, then the tail's kernel."""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    torch._dynamo.reset()
    model = _GuardedNorm(768).half().eval().cuda()
    compiled = spacefusion.compile(model, mode="reduce-overhead", measure=False)
    with torch.no_grad():
        for seed in (0, 1):
            x = _overflowing(1024, 768, seed, inf).cuda()
            r = torch.zeros_like(x)
            (wy, wh), (gy, gh) = model(x, r), compiled(x, r)
            assert _same(gh, wh)
            finite = wy.isfinite()
            torch.testing.assert_close(gy[finite].float(), wy[finite].float(), rtol=1e-2, atol=1e-2)
    torch._dynamo.reset()
    assert "inf guard + rmsnorm (clamped kept) 1024x768" in str(compiled.spacefusion)


def test_a_barriers_kernels_are_tuned_each_and_built_from_the_database(tmp_path) -> None:
    """Tuning measures the barrier's two kernels (the whole graph has no schedule); a build from that database
    takes each one's best, and the model still matches torch."""
    from spacefusion.frontend.tune import captured_partitions, tune_partitions
    from spacefusion.runners import LLVMRunner

    torch._dynamo.reset()
    model = _GuardedNorm(64).half().eval()
    x, r = _overflowing(32, 64, 5, True), torch.zeros(32, 64).half()
    parts = captured_partitions(model, x, r)
    torch._dynamo.reset()
    report = tune_partitions(parts, LLVMRunner(repeats=1, warmup=0), tmp_path / "t.db", target="llvm", trials=2,
                             batch=2, progress=False)
    names = [t.label for t in report.tuned]
    assert len(names) == 2 and names[0].endswith(".head.partial]") and names[1].endswith(".tail]"), names
    assert all(t.summary.best is not None for t in report.tuned)
    compiled = spacefusion.compile(model, target="llvm", db=tmp_path / "t.db")
    with torch.no_grad():
        (wy, wh), (gy, gh) = model(x, r), compiled(x, r)
    torch._dynamo.reset()
    assert _same(gh, wh)
    torch.testing.assert_close(gy.float(), wy.float(), rtol=1e-2, atol=1e-2, equal_nan=True)
