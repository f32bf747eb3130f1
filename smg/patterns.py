"""Fusion patterns beyond attention, each an SMG built from ``smg.ops``.

Norms, GEMM epilogues, the fused MLP, an LSTM cell, horizontal fusion and
attention variants.  None of them has a code path of its own: they go through
the same slicers and lowering as MHA.  Names follow torch (``A @ B`` with
B[k, n]); sizes are the only parameters besides options.
"""

from __future__ import annotations

import dataclasses
import math

from smg.errors import ShapeError, UnknownOperatorError
from smg.ir import SMG, with_dtypes
from smg.ops import UNARY, Builder


def layernorm(m: int, n: int, dtype: str = "float32", eps: float = 1e-5) -> SMG:
    """``Y = LayerNorm(X) * W + B`` over the last dim."""
    g = Builder("layernorm", dtype)
    x = g.input("X", {"m": m, "n": n})
    w, b = g.input("W", {"n": n}), g.input("B", {"n": n})
    return g.build(g.layernorm(x, "n", w, b, eps=eps, name="Y"))


def layernorm_stats(m: int, n: int, dtype: str = "float32", eps: float = 1e-5, stats_dtype: str | None = None) -> SMG:
    """``Y = LayerNorm(X) * W + B`` over the last dim, with the rows' statistics as two more outputs: ``Mean``
    and ``Rstd`` (``1 / sqrt(var + eps)``, the biased variance), each {m}: what ``aten.native_layer_norm``
    returns beside its output and ``native_layer_norm_backward`` reads, so a training forward's norm can be
    fused and still feed torch's backward.  The same primitives as ``Builder.layernorm`` (one kernel reducing
    each row twice), only named so they can be outputs; its own name, so ``layernorm``'s content key stays.
    ``stats_dtype``: the statistics' storage where it is not ``dtype`` (``with_dtypes``): a fp16/bf16 norm's
    are float32 where torch's kernel saves them so (its CUDA kernel always; its CPU one for float32 weights)."""
    g = Builder("layernorm_stats", dtype)
    x = g.input("X", {"m": m, "n": n})
    w, b = g.input("W", {"n": n}), g.input("B", {"n": n})
    with g.group("Y"):
        mean = g.scale(g.reduce(x, "n", "sum", name="Y_sum"), 1.0 / n, name="Mean")
        xc = g.binary("sub", x, mean, name="Y_xc")
        sq = g.map(f"{xc.name}**2", xc, name="Y_sq")
        var = g.scale(g.reduce(sq, "n", "sum", name="Y_sqsum"), 1.0 / n, name="Y_var")
        rstd = g.map(f"1/sqrt({var.name} + {float(eps)!r})", var, name="Rstd")
        y = g.binary("add", g.binary("mul", g.binary("mul", xc, rstd), w), b, name="Y")
    return _stats_in(g.build(y, mean, rstd), ("Mean", "Rstd"), stats_dtype)


def _stats_in(smg: SMG, stats: tuple[str, ...], dtype: str | None) -> SMG:
    """``smg`` with its saved statistics ``stats`` stored in ``dtype`` (None: as built, so a one-dtype
    graph's content key stays what it was)."""
    return smg if dtype is None else with_dtypes(smg, dict.fromkeys(stats, dtype))


def rmsnorm(m: int, n: int, dtype: str = "float32", eps: float = 1e-6) -> SMG:
    """``Y = X / sqrt(mean(X^2) + eps) * W`` over the last dim."""
    g = Builder("rmsnorm", dtype)
    x = g.input("X", {"m": m, "n": n})
    return g.build(g.rmsnorm(x, "n", g.input("W", {"n": n}), eps=eps, name="Y"))


def rmsnorm_stats(m: int, n: int, dtype: str = "float32", eps: float = 1e-6, residual: bool = False,
                  keep_sum: bool = False, stats_dtype: str | None = None) -> SMG:
    """``Y = T * Rstd * W`` with ``Rstd = 1 / sqrt(mean(T^2) + eps)`` ({m}) a second output, over the last dim of
    ``T = X`` (``residual``: ``T = X + R``, and ``keep_sum``: T a third output, the residual stream the next
    block reads): a training forward's RMSNorm, whose rsqrt the backward reads (aot_autograd traces LLaMA's
    ``LlamaRMSNorm`` and ``F.rms_norm`` as primitives and saves that rsqrt), fused and still feeding torch's
    backward, as ``layernorm_stats`` does for LayerNorm.  ``Builder.rmsnorm``'s primitives, the statistic
    named so it can be an output; its own name, so ``rmsnorm``'s content key stays.  ``stats_dtype``: ``Rstd``'s
    storage where it is not ``dtype``: float32 for a fp16/bf16 model's (HF's RMSNorm upcasts to float32 and
    saves that rsqrt; the kernel computes in float32 and stores it unrounded)."""
    name = f"{'residual_' if residual else ''}rmsnorm{'_sum' if keep_sum else ''}_stats"
    if keep_sum and not residual:
        raise ValueError(f"{name}: the sum T is kept only where there is one (residual=True)")
    g = Builder(name, dtype)
    x = g.input("X", {"m": m, "n": n})
    t = g.binary("add", x, g.input("R", {"m": m, "n": n}), name="T") if residual else x
    w = g.input("W", {"n": n})
    with g.group("Y"):
        rstd = g.rms_rstd(t, "n", eps, "Y", name="Rstd")
        y = g.binary("mul", g.binary("mul", t, rstd, name="Y_n"), w, name="Y")
    return _stats_in(g.build(y, rstd, *((t,) if keep_sum else ())), ("Rstd",), stats_dtype)


