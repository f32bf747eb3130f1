"""Activations after a GEMM, as one op (``F.gelu``, ``nn.SiLU``) or written out in element-wise ops.

HF writes some activations as arithmetic: GPT-2's and ALBERT's ``gelu_new`` is
``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))`` in six ops.  Rather than one structural
template per spelling, ``written_unary`` collects the element-wise region that reads only ``x`` and
constants, turns it into a sympy expression of ``x`` and compares it with every SMG unary
(``smg.ops.UNARY``) at sample points: any spelling of a known function is recognised, and a near miss
(another constant) is not.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np
import sympy as sp
import torch
from torch import fx

from smg.expr import parse, symbol
from smg.ops import UNARY
from spacefusion.frontend.graph import activation_of, shape

_BINARY = {operator.add: operator.add, torch.add: operator.add, operator.mul: operator.mul, torch.mul: operator.mul,
           operator.sub: operator.sub, torch.sub: operator.sub, operator.truediv: operator.truediv,
           torch.div: operator.truediv, operator.pow: operator.pow, torch.pow: operator.pow}
_METHODS = {"add": operator.add, "mul": operator.mul, "sub": operator.sub, "div": operator.truediv,
            "pow": operator.pow}
_UNARY_FNS = {torch.tanh: sp.tanh, torch.exp: sp.exp, torch.sigmoid: lambda e: 1 / (1 + sp.exp(-e)),
              torch.erf: sp.erf, operator.neg: operator.neg, torch.neg: operator.neg}
_UNARY_METHODS = {"tanh": sp.tanh, "exp": sp.exp, "sigmoid": lambda e: 1 / (1 + sp.exp(-e)), "erf": sp.erf,
                  "neg": operator.neg}
#: ``x`` as the SMG unaries' bodies read it (``smg.expr``: a real value), so the two compare as one function
_X = symbol("x")
#: sample points: both signs, the knee and the tails (a GELU and its tanh form differ by ~1e-3 near |x| = 2)
_POINTS = np.array([-6.0, -3.0, -2.1, -1.3, -0.7, -0.2, 0.0, 0.15, 0.6, 1.1, 1.9, 2.6, 4.0, 7.0])


@dataclass(frozen=True)
class Activation:
    """An activation applied to a GEMM's output: the SMG unary, the nodes computing it, the last one."""

    name: str
    nodes: tuple[fx.Node, ...]
    out: fx.Node


def _sympy_of(node: fx.Node, env: dict[fx.Node, sp.Expr]) -> sp.Expr | None:
    """``node`` as a sympy expression of its inputs in ``env`` (constants taken as numbers), or None."""
    def arg(a: object) -> sp.Expr | None:
        if isinstance(a, fx.Node):
            return env.get(a)
        return sp.Float(a) if isinstance(a, float) else sp.Integer(a) if isinstance(a, int) else None

    args = [arg(a) for a in node.args]
    if node.kwargs or any(a is None for a in args):
        return None
    if node.op == "call_function" and node.target in _BINARY and len(args) == 2:
        return _BINARY[node.target](*args)
    if node.op == "call_method" and node.target in _METHODS and len(args) == 2:
        return _METHODS[node.target](*args)
    if node.op == "call_function" and node.target in _UNARY_FNS and len(args) == 1:
        return _UNARY_FNS[node.target](args[0])
    if node.op == "call_method" and node.target in _UNARY_METHODS and len(args) == 1:
        return _UNARY_METHODS[node.target](args[0])
    return None


def _matches(expr: sp.Expr, name: str) -> bool:
    want = parse(UNARY[name].format(x="x"))
    f, g = (sp.lambdify(_X, e, modules=[{"erf": np.vectorize(math.erf)}, "numpy"]) for e in (expr, want))
    with np.errstate(all="ignore"):
        a, b = np.broadcast_to(f(_POINTS), _POINTS.shape), np.broadcast_to(g(_POINTS), _POINTS.shape)
    return bool(np.all(np.isfinite(b)) and np.allclose(a, b, rtol=1e-6, atol=1e-7))


def written_unary(x: fx.Node, limit: int = 16) -> Activation | None:
    """The SMG unary that the element-wise ops reading ``x`` (and constants) compute, when those ops form a
    region with one output read outside it; None otherwise."""
    env: dict[fx.Node, sp.Expr] = {x: _X}
    order: list[fx.Node] = []
    frontier = list(x.users)
    while frontier and len(order) < limit:
        grew = False
        for node in list(frontier):
            if node in env:
                frontier.remove(node)
                continue
            if not all(a in env for a in node.all_input_nodes):
                continue  # waits for its other inputs (or reads something outside: never joins)
            expr = _sympy_of(node, env)
            frontier.remove(node)
            if expr is None or shape(node) != shape(x):
                continue
            env[node] = expr
            order.append(node)
            frontier += [u for u in node.users if u not in frontier]
            grew = True
        if not grew:
            break
    inside = set(order) | {x}
    outs = [n for n in order if any(u not in inside for u in n.users) or not n.users]
    if len(outs) != 1 or any(u not in inside for u in x.users):
        return None
    out = outs[0]
    # the region is what ``out`` depends on; a node inside that ``out`` does not read is not the activation's
    needed, stack = set(), [out]
    while stack:
        n = stack.pop()
        if n in needed or n is x:
            continue
        needed.add(n)
        stack += n.all_input_nodes
    if needed != set(order):
        return None
    for name in UNARY:
        if _matches(env[out], name):
            return Activation(name, tuple(order), out)
    return None


def activation_after(y: fx.Node, gm: fx.GraphModule) -> Activation | None:
    """The activation applied to ``y`` (a GEMM's output): one op, its only reader (``activation_of``), or a
    written-out region (``written_unary``)."""
    users = list(y.users)
    if len(users) == 1 and (name := activation_of(users[0], gm)) is not None:
        return Activation(name, (users[0],), users[0])
    return written_unary(y)
