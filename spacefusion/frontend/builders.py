"""SMGs the frontend fuses that ``smg.patterns`` has no builder for, written with ``smg.ops.Builder``.

Each one exists because a model needs it: LLaMA's gated MLP input (two GEMMs sharing X with a SiLU
product), RMSNorm after a residual add, and a pre-LN residual
stream whose sum is both normalised and carried on to the next residual (so the sum ``T`` is an output
beside ``Y``), T5's clamped stream the same way.
"""

from __future__ import annotations

from smg import patterns
from smg.errors import UnknownOperatorError
from smg.ir import SMG
from smg.ops import UNARY, Builder, Tensor
from spacefusion.frontend.guard import Guard, clamped, guarded


def gated_gemm(m: int, n: int, k: int, act: str = "silu", dtype: str = "float32", b_layout: str = "kn",
               bias: bool = False, norm: str = "none", eps: float | None = None) -> SMG:
    """``Y = act(X @ Wg) * (X @ Wu)`` (LLaMA's ``act_fn(gate_proj(x)) * up_proj(x)``), X[m, k], W*[k, n]
    (``b_layout`` "nk": W*[n, k], the linears' weights as stored); ``bias``: ``act(X @ Wg + bg) * (X @ Wu +
    bu)`` (GEGLU: diffusers' one projection to 2n columns, chunked into its halves); ``norm``: of
    ``norm(X)``, the norm without its weight (``patterns.norm_prologue``: folded into Wg and Wu)."""
    if act not in UNARY:
        raise UnknownOperatorError(f"unknown activation {act!r}; known: {sorted(UNARY)}")
    g = Builder(f"{'' if norm == 'none' else norm + '_'}gated_gemm_{act}{'_bias' if bias else ''}", dtype)
    x = patterns.norm_prologue(g, g.input("X", {"m": m, "k": k}), norm, eps=eps)
    dims = patterns._b_dims(k, n, b_layout)
    gate = g.matmul(x, g.input("Wg", dims), reduce="k", name="G")
    up = g.matmul(x, g.input("Wu", dims), reduce="k", name="U")
    if bias:
        gate = g.binary("add", gate, g.input("bg", {"n": n}), name="Gb")
        up = g.binary("add", up, g.input("bu", {"n": n}), name="Ub")
    return g.build(g.binary("mul", g.unary(act, gate, name="Ga"), up, name="Y"))


def norm(kind: str, m: int, n: int, residual: bool, keep_sum: bool, dtype: str, eps: float,
         offset: float = 0.0, guard: Guard | None = None, clamp: tuple[float, float] | None = None,
         stats: str | None = None) -> SMG:
    """LayerNorm or RMSNorm of ``X`` (``residual``: of ``T = X + R``; ``guard``: of ``T``, T5's fp16 clamp
    of X; ``clamp`` (lo, hi): of ``T = clamp(X + R, lo, hi)``, Whisper's fp16 clamp after its residual add)
    over the last dim; ``keep_sum`` also outputs ``T``; the weight is ``offset + W`` (Gemma's
    ``1 + w``: one more element-wise op on W, fused like the rest); ``stats``, a dtype: an RMSNorm's ``Rstd`` is
    an output too, stored in it (a training forward's, which the backward reads: ``patterns.rmsnorm_stats``, no
    offset, guard or clamp; float32 for a fp16/bf16 model's, as HF's upcast saves it).  The forms
    ``smg.patterns`` has are taken from there."""
    if stats is not None:
        if kind != "rmsnorm" or offset or guard is not None or clamp is not None:
            raise ValueError("only a plain or residual RMSNorm (no offset weight, guard or clamp) outputs its rstd")
        return patterns.rmsnorm_stats(m, n, dtype, eps, residual, keep_sum, None if stats == dtype else stats)
    if residual and guard is not None:
        raise ValueError("a norm's input is either a residual sum or a guarded value, not both")
    if clamp is not None and (not residual or guard is not None):
        raise ValueError("a clamp is fused on a residual sum (clamp(X + R)), not on a plain or guarded input")
    if not offset and not residual and guard is None:
        return patterns.layernorm(m, n, dtype, eps) if kind == "layernorm" else patterns.rmsnorm(m, n, dtype, eps)
    if not offset and kind == "layernorm" and not keep_sum and guard is None and clamp is None:
        return patterns.residual_layernorm(m, n, dtype, eps)
    name = (f"{'residual_' if residual else ''}{'clamp_' if clamp else ''}{'inf_guard_' if guard else ''}{kind}"
            f"{'_offset_w' if offset else ''}"
            f"{'_sum' if keep_sum else ''}")
    g = Builder(name, dtype)
    x = g.input("X", {"m": m, "n": n})
    if guard is not None:
        t = guarded(g, x, guard, dtype)
    elif clamp is not None:
        t = clamped(g, g.binary("add", x, g.input("R", {"m": m, "n": n}), name="S"), *clamp)
    else:
        t = g.binary("add", x, g.input("R", {"m": m, "n": n}), name="T") if residual else x
    return _normalised(g, t, kind, n, eps, offset, keep_sum)