def residual_layernorm(m: int, n: int, dtype: str = "float32", eps: float = 1e-5) -> SMG:
    """``Y = LayerNorm(X + R) * W + B`` (seed 004's example)."""
    g = Builder("residual_layernorm", dtype)
    x, r = g.input("X", {"m": m, "n": n}), g.input("R", {"m": m, "n": n})
    w, b = g.input("W", {"n": n}), g.input("B", {"n": n})
    t = g.binary("add", x, r, name="T")
    return g.build(g.layernorm(t, "n", w, b, eps=eps, name="Y"))


def softmax(m: int, n: int, dtype: str = "float32") -> SMG:
    """Row softmax ``Y = softmax(X, dim=-1)``."""
    g = Builder("softmax", dtype)
    return g.build(g.softmax(g.input("X", {"m": m, "n": n}), "n", name="Y"))


#: layouts of a GEMM's B operand: [k, n] (torch's ``A @ B``) or [n, k] (``nn.Linear``'s weight, ``A @ W.T``)
B_LAYOUTS = ("kn", "nk")


def _b_dims(k: int, n: int, b_layout: str) -> dict[str, int]:
    """B's dims in memory order: [n, k] rows are what a GEMV's lanes read in 16-byte runs along k."""
    if b_layout not in B_LAYOUTS:
        raise ShapeError(f"unknown B layout {b_layout!r}; known: {', '.join(B_LAYOUTS)}")
    return {"k": k, "n": n} if b_layout == "kn" else {"n": n, "k": k}


#: norms a GEMM may take as its prologue (``gemm_epilogue(..., norm=...)``)
PROLOGUE_NORMS = ("none", "rmsnorm", "layernorm")


def norm_prologue(g: Builder, a, norm: str, weight: bool = False, eps: float | None = None):
    """``norm(A)`` over k (its own weight ``Gn[k]`` and, for LayerNorm, bias ``Bn[k]`` with ``weight``), the
    GEMM's A operand; ``A`` unchanged for ``"none"``.  Without its weight, a norm's affine part is the caller's
    to fold into B (``nn.Linear(RMSNorm(x))``: ``W * g`` once): every GEMM state then multiplies the staged A
    itself and the norm is the rows' statistics, applied after the loop (``warp_tile.staged_factors``)."""
    if norm not in PROLOGUE_NORMS:
        raise UnknownOperatorError(f"unknown prologue norm {norm!r}; known: {', '.join(PROLOGUE_NORMS)}")
    if norm == "none":
        return a
    k = g.dims["k"]
    w = g.input("Gn", {"k": k}) if weight else None
    if norm == "rmsnorm":
        return g.rmsnorm(a, "k", w, eps=1e-6 if eps is None else eps, name="An")
    b = g.input("Bn", {"k": k}) if weight else None
    return g.layernorm(a, "k", w, b, eps=1e-5 if eps is None else eps, name="An")


def gemm_epilogue(m: int, n: int, k: int, act: str = "sigmoid", bias: bool = True,
                  dtype: str = "float32", b_layout: str = "kn", stack: int = 0, residual: bool = False,
                  norm: str = "none", norm_weight: bool = False, eps: float | None = None) -> SMG:
    """``Y = act(A @ B + bias (+ R))``; ``act`` is any unary operator or ``"none"``; ``b_layout`` "nk" stores
    B as [n, k] (``Y = A @ Bw.T``, an ``nn.Linear`` weight as it is); ``residual`` adds ``R[m, n]`` (a
    transformer block's ``ff(x) + x`` where no norm follows to take the add).

    ``stack`` = t > 0: ``Y[i] = act(A @ B_i + bias_i)`` for t linears of one input (Q/K/V projections) as
    one GEMM whose B stacks the weights along t ([t, k, n]; "nk": [t, n, k]) and whose output is [t, m, n],
    so each ``Y[i]`` is a contiguous [m, n] slice a consumer binds without a copy.  A is broadcast
    (One-to-All) along t, which the spatial slicer cuts: one batch dim of a warp-tile GEMM.  Unlike
    ``horizontal_gemms`` (one output per GEMM), the t GEMMs share one output space, hence one epilogue.

    ``norm`` "rmsnorm" / "layernorm": the GEMM of ``norm(A)`` (``norm_prologue``; ``norm_weight``: with the
    norm's own weight ``Gn``), the norm before a projection fused as its prologue."""
    if act != "none" and act not in UNARY:
        raise UnknownOperatorError(f"unknown activation {act!r}; known: none, {sorted(UNARY)}")
    if residual and stack:
        raise ShapeError("a residual add takes one GEMM's output, not a stack of them")
    t = {"t": stack} if stack else {}
    pre = "" if norm == "none" else f"{norm}{'_w' if norm_weight else ''}_"
    g = Builder(f"{pre}{'stacked_' if stack else ''}gemm_{act}{'_res' if residual else ''}", dtype)
    a, b = g.input("A", {"m": m, "k": k}), g.input("Bw", t | _b_dims(k, n, b_layout))
    a = norm_prologue(g, a, norm, norm_weight, eps)
    y = g.matmul(a, b, reduce="k", name="C" if bias or residual or act != "none" else "Y",
                 order=("t", "m", "n") if stack else None)
    if bias:
        y = g.binary("add", y, g.input("bias", t | {"n": n}), name="Cb" if act != "none" or residual else "Y")
    if residual:
        y = g.binary("add", y, g.input("R", {"m": m, "n": n}), name="Cr" if act != "none" else "Y")
    if act != "none":
        y = g.unary(act, y, name="Y")
    return g.build(y)


