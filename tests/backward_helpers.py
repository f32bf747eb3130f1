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


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


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