def embedding_norm(kind: str, rows: dict[str, int], n: int, gathered: int, added: tuple[tuple[str, ...], ...],
                   keep_sum: bool, dtype: str, eps: float, offset: float = 0.0) -> SMG:
    """LayerNorm or RMSNorm over ``n`` of ``T = E0 + .. + C0 + ..``: ``gathered`` terms ``E{i}[*rows, n]`` (each an
    embedding's rows, read through its ids: ``smg.loads``, attached by the caller) and one ``C{j}`` per entry of
    ``added``, over those of ``rows``' dims (a position embedding [1, s, n] broadcast over the batch: ``("s",)``)
    and ``n``; ``keep_sum`` also outputs ``T`` (the residual stream it starts); the weight is ``offset + W``.
    Why one graph: BERT's embeddings are a gather, two adds and a LayerNorm, four ops torch ran back to back over
    the same rows; the norm's kernel reads each row's terms once and writes the normalised row."""
    g = Builder(f"embedding{gathered}_{kind}{'_offset_w' if offset else ''}{'_sum' if keep_sum else ''}", dtype)
    full = {**rows, "n": n}
    terms = [g.input(f"E{i}", full) for i in range(gathered)]
    terms += [g.input(f"C{j}", {**{d: rows[d] for d in dims}, "n": n}) for j, dims in enumerate(added)]
    t = g.map(" + ".join(x.name for x in terms), *terms, name="T")
    return _normalised(g, t, kind, n, eps, offset, keep_sum)


def _normalised(g: Builder, t: Tensor, kind: str, n: int, eps: float, offset: float, keep_sum: bool) -> SMG:
    """The norm over ``n`` of ``t`` with its weight ``W`` (and ``B`` for a LayerNorm) as the inputs after ``t``'s,
    the weight ``offset + W`` where ``offset``; ``keep_sum`` also outputs ``t``.  One tail for ``norm`` and
    ``embedding_norm``: their graphs differ only in how ``t`` is made, and the same ops in the same order keep
    their content keys."""
    w = g.input("W", {"n": n})
    if offset:  # y * (W + offset) as one op: W + offset alone would be an intermediate over n that every
        # block of rows recomputes (the spatial slicer then cuts no dim)
        y0 = g.layernorm(t, "n", eps=eps, name="Yn") if kind == "layernorm" else g.rmsnorm(t, "n", eps=eps, name="Yn")
        y = g.map(f"{y0.name}*({w.name} + {float(offset)!r})", y0, w, name="Yw" if kind == "layernorm" else "Y")
        if kind == "layernorm":
            y = g.binary("add", y, g.input("B", {"n": n}), name="Y")
    elif kind == "layernorm":
        y = g.layernorm(t, "n", w, g.input("B", {"n": n}), eps=eps, name="Y")
    else:
        y = g.rmsnorm(t, "n", w, eps=eps, name="Y")
    return g.build(y, t) if keep_sum else g.build(y)
