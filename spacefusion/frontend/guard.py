"""T5's fp16 overflow guard, recognised in a captured graph and written as SMG ops.

HF's T5 (and the models copied from it) clamps its residual stream after every sub-layer in fp16::

    c = torch.where(torch.isinf(h).any(), finfo.max - 1000, finfo.max)
    h = torch.clamp(h, min=-c, max=c)

Five ops and two full passes over ``h`` each time, 24 times in T5-base's encoder (about half its time on
the H100 when torch runs them).  As SMG ops the flag is a reduction over every dim of ``h`` and the clamp
reads it back along all of them: ``schedulers.barrier`` materialises the flag (a split reduction) and
fuses the clamp into whatever reads ``h`` next (T5's RMSNorm).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from smg.ops import Builder, Tensor
from spacefusion.frontend.graph import dtype, is_function

#: the largest finite value of each dtype: ``isinf(x)`` is ``|x| > max`` (NaN compares false, as isinf says)
FINITE_MAX = {"float16": 65504.0, "bfloat16": float(torch.finfo(torch.bfloat16).max),
              "float32": float(torch.finfo(torch.float32).max)}


@dataclass(frozen=True)
class Guard:
    """``clamp(x, -c, c)`` with ``c = on_inf if isinf(x).any() else bound``; ``nodes`` are its five ops."""

    x: fx.Node
    on_inf: float
    bound: float
    nodes: tuple[fx.Node, ...]


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _is_any(node: object) -> bool:
    """``t.any()`` / ``torch.any(t)`` over every dim."""
    if not isinstance(node, fx.Node) or len(node.args) != 1 or node.kwargs:
        return False
    return node.op == "call_method" and node.target == "any" or is_function(node, (torch.any,))


def guard_of(node: fx.Node) -> Guard | None:
    """The guard whose clamp is ``node``, else None.  Only the written form above: the flag read by nothing
    but the ``where``, the bound by nothing but the clamp and its negation."""
    if not is_function(node, (torch.clamp, torch.clip)) or len(node.args) != 1:
        return None
    x, lo, hi = node.args[0], node.kwargs.get("min"), node.kwargs.get("max")
    if not isinstance(x, fx.Node) or not isinstance(hi, fx.Node) or not isinstance(lo, fx.Node) \
            or set(node.kwargs) != {"min", "max"} or dtype(x) not in FINITE_MAX:
        return None
    if not is_function(lo, (operator.neg, torch.neg)) or lo.args != (hi,) or len(lo.users) != 1:
        return None
    if not is_function(hi, (torch.where,)) or len(hi.args) != 3 or hi.kwargs or set(hi.users) != {lo, node}:
        return None
    flag, on_inf, bound = hi.args[0], _number(hi.args[1]), _number(hi.args[2])
    if on_inf is None or bound is None or not _is_any(flag) or len(flag.users) != 1:
        return None
    inf = flag.args[0]
    if not is_function(inf, (torch.isinf,)) or inf.args != (x,) or inf.kwargs or len(inf.users) != 1:
        return None
    return Guard(x, on_inf, bound, (inf, flag, hi, lo, node))


def clamp_of(node: fx.Node) -> tuple[fx.Node, float, float] | None:
    """(x, lo, hi) of ``torch.clamp(x, min=lo, max=hi)`` with both bounds numbers (Whisper's, BART's and
    other HF models' fp16 guard after a residual add: ``clamp(h, -(finfo.max - 1000), finfo.max - 1000)``,
    unconditional), else None."""
    if not is_function(node, (torch.clamp, torch.clip)) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    a = dict(zip(("input", "min", "max"), node.args)) | dict(node.kwargs)
    lo, hi = _number(a.get("min")), _number(a.get("max"))
    if set(a) != {"input", "min", "max"} or lo is None or hi is None or lo > hi:
        return None
    return node.args[0], lo, hi


def clamped(g: Builder, x: Tensor, lo: float, hi: float, name: str = "T") -> Tensor:
    """``clamp(x, lo, hi)`` as one SMG map, with comparisons so a NaN passes through as torch's clamp passes it."""
    return g.map(f"Piecewise(({hi!r}, {x.name} > {hi!r}), ({lo!r}, {x.name} < {lo!r}), ({x.name}, True))", x,
                 name=name)


def guarded(g: Builder, x: Tensor, guard: Guard, dt: str) -> Tensor:
    """``clamp(x, -c, c)`` as SMG ops on ``x`` (``dt``: its dtype): the flag ``F`` (a max over every dim of
    x's 0/1 overflow), the bound ``C`` and the clamp ``T``, written with comparisons so a NaN passes
    through as torch's clamp passes it."""
    with g.group("inf_flag"):
        inf = g.map(f"Piecewise((1.0, Abs({x.name}) > {FINITE_MAX[dt]!r}), (0.0, True))", x, name="Inf")
        flag = g.reduce(inf, x.dims, "max", name="F")
    with g.group("clamp"):
        c = g.map(f"Piecewise(({guard.on_inf!r}, F > 0.5), ({guard.bound!r}, True))", flag, name="C")
        return g.map(f"Piecewise((C, {x.name} > C), (-C, {x.name} < -C), ({x.name}, True))", x, c, name="T")


__all__ = ["FINITE_MAX", "Guard", "clamp_of", "clamped", "guard_of", "guarded"]