def act_gemm(m: int, n: int, k: int, act: str = "gelu", dtype: str = "float32") -> SMG:
    """``Y[m, n] = sum_k act(Z[m, k]) * Bw[n, k]``: a linear (``Bw`` an ``nn.Linear`` weight as it is) reading an
    activation of ``Z``, the pre-activation of the linear before it (an MLP's ``fc2(gelu(fc1(x)))``).  Its
    backward with respect to Z, ``dZ = act'(Z) * (dY @ Bw)``, is the input-gradient GEMM of the linear with the
    activation's derivative as its epilogue: what a training backward computes as ``mm(grad, W)`` then
    ``gelu_backward(., Z)``, derived (``smg.autodiff``) instead of written by hand."""
    if act not in UNARY:
        raise UnknownOperatorError(f"unknown activation {act!r}; known: {sorted(UNARY)}")
    g = Builder(f"{act}_gemm", dtype)
    z, b = g.input("Z", {"m": m, "k": k}), g.input("Bw", {"n": n, "k": k})
    return g.build(g.matmul(g.unary(act, z, name="A"), b, reduce="k", name="Y"))


def gated_act_gemm(m: int, n: int, k: int, act: str = "silu", dtype: str = "float32") -> SMG:
    """``Y[m, n] = sum_k act(G[m, k]) * U[m, k] * Bw[n, k]``: the down projection of a gated MLP (LLaMA's, Qwen2's,
    Mistral's ``down(silu(gate(x)) * up(x))``) reading the gated product of the gate's and the up projection's
    outputs ``G`` and ``U``.  Its backward with respect to G and U, ``dH = dY @ Bw``, ``dG = dH * U * act'(G)``,
    ``dU = dH * act(G)``, is one input-gradient GEMM writing both gradients from its epilogue
    (``schedulers.passes``): what a training backward computes as ``mm(grad, W)``, two multiplies and
    ``silu_backward``, derived (``smg.autodiff``) instead of written by hand."""
    if act not in UNARY:
        raise UnknownOperatorError(f"unknown activation {act!r}; known: {sorted(UNARY)}")
    g = Builder(f"gated_{act}_gemm", dtype)
    gate, up, b = g.input("G", {"m": m, "k": k}), g.input("U", {"m": m, "k": k}), g.input("Bw", {"n": n, "k": k})
    h = g.binary("mul", g.unary(act, gate, name="A"), up, name="H")
    return g.build(g.matmul(h, b, reduce="k", name="Y"))


def weight_gradient(m: int, n: int, k: int, bias: bool = False, dtype: str = "float32") -> SMG:
    """``Y[m, n] = sum_k G[k, m] * X[k, n]``: a linear's weight gradient ``dW = grad.T @ x`` with both operands
    graph values as autograd's backward holds them (``grad`` [k, m] and ``x`` [k, n], k the tokens, read where
    they lie: no transposed copy of ``grad``); Y is [m, n], the weight's own layout.  ``bias``: also the bias
    gradient ``Db[m] = sum_k G[k, m]`` (``grad.sum(0)``), a second reduction of the same operand over the same
    dim, so it rides on the GEMM's loads of G instead of reading ``grad`` again.

    Why A lies [k, m]: the GEMM contracts the tokens, the outer dim of both operands.  The tensor-core path
    (``schedulers.warp_tile``) takes A with k last only, so on the GPU this is a CUDA-core GEMM."""
    g = Builder(f"weight_gradient{'_bias' if bias else ''}", dtype)
    grad, x = g.input("G", {"k": k, "m": m}), g.input("X", {"k": k, "n": n})
    y = g.matmul(grad, x, reduce="k", name="Y")
    return g.build(y, g.reduce(grad, "k", "sum", name="Db")) if bias else g.build(y)


def gemm_layernorm(m: int, n: int, k: int, dtype: str = "float32", eps: float = 1e-5) -> SMG:
    """``Y = LayerNorm(A @ B) * W + Bn`` over the GEMM's output row."""
    g = Builder("gemm_layernorm", dtype)
    a, b = g.input("A", {"m": m, "k": k}), g.input("Bw", {"k": k, "n": n})
    c = g.matmul(a, b, reduce="k", name="C")
    return g.build(g.layernorm(c, "n", g.input("W", {"n": n}), g.input("Bn", {"n": n}), eps=eps, name="Y"))


def mlp(m: int, k: int, h: int, n: int, act: str = "gelu", dtype: str = "float32") -> SMG:
    """Fused MLP ``Y = act(X @ W1) @ W2`` with X[m, k], W1[k, h], W2[h, n]."""
    if act not in UNARY:
        raise UnknownOperatorError(f"unknown activation {act!r}; known: {sorted(UNARY)}")
    g = Builder("mlp", dtype)
    x = g.input("X", {"m": m, "k": k})
    w1, w2 = g.input("W1", {"k": k, "h": h}), g.input("W2", {"h": h, "n": n})
    hid = g.unary(act, g.matmul(x, w1, reduce="k", name="H"), name="Ha")
    return g.build(g.matmul(hid, w2, reduce="h", name="Y"))


def lstm_cell(batch: int, input_size: int, hidden: int, dtype: str = "float32") -> SMG:
    """One LSTM step: gates = X @ Wx_g + H @ Wh_g + b_g for g in (i, f, g, o);
    ``C' = sigmoid(f) * C + sigmoid(i) * tanh(g)``, ``H' = sigmoid(o) * tanh(C')``."""
    g = Builder("lstm_cell", dtype)
    x = g.input("X", {"b": batch, "k": input_size})
    h = g.input("H", {"b": batch, "j": hidden})
    c = g.input("C", {"b": batch, "n": hidden})
    act = {"i": "sigmoid", "f": "sigmoid", "g": "tanh", "o": "sigmoid"}
    gates = {}
    for gate in "ifgo":
        gx = g.matmul(x, g.input(f"Wx{gate}", {"k": input_size, "n": hidden}), reduce="k", name=f"X{gate}")
        gh = g.matmul(h, g.input(f"Wh{gate}", {"j": hidden, "n": hidden}), reduce="j", name=f"H{gate}")
        pre = g.map(f"X{gate} + H{gate} + b{gate}", gx, gh, g.input(f"b{gate}", {"n": hidden}), name=f"P{gate}")
        gates[gate] = g.unary(act[gate], pre, name=f"G{gate}")
    c_new = g.map("Gf*C + Gi*Gg", gates["f"], c, gates["i"], gates["g"], name="Cn")
    h_new = g.binary("mul", gates["o"], g.unary("tanh", c_new, name="Ct"), name="Hn")
    return g.build(h_new, c_new)


