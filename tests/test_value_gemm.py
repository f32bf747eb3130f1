"""The value-GEMM row (``frontend.value_gemm``, ``patterns.value_gemm``): a batched GEMM of two run-time graph values
(``bmm`` / ``matmul`` / ``einsum``, either operand a transposed view, batch dims broadcast), with a scale and an add
as its epilogue, on llvm against torch; its refusals (``left.value_gemm``); attention GEMMs left to the attention
rows; DeBERTa-v2's content-to-position and position-to-content scores (issue 56); the CUDA build (nvcc)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from smg import patterns
from smg.reference import evaluate
from spacefusion.frontend.capture import capture
from spacefusion.frontend.dynamo import SpaceFusionBackend
from spacefusion.frontend.partition import partition

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
        return self.fn(a, b) if c is None else self.fn(a, b, c)


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


#: (name, the function, its operands' shapes): odd sizes, every layout the row reads where it lies
FORMS = [
    ("bmm", lambda a, b: torch.bmm(a, b), ((3, 7, 5), (3, 5, 9))),
    ("bmm_bt", lambda a, b: torch.bmm(a, b.transpose(-1, -2)), ((3, 7, 5), (3, 9, 5))),  # DeBERTa's c2p
    ("matmul_at", lambda a, b: a.transpose(1, 2) @ b, ((2, 5, 7), (2, 5, 9))),
    ("matmul_4d_bt", lambda a, b: torch.matmul(a, b.transpose(-1, -2)) * 0.5, ((2, 3, 7, 5), (2, 3, 9, 5))),
    ("broadcast_heads", lambda a, b: a @ b, ((2, 3, 7, 5), (2, 1, 5, 9))),
    ("broadcast_2d", lambda a, b: a @ b, ((2, 3, 7, 5), (5, 9))),
    ("einsum", lambda a, b: torch.einsum("bqhd,bkhd->bhqk", a, b), ((2, 7, 3, 5), (2, 9, 3, 5))),
    ("bias", lambda a, b, c: torch.bmm(a, b) / 4 + c, ((3, 7, 5), (3, 5, 9), (9,))),
    ("residual", lambda a, b, c: torch.bmm(a, b) + c, ((3, 7, 5), (3, 5, 9), (3, 7, 9))),
]


@pytest.mark.parametrize("name, fn, shapes", FORMS, ids=[f[0] for f in FORMS])
def test_a_gemm_of_two_values_is_one_kernel_on_llvm(name: str, fn, shapes) -> None:
    xs = [_randn(*s, seed=i) for i, s in enumerate(shapes)]
    model = Fn(fn)
    backend = SpaceFusionBackend("llvm")
    with torch.no_grad():
        got = torch.compile(model, backend=backend, dynamic=False)(*xs)
    torch.testing.assert_close(got, fn(*xs), rtol=1e-5, atol=1e-5)
    p = backend.graphs[0].partition
    assert [s.kind for s in p.subgraphs] == ["value_gemm"], p.summary()
    assert p.coverage().fraction == 1.0, p.summary()
    if name in ("bias", "residual", "matmul_4d_bt"):  # the scale and the add are the GEMM's epilogue
        assert not [op for op in p.left if op.code == "left.elementwise"], p.summary()


def test_a_transposed_operand_is_read_where_it_lies() -> None:
    """``bmm(q, k.transpose(-1, -2))``: B is bound as ``k`` itself, [b, n, k] (K-major), no copy made."""
    q, k = _randn(3, 7, 5, seed=0), _randn(3, 9, 5, seed=1)
    p = partition(capture(Fn(lambda a, b: torch.bmm(a, b.transpose(-1, -2))), q, k).module)
    (sub,) = p.subgraphs
    a, b = sub.operands
    assert (a.shape, b.shape, a.permute, b.permute) == ((3, 7, 5), (3, 9, 5), None, None), sub.operands
    assert sub.smg.space("B").dims == ("b0", "n", "k") and sub.smg.space("A").dims == ("b0", "m", "k")


def test_a_transposed_a_is_copied_with_k_last() -> None:
    """``a.transpose(1, 2) @ b``: A stored [b, k, m] is bound as a packed [b, m, k] copy (the tensor-core GEMM takes
    A with k last only; its H100 kernel of A as it lay returned NaN), B read where it lies."""
    a, b = _randn(2, 5, 7, seed=0), _randn(2, 5, 9, seed=1)
    p = partition(capture(Fn(lambda x, y: x.transpose(1, 2) @ y), a, b).module)
    (sub,) = p.subgraphs
    op_a, op_b = sub.operands
    assert (op_a.ref, op_a.permute, op_a.shape, op_b.permute) == ("a", (0, 2, 1), (2, 7, 5), None), sub.operands
    assert sub.smg.space("A").dims == ("b0", "m", "k") and sub.smg.space("B").dims == ("b0", "k", "n")


def test_the_smg_against_numpy() -> None:
    rng = np.random.default_rng(0)
    a, b, r = rng.standard_normal((4, 7, 3)), rng.standard_normal((6, 3)), rng.standard_normal((4, 7, 6))
    smg = patterns.value_gemm(
        {"b0": 4, "m": 7, "k": 3},
        {"n": 6, "k": 3},
        ("b0", "m", "n"),
        scale=0.25,
        add={"b0": 4, "m": 7, "n": 6},
        dtype="float64",
    )
    np.testing.assert_allclose(evaluate(smg, {"A": a, "B": b, "R": r})["Y"], 0.25 * a @ b.T + r, rtol=1e-12)


REFUSED = [
    (
        "int",
        lambda a, b: torch.bmm(a, b),
        (torch.randint(0, 5, (2, 3, 4)), torch.randint(0, 5, (2, 4, 5))),
        "non-float",
    ),
    ("vector", lambda a, b: torch.matmul(a, b), (torch.randn(2, 3, 4), torch.randn(4)), "1-D operand"),
    (
        "two_contracted",
        lambda a, b: torch.einsum("bij,bij->b", a, b),
        (torch.randn(2, 3, 4), torch.randn(2, 3, 4)),
        "not one GEMM",
    ),
    ("outer", lambda a, b: torch.bmm(a, b), (torch.randn(2, 3, 1), torch.randn(2, 1, 5)), "outer product"),
]


@pytest.mark.parametrize("name, fn, xs, why", REFUSED, ids=[r[0] for r in REFUSED])
def test_what_the_row_cannot_serve_is_refused_with_its_reason(name: str, fn, xs, why: str) -> None:
    p = partition(capture(Fn(fn), *xs).module)
    assert not p.subgraphs, p.summary()
    (left,) = [op for op in p.left if op.op in ("torch.bmm", "torch.matmul", "torch.einsum")]
    assert left.code == "left.value_gemm" and why in left.reason, left


class Attention(nn.Module):
    """A written-out attention: ``softmax(q @ k^T * s) @ v``; ``weights``: the probabilities returned too (the
    eager attention rows leave it then: both GEMMs stay with it, not the value-GEMM row's)."""

    def __init__(self, weights: bool = False) -> None:
        super().__init__()
        self.weights = weights

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.25, dim=-1)
        out = torch.matmul(p, v)
        return (out, p) if self.weights else out


