"""The workloads of the paper, built from ``smg.ops`` (no special cases)."""

from __future__ import annotations

import dataclasses
import math

from smg.ir import SMG
from smg.ops import Builder


def mha(batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int,
        dtype: str = "float16", scale: float | None = None) -> SMG:
    """``O = softmax(Q K^T * scale) V`` over (b, h, m, l, d); output dims (b, h, m, n)."""
    g = Builder("mha", dtype)
    q = g.input("Q", {"b": batch, "h": heads, "m": seq_q, "d": head_dim})
    k = g.input("K", {"b": batch, "h": heads, "l": seq_kv, "d": head_dim})
    v = g.input("V", {"b": batch, "h": heads, "l": seq_kv, "n": head_dim})
    s = g.matmul(q, k, reduce="d", name="S")
    s = g.scale(s, 1.0 / math.sqrt(head_dim) if scale is None else scale, name="Ss")
    p = g.softmax(s, "l", name="P")
    o = g.matmul(p, v, reduce="l", name="O")
    sc = 1.0 / math.sqrt(head_dim) if scale is None else scale
    return dataclasses.replace(g.build(o), attrs=(("scale", repr(sc)),))


def softmax_gemm(m: int, l: int, n: int, dtype: str = "float16") -> SMG:  # noqa: E741
    """``O = softmax(S) @ V`` with S[m, l], V[l, n]."""
    g = Builder("softmax_gemm", dtype)
    s = g.input("S", {"m": m, "l": l})
    v = g.input("V", {"l": l, "n": n})
    p = g.softmax(s, "l", name="P")
    return g.build(g.matmul(p, v, reduce="l", name="O"))


def gemm(m: int, n: int, k: int, dtype: str = "float32") -> SMG:
    """``C[m, n] = sum_k A[m, k] B[n, k]`` (the paper's GEMM convention)."""
    g = Builder("gemm", dtype)
    a = g.input("A", {"m": m, "k": k})
    b = g.input("B", {"n": n, "k": k})
    return g.build(g.matmul(a, b, reduce="k", name="C"))


def simplified_mha(seq: int, feat: int) -> SMG:
    """Figure 1 of the paper: QK = GEMM(Query, Key); Max; Exp = exp(QK - Max);
    Sum; Softmax = Exp / Sum; Out = GEMM(Softmax, Value), with L = seq, K = feat."""
    g = Builder("simplified_mha")
    q = g.input("Query", {"m": seq, "k": feat})
    k = g.input("Key", {"l": seq, "k": feat})
    v = g.input("Value", {"l": seq, "n": feat})
    qk = g.matmul(q, k, reduce="k", name="QK")
    mx = g.reduce(qk, "l", "max", name="Max")
    ex = g.map("exp(QK - Max)", qk, mx, name="Exp")
    sm = g.reduce(ex, "l", "sum", name="Sum")
    p = g.binary("div", ex, sm, name="Softmax")
    return g.build(g.matmul(p, v, reduce="l", name="Out"))


WORKLOADS = {"mha": mha, "softmax_gemm": softmax_gemm, "gemm": gemm}
