"""A training backward's LayerNorm backward as the kernels derived from the LayerNorm SMG (issue 58).

torch's ``native_layer_norm_backward(grad_out, input, [n], mean, rstd, weight, bias, output_mask)`` is replaced by
the passes ``schedulers.passes.backward_passes`` cuts from ``smg.autodiff.derive_backward(patterns.layernorm)``:
``dX`` (a row pass: the two row reductions it reads, ``sum_n W dY (X - mean)`` and ``sum_n dY_xc``, inside it)
and ``dW_dB`` (both reduce over the rows: one pass, running states of a serial walk over them).  The derivation
saves the forward's row ``Y_mean`` and ``Y_rstd``; those are exactly torch's saved ``mean`` and ``rstd``
(``sum_n X / n`` and ``1 / sqrt(biased var + eps)``, [..., 1]), so the passes read the statistics the
fused forward (``patterns.layernorm_stats``) saved and recompute nothing: eps appears only in the forward's
``Y_rstd``, which no backward body reads.  The derivation is always with respect to X, W and B (derived with
respect to W and B alone, ``dW``'s body keeps the rows' dim: ``BackwardError``); ``output_mask`` picks the passes
that run: dW and dB only, where the norm's input needs no gradient (the first norm of a model), is one pass.  A
norm without affine weight is the same derivation with W bound to ones.  fp16/bf16: the derivation in the input's
dtype, its saved statistics retyped to those torch saved (float32 on CUDA, the input's on CPU: ``half_derivation``),
so the passes read them as saved and give dX, dW, dB in the input's dtype, computing in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor

from spacefusion.frontend.derived_calls import derived_kernels, install, mark
from spacefusion.frontend.graph import DTYPES
from spacefusion.frontend.norm_stats import saved_stats_dtypes

#: torch's LayerNorm backward, as a training step's backward ATen graph holds it
LAYER_NORM_BACKWARD = torch.ops.aten.native_layer_norm_backward.default
#: the forward SMG's inputs in ``native_layer_norm_backward``'s gradient order (dX, dW, dB)
_WRT = ("X", "W", "B")
#: the derivation's saved statistics that are torch's saved mean and rstd, in the derived call's order
_STATS = ("Y_mean", "Y_rstd")


def stats_text(stats: str, dt: str) -> str:
    """The report's word for saved statistics stored in ``stats`` where the norm is ``dt``: "float32 " for a
    fp16/bf16 norm's float32 ones, nothing where they are the norm's dtype."""
    return f"{stats} " if stats != dt else ""


class DerivedNormBackward(nn.Module):
    """A norm's backward over the last dim as the derived passes, each built by the stage's kernel backend.
    Called with (grad_out, input, weight or None, *the saved statistics, in ``stats``' order: their SMG names,
    each torch's [..., 1] value); returns one gradient per differentiated input (``bw.grads``' order: X, W, and
    B for LayerNorm), ``None`` where ``mask`` did not ask for it.  dX comes back in input's shape, contiguous
    (torch's ops give it so), dW and dB as [n]; each a fresh tensor (a kernel's outputs are its own)."""

    def __init__(self, bw: Any, passes: Sequence[Any], kernels: Sequence[Any], rows: int, n: int,
                 mask: tuple[bool, ...], stats: tuple[str, ...]) -> None:
        super().__init__()
        self.passes, self.kernels = tuple(passes), tuple(kernels)
        self.seed, self.grads = dict(bw.seeds)["Y"], tuple(bw.grads)
        self.rows, self.n, self.mask, self.stats = rows, n, mask, stats
        wanted = {g for (_, g), want in zip(self.grads, mask) if want}
        self.runs = tuple(i for i, p in enumerate(self.passes) if wanted & set(p.smg.outputs))  # passes asked for

    def forward(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                *stats: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shapes = [x.shape] + [(self.n,)] * (len(self.grads) - 1)
        if any(isinstance(t, FakeTensor) for t in (grad_out, x)):  # shape propagation: no kernel runs
            return tuple(x.new_empty(s) if want else None for s, want in zip(shapes, self.mask))
        m, n = self.rows, self.n
        env = {"X": x.contiguous().reshape(m, n), self.seed: grad_out.contiguous().reshape(m, n),
               "W": weight.contiguous() if weight is not None else x.new_ones(n)}
        env |= {name: t.contiguous().reshape(m) for name, t in zip(self.stats, stats)}
        for i in self.runs:
            env |= self.kernels[i]({name: env[name] for name in self.passes[i].smg.inputs})
        return tuple(env[g].reshape(s).clone() if want else None
                     for (_, g), s, want in zip(self.grads, shapes, self.mask))


def norm_line(head: str, module: DerivedNormBackward) -> str:
    """The report's line of a derived norm backward: ``head``, then the passes it runs."""
    runs = [module.passes[i].name for i in module.runs]
    return f"{head}: {len(runs)} kernel{'s' if len(runs) > 1 else ''} ({', '.join(runs)})"