def test_attention_gemms_are_left_to_the_attention_rows() -> None:
    q, k, v = (_randn(1, 2, 16, 16, seed=i) for i in range(3))
    p = partition(capture(Attention(), q, k, v).module)
    assert [s.kind for s in p.subgraphs] == ["attention"], p.summary()
    p = partition(capture(Attention(weights=True), q, k, v).module)
    assert not [s for s in p.subgraphs if s.kind == "value_gemm"], p.summary()
    left = [op for op in p.left if op.op == "torch.matmul"]
    assert len(left) == 2 and all(op.code == "left.value_gemm" and "attention" in op.reason for op in left), left


def test_deberta_c2p_and_p2c_scores_are_fused() -> None:
    """DeBERTa-v2 (tiny, ``experiments/fused_fraction.py``'s config): the 4 ``bmm`` of Q (K) against the position
    keys (queries), each B a transposed view read K-major, are value GEMMs: 24 of 24 matmuls fused, the output
    matching eager (``measure`` raises where not); the ``torch.gather`` of their products stays with torch."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import fused_fraction as ff

    m, compiled = ff.measure("deberta_v2", "reference")
    assert (m.fused, m.total) == (24, 24) and not m.left, m
    subs = [s for p in compiled.spacefusion.partitions for s in p.subgraphs if s.kind == "value_gemm"]
    assert len(subs) == 4 and all(s.smg.space("B").dims == ("b0", "n", "k") for s in subs), subs
    assert all(op.permute is None for s in subs for op in s.operands), subs
    gathers = [op for p in compiled.spacefusion.partitions for op in p.left if op.op == "torch.gather"]
    assert len(gathers) == 4 and all(op.code == "left.gather" for op in gathers), gathers


def test_a_fp16_value_gemm_builds_for_sm90a_on_tensor_cores(tmp_path) -> None:
    """The first pick of a fp16 ``bmm(q, k^T)`` (8 x 64x128x64) lowers to CUDA on tensor cores (``mma``): A
    [b, m, k] and B [b, n, k] as they lie are a layout the warp-tile GEMM takes (at batch 2 the H100 ranking
    puts a CUDA-core schedule first); where nvcc is, it compiles."""
    pytest.importorskip("tvm")
    from spacefusion.api import build
    from spacefusion.frontend.dynamo import first_pick

    smg = patterns.value_gemm(
        {"b0": 8, "m": 64, "k": 64}, {"b0": 8, "n": 128, "k": 64}, ("b0", "m", "n"), dtype="float16"
    )
    folder = build(first_pick(smg), "cuda:sm_90a").save(tmp_path / "k")
    src = (folder / "kernel.cu").read_text()
    assert "__global__" in src and "mma" in src
    assert (folder / "kernel.cubin").is_file() or shutil.which("nvcc") is None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_value_gemms_run_on_the_gpu(tmp_path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """The row's forms on the "cuda" target (TVM builds each first pick, the runtime launches it) against torch on
    the GPU: fp16 at 16-aligned sizes on tensor cores where the first pick is an mma kernel, float32 on CUDA
    cores.  (Run on an H100 from artefacts exported here, ``FORMS`` at these sizes: 17 of the 18 matched torch;
    the fp16 ``matmul_at`` kernel of A as it lay, [b, k, m], returned NaN: A is bound k-last since.)"""
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setenv("SPACEFUSION_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    for name, fn, shapes in FORMS:
        torch._dynamo.reset()  # one ``Fn.forward`` compiled per form: past Dynamo's recompile limit otherwise
        # the last two dims (a bias's one) 16 times larger: sizes the tensor-core GEMM tiles
        xs = [_randn(*s[:-2], *(16 * d for d in s[-2:]), seed=i, dtype=dtype).cuda() for i, s in enumerate(shapes)]
        backend = SpaceFusionBackend("cuda", measure=False)
        with torch.no_grad():
            got = torch.compile(Fn(fn), backend=backend, dynamic=False)(*xs)
            want = fn(*(x.float() for x in xs)).to(dtype)
        tol = 2e-2 if dtype == torch.float16 else 1e-4
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)
        assert backend.graphs[0].partition.counts()["value_gemm"] == 1, (name, str(backend))
