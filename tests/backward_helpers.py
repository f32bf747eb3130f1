"""Run a derived backward's passes on llvm, and the float64 numpy references the tests check them against."""

from __future__ import annotations

import numpy as np

from schedulers.passes import backward_passes
from smg.autodiff import Backward


def run_backward_llvm(bw: Backward, x: dict[str, np.ndarray], seeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The forward (with its saved statistics) then every pass, each scheduled by the slicers, on llvm."""
    from spacefusion.api import build, schedule

    env = dict(x)
    env |= build(schedule(bw.forward), "llvm")(dict(x))
    env |= seeds
    for p in backward_passes(bw):
        env |= build(schedule(p.smg), "llvm")({k: env[k] for k in p.smg.inputs})
    return env


def rel_err(got: np.ndarray, want: np.ndarray, scale: float = 0.0) -> float:
    """Largest error relative to the largest element of ``want`` or ``scale`` (the size of the terms that
    cancel into it: a norm's dX of two elements is ~1e-5 of its terms)."""
    return float(np.abs(got - want).max() / max(np.abs(want).max(), scale, 1e-30))


def attention_grads(q, k, v, do, scale, causal):
    """Unfused float64 attention backward (softmax written out), [b, h, m, d] layout."""
    q, k, v, do = (t.astype(np.float64) for t in (q, k, v, do))
    s = np.einsum("bhmd,bhld->bhml", q, k) * scale
    if causal:
        m, l = s.shape[-2:]
        s = np.where(np.arange(l)[None, :] <= np.arange(m)[:, None], s, -np.inf)
    mx = s.max(-1, keepdims=True)
    e = np.exp(s - mx)
    p = e / e.sum(-1, keepdims=True)
    o = np.einsum("bhml,bhln->bhmn", p, v)
    lse = (mx + np.log(e.sum(-1, keepdims=True)))[..., 0]
    dv = np.einsum("bhml,bhmn->bhln", p, do)
    dp = np.einsum("bhmn,bhln->bhml", do, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhml,bhld->bhmd", ds, k) * scale
    dk = np.einsum("bhml,bhmd->bhld", ds, q) * scale
    return {"O": o, "LSE": lse, "dQ": dq, "dK": dk, "dV": dv}


def _erf(z: np.ndarray) -> np.ndarray:
    import math

    return np.vectorize(math.erf)(z)


def act_and_grad(act: str, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An activation and its derivative, written out by hand in float64 (independent of sympy)."""
    if act == "none":
        return z, np.ones_like(z)
    if act == "sigmoid":
        s = 1 / (1 + np.exp(-z))
        return s, s * (1 - s)
    if act == "silu":
        s = 1 / (1 + np.exp(-z))
        return z * s, s * (1 + z * (1 - s))
    if act == "tanh":
        t = np.tanh(z)
        return t, 1 - t * t
    if act == "gelu":
        cdf = 0.5 * (1 + _erf(z / np.sqrt(2)))
        return z * cdf, cdf + z * np.exp(-z * z / 2) / np.sqrt(2 * np.pi)
    if act == "gelu_tanh":
        c = np.sqrt(2 / np.pi)
        u = c * (z + 0.044715 * z**3)
        t = np.tanh(u)
        return 0.5 * z * (1 + t), 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * 0.044715 * z * z)
    raise ValueError(act)


def layernorm_grads(x, w, b, dy, eps):
    x, w, dy = (t.astype(np.float64) for t in (x, w, dy))
    mu = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    xhat = (x - mu) * rstd
    g = dy * w
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return {"Y": xhat * w + b, "dX": dx, "dW": (dy * xhat).sum(0), "dB": dy.sum(0),
            "scale": float(np.abs(rstd * g).max())}


def rmsnorm_grads(x, w, dy, eps):
    x, w, dy = (t.astype(np.float64) for t in (x, w, dy))
    rstd = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    g = dy * w
    dx = rstd * (g - x * rstd**2 * (g * x).mean(-1, keepdims=True))
    return {"Y": x * rstd * w, "dX": dx, "dW": (dy * x * rstd).sum(0), "scale": float(np.abs(rstd * g).max())}


def gemm_epilogue_grads(a, bw, bias, dy, act):
    a, bw, dy = (t.astype(np.float64) for t in (a, bw, dy))
    z = a @ bw + (0 if bias is None else bias.astype(np.float64))
    y, d = act_and_grad(act, z)
    dz = dy * d
    out = {"Y": y, "dA": dz @ bw.T, "dBw": a.T @ dz}
    if bias is not None:
        out["dbias"] = dz.sum(0)
    return out
