"""Convolution and pool builders: the implicit-GEMM convolution with its epilogue (``match_conv``: 2-D, 1-D,
after a nearest upsampling), the depthwise one, and the max pool (``match_max_pool``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import fx

from smg import patterns
from smg.errors import ShapeError
from smg.ir import SMG
from smg.ops import upsample_taps
from spacefusion.frontend.gemms import _activation_after, _add_after
from spacefusion.frontend.graph import (
    ADD,
    activation_of,
    batchnorm_of,
    contiguous,
    contiguous_nhwc,
    conv_of,
    dtype,
    is_function,
    is_max_pool,
    max_pool_of,
    nearest_upsample_of,
    param_ref,
    patch_conv_of,
    shape,
    single_user,
)
from spacefusion.frontend.matchers import Context, _build, _param, _value
from spacefusion.frontend.records import Operand, Result, Subgraph

#: activations a convolution's epilogue takes (ResNet's ReLU, diffusion models' SiLU, GELU)
CONV_ACTIVATIONS = ("relu", "relu6", "silu", "gelu", "gelu_tanh", "sigmoid", "tanh")


def conv_refusal(cv, x_shape: tuple[int, ...] | None, dt: str | None) -> str | None:
    """Why the implicit-GEMM convolution cannot take ``cv`` (None: it can)."""
    from spacefusion.frontend.reasons import conv_reason

    if cv.groups != 1 or cv.dilation not in ((1, 1), (1,)):
        return conv_reason(cv.stride, cv.padding, cv.dilation, cv.groups) + (
            f" (padding mode {cv.padding_mode!r})" if cv.padding_mode != "zeros" else "")
    if cv.padding_mode != "zeros":
        return f"padding mode {cv.padding_mode!r}: the SMG window reads zeros outside the image"
    if cv.dims == 1:
        if not isinstance(cv.padding, tuple):
            return (f"a 1-D convolution with padding {cv.padding!r} (kernel {cv.kw}): the window pads both ends "
                    f"alike")
    elif cv.kh != cv.kw or cv.stride[0] != cv.stride[1] or not isinstance(cv.padding, tuple) \
            or cv.padding[0] != cv.padding[1]:
        return (f"a {cv.kh}x{cv.kw} kernel, stride {cv.stride}, padding {cv.padding}: the implicit GEMM takes square "
                f"kernels with one stride and one padding")
    if x_shape is None or len(x_shape) != cv.dims + 2 or dt not in ("float16", "bfloat16", "float32"):
        return f"a convolution of a non-float or non-image input (shape {x_shape}, dtype {dt})"
    if cv.cout % 8:
        return (f"{cv.cout} output channels: the tensor-core GEMM's columns come in 8s, so the search's kernels "
                f"for so narrow an output run on CUDA cores (SD 1.5 VAE's RGB head took 919 us on the H100); cuDNN "
                f"keeps it")
    return None


#: K (kh * kw * c_in) of an implicit GEMM is padded to a multiple of this where c_in is not one (an RGB stem's 7 *
#: 7 * 3 = 147 -> 152, ConvNeXt's or MobileNet's 3 * 3 * 3 = 27 -> 32), with zero weight rows: the tensor-core tile
#: stages A in 16-byte runs of 8 columns (``warp_tile.tile_input``; its last step is predicated), and its gathered
#: tile reads 3 channels element by element (``gather_tile``'s scalar form).  Exact: the padded taps meet zero
#: weights (an inf or NaN pixel they read would give NaN, as it would in another output's window)
K_ALIGN = 8


def library_stem(cv, library: Mapping[str, str]) -> str | None:
    """Why the backend leaves ``cv`` to torch's library (``library["stem_conv"]``, ``CudaBackend.library_first``)
    where it is a stem of unaligned channels (``k_align``), else None.  Shared with ``bn_fold``, which folds
    the BatchNorm of a conv that stays with torch before the partition."""
    return library.get("stem_conv") if cv.c % K_ALIGN else None


def k_align(c: int) -> int:
    """``K_ALIGN`` where ``c`` input channels leave K unaligned, else 1 (the graph, its key and its kernels
    exactly as before: K = kh * kw * c is then a multiple of 8 already)."""
    return K_ALIGN if c % K_ALIGN else 1


#: an ``Upsample -> Conv`` runs per output parity (``patterns.upsample_conv2d``: 4 merged taps of the small image
#: an output pixel, not 9) where its GEMMs' rows fill a warpgroup MMA's 64: they run along one small-image row
#: (w pixels) or one column of them (n * h).  On the H100 the VAE's three went 115 -> 60, 510 -> 190 and 514 ->
#: 198 us, the UNet's 2x32x32x640 132 -> 70; its 2x16x16x1280 (32 rows) lost 134 -> 253 and its 2x8x8x1280 54
#: -> 139 (``experiments/tuning/upsample_parity_h100.json``)
PARITY_MIN_ROWS = 64


def by_parity(rows: int, width: int, kernel: int, stride: int, pad: int, factor: int) -> bool:
    """Whether a conv after a nearest ``factor``x upsampling of ``rows`` (n * h) image rows ``width`` wide runs
    by output parity: a stride-1 'same' conv whose parity GEMMs' rows fill a 64-row MMA tile
    (``PARITY_MIN_ROWS``) and whose parities each read a window of one width (``upsample_taps``; a 3x3
    after a 3x upsampling does not, and keeps the upsampled read)."""
    if factor < 2 or stride != 1 or 2 * pad != kernel - 1 or max(rows, width) < PARITY_MIN_ROWS:
        return False
    try:
        upsample_taps(kernel, pad, factor)
    except ShapeError:
        return False
    return True


#: an upsampled image of at most this many pixels (n * H * W, after the upsampling) that the parity form refuses
#: is written apart (torch's nearest kernel) and convolved as a plain image, by TMA im2col.  SD 1.5's UNet's
#: 2x1280x8x8 -> 16x16 (512 pixels) took 106 us read through the window on the H100, its plain 16x16 1280-channel
#: convs 44-55 (``experiments/results/model_profile_unet_h100.json``; the analytical model agrees: 64 against 41
#: + the copy).  Its 2x1280x16x16 -> 32x32 (2048) keeps the window read: 129 us measured, the plain form not
#: measured (the model's 98 + 4 was not trusted).  A rule, not the model's estimate, because the partition is
#: derived again on the GPU machine, which has no cost model (islpy), and must come out the same there
APART_MAX_PIXELS = 512


def upsample_apart(small: tuple[int, ...], cv, factor: int) -> str | None:
    """Why a nearest ``factor``x upsampling of ``small`` (NCHW) before ``cv`` should run apart (torch writes the
    upsampled image, the conv reads it as a plain one), or None to read it through the conv's window or by
    parity: where the parity form is refused (``by_parity``), the window read gathers its tile by cp.async (no
    TMA im2col reads ``floor(y / 2)``), and on a small grid that lost to the plain conv by TMA
    (``APART_MAX_PIXELS``); the plain conv must itself take TMA im2col (whole 64-channel bands; it is stride 1 here)."""
    n, c, h, w = small
    pad, k, stride = cv.padding[0], cv.kh, cv.stride[0]
    pixels = n * h * w * factor * factor
    if factor < 2 or by_parity(n * h, w, k, stride, pad, factor) or stride != 1 or c % 64 \
            or pixels > APART_MAX_PIXELS:
        return None
    return (f"a {factor}x nearest upsampling of a {n}x{c}x{h}x{w} image runs apart (torch's kernel): too few rows "
            f"for the parity form, and {pixels} pixels (at most {APART_MAX_PIXELS}) read through the window by the "
            f"cp.async gather lost to the plain conv by TMA im2col")


def lies_nchw(x: fx.Node) -> bool:
    """Whether a conv's image ``x`` is known to lie NCHW: a graph input packed so.  Only graph inputs: the
    export's meta tensors give a channels-last conv's output NCHW strides, so another value's strides there
    are not what the GPU sees (its layout is decided as channels-last, where every conv kernel writes)."""
    return x.op == "placeholder" and contiguous(x) and not contiguous_nhwc(x)


def _conv_epilogue(node: fx.Node, ctx: Context) -> tuple[fx.Node, Any, Any, Any, list[fx.Node]]:
    """What a convolution's kernel takes after it: an inference BatchNorm (folded), then a residual add, then
    an activation of ``CONV_ACTIVATIONS``.  (the last node taken, the BatchNorm, the residual, the activation,
    the nodes taken with the conv's own first)."""
    y, bn, res, act = node, None, None, None
    taken = [node]
    if (u := single_user(y)) is not None and (b := batchnorm_of(u, ctx.gm)) is not None and b.x is y \
            and ctx.free(u):
        y, bn = u, b
        taken.append(u)
    if (added := _add_after(y, ctx)) is not None:
        y, res = added
        taken.append(y)
    got = _activation_after(y, ctx)
    if got is not None and got.name in CONV_ACTIVATIONS and len(got.nodes) == 1:
        act, y = got, got.out
        taken.extend(got.nodes)
    return y, bn, res, act, taken


def match_conv(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``nn.Conv2d`` (any padding and stride, groups 1) -> ``patterns.conv2d``, an implicit GEMM over the
    image seen channels-last, with what follows it fused: an inference BatchNorm (folded into the weight and
    bias once), a residual add of a value of the output's shape, an activation; and a nearest upsampling
    before it read through the window.  The output goes back as the conv's NCHW shape with channels-last
    strides, so the next convolution reads it without a copy."""
    cv = conv_of(node, ctx.gm)
    if cv is None or not ctx.free(node):
        return None
    if patch_conv_of(node, ctx.gm) is not None and not _fused_after(node, ctx):
        return None  # a lone patch embedding (ViT's): match_patch_conv's GEMM of the patches
    x, dt = cv.x, dtype(node)
    if cv.dims == 1:
        return _conv1d(node, cv, ctx)
    if cv.groups > 1 and cv.groups == cv.c == cv.cout:
        return _depthwise(node, cv, ctx)
    why = conv_refusal(cv, shape(x), dt)
    if why is not None:
        ctx.refuse(node, "conv.form", why)
        return None
    if (lib := library_stem(cv, ctx.library)) is not None:
        ctx.refuse(node, "library.first", lib)
        return None
    taken: list[fx.Node] = []
    up, factor = nearest_upsample_of(x, ctx.gm) or (None, 1)
    if up is not None and single_user(x) is node and ctx.free(x) and shape(up) is not None and cv.c % K_ALIGN:
        ctx.refuse(x, "conv.upsample_apart", f"a {factor}x nearest upsampling before a conv of {cv.c} input "
                   f"channels runs apart (torch's kernel): the padded-K conv (convs.k_align) reads a plain image")
        factor = 1
    elif up is not None and single_user(x) is node and ctx.free(x) and shape(up) is not None:
        apart = upsample_apart(shape(up), cv, factor)
        if apart is None:
            taken, x = [x], up
        else:
            ctx.refuse(x, "conv.upsample_apart", apart)
            factor = 1
    else:
        factor = 1
    n, c, h, w = shape(x)
    y, bn, res, act, after = _conv_epilogue(node, ctx)
    taken += after
    pad = cv.padding[0]
    has_bias = cv.bias is not None or bn is not None  # a BatchNorm folds into a bias even where the conv has none
    kw = {"act": act.name if act else "none", "bias": has_bias, "residual": res is not None, "dtype": dt}
    parity = by_parity(n * h, w, cv.kh, cv.stride[0], pad, factor)

    def make(layout: str) -> Callable[[], SMG]:
        return lambda: (patterns.upsample_conv2d(n, h, w, c, cv.cout, cv.kh, pad, factor=factor, **kw) if parity
                        else patterns.conv2d(n, h, w, c, cv.cout, cv.kh, cv.stride[0], pad, upsample=factor,
                                             layout=layout, k_align=k_align(c), **kw))

    smg, layout = _build(ctx, node, make("nhwc")), "nhwc"
    if smg is None:
        return None
    if factor == 1 and lies_nchw(x) and (nchw := _build(ctx, node, make("nchw"))) is not None:
        choice = ctx.layout_of(nchw, smg)  # the search's decision: read where it lies, or copied first
        if choice.layout == "nchw":
            smg, layout = nchw, "nchw"
        ctx.layouts[smg.key] = choice.reason
    _, p, q, co = shape(node)[0], shape(node)[2], shape(node)[3], cv.cout
    m, k = n * p * q, smg.dim_sizes["k"]  # kh * kw * c, padded (``k_align``; zero rows of Wt)
    fold = (bn.mean, bn.var, bn.weight or "", bn.bias or "", repr(bn.eps)) if bn is not None else ()
    rows: tuple[int, ...] = (n * h, factor, w, factor, co) if parity else (m, co)
    wt = (Operand("Wt", "param", cv.weight, (factor, factor, smg.dim_sizes["k"], co), conv=True, fold_bn=fold,
                  fold_upsample=(cv.kh, pad, factor)) if parity
          else Operand("Wt", "param", cv.weight, (k, co), conv=True, fold_bn=fold))
    ops = [_value("X", x, (n, c, h, w)) if layout == "nchw" else _value("X", x, (n, h, w, c), (0, 2, 3, 1)), wt]
    if has_bias:
        ops.append(Operand("bias", "param", cv.bias or "", (co,), fold_bn=fold))
    if res is not None:
        ops.append(_value("R", res, rows, (0, 2, 3, 1)))
    out = Result("Y", y.name, shape(y), permute=(0, 3, 1, 2), split=(n, p, q, co))
    parts = ["conv"] + ["bn"] * (bn is not None) + ["add"] * (res is not None) + ([act.name] if act else [])
    label = (f"{' + '.join(parts)}{' (upsample x' + str(factor) + ')' if factor > 1 else ''} {cv.kh}x{cv.kw}/s"
             f"{cv.stride[0]} {n}x{c}x{h * factor}x{w * factor} -> {co} {dt}"
             f"{' (NCHW image)' if layout == 'nchw' else ''}")
    return Subgraph("conv", label, tuple(t.name for t in taken), smg, tuple(ops), (out,))


def _conv1d(node: fx.Node, cv, ctx: Context) -> Subgraph | None:
    """A 1-D ``nn.Conv1d`` / ``F.conv1d`` (groups 1) -> ``patterns.conv1d``: the implicit GEMM of ``match_conv``
    over an image one row high, with what follows it fused as there (an inference BatchNorm folded, a residual
    add, an activation: Whisper's GELUs).  The input [batch, channels, length] is bound channels-last
    ([n, L, c]: a copy of an NCL tensor, none of a fused conv's output), or read where it lies where it is a
    graph input lying NCL and the search decides so (``ctx.layout_of``, as for a 2-D image: Whisper's log-mel
    frames).  The output goes back as the conv's [n, c_out, L'] with channels-last strides ([n, L', c_out] in
    memory): the next conv reads it without a copy, and Whisper's ``permute(0, 2, 1)`` after its second conv
    is then a packed [n, L', d] view."""
    x, dt = cv.x, dtype(node)
    if cv.groups > 1 and cv.groups == cv.c == cv.cout:
        ctx.refuse(node, "conv1d.depthwise",
                   f"a depthwise 1-D convolution (groups {cv.groups}): the depthwise pattern's window is "
                   f"square (2-D); torch runs it")
        return None
    why = conv_refusal(cv, shape(x), dt)
    if why is not None:
        ctx.refuse(node, "conv.form", why)
        return None
    if (lib := library_stem(cv, ctx.library)) is not None:
        ctx.refuse(node, "library.first", lib)
        return None
    n, c, length = shape(x)
    y, bn, res, act, taken = _conv_epilogue(node, ctx)
    k, stride, pad, co = cv.kw, cv.stride[1], cv.padding[1], cv.cout
    has_bias = cv.bias is not None or bn is not None
    kw = {"act": act.name if act else "none", "bias": has_bias, "residual": res is not None, "dtype": dt}

    def make(layout: str) -> Callable[[], SMG]:
        return lambda: patterns.conv1d(n, length, c, co, k, stride, pad, layout=layout, k_align=k_align(c), **kw)

    smg, layout = _build(ctx, node, make("nhwc")), "nhwc"
    if smg is None:
        return None
    if lies_nchw(x) and (ncl := _build(ctx, node, make("nchw"))) is not None:
        choice = ctx.layout_of(ncl, smg)  # the search's decision: read where it lies, or copied first
        if choice.layout == "nchw":
            smg, layout = ncl, "nchw"
        ctx.layouts[smg.key] = choice.reason
    out_len = shape(node)[2]
    fold = (bn.mean, bn.var, bn.weight or "", bn.bias or "", repr(bn.eps)) if bn is not None else ()
    ops = [_value("X", x, (n, c, 1, length)) if layout == "nchw" else _value("X", x, (n, 1, length, c), NLC),
           Operand("Wt", "param", cv.weight, (smg.dim_sizes["k"], co), conv=True, fold_bn=fold)]  # [k, c, co]
    if has_bias:
        ops.append(Operand("bias", "param", cv.bias or "", (co,), fold_bn=fold))
    if res is not None:
        ops.append(_value("R", res, (n * out_len, co), NLC))
    out = Result("Y", y.name, shape(y), permute=NLC, split=(n, out_len, co))
    parts = ["conv1d"] + ["bn"] * (bn is not None) + ["add"] * (res is not None) + ([act.name] if act else [])
    label = (f"{' + '.join(parts)} k{k}/s{stride} {n}x{c}x{length} -> {co} {dt}"
             f"{' (NCL frames)' if layout == 'nchw' else ''}")
    return Subgraph("conv", label, tuple(t.name for t in taken), smg, tuple(ops), (out,))


#: a 1-D image [n, c, L] seen channels-last [n, L, c] (and a [n, L, c] kernel output seen back as [n, c, L])
NLC = (0, 2, 1)


def depthwise_refusal(cv, x_shape: tuple[int, ...] | None, dt: str | None) -> str | None:
    """Why ``patterns.depthwise_conv2d`` cannot take the depthwise convolution ``cv`` (None: it can)."""
    if cv.dilation != (1, 1) or cv.padding_mode != "zeros":
        return (f"a depthwise convolution with dilation {cv.dilation} and padding mode {cv.padding_mode!r}: the "
                f"window is s*y + ky over a zero-padded image")
    if cv.kh != cv.kw or cv.stride[0] != cv.stride[1] or not isinstance(cv.padding, tuple) \
            or cv.padding[0] != cv.padding[1] or 2 * cv.padding[0] > cv.kh:
        return (f"a depthwise {cv.kh}x{cv.kw} kernel, stride {cv.stride}, padding {cv.padding}: the window takes "
                f"square kernels with one stride and a padding of at most half the kernel")
    if x_shape is None or len(x_shape) != 4 or dt not in ("float16", "bfloat16", "float32"):
        return f"a depthwise convolution of a non-float or non-image input (shape {x_shape}, dtype {dt})"
    return None


def _depthwise(node: fx.Node, cv, ctx: Context) -> Subgraph | None:
    """A depthwise ``nn.Conv2d`` (groups = in = out channels) -> ``patterns.depthwise_conv2d``: the window read
    channels-last and a per-channel filter summed over the taps, on CUDA cores, with what follows it as in
    ``match_conv`` (an inference BatchNorm folded into the filter and bias, a residual add, an activation)."""
    x, dt = cv.x, dtype(node)
    if ctx.library.get("dwconv"):
        ctx.refuse(node, "library.first", ctx.library["dwconv"])
        return None
    why = depthwise_refusal(cv, shape(x), dt)
    if why is not None:
        ctx.refuse(node, "dwconv.form", why)
        return None
    n, c, h, w = shape(x)
    y, bn, res, act, taken = _conv_epilogue(node, ctx)
    k, stride, pad = cv.kh, cv.stride[0], cv.padding[0]
    has_bias = cv.bias is not None or bn is not None
    smg = _build(ctx, node, lambda: patterns.depthwise_conv2d(n, h, w, c, k, stride, pad, act.name if act else "none",
                                                              has_bias, res is not None, dt))
    if smg is None:
        return None
    p, q = smg.dim_sizes["p"], smg.dim_sizes["q"]
    fold = (bn.mean, bn.var, bn.weight or "", bn.bias or "", repr(bn.eps)) if bn is not None else ()
    ops = [_value("X", x, (n, h, w, c), (0, 2, 3, 1)),
           Operand("Wt", "param", cv.weight, (k, k, c), conv=True, fold_bn=fold)]  # [c, 1, k, k] -> [k, k, c]
    if has_bias:
        ops.append(Operand("bias", "param", cv.bias or "", (c,), fold_bn=fold))
    if res is not None:
        ops.append(_value("R", res, (n, p, q, c), (0, 2, 3, 1)))
    out = Result("Y", y.name, shape(y), permute=(0, 3, 1, 2), split=(n, p, q, c))
    parts = ["dwconv"] + ["bn"] * (bn is not None) + ["add"] * (res is not None) + ([act.name] if act else [])
    label = f"{' + '.join(parts)} {k}x{k}/s{stride} {n}x{c}x{h}x{w} {dt}"
    return Subgraph("conv", label, tuple(t.name for t in taken), smg, tuple(ops), (out,))


def match_max_pool(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``nn.MaxPool2d`` / ``F.max_pool2d`` -> ``patterns.max_pool2d``: the window read through the SMG's pooling
    view (taps outside the image masked as torch pads them, with -inf), the max over its taps, per channel.  A
    free ReLU right before the pool, and a per-channel shift before that (a BatchNorm's, which ``bn_fold``
    leaves after a cuDNN conv), move after the max, where they give the same values (both are monotone), and
    join the kernel."""
    if not is_max_pool(node, ctx.gm) or not ctx.free(node):
        return None
    mp = max_pool_of(node, ctx.gm)
    if mp is None:
        ctx.refuse(node, "max_pool.form",
                   "a max pool with dilation, ceil mode, indices or a non-square window: the SMG's pooling "
                   "view takes a square window with one stride and one padding")
        return None
    xs, dt = shape(mp.x), dtype(node)
    if xs is None or len(xs) != 4 or dt not in ("float16", "bfloat16", "float32"):
        ctx.refuse(node, "max_pool.input", f"a max pool of a non-float or non-image input (shape {xs}, dtype {dt})")
        return None
    n, c, h, w = xs
    x, taken, act, bias = mp.x, [node], "none", None

    def movable(v: fx.Node, reader: fx.Node) -> fx.Node | None:
        """The input of ``v``, where ``v`` (read by ``reader`` alone) may leave the graph: an in-place op wrote
        its input too, so that input must have no other reader either."""
        src = v.args[0] if v.args else None
        ok = isinstance(src, fx.Node) and single_user(v) is reader and single_user(src) is v and ctx.free(v) \
            and shape(src) == xs
        return src if ok else None

    if activation_of(x, ctx.gm) == "relu" and (src := movable(x, node)) is not None:
        taken, act, reader, x = [x, node], "relu", x, src
        if is_function(x, ADD) and len(x.args) == 2 and not x.kwargs and single_user(x) is reader and ctx.free(x):
            img, b = x.args
            ref = param_ref(b)
            if isinstance(img, fx.Node) and ref is not None and shape(img) == xs and shape(b) in ((1, c, 1, 1),
                                                                                            (c, 1, 1)):
                taken, bias, x = [x, *taken], ref, img
    smg = _build(ctx, node, lambda: patterns.max_pool2d(n, h, w, c, mp.kernel, mp.stride, mp.pad, act,
                                                        bias is not None, dt))
    if smg is None:
        return None
    p, q = shape(node)[2], shape(node)[3]
    ops = [_value("X", x, (n, h, w, c), (0, 2, 3, 1))] + ([_param("bias", bias, (c,))] if bias else [])
    out = Result("Y", node.name, shape(node), permute=(0, 3, 1, 2), split=(n, p, q, c))
    label = (f"{'add + ' if bias else ''}{'relu + ' if act == 'relu' else ''}max_pool {mp.kernel}x{mp.kernel}/s"
             f"{mp.stride} {n}x{c}x{h}x{w} {dt}")
    return Subgraph("pool", label, tuple(t.name for t in taken), smg, tuple(ops), (out,))


def _fused_after(node: fx.Node, ctx: Context) -> bool:
    """Whether a BatchNorm, an add or an activation reads ``node`` alone (what match_conv fuses after it)."""
    u = single_user(node)
    return u is not None and ctx.free(u) and (batchnorm_of(u, ctx.gm) is not None or is_function(u, ADD)
                                              or activation_of(u, ctx.gm) is not None)
