"""The weight-gradient row (``gemms.match_weight_gradient``, ``patterns.weight_gradient``): ``mm(t(grad), x)``, a
GEMM of two graph values as autograd's backward writes a linear's ``dW = grad.T @ x``, with the bias gradient
``grad.sum(0)`` as a second output.  Training steps that use it are ``tests/test_training.py``'s."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from smg import patterns
from smg.reference import evaluate
from spacefusion.frontend.backends import CudaBackend
from spacefusion.frontend.capture import capture
from spacefusion.frontend.dynamo import SpaceFusionBackend
from spacefusion.frontend.partition import partition


class WeightGrad(nn.Module):
    """What autograd's backward computes for a linear: ``grad.T @ x`` and ``grad.sum(0, keepdim=True)``."""

    def forward(self, grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.mm(grad.t(), x), torch.sum(grad, [0], True)


class PooledWeightGrad(nn.Module):
    """The pooler's weight gradient: its x is ``h[:, 0]``, rows a stride apart (not packed)."""

    def forward(self, grad: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.mm(grad.t(), h[:, 0])


def _inputs(k: int, m: int, n: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(k, m, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)


def test_the_smg_is_grad_t_at_x_and_the_row_sums() -> None:
    g, x = (a.numpy().astype(np.float64) for a in _inputs(24, 16, 8))
    out = evaluate(patterns.weight_gradient(16, 8, 24, bias=True, dtype="float64"), {"G": g, "X": x})
    np.testing.assert_allclose(out["Y"], g.T @ x, rtol=1e-12)
    np.testing.assert_allclose(out["Db"], g.sum(0), rtol=1e-12)
    assert set(patterns.weight_gradient(16, 8, 24).outputs) == {"Y"}


@pytest.mark.parametrize("target", ["reference", "llvm"])
def test_grad_t_at_x_and_its_bias_gradient_are_one_kernel(target: str) -> None:
    grad, x = _inputs(32, 48, 40)
    model = WeightGrad()
    p = partition(capture(model, grad, x).module)
    assert [s.kind for s in p.subgraphs] == ["weight_gradient"], p.summary()
    assert len(p.subgraphs[0].results) == 2 and "+ bias gradient 48x40x32" in p.subgraphs[0].label, p.summary()
    backend = SpaceFusionBackend(target)
    with torch.no_grad():
        got = torch.compile(model, backend=backend, dynamic=False)(grad, x)
    for a, b in zip(got, model(grad, x), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert backend.graphs[0].partition.counts()["weight_gradient"] == 1, str(backend)


def test_an_operand_not_packed_is_bound_as_a_copy() -> None:
    grad, h = torch.randn(4, 24), torch.randn(4, 7, 16)
    model = PooledWeightGrad()
    p = partition(capture(model, grad, h).module)
    (sub,) = p.subgraphs
    x = next(op for op in sub.operands if op.space == "X")
    assert x.permute == (0, 1), sub.operands  # h[:, 0] copied packed; grad read where it lies
    assert next(op for op in sub.operands if op.space == "G").permute is None, sub.operands
    backend = SpaceFusionBackend("reference")
    with torch.no_grad():
        got = torch.compile(model, backend=backend, dynamic=False)(grad, h)
    torch.testing.assert_close(got, model(grad, h), rtol=1e-5, atol=1e-5)


def test_a_gemm_of_two_values_untransposed_is_not_taken() -> None:
    """``a @ b`` of two values with no transposed A is no weight gradient: left to torch, as before."""

    class Plain(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.mm(a, b)

    p = partition(capture(Plain(), torch.randn(8, 16), torch.randn(16, 4)).module)
    assert not p.subgraphs, p.summary()


def test_the_weight_gradient_stays_with_the_library_where_the_backend_says_so() -> None:
    """On the GPU (``CudaBackend.library_first``) a weight gradient is cuBLAS's, in every dtype: no tensor-core
    schedule takes an A stored [k, m], and the CUDA-core kernel is not measured against cuBLAS's SGEMM yet."""
    half = capture(WeightGrad(), *_inputs(32, 16, 16, torch.float16)).module
    p = partition(half, library=CudaBackend.library_first)
    assert not p.subgraphs and p.left_codes()["library.first"] == 1, p.summary()
    assert "stays with cuBLAS" in next(op.reason for op in p.left if op.code == "library.first")
    assert [s.kind for s in partition(half).subgraphs] == ["weight_gradient"]  # no library named: fused
    single = capture(WeightGrad(), *_inputs(32, 16, 16)).module
    p = partition(single, library=CudaBackend.library_first)
    assert not p.subgraphs and p.left_codes()["library.first"] == 1, p.summary()


def test_the_weight_gradient_exports_a_cuda_artefact(tmp_path) -> None:
    """The cuda backend builds its first pick (compile only here; ``test_training``'s cuda test runs it):
    G, X in and Y, Db out as the kernel's parameters."""
    smg = patterns.weight_gradient(64, 64, 32, bias=True)
    backend = CudaBackend(tmp_path, build_missing=True, load=False)
    backend.compile(smg)
    meta = json.loads((backend.artefact_dir(smg) / "kernel.json").read_text())
    roles = {p["name"]: (p["role"], p["shape"]) for p in meta["params"]}
    assert roles == {"G": ("input", [32, 64]), "X": ("input", [32, 64]), "Y": ("output", [64, 64]),
                     "Db": ("output", [64])}, meta["params"]
