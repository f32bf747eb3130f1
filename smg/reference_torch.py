"""Unfused torch evaluation of an SMG: a GPU runner's reference and eager baseline for graphs it has
no hand-written torch form of (LLaMA's gated MLP input), read off the ops as ``smg.reference`` does.

A GPU machine has torch and no TVM: a kernel artefact's graph travels beside it as ``smg.json``
(``save_smg``), and this module evaluates it with torch only -- a sum of a product of two spaces as
``torch.einsum`` (cuBLAS), every other op as its sympy body on broadcast views, then its reduction.
A read at ``d + c`` along one dim (``Builder.shift``: RoPE's rotate-half) is the tensor shifted along it,
zero outside.  Ops that gather through other index expressions (windows, ``floor``) or read their indices
(masks) are refused: those workloads have torch forms of their own in ``experiments/run_artefacts_gpu.py``.
"""

from __future__ import annotations

import functools
import json
import math
import operator
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smg.expr import Role, body_expr, index_symbols, parse, symbol
from smg.ir import SMG, Op

if TYPE_CHECKING:
    import sympy as sp

#: the graph of a kernel artefact, beside kernel.json
SMG_FILE = "smg.json"

_FUNCS = {"exp": "exp", "log": "log", "tanh": "tanh", "erf": "erf", "sqrt": "sqrt", "Abs": "abs"}


def save_smg(folder: str | Path, smg: SMG) -> Path:
    """Write ``smg`` into artefact folder ``folder`` (``SMG_FILE``) for a TVM-free runner's reference."""
    from smg.serialize import smg_to_dict

    path = Path(folder) / SMG_FILE
    path.write_text(json.dumps(smg_to_dict(smg), indent=1) + "\n")
    return path


def load_smg(folder: str | Path) -> SMG | None:
    """The graph saved beside an artefact by ``save_smg``, or None when there is none."""
    from smg.serialize import smg_from_dict

    path = Path(folder) / SMG_FILE
    return smg_from_dict(json.loads(path.read_text())) if path.is_file() else None


def input_scales(smg: SMG) -> dict[str, float]:
    """A factor per input for random unit-variance inputs: ``K ** -0.25`` for the longest sum of products
    that reads it (1 if none), so a GEMM of two such inputs over K has unit variance again.  Unscaled,
    LLaMA's gated GEMM (k = 4096) has G and U of standard deviation 64 and ``silu(G) * U`` past fp16's
    65504 in some elements."""
    longest = {n: 1 for n in smg.inputs}
    for op in smg.ops:
        if op.combiner == "sum" and op.reduce and len(op.inputs) > 1:
            extent = math.prod(smg.dim_sizes[d] for d in op.reduce)
            for a in op.inputs:
                if a.space in longest:
                    longest[a.space] = max(longest[a.space], extent)
    return {n: float(k) ** -0.25 for n, k in longest.items()}


