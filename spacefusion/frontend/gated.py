"""Gated linear units found in a graph: ``act(x @ Wg (+ bg)) * (x @ Wu (+ bu))``, one gated GEMM.

Two forms reach the same SMG (``builders.gated_gemm``):

- two linears of one input (LLaMA's ``act_fn(gate_proj(x)) * up_proj(x)``);
- one linear to 2n columns chunked into its halves (diffusers' GEGLU, ``h, gate = proj(x).chunk(2, -1);
  h * gelu(gate)``): each half is the linear of a slice of the weight's rows, so the GEMM reads the two
  slices as its two B operands and the 2n-column output is never written.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from spacefusion.frontend.graph import MUL, Linear, activation_of, is_function, linear_of, shape, single_user


@dataclass(frozen=True)
class Gated:
    """One gated unit: the gate and up linears (for a chunked projection the same one, with the weight rows
    each half reads), the activation's name and every node the fused GEMM replaces."""

    x: fx.Node
    gate: Linear
    up: Linear
    act: str
    gate_rows: tuple[int, int] | None  # the gate's rows of a chunked projection's weight [2n, k]
    up_rows: tuple[int, int] | None
    nodes: tuple[fx.Node, ...]  # the product (the unit's output) last

    @property
    def n(self) -> int:
        return self.gate.n if self.gate_rows is None else self.gate_rows[1] - self.gate_rows[0]

    @property
    def bias(self) -> bool:
        return self.gate.bias is not None


def _chunk_half(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(the chunked value, which half) of ``getitem(x.chunk(2, dim=-1), i)``."""
    if not is_function(node, (operator.getitem,)) or len(node.args) != 2 or not isinstance(node.args[0], fx.Node):
        return None
    ch, i = node.args
    if ch.op == "call_method" and ch.target == "chunk" or ch.op == "call_function" and ch.target is torch.chunk:
        a = dict(zip(("input", "chunks", "dim"), ch.args)) | ch.kwargs
        x, shp = a.get("input"), shape(a.get("input")) if isinstance(a.get("input"), fx.Node) else None
        dim = a.get("dim", 0)
        if a.get("chunks") == 2 and shp is not None and dim in (-1, len(shp) - 1) and isinstance(i, int):
            return x, i
    return None


def _two_linears(act_node: fx.Node, up: fx.Node, act: str, mul: fx.Node, gm: fx.GraphModule) -> Gated | None:
    gate = act_node.args[0]
    lg, lu = linear_of(gate, gm), linear_of(up, gm)
    if lg is None or lu is None or lg.x is not lu.x or (lg.bias is None) != (lu.bias is None) \
            or (lg.k, lg.n) != (lu.k, lu.n) or lg.stored_kn or lu.stored_kn:
        return None
    if not (single_user(gate) is act_node and single_user(act_node) is mul and single_user(up) is mul):
        return None
    return Gated(lg.x, lg, lu, act, None, None, (gate, act_node, up, mul))


def _chunked(act_node: fx.Node, up: fx.Node, act: str, mul: fx.Node, gm: fx.GraphModule) -> Gated | None:
    g_half, u_half = _chunk_half(act_node.args[0]), _chunk_half(up)
    if g_half is None or u_half is None or g_half[0] is not u_half[0] or {g_half[1], u_half[1]} != {0, 1}:
        return None
    proj = g_half[0]
    lin = linear_of(proj, gm)
    chunk = act_node.args[0].args[0]
    if lin is None or lin.stored_kn or lin.n % 2 or single_user(proj) is not chunk or len(chunk.users) != 2:
        return None
    if not (single_user(act_node.args[0]) is act_node and single_user(act_node) is mul and single_user(up) is mul):
        return None
    n = lin.n // 2
    half = {0: (0, n), 1: (n, 2 * n)}
    return Gated(lin.x, lin, lin, act, half[g_half[1]], half[u_half[1]],
                 (proj, chunk, act_node.args[0], up, act_node, mul))


def gated_of(node: fx.Node, gm: fx.GraphModule) -> Gated | None:
    """The gated unit whose product is ``node``, or None."""
    if not is_function(node, MUL) or len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return None
    for act_node, up in (node.args, node.args[::-1]):
        act = activation_of(act_node, gm)
        if act is None or not act_node.args or not isinstance(act_node.args[0], fx.Node):
            continue
        found = _two_linears(act_node, up, act, node, gm) or _chunked(act_node, up, act, node, gm)
        if found is not None and shape(up) == shape(node):
            return found
    return None