def attr_tensor(node: fx.Node) -> Any:
    """The tensor a ``get_attr`` node names (a weight: aot's graphs carry no traced value on those), else None."""
    obj = node.graph.owning_module
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def _traced(t: Any) -> Any:
    """The value of a backward op's argument: a node's traced value (a weight's tensor), else ``t`` itself."""
    if isinstance(t, fx.Node):
        return attr_tensor(t) if t.op == "get_attr" else t.meta.get("val")
    return t


def _norm_form(node: fx.Node) -> tuple[tuple | None, Any]:
    """(("layernorm", rows, n): the derived norm backward's cache key, and the gradients asked for; or None, why
    not)."""
    grad_out, x, normalized, mean, rstd, weight, bias, mask = node.args
    vals = [_traced(t) for t in (grad_out, x, mean, rstd, weight, bias)]
    if any(v is None for v in vals[:4]) or any(v is None for v, t in zip(vals[4:], (weight, bias)) if t is not None):
        return None, "a LayerNorm backward of values whose shapes were not traced"
    xs = tuple(vals[1].shape)
    if len(normalized) != 1 or not xs or normalized[0] != xs[-1] or not all(isinstance(s, int) for s in xs):
        return None, (f"a LayerNorm backward over {list(normalized)} of a {list(xs)} input: the derived kernels "
                      "normalise the last dim, at static sizes")
    dt, sdt = DTYPES.get(vals[1].dtype), {DTYPES.get(v.dtype) for v in vals[2:4]}
    stats = next(iter(sdt)) if len(sdt) == 1 else None
    if any(v.dtype != vals[1].dtype for v in (vals[0], *vals[4:]) if v is not None) \
            or not saved_stats_dtypes(dt, dt, stats, dt):
        dts = sorted({str(v.dtype) for v in vals if v is not None})
        return None, (f"a LayerNorm backward in {dts}: the derived kernels take grad, input and weight of one float "
                      "dtype with the statistics in it or float32")
    return ("layernorm", math.prod(xs[:-1]), xs[-1], dt, stats), tuple(bool(b) for b in mask)


def _layernorm_forward(rows: int, n: int, dt: str, stats: str) -> Any:
    """The LayerNorm SMG whose backward is derived: in ``dt``, its saved statistics stored in ``stats``."""
    from smg import patterns

    return half_derivation(patterns.layernorm(rows, n, dt), dict.fromkeys(_STATS, stats))


def half_derivation(fwd: Any, stats: dict[str, str]) -> Any:
    """``derive_backward(fwd)``'s input for a norm whose saved statistics ``stats`` ({space: dtype}) are stored in
    another dtype than ``fwd``'s (float32 for a fp16/bf16 norm): the derivation reads each saved space in its
    dtype and gives the gradients in the forward's (``smg.autodiff``: a gradient is in its input's dtype), every
    body computed in float32 by the kernels.  ``fwd`` itself where nothing differs, so float32's graphs keep
    their keys."""
    from smg.ir import with_dtypes

    differ = {name: dt for name, dt in stats.items() if fwd.space(name).dtype != dt}
    return with_dtypes(fwd, differ) if differ else fwd


def derive_norm_backwards(gm: fx.GraphModule, kernels: Any, cache: dict[tuple, Any]) -> list[str]:
    """Replace every ``native_layer_norm_backward`` of ``gm`` that ``_norm_form`` takes by a
    ``DerivedNormBackward`` built on ``kernels`` (a kernel backend).  A form it does not take stays torch's op,
    marked ``left.norm_backward``; one whose kernels cannot be derived or built, ``left.derived_backward``.
    ``cache``: per form, the derivation, its passes and their kernels (or the reason none), kept by the caller
    across rebuilds.  Returns one report line per replaced op."""

    lines: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not LAYER_NORM_BACKWARD:
            continue
        key, mask = _norm_form(node)
        if key is None:
            mark(node, "left.norm_backward", f"torch's native_layer_norm_backward: {mask}")
            continue
        _, rows, n, dt, stats = key
        found = derived_kernels(cache, key, kernels, _layernorm_forward, rows, n, dt, stats, wrt=_WRT)
        if isinstance(found, str):
            mark(node, "left.derived_backward", f"torch's native_layer_norm_backward: its derived kernels could "
                 f"not be built: {found}")
            continue
        bw, passes, built = found
        grad_out, x, _, mean, rstd, weight = node.args[:6]
        module = DerivedNormBackward(bw, passes, built, rows, n, mask, _STATS)
        install(gm, node, f"derived_norm_backward_{len(lines)}", module, (grad_out, x, weight, mean, rstd))
        lines.append(norm_line(f"layernorm backward {rows}x{n} {dt}, the forward's saved {stats_text(stats, dt)}mean "
                               "and rstd read", module))
    gm.graph.lint()
    gm.recompile()
    return lines