def evaluate_torch(smg: SMG, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Every op of ``smg`` unfused on torch tensors, in the inputs' dtype and device; the outputs.  A row
    whose every value is -inf has softmax 0 (``smg.reference.guarded_reads``), as the kernels give it."""
    import torch

    from smg.reference import guarded_reads

    env = dict(inputs)
    for op in smg.ops:
        rules = guarded_reads(smg, op)
        reads = env if not rules else {**env, **{
            n: torch.where(env[n] == (-math.inf if r == "max" else 0.0),
                           torch.zeros_like(env[n]) if r == "max" else torch.ones_like(env[n]), env[n])
            for n, r in rules.items()}}
        env[op.out] = _evaluate_op(op, reads, smg.dim_sizes)
    return {o: env[o] for o in smg.outputs}


def _evaluate_op(op: Op, env: Mapping[str, Any], sizes: Mapping[str, int]) -> Any:
    import torch

    shifted = [_shifts(a.index) for a in op.inputs]
    if any(sh is None for sh in shifted) or index_symbols(op):
        raise ValueError(f"op {op.out!r} gathers or reads its indices; the torch reference takes plain ops and "
                         f"shifts (d + c) only")
    expr = body_expr(op)
    ins = [_shifted(env[a.space], sh, sizes) for a, sh in zip(op.inputs, shifted)]
    op = _unshifted(op, shifted)
    syms = [symbol(a.space) for a in op.inputs]
    if op.combiner == "sum" and len(ins) == 2 and expr.is_Mul and set(expr.free_symbols) == set(syms):
        coeff, rest = expr.as_coeff_Mul()
        if rest == syms[0] * syms[1]:  # a GEMM (or any product summed): one einsum
            letters = {d: chr(97 + i) for i, d in enumerate(op.iter_dims)}
            spec = ",".join("".join(letters[d] for d in a.index) for a in op.inputs)
            out = torch.einsum(f"{spec}->{''.join(letters[d] for d in op.out_index)}", *ins)
            return out if coeff == 1 else out * float(coeff)
    shape = tuple(sizes[d] for d in op.iter_dims)
    like = ins[0]
    values = {sym: _aligned(x, a.index, op.iter_dims) for sym, x, a in zip(syms, ins, op.inputs)}
    val = _eval(expr, values, like).expand(shape)
    axes = tuple(range(len(op.out_index), len(op.iter_dims)))
    if op.combiner == "sum":
        return val.sum(dim=axes)
    if op.combiner == "max":
        return val.amax(dim=axes)
    return val.clone()


def _shifts(index: tuple[str, ...]) -> list[tuple[str, int]] | None:
    """(dim, offset) per component of an access whose components are each a dim plus a constant; None
    for any other index expression."""
    out = []
    for comp in index:
        if comp.isidentifier():
            out.append((comp, 0))
            continue
        e = parse(comp, Role.INDEX)
        dims = [x for x in e.free_symbols]
        if len(dims) != 1 or not (e - dims[0]).is_Integer:
            return None
        out.append((dims[0].name, int(e - dims[0])))
    return out


def _shifted(x: Any, shifts: list[tuple[str, int]], sizes: Mapping[str, int]) -> Any:
    """``x`` read at ``d + c`` along each axis with an offset: the iteration's extent of ``d``, 0 outside."""
    import torch

    for axis, (dim, c) in enumerate(shifts):
        if c == 0 and x.shape[axis] == sizes[dim]:
            continue
        idx = torch.arange(sizes[dim], device=x.device) + c
        ok = (idx >= 0) & (idx < x.shape[axis])
        x = x.index_select(axis, idx.clamp(0, x.shape[axis] - 1))
        view = [1] * x.dim()
        view[axis] = -1
        x = torch.where(ok.reshape(view), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x


def _unshifted(op: Op, shifted: list[list[tuple[str, int]]]) -> Op:
    """``op`` with its shifted accesses read plainly (their tensors already shifted by ``_shifted``)."""
    import dataclasses

    inputs = tuple(dataclasses.replace(a, index=tuple(d for d, _ in sh)) for a, sh in zip(op.inputs, shifted))
    return dataclasses.replace(op, inputs=inputs)


def _aligned(x: Any, index: tuple[str, ...], iter_dims: tuple[str, ...]) -> Any:
    """``x`` (dims ``index``) viewed with its axes in ``iter_dims`` order, size 1 where absent."""
    order = [d for d in iter_dims if d in index]
    x = x.permute(*[index.index(d) for d in order])
    return x.reshape([x.shape[order.index(d)] if d in index else 1 for d in iter_dims])


def _eval(e: sp.Expr, values: Mapping[sp.Symbol, Any], like: Any) -> Any:
    """A sympy body on torch tensors (numbers as 0-d tensors of ``like``'s dtype and device)."""
    import torch

    if e.is_Symbol:
        return values[e]
    if e.is_Number:
        return torch.tensor(float(e), dtype=like.dtype, device=like.device)
    args = [_eval(a, values, like) for a in e.args]
    if e.is_Add:
        return functools.reduce(operator.add, args)
    if e.is_Mul:
        return functools.reduce(operator.mul, args)
    if e.is_Pow:
        return args[0] ** args[1]
    name = type(e).__name__
    if name in ("Max", "Min"):
        return functools.reduce(torch.maximum if name == "Max" else torch.minimum, args)
    if name in _FUNCS and len(args) == 1:
        return getattr(torch, _FUNCS[name])(args[0])
    raise ValueError(f"the torch reference has no form of {name} (in {e})")