def horizontal_gemms(m: int, k: int, n: int, names: tuple[str, ...] = ("shift", "scale", "gate"),
                     dtype: str = "float32") -> SMG:
    """Independent GEMMs sharing their input X: ``Y_i = X @ W_i``, one launch.

    The SMG is the join of the GEMMs on X's space; the blocks of all outputs
    share X's tile (AdaLN's shift/scale/gate, or Q/K/V projections).
    """
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"output names must be distinct and non-empty: {names}")
    g = Builder("horizontal_" + "_".join(names), dtype)
    x = g.input("X", {"m": m, "k": k})
    outs = [g.matmul(x, g.input(f"W_{nm}", {"k": k, "n": n}), reduce="k", name=nm) for nm in names]
    return g.build(*outs)


#: attention's operand layouts: dims of Q, K, V and O in memory order (``s`` the sequence dim)
ATTENTION_LAYOUTS = ("bhsd", "bshd")


@dataclasses.dataclass(frozen=True)
class ScoreMod:
    """An element-wise op on attention scores with inputs of its own (FlexAttention's ``score_mod`` and
    ``mask_mod`` as one thing): ``body`` is a sympy expression of the scores ``{s}`` (after scaling; the causal
    mask comes after the mods), of the index names ``b``, ``h`` (kv head), ``r`` (query head within a kv head's
    group), ``m`` (query), ``l`` (key), and of ``inputs``: (name, dims) pairs, each dim one of those names
    (a dim it lacks is broadcast: One-to-All).  A padding mask is ``Piecewise(({s}, Keep > 0.5), (-1e30,
    True))`` over Keep[b, l]; an additive bias ``{s} + Bias`` over Bias[h, m, l]; ALiBi ``{s} + Slope *
    (l - m)``.  The slicers derive the online softmax through it like through any streamed op."""

    body: str
    inputs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    dtype: str | None = None  # the inputs' dtype (default: the attention's)
    #: one of ``inputs`` (0/1) that the probabilities are multiplied by: a query row whose every key a padding
    #: row masks then gives 0, as torch's SDPA does, where the finite fill alone gives the mean of V
    zero_v: str | None = None


def causal_fill(mods: tuple[ScoreMod, ...]) -> float:
    """The score of a key the causal mask removes: -inf where a mod may mask keys (one that reads an input,
    a mask or a bias of any values, or holds a ``Piecewise``), else -1e30.

    Why -inf: torch's ``is_causal`` removes the key outright (SDPA's reference adds -inf), and a mod's mask
    may leave a query no key it can see (a left-padded decoder's padding queries).  With a finite -1e30 the
    excluded FUTURE keys then outweighed the masked visible ones (an added finfo.min or -inf, a boolean
    mask's -1e30 tie) and the row became a mean of future V, which neither eager nor SDPA gives.  With -inf
    such a row is the exact softmax over the keys it may see: 0 where they are all -inf (SDPA's value for an
    all-false boolean row, which HF's sdpa LLaMA/Qwen2 give their padding queries), their softmax where
    they are finite.  Why -1e30 without such mods: every row keeps key 0 (``l <= m``), so no row is empty
    and every value is the same either way; the graphs' bodies, and so their content keys (committed
    schedules name them), stay what they were."""
    masking = any(mod.inputs or "Piecewise" in mod.body for mod in mods)
    return -math.inf if masking else -1e30


def attention(batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int, kv_heads: int | None = None,
              causal: bool = False, dtype: str = "float16", scale: float | None = None,
              layout: str = "bhsd", mods: tuple[ScoreMod, ...] = (), save_lse: bool = False) -> SMG:
    """``softmax(Q K^T * scale [+ causal mask]) V`` with optional grouped-query heads.

    ``save_lse=True`` gives the forward a training step runs: the same graph with the statistics its backward
    reads as extra outputs, as ``smg.autodiff.derive_backward`` derives them (the row logsumexp ``LSE``);
    without it the graph, and its content key, are what they were.

    Grouped-query attention is a broadcast, not a gather: the query heads are
    (kv head ``hk``, member ``r``) and K/V lack ``r`` (One-to-All), so
    Q [b, heads, m, d] is viewed as [b, kv_heads, heads/kv_heads, m, d].  The
    causal mask keeps ``l <= m`` (torch's ``is_causal``: top-left aligned).

    ``layout="bshd"`` declares the operands in the order a projection ``x @ W`` leaves them,
    [b, s, h, d] (a space's dims are its memory order and dims align by name, so only the
    declaration order changes): Q {b, m, h, d} (GQA: {b, m, h, r, d}, query head ``h * r_count + r``,
    the unflatten of the projection's columns), K {b, l, h, d}, V {b, l, h, n} and O {b, m, h, n},
    so HF-style models need no ``.contiguous()`` copy of the ``split_heads`` views.
    """
    if layout not in ATTENTION_LAYOUTS:
        raise ValueError(f"attention layout {layout!r}: known {ATTENTION_LAYOUTS}")
    kv_heads = heads if kv_heads is None else kv_heads
    if kv_heads <= 0 or heads % kv_heads:
        raise ShapeError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    sc = 1.0 / math.sqrt(head_dim) if scale is None else scale
    g = Builder("attention", dtype)
    hd = {"h": kv_heads} if kv_heads != heads else {"h": heads}
    group = {"r": heads // kv_heads} if kv_heads != heads else {}

    def dims(seq: dict[str, int], last: dict[str, int], r: dict[str, int] | None = None) -> dict[str, int]:
        if layout == "bshd":
            return {"b": batch, **seq, **hd, **(r or {}), **last}
        return {"b": batch, **hd, **(r or {}), **seq, **last}

    q = g.input("Q", dims({"m": seq_q}, {"d": head_dim}, group))
    k = g.input("K", dims({"l": seq_kv}, {"d": head_dim}))
    v = g.input("V", dims({"l": seq_kv}, {"n": head_dim}))
    s = g.scale(g.matmul(q, k, reduce="d", name="S"), sc, name="Ss")
    sizes = {"b": batch, "m": seq_q, "l": seq_kv, **hd, **group}
    zeros = []
    for i, mod in enumerate(mods):
        ins = []
        for name, mdims in mod.inputs:
            unknown = [d for d in mdims if d not in sizes]
            if unknown:
                raise ShapeError(f"score mod input {name!r} has dims {mdims}; {unknown} are not dims of the scores "
                                 f"{tuple(sizes)}")
            ins.append(g.input(name, {d: sizes[d] for d in mdims}, dtype=mod.dtype))
        s = g.map(mod.body.format(s=s.name), s, *ins, name=f"Smod{i}")
        zeros += [t for t in ins if t.name == mod.zero_v]
    if causal:  # after the mods, as FlexAttention masks after its score_mod: a soft-cap must not lift the fill
        s = g.mask(s, "l <= m", fill=causal_fill(mods), name="Sm")
    p = g.softmax(s, "l", name="P")
    for i, keep in enumerate(zeros):
        p = g.map(f"{p.name}*{keep.name}", p, keep, name=f"Pmod{i}")
    o = g.matmul(p, v, reduce="l", name="O")
    attrs = (("scale", repr(sc)), ("causal", str(causal)), ("kv_heads", str(kv_heads)))
    if layout != "bhsd":  # the default's content key stays what it was
        attrs += (("layout", layout),)
    if mods:
        attrs += (("mods", repr([(m.body, m.inputs, m.zero_v) for m in mods])),)
    fwd = dataclasses.replace(g.build(o), attrs=attrs)
    if not save_lse:
        return fwd
    from smg.autodiff import derive_backward  # the derivation needs sympy's calculus: only when asked

    return derive_backward(fwd).forward


#: RoPE's cos/sin tables: one per position shared by the batch ([s, d]), or one per sequence ([b, s, d])
ROPE_TABLES = ("shared", "per_batch")


def rope(batch: int, seq: int, heads: int, head_dim: int, tables: str = "shared", dtype: str = "float16",
         layout: str = "bhsd", carry: bool = False) -> SMG:
    """Rotary position embedding in HF's rotate-half form, ``Y = X * cos + rotate_half(X) * sin``, with
    ``rotate_half(x) = cat(-x[d/2:], x[:d/2])`` along the head dim ``j``.

    Under the IR's zero padding rotate-half is two shifts: ``rotate_half(X)[j] = X[j - d/2] - X[j + d/2]``
    (for j < d/2 the first read is outside the row, for j >= d/2 the second), so RoPE is element-wise
    over (b, h, s, j) with reads along the same row: no gather, no halo for a block holding whole rows.
    cos and sin are broadcast over the heads (``tables``: and over the batch, or one table per sequence).
    ``layout="bshd"`` declares X and Y [b, s, h, d], the memory order of HF's split_heads view of a
    projection ([b, h, s, d] lying as [b, s, h, d]; dims align by name, so only the declaration changes).

    ``carry``: a second value ``V`` of X's shape and layout passes through the same kernel as output ``Vo``
    (a One-to-One copy over the same iteration space).  Why: a decoder step writes RoPE's K and the
    projection's V into its KV cache side by side; with both outputs stored into the caches
    (``smg.stores``), one kernel does both writes where torch ran two ``index_copy_``."""
    if head_dim % 2:
        raise ShapeError(f"RoPE rotates the two halves of the head dim; {head_dim} is odd")
    if tables not in ROPE_TABLES:
        raise ValueError(f"RoPE tables {tables!r}: known {ROPE_TABLES}")
    if layout not in ATTENTION_LAYOUTS:
        raise ValueError(f"RoPE layout {layout!r}: known {ATTENTION_LAYOUTS}")
    g = Builder("rope", dtype)
    dims = {"b": batch, "h": heads, "s": seq, "j": head_dim}
    order = ("b", "s", "h", "j") if layout == "bshd" else ("b", "h", "s", "j")
    x = g.input("X", {d: dims[d] for d in order})
    table = {"b": batch, "s": seq, "j": head_dim} if tables == "per_batch" else {"s": seq, "j": head_dim}
    cos, sin = g.input("Cos", table), g.input("Sin", table)
    lo, hi = g.shift(x, "j", -head_dim // 2, name="Xlo"), g.shift(x, "j", head_dim // 2, name="Xhi")
    y = g.map("X*Cos + (Xlo - Xhi)*Sin", x, cos, sin, lo, hi, name="Y")
    if not carry:
        return g.build(y)
    v = g.input("V", {d: dims[d] for d in order})
    return g.build(y, g.map("V", v, name="Vo"))


def vae_decoder_block(batch: int, c_in: int, c_out: int, height: int, width: int, groups: int,
                      dtype: str = "float32", eps: float = 1e-6) -> SMG:
    """Seed 000's vertical chain ``Upsample(2x nearest) -> Conv2d 3x3 (pad 1) -> GroupNorm -> SiLU``.

    The output channels are (group ``g``, member ``cg``), so GroupNorm is a LayerNorm over
    (cg, y, x).  The convolution's window is a Windowed mapping (``y + ky - 1``), the
    upsampling a ``floor(y/2)`` gather: index expressions on the accesses.
    """
    if c_out % groups:
        raise ShapeError(f"output channels ({c_out}) must be a multiple of the groups ({groups})")
    g = Builder("vae_decoder_block", dtype)
    x = g.input("In", {"n": batch, "c": c_in, "h": height, "w": width})
    up = g.upsample(x, {"h": "y", "w": "x"}, 2, name="U")
    wc = g.input("Wc", {"g": groups, "cg": c_out // groups, "c": c_in, "ky": 3, "kx": 3})
    conv = g.conv(up, wc, {"y": "ky", "x": "kx"}, "c", pad=1, name="Cv")
    gw, gb = g.input("gw", {"g": groups, "cg": c_out // groups}), g.input("gb", {"g": groups, "cg": c_out // groups})
    gn = g.layernorm(conv, ("cg", "y", "x"), gw, gb, eps=eps, name="GN")
    return g.build(g.unary("silu", gn, name="Out"))


def max_pool2d(batch: int, height: int, width: int, channels: int, kernel: int = 3, stride: int = 2, pad: int = 1,
               act: str = "none", bias: bool = False, dtype: str = "float32") -> SMG:
    """``Y = act(max_pool2d(X) (+ bias))`` on a channels-last image ``X[n, h, w, c]``: the pooling view
    ``A[n, p, q, ky, kx, c]`` (``Builder.pool_window2d``, the taps outside the image masked as torch pads, with
    -inf), its max over the taps, ``Y[n, p, q, c]`` NHWC.  A per-channel ``bias`` and a monotone ``act`` commute
    with the max, so the frontend moves a ``conv -> +bias -> ReLU -> MaxPool`` chain's bias and ReLU after it
    (ResNet's stem: its BatchNorm's shift and ReLU)."""
    if act != "none" and act not in UNARY:
        raise UnknownOperatorError(f"unknown activation {act!r}; known: none, {sorted(UNARY)}")
    g = Builder(f"max_pool2d_{kernel}x{kernel}_s{stride}{'_bias' if bias else ''}{'_' + act if act != 'none' else ''}",
                dtype)
    x = g.input("X", {"n": batch, "h": height, "w": width, "c": channels})
    a = g.pool_window2d(x, kernel, stride, pad, name="A")
    last = not bias and act == "none"
    y = g.reduce(a, ("ky", "kx"), "max", name="Y" if last else "M")
    if bias:
        y = g.binary("add", y, g.input("bias", {"c": channels}), name="Y" if act == "none" else "Mb")
    return g.build(y if act == "none" else g.unary(act, y, name="Y"))


def depthwise_conv2d(batch: int, height: int, width: int, channels: int, kernel: int = 3, stride: int = 1,
                     pad: int = 1, act: str = "none", bias: bool = True, residual: bool = False,
                     dtype: str = "float32") -> SMG:
    """``Y = act(depthwise_conv2d(X, Wt) + bias (+ R))`` on a channels-last image ``X[n, h, w, c]``: each channel
    convolved with its own ``kernel`` x ``kernel`` filter (``groups`` = channels: MobileNet's and EfficientNet's
    3x3 and 5x5, ConvNeXt's 7x7).  One windowed reduction (``Builder.depthwise_window2d``): ``Wt[ky, kx, c]``
    times ``X`` read through the window (zero outside the image: torch's zero padding), summed over the taps.
    The channel is One-to-One, so no GEMM (one multiply-add per tap and channel, on CUDA cores); the window's
    input is staged in shared memory as its halo box (``schedulers.halo``), and the epilogue (bias, a residual
    ``R[n, p, q, c]``, an activation) runs in the same kernel.  ``Y[n, p, q, c]`` is NHWC."""
    if act != "none" and act not in UNARY:
        raise UnknownOperatorError(f"unknown activation {act!r}; known: none, {sorted(UNARY)}")
    g = Builder(f"dwconv2d_{kernel}x{kernel}_s{stride}{'_bias' if bias else ''}{'_res' if residual else ''}"
                f"{'_' + act if act != 'none' else ''}", dtype)
    x = g.input("X", {"n": batch, "h": height, "w": width, "c": channels})
    wt = g.input("Wt", {"ky": kernel, "kx": kernel, "c": channels})
    last = not (bias or residual) and act == "none"
    y = g.depthwise_window2d(x, wt, kernel, stride, pad, name="Y" if last else "S")
    if bias:
        last = not residual and act == "none"
        y = g.binary("add", y, g.input("bias", {"c": channels}), name="Y" if last else "Sb")
    if residual:
        r = g.input("R", {"n": batch, "p": g.dims["p"], "q": g.dims["q"], "c": channels})
        y = g.binary("add", y, r, name="Y" if act == "none" else "Sr")
    return g.build(y if act == "none" else g.unary(act, y, name="Y"))


def concat(batch: int, pixels: int, channels: tuple[int, ...], dtype: str = "float16") -> SMG:
    """``Y = torch.cat(parts, dim=1)`` of channels-last images ``X<i>[n, s, c<i>]`` into ``Y[n, s, c]``: a
    diffusion UNet's skip connections (each up block's ResNet reads the previous output and a down block's
    next to each other).  torch's kernel for it moved 127 MB in 100 us a UNet forward on the H200 (1.3 TB/s);
    as an SMG it is a One-to-One copy per part that the element-wise lowering reads and writes in wide runs."""
    if len(channels) < 2 or any(c <= 0 for c in channels):
        raise ShapeError(f"a concatenation of channels {channels}: two or more positive parts")
    g = Builder(f"concat{len(channels)}", dtype)
    xs = tuple(g.input(f"X{i}", {"n": batch, "s": pixels, f"c{i}": c}) for i, c in enumerate(channels))
    return g.build(g.concat(xs, "c", name="Y"))


def to_channels_last(batch: int, channels: int, pixels: int, dtype: str = "float16") -> SMG:
    """``Y[n, s, c] = X[n, c, s]``: an NCHW image copied channels-last, as the frontend's binding copies one
    for a channels-last kernel (torch's ``contiguous(memory_format=channels_last)``).  The layout decision
    (``spacefusion.frontend.layouts``) prices that copy as this SMG's estimate."""
    g = Builder("to_channels_last", dtype)
    return g.build(g.permute(g.input("X", {"n": batch, "c": channels, "s": pixels}), ("n", "s", "c"), name="Y"))


def group_norm(batch: int, pixels: int, groups: int, channels: int, act: str = "none", affine: bool = True,
               dtype: str = "float32", eps: float = 1e-5, shift: bool = False) -> SMG:
    """``Y = act(GroupNorm(X))`` on a channels-last image ``X[n, s, g, c]``: ``s`` the pixels (h * w), the
    channels split as (group ``g``, member ``c``).  A LayerNorm over (s, c); at batch 1 its n * g reductions
    leave most SMs idle, which ``schedulers.split`` answers by splitting ``s``.  ``shift``: of ``X + E``,
    ``E[n, g, c]`` broadcast over the pixels (a diffusion ResNet block's time embedding, added to the
    conv's output just before its second GroupNorm)."""
    if channels % groups:
        raise ShapeError(f"channels ({channels}) must be a multiple of the groups ({groups})")
    if act != "none" and act not in UNARY:
        raise UnknownOperatorError(f"unknown activation {act!r}; known: none, {sorted(UNARY)}")
    g = Builder(f"group_norm{'_shift' if shift else ''}{'_' + act if act != 'none' else ''}", dtype)
    cg = channels // groups
    x = g.input("X", {"n": batch, "s": pixels, "g": groups, "c": cg})
    if shift:
        x = g.binary("add", x, g.input("E", {"n": batch, "g": groups, "c": cg}), name="T")
    w, b = (g.input("W", {"g": groups, "c": cg}), g.input("B", {"g": groups, "c": cg})) if affine else (None, None)
    y = g.layernorm(x, ("s", "c"), w, b, eps=eps, name="Y" if act == "none" else "N")
    return g.build(y if act == "none" else g.unary(act, y, name="Y"))


def conv2d(batch: int, height: int, width: int, c_in: int, c_out: int, kernel: int | tuple[int, int] = 3,
           stride: int = 1, pad: int | tuple[int, int] = 1, act: str = "none", bias: bool = True,
           residual: bool = False, upsample: int = 1, dtype: str = "float32", layout: str = "nhwc",
           name: str | None = None, k_align: int = 1) -> SMG:
    """``Y = act(conv2d(X, W) + bias (+ R))`` as an implicit GEMM: X channels-last [n, h, w, c], its im2col
    view ``A[m, k]`` (``Builder.window2d``: m the output pixels, k the taps (ky, kx, c)), the weight as
    ``Wt[k, co]`` ([kh, kw, c, c_out]: the tensor-core B operand's layout, permuted once), Y [m, co] (the NHWC
    output [n, p, q, c_out]).  An inference BatchNorm is folded into W and the bias before this (the frontend
    does it); ``R`` is a residual [m, co] added before ``act``; ``upsample`` 2 reads X nearest-upsampled (an
    ``Upsample -> Conv`` chain).  ``layout="nchw"`` reads X as torch's default [n, c, h, w] where it lies (no
    transposed copy; the output is still [m, co]).  ``kernel`` and ``pad`` are one int (square) or (rows,
    columns) each: ``conv1d`` is this with one row.  ``k_align`` rounds K = kh * kw * c_in up to its multiple
    (``Builder.window2d``): ``Wt``'s rows past kh * kw * c_in must then be zero (an RGB stem's K = 147 is 152,
    which the tensor-core tile takes: it stages A in runs of 8 columns)."""
    if act != "none" and act not in UNARY:
        raise UnknownOperatorError(f"unknown activation {act!r}; known: none, {sorted(UNARY)}")
    nchw = layout == "nchw"
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    g = Builder(name or f"conv2d_{kh}x{kw}{'_res' if residual else ''}_{act}{'_nchw' if nchw else ''}", dtype)
    dims = {"n": batch, "c": c_in, "h": height, "w": width} if nchw else {"n": batch, "h": height, "w": width,
                                                                         "c": c_in}
    x = g.input("X", dims)
    a = g.window2d(x, (kh, kw), stride, pad, upsample=upsample, name="A", layout=layout, k_align=k_align)
    w = g.input("Wt", {"k": g.dims["k"], "co": c_out})
    y = g.matmul(a, w, reduce="k", name="Y" if not (bias or residual or act != "none") else "C")
    return _conv_epilogue(g, y, c_out, act, bias, residual, {"m": g.dims["m"], "co": c_out})


def conv1d(batch: int, length: int, c_in: int, c_out: int, kernel: int = 3, stride: int = 1, pad: int = 1,
           act: str = "none", bias: bool = True, residual: bool = False, dtype: str = "float32",
           layout: str = "nhwc", k_align: int = 1) -> SMG:
    """``Y = act(conv1d(X, W) + bias (+ R))``: ``conv2d`` over an image one row high, kernel (1, ``kernel``),
    padding (0, ``pad``) (a stride along that one row moves nothing: the output has one row), so the implicit
    GEMM, its gathered tile and its epilogue are the 2-D convolution's.  X is [n, 1, L, c] (channels-last:
    a [batch, channels, frames] tensor transposed, or a fused conv's output as it lies) or, with
    ``layout="nchw"``, [n, c, 1, L] (Whisper's log-mel frames where they lie); the weight ``Wt[k, co]`` is
    torch's [co, c, kernel] laid out as [kernel, c, co]; Y [m, co] is [n, L', co] (L' = (L + 2 pad - kernel) //
    stride + 1); ``k_align`` as there."""
    return conv2d(batch, 1, length, c_in, c_out, (1, kernel), stride, (0, pad), act, bias, residual,
                  dtype=dtype, layout=layout, k_align=k_align,
                  name=f"conv1d_k{kernel}{'_res' if residual else ''}_{act}{'_nchw' if layout == 'nchw' else ''}")


def _conv_epilogue(g: Builder, y, c_out: int, act: str, bias: bool, residual: bool, rows: dict[str, int]) -> SMG:
    """A conv's ``act(Y + bias (+ R))`` after its GEMM ``y`` (named C, or Y when nothing follows), R on
    ``rows``; the graph built."""
    for i, (on, inp) in enumerate(((bias, lambda: g.input("bias", {"co": c_out})),
                                   (residual, lambda: g.input("R", rows)))):
        if on:
            last = act == "none" and (i == 1 or not residual)
            y = g.binary("add", y, inp(), name="Y" if last else ("Cb" if i == 0 else "Cr"))
    if act != "none":
        y = g.unary(act, y, name="Y")
    return g.build(y)


def upsample_conv2d(batch: int, height: int, width: int, c_in: int, c_out: int, kernel: int = 3, pad: int = 1,
                    act: str = "none", bias: bool = True, residual: bool = False, factor: int = 2,
                    dtype: str = "float32") -> SMG:
    """``Y = act(conv2d(upsample(X), W) + bias (+ R))`` for a stride-1 'same' conv after a nearest ``factor``x
    upsampling, computed by output parity on the small image (``Builder.upsample_window2d``): X [n, h, w, c],
    the merged weight ``Wt[a, b, k, co]`` (``ops.upsample_fold`` of [kh, kw, c, c_out]; the frontend merges it
    once), Y and R [nh, a, j, b, co], which lie as the upsampled NHWC image [n, factor * h, factor * w, c_out].
    A 3x3 conv so costs 4 merged taps an output pixel, not 9."""
    if act != "none" and act not in UNARY:
        raise UnknownOperatorError(f"unknown activation {act!r}; known: none, {sorted(UNARY)}")
    g = Builder(f"upsample_conv2d_{kernel}x{kernel}{'_res' if residual else ''}_{act}", dtype)
    x = g.input("X", {"n": batch, "h": height, "w": width, "c": c_in})
    a = g.upsample_window2d(x, kernel, pad, factor, name="A")
    w = g.input("Wt", {"a": factor, "b": factor, "k": g.dims["k"], "co": c_out})
    plain = not (bias or residual or act != "none")
    y = g.matmul(a, w, reduce="k", name="Y" if plain else "C", order=("nh", "a", "j", "b", "co"))
    rows = {"nh": g.dims["nh"], "a": factor, "j": width, "b": factor, "co": c_out}
    return _conv_epilogue(g, y, c_out, act, bias, residual, rows)


PATTERNS = {
    "layernorm": layernorm,
    "conv2d": conv2d,
    "conv1d": conv1d,
    "upsample_conv2d": upsample_conv2d,
    "group_norm": group_norm,
    "rmsnorm": rmsnorm,
    "residual_layernorm": residual_layernorm,
    "softmax": softmax,
    "gemm_epilogue": gemm_epilogue,
    "gemm_layernorm": gemm_layernorm,
    "mlp": mlp,
    "lstm_cell": lstm_cell,
    "horizontal_gemms": horizontal_gemms,
    "attention": attention,
    "vae_decoder_block": vae_decoder_block,
    "rope": rope,
}


def value_gemm(a: dict[str, int], b: dict[str, int], out: tuple[str, ...], reduce: str = "k",
               scale: float | None = None, add: dict[str, int] | None = None, dtype: str = "float32") -> SMG:
    """``Y[out] = scale * sum_k A[a] * B[b] (+ R[add])``: a (batched) GEMM of two run-time values, each read
    where it lies.  ``a`` and ``b`` are the operands' dims in their memory order (A [.., m, k], or [.., k, m]
    where A was a transposed view; B [.., k, n] or [.., n, k]); the dims both carry besides ``reduce`` are batch
    dims, a batch dim one of them lacks is broadcast (One-to-All) along it; ``out`` is Y's memory order.
    ``scale``: a number the product is multiplied by; ``add``: a tensor over some of ``out``'s dims added after
    (a bias over n, or a residual of Y's shape).

    Why a pattern of its own: the GEMM rows (``gemm_epilogue``) read B as a weight laid out once at build time;
    here both operands arrive each call (DeBERTa's content-to-position scores ``Q @ K_pos^T``), so B's layout
    is whatever the value's strides are, and the dims are named by the caller (``frontend.value_gemm``)."""
    for name, dims in (("A", a), ("B", b)):
        if reduce not in dims:
            raise ShapeError(f"value_gemm: {name} {dict(dims)} lacks the contracted dim {reduce!r}")
    g = Builder(f"value_gemm{'_scale' if scale is not None else ''}{'_add' if add else ''}", dtype)
    last = scale is None and not add
    y = g.matmul(g.input("A", dict(a)), g.input("B", dict(b)), reduce=reduce, name="Y" if last else "C",
                 order=tuple(out))
    if scale is not None:
        y = g.scale(y, scale, name="Y" if not add else "Cs")
    if add:
        y = g.binary("add", y, g.input("R", dict(add)), name="Y")
    return g.build(y)
