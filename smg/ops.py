"""Operator definitions as tensor index expressions, and the graph builder.

Every operator is written once here as an ``Op`` (index expression).  Fusing
is a join of the per-operator SMGs on shared names, done by ``Builder.build``.
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from smg.errors import BadNameError, ExpressionError, ShapeError, UnknownAxisError, UnknownOperatorError
from smg.expr import MINUS_INF, check_body
from smg.ir import SMG, Access, DataSpace, Dim, Op, check_dtype, join_smgs

#: Element-wise unary functions: sympy body templates over ``{x}``.
UNARY: dict[str, str] = {
    "exp": "exp({x})",
    "log": "log({x})",
    "neg": "-({x})",
    "abs": "Abs({x})",
    "sqrt": "sqrt({x})",
    "rsqrt": "1/sqrt({x})",
    "recip": "1/({x})",
    "tanh": "tanh({x})",
    "sigmoid": "1/(1 + exp(-({x})))",
    "relu": "Max({x}, 0)",
    "silu": "({x})/(1 + exp(-({x})))",
    "gelu": "({x})*(1 + erf(({x})/sqrt(2)))/2",
    # GELU's tanh approximation (HF's gelu_new / gelu_pytorch_tanh, F.gelu(approximate="tanh")): sqrt(2/pi)
    "gelu_tanh": "({x})*(1 + tanh(0.7978845608028654*(({x}) + 0.044715*({x})**3)))/2",
    # MobileNet's ReLU6 (nn.ReLU6, F.hardtanh(x, 0, 6))
    "relu6": "Min(Max({x}, 0), 6)",
}

#: Element-wise binary functions (with broadcast) over ``{a}`` and ``{b}``.
BINARY: dict[str, str] = {
    "add": "({a}) + ({b})",
    "sub": "({a}) - ({b})",
    "mul": "({a})*({b})",
    "div": "({a})/({b})",
    "max": "Max({a}, {b})",
    "min": "Min({a}, {b})",
}

REDUCE = ("sum", "max")

#: Function names used in bodies; a space may not be called like one.
RESERVED = frozenset({"exp", "log", "sqrt", "tanh", "erf", "Abs", "Min", "sin", "cos"})


def _mentions(body: str, name: str) -> bool:
    import re

    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_(])", body) is not None


@dataclass(frozen=True)
class Tensor:
    """A handle on a data space of a graph under construction."""

    name: str
    dims: tuple[str, ...]
    builder: Builder = field(compare=False, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.builder.dims[d] for d in self.dims)


def pads2d(pad: int | tuple[int, int]) -> tuple[int, int]:
    """A window's zero padding as (rows, columns): one int pads both (a square conv's), a pair each its own (a
    1-D convolution is a window over an image one row high, padded along its columns only: (0, p))."""
    try:
        if isinstance(pad, tuple | list) and len(pad) == 2:
            return operator.index(pad[0]), operator.index(pad[1])
        return operator.index(pad), operator.index(pad)
    except TypeError:
        raise ShapeError(f"a window's padding is an int or a pair of ints (rows, columns); got {pad!r}") from None


def window2d_index(m: str, k: str, c: int, out: tuple[int, int], kernel_w: int, stride: int,
                   pad: int | tuple[int, int], upsample: int = 1) -> tuple[str, str, str, str]:
    """The index expressions of ``Builder.window2d``'s view into a channels-last image [n, h, w, c]: row ``m``
    an output pixel of the ``out`` = (p, q) grid, column ``k`` a tap (ky, kx, channel) of a window
    ``kernel_w`` wide, padded ``pad`` (``pads2d``: one int, or (rows, columns)).  One definition, so analyses
    that recognise a window (a TMA im2col load) rebuild it instead of restating it."""
    p, q = out
    pad_y, pad_x = pads2d(pad)
    y = f"{stride}*(floor({m}/{q}) - {p}*floor({m}/{p * q})) + floor({k}/{kernel_w * c}) - {pad_y}"
    x = f"{stride}*({m} - {q}*floor({m}/{q})) + floor({k}/{c}) - {kernel_w}*floor({k}/{kernel_w * c}) - {pad_x}"
    if upsample > 1:
        y, x = f"floor(({y})/{upsample})", f"floor(({x})/{upsample})"
    return (f"floor({m}/{p * q})", y, x, f"{k} - {c}*floor({k}/{c})")


#: the memory orders of an image ``Builder.window2d`` reads: channels-last, or torch's default NCHW
IMAGE_LAYOUTS = ("nhwc", "nchw")

#: the dims of ``Builder.upsample_window2d``'s view, in order: small-image row (n * h + i), the output's row and
#: column parities, small-image column, merged tap; analyses that recognise the view name them from here
UPSAMPLE_VIEW = ("nh", "a", "b", "j", "k")


def upsample_taps(kernel: int, pad: int, factor: int = 2) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """How a ``kernel``-wide, ``pad``-padded stride-1 window over an image nearest-upsampled ``factor`` times
    reads the small image, per output parity ``a`` (output row ``factor * i + a``): (``d``, ``taps``) with tap
    ``ky`` reading small row ``i + d + taps[ky]``.  Taps that land on one small row merge, so each parity is a
    smaller window (a 3x3 conv after a 2x upsampling is four 2x2 convs of the small image: 2.25x fewer FLOPs).
    ShapeError where the parities' windows differ in width (they then cannot share one GEMM)."""
    if kernel < 1 or pad < 0 or factor < 2:
        raise ShapeError(f"an upsampling conv by output parity needs kernel >= 1, pad >= 0 and an upsampling "
                         f"factor >= 2; got kernel {kernel}, pad {pad}, factor {factor}")
    out = []
    for a in range(factor):
        rows = [(a + ky - pad) // factor for ky in range(kernel)]
        out.append((rows[0], tuple(r - rows[0] for r in rows)))
    widths = {t[-1] + 1 for _, t in out}
    if len(widths) != 1:
        raise ShapeError(f"a {kernel}-wide window with pad {pad} over a {factor}x upsampled image reads "
                         f"{sorted(widths)} small rows depending on the output's parity: no one merged window")
    return tuple(out)


def upsample_window2d_index(c: int, h: int, kernel: int, pad: int, factor: int = 2) -> tuple[str, str, str, str]:
    """The index expressions of ``Builder.upsample_window2d``'s view [nh, a, b, j, k] into the small image
    [n, h, w, c]: output pixel (n, factor * i + a, factor * j + b) with ``nh`` = n * h + i, column ``k`` a merged
    tap (ty, tx, channel).  One definition, shared with the analyses that recognise it (a TMA im2col load)."""
    taps = upsample_taps(kernel, pad, factor)
    t = taps[0][1][-1] + 1
    y = f"nh - {h}*floor(nh/{h}) + floor((a - {pad})/{factor}) + floor(k/{t * c})"
    x = f"j + floor((b - {pad})/{factor}) + floor(k/{c}) - {t}*floor(k/{t * c})"
    return (f"floor(nh/{h})", y, x, f"k - {c}*floor(k/{c})")


def upsample_fold(kernel: int, pad: int, factor: int = 2) -> list[list[list[int]]]:
    """The 0/1 matrix F[a][t][ky] that merges a ``kernel``-wide window's taps per output parity ``a``
    (``upsample_taps``): the merged weight of a conv after an upsampling is
    ``W'[a, b, t, u, c, co] = sum F[a][t][ky] * F[b][u][kx] * W[ky, kx, c, co]``."""
    taps = upsample_taps(kernel, pad, factor)
    t = taps[0][1][-1] + 1
    return [[[int(tap[ky] == i) for ky in range(kernel)] for i in range(t)] for _, tap in taps]


class Builder:
    """Collects per-operator SMGs; ``build`` joins them into one fused SMG."""

    def __init__(self, name: str, dtype: str = "float32") -> None:
        check_dtype(dtype, name)  # at once: not first at random_inputs, nor wrong results from an int type
        self.name = name
        self.dtype = dtype
        self.dims: dict[str, int] = {}
        self.spaces: dict[str, DataSpace] = {}
        self.graphs: list[SMG] = []
        self._count: dict[str, int] = {}
        self._group: str | None = None

    @contextmanager
    def group(self, name: str) -> Iterator[None]:
        """Ops emitted inside form one user-level operator (one kernel when unfused)."""
        outer = self._group
        self._group = outer or name  # a composite inside a composite stays in the outer one
        try:
            yield
        finally:
            self._group = outer

    # -- helpers ----------------------------------------------------------------
    def _fresh(self, base: str, name: str | None) -> str:
        if name is None:  # auto names carry a number so they never shadow a function (exp, log)
            n = self._count.get(base, 0)
            self._count[base] = n + 1
            name = f"{base}{n}"
            while name in self.spaces:
                n += 1
                name = f"{base}{n}"
        if (not name.isidentifier() or not name.isascii() or keyword.iskeyword(name) or "__" in name
                or name in RESERVED):
            raise BadNameError(f"space name {name!r} of graph {self.name!r} must be an ASCII identifier without "
                               f"'__' and not one of the function names {sorted(RESERVED)} (it names "
                               f"a CUDA kernel parameter)")
        if name in self.spaces:
            raise BadNameError(f"space name {name!r} is already used in graph {self.name!r}")
        if name in self.dims:
            raise BadNameError(f"space name {name!r} is already a dimension of graph {self.name!r}")
        return name

    def _dim(self, name: str, size: int) -> None:
        if name in self.spaces:
            raise BadNameError(f"dimension name {name!r} is already a space of graph {self.name!r}")
        if name in self.dims and self.dims[name] != size:
            raise ShapeError(
                f"dimension {name!r} has size {self.dims[name]} elsewhere in graph "
                f"{self.name!r} but {size} here"
            )
        Dim(name, size)
        self.dims[name] = int(size)

    def _emit(self, op: Op, dtype: str | None = None) -> Tensor:
        if self._group:
            op = dataclasses.replace(op, group=self._group)
        out = DataSpace(op.out, op.out_index, dtype or self.dtype)
        self.spaces[op.out] = out
        ins = tuple(self.spaces[a.space] for a in op.inputs)
        used = set(op.iter_dims) | {d for sp in ins for d in sp.dims}  # gathers read dims they don't iterate
        self.graphs.append(
            SMG(
                name=op.out,
                dims=tuple(Dim(d, self.dims[d]) for d in self.dims if d in used),
                spaces=(*ins, out),
                ops=(op,),
                outputs=(op.out,),
            )
        )
        return Tensor(op.out, op.out_index, self)

    def _own(self, *ts: Tensor) -> None:
        for t in ts:
            if t.builder is not self:
                raise ValueError(f"tensor {t.name!r} belongs to another graph")

    # -- inputs -----------------------------------------------------------------
    def input(self, name: str, dims: dict[str, int], dtype: str | None = None) -> Tensor:
        """Declare an input tensor with named dims, e.g. ``{"m": 128, "k": 64}``."""
        name = self._fresh(name, name)
        for d, s in dims.items():
            self._dim(d, s)
        self.spaces[name] = DataSpace(name, tuple(dims), dtype or self.dtype)
        return Tensor(name, tuple(dims), self)

    # -- operators --------------------------------------------------------------
    def unary(self, fn: str, x: Tensor, name: str | None = None) -> Tensor:
        if fn not in UNARY:
            raise UnknownOperatorError(f"unknown unary operator {fn!r}; known: {sorted(UNARY)}")
        self._own(x)
        body = UNARY[fn].format(x=x.name)
        return self._emit(Op(fn, self._fresh(fn, name), x.dims, (Access(x.name, x.dims),), body))

    def binary(self, fn: str, a: Tensor, b: Tensor, name: str | None = None) -> Tensor:
        """Element-wise op; dims missing from one side are broadcast (One-to-All)."""
        if fn not in BINARY:
            raise UnknownOperatorError(f"unknown binary operator {fn!r}; known: {sorted(BINARY)}")
        self._own(a, b)
        if a.name == b.name:
            body = BINARY[fn].format(a=a.name, b=a.name)
            return self._emit(Op(fn, self._fresh(fn, name), a.dims, (Access(a.name, a.dims),), body))
        out_dims = a.dims + tuple(d for d in b.dims if d not in a.dims)
        body = BINARY[fn].format(a=a.name, b=b.name)
        accs = (Access(a.name, a.dims), Access(b.name, b.dims))
        return self._emit(Op(fn, self._fresh(fn, name), out_dims, accs, body))

    def map(self, body: str, *xs: Tensor, name: str | None = None, kind: str = "map") -> Tensor:
        """A user-written element-wise expression over ``xs`` (broadcasting).

        The body may also read the index along an output dim by its name
        (e.g. ``l <= m`` for a causal mask).  It is parsed here, so a malformed body, a name that is
        none of ``xs`` and their dims, or an unknown function raises ExpressionError now, naming the
        body, rather than later inside the lowering (``smg.expr.check_body``).
        """
        self._own(*xs)
        out_dims: tuple[str, ...] = ()
        for x in xs:
            out_dims += tuple(d for d in x.dims if d not in out_dims)
        for d in self.dims:
            if d not in out_dims and isinstance(body, str) and _mentions(body, d):
                raise UnknownAxisError(f"body {body!r} reads index {d!r}, which is not a dim of its inputs {out_dims}")
        inputs = tuple(dict.fromkeys(x.name for x in xs))
        where = f"{kind} {name or '(unnamed)'} of graph {self.name!r} over inputs {list(inputs)}"
        try:
            check_body(body, inputs + out_dims, where)
        except ExpressionError as exc:
            passed = [n for n in self.spaces if n not in inputs and _mentions(str(body), n)]
            if passed:  # the likeliest slip: a space of the graph read but not passed
                raise ExpressionError(f"{exc}; {passed} are spaces of graph {self.name!r}: pass them to map "
                                      f"as inputs") from None
            raise
        accs = tuple(Access(x.name, x.dims) for x in dict.fromkeys(xs))
        return self._emit(Op(kind, self._fresh(kind, name), out_dims, accs, body))

    def mask(self, x: Tensor, keep: str, fill: float = -1e30, name: str | None = None) -> Tensor:
        """``x`` where the index condition ``keep`` holds (e.g. ``"l <= m"``), else ``fill``.

        The default fill is a large finite negative.  ``fill=-math.inf`` removes the masked values outright
        (``smg.expr.MINUS_INF`` in the body): a row whose every value is then -inf has softmax 0 in every
        kernel and reference (the running max is read as 0 while -inf, a zero sum divides as 1), where a
        finite fill would give its masked values the row's whole weight once the rest are lower still.
        """
        value = MINUS_INF if float(fill) == -math.inf else repr(float(fill))
        return self.map(f"Piecewise(({x.name}, {keep}), ({value}, True))", x, name=name, kind="mask")

    def scale(self, x: Tensor, factor: float, name: str | None = None) -> Tensor:
        self._own(x)
        body = f"{float(factor)!r}*{x.name}"
        return self._emit(Op("scale", self._fresh("scale", name), x.dims, (Access(x.name, x.dims),), body))

    def reduce(self, x: Tensor, dim: str | tuple[str, ...], combiner: str, name: str | None = None) -> Tensor:
        """Reduce ``x`` over ``dim`` (or several dims) (All-to-One) with ``sum`` or ``max``."""
        if combiner not in REDUCE:
            raise UnknownOperatorError(f"unknown reduction {combiner!r}; known: {list(REDUCE)}")
        self._own(x)
        dims = (dim,) if isinstance(dim, str) else tuple(dim)
        for d in dims:
            if d not in x.dims:
                raise UnknownAxisError(f"cannot reduce {x.name!r} over {d!r}: its dims are {x.dims}")
        out_dims = tuple(d for d in x.dims if d not in dims)
        op = Op(f"reduce_{combiner}", self._fresh(f"{x.name}_{combiner}", name), out_dims,
                (Access(x.name, x.dims),), x.name, dims, combiner)
        return self._emit(op)

    def upsample(self, x: Tensor, dims: dict[str, str], factor: int = 2, name: str | None = None) -> Tensor:
        """Nearest-neighbour upsampling: dim ``d`` becomes ``dims[d]`` (``factor`` times longer),
        read at ``floor(new / factor)``."""
        self._own(x)
        for d in dims:
            if d not in x.dims:
                raise UnknownAxisError(f"cannot upsample {x.name!r} along {d!r}: its dims are {x.dims}")
        for d, nd in dims.items():
            self._dim(nd, factor * self.dims[d])
        out_dims = tuple(dims.get(d, d) for d in x.dims)
        index = tuple(f"floor({dims[d]}/{int(factor)})" if d in dims else d for d in x.dims)
        return self._emit(Op("upsample", self._fresh("upsample", name), out_dims, (Access(x.name, index),), x.name))

    def shift(self, x: Tensor, dim: str, offset: int, name: str | None = None) -> Tensor:
        """``x`` read ``offset`` elements along ``dim`` away: ``out[.., i, ..] = x[.., i + offset, ..]``,
        0 where ``i + offset`` falls outside the dim (the IR's zero padding).  RoPE's rotate-half is the
        difference of two such shifts by half the head dim."""
        self._own(x)
        if dim not in x.dims:
            raise UnknownAxisError(f"cannot shift {x.name!r} along {dim!r}: its dims are {x.dims}")
        off = int(offset)
        if off == 0:
            raise ValueError(f"a shift of {x.name!r} by 0 is {x.name!r} itself")
        index = tuple(f"{d} {'+' if off > 0 else '-'} {abs(off)}" if d == dim else d for d in x.dims)
        return self._emit(Op("shift", self._fresh("shift", name), x.dims, (Access(x.name, index),), x.name))

    def permute(self, x: Tensor, dims: tuple[str, ...], name: str | None = None) -> Tensor:
        """``x`` with its dims in the order ``dims`` (a One-to-One copy whose innermost dim is another's:
        an NCHW image written channels-last)."""
        self._own(x)
        if sorted(dims) != sorted(x.dims) or len(set(dims)) != len(dims):
            raise UnknownAxisError(f"cannot permute {x.name!r} {x.dims} to {dims}: the same dims, each once")
        return self._emit(Op("permute", self._fresh("permute", name), tuple(dims), (Access(x.name, x.dims),), x.name))

    def concat(self, parts: tuple[Tensor, ...], dim: str, name: str | None = None) -> Tensor:
        """``torch.cat(parts, dim)``: each part's last dim not shared with the others is its stretch of the new
        dim ``dim`` (as long as theirs together), read One-to-One at ``dim - offset``.  Under the IR's zero
        padding a part reads 0 outside its stretch, so the body is the sum of the reads: exact, since every
        element has one nonzero term.  The first part's read is written ``dim - 0`` (its dim is shorter than
        ``dim``: not a plain read of its own dims)."""
        self._own(*parts)
        if len(parts) < 2:
            raise ValueError(f"a concatenation along {dim!r} needs two or more parts, got {len(parts)}")
        own = [[d for d in p.dims if any(d not in q.dims for q in parts if q is not p)] for p in parts]
        if any(len(o) != 1 for o in own) or len({tuple(d if d not in o else "*" for d in p.dims)
                                                 for p, o in zip(parts, own)}) != 1:
            raise ShapeError(f"concatenating {[p.name for p in parts]} {[p.dims for p in parts]} along {dim!r}: "
                             "the parts must share every dim but one, in one order")
        self._dim(dim, sum(self.dims[o[0]] for o in own))
        accs, offset = [], 0
        for p, (d,) in zip(parts, own):
            accs.append(Access(p.name, tuple(f"{dim} - {offset}" if e == d else e for e in p.dims)))
            offset += self.dims[d]
        out_dims = tuple(dim if d == own[0][0] else d for d in parts[0].dims)
        body = " + ".join(p.name for p in parts)
        return self._emit(Op("concat", self._fresh("concat", name), out_dims, tuple(accs), body))

    def conv(self, x: Tensor, w: Tensor, window: dict[str, str], channel: str, pad: int = 0,
             name: str | None = None) -> Tensor:
        """Convolution (stride 1): ``out = sum_{channel, window} w * x[.., d + k_d - pad, ..]``.

        ``window`` maps each spatial dim of ``x`` to its kernel dim in ``w``; ``w``'s other dims
        (besides ``channel``) are the output channels, placed where ``channel`` was in ``x``.
        """
        self._own(x, w)
        for d, kd in window.items():
            if d not in x.dims or kd not in w.dims:
                raise UnknownAxisError(f"conv window {d!r}->{kd!r}: {x.name!r} has {x.dims}, {w.name!r} has {w.dims}")
        if channel not in x.dims or channel not in w.dims:
            raise UnknownAxisError(f"conv channel {channel!r} must be a dim of {x.name!r} {x.dims} and {w.name!r} "
                                   f"{w.dims}")
        out_ch = tuple(d for d in w.dims if d != channel and d not in window.values())
        out_dims = ()
        for d in x.dims:
            out_dims += out_ch if d == channel else (d,)
        index = tuple(f"{d} + {window[d]} - {int(pad)}" if d in window else d for d in x.dims)
        accs = (Access(w.name, w.dims), Access(x.name, index))
        op = Op("conv", self._fresh("conv", name), out_dims, accs, f"{w.name}*{x.name}",
                (channel, *window.values()), "sum")
        return self._emit(op)

    def window2d(self, x: Tensor, kernel: tuple[int, int], stride: int = 1, pad: int | tuple[int, int] = 0,
                 rows: str = "m", cols: str = "k", upsample: int = 1, name: str | None = None,
                 layout: str = "nhwc", k_align: int = 1) -> Tensor:
        """The im2col view of a channels-last image ``x`` [n, h, w, c]: ``A[rows, cols]`` with rows the output
        pixels (n, p, q) and cols the taps (ky, kx, c), ``A = x[n, s*p + ky - pad_y, s*q + kx - pad_x, c]`` (zero
        outside; ``pad`` one int for both, or (pad_y, pad_x): a 1-D convolution is this view of an image one
        row high, kernel (1, k), padding (0, p)).  ``upsample`` = u reads ``x`` nearest-upsampled u times first
        (``x[.., floor(y/u), ..]``), so an ``Upsample -> Conv`` chain never writes the upsampled image.  A
        convolution is then ``A @ W^T`` with the weight [c_out, kh, kw, c] seen as [c_out, cols]: an implicit
        GEMM, whose A tile the lowering loads through these index expressions (no im2col in memory).
        ``layout="nchw"``: ``x`` is [n, c, h, w] (the same view; a run of 8 columns is then 8 channels H * W
        apart, which the tensor-core kernels gather element by element, ``schedulers.gather_tile``).
        ``k_align``: the cols dim is rounded up to a multiple of it (an RGB stem's 7 * 7 * 3 = 147 taps to 152:
        the tensor-core tile stages A in 16-byte runs of 8 columns).  The extra columns read the taps the same
        expressions give past the last kernel row (a pixel below the window, or zero outside the image): only a
        GEMM whose weight has zero rows there (``patterns.conv2d``'s, as the frontend pads it) may take them."""
        self._own(x)
        if int(k_align) < 1:
            raise ShapeError(f"window2d of {x.name!r}: k_align {k_align} must be 1 or more")
        if layout not in IMAGE_LAYOUTS:
            raise ValueError(f"window2d layout {layout!r}: known {IMAGE_LAYOUTS}")
        if len(x.dims) != 4:
            raise ShapeError(f"window2d takes an image [n, h, w, c] or [n, c, h, w]; {x.name!r} has dims {x.dims}")
        sizes = [self.dims[d] for d in x.dims]
        n, h, w, c = sizes if layout == "nhwc" else (sizes[0], sizes[2], sizes[3], sizes[1])
        (r, s), st, u = (int(v) for v in kernel), int(stride), int(upsample)
        pad_y, pad_x = pads2d(pad)
        if min(r, s, st, u) < 1 or min(pad_y, pad_x) < 0:
            raise ShapeError(f"window2d of {x.name!r}: kernel {kernel}, stride {stride}, upsample {upsample} must be "
                             f"positive and pad {pad} not negative")
        hp, wp = h * u + 2 * pad_y - r, w * u + 2 * pad_x - s
        if hp < 0 or wp < 0:
            raise ShapeError(f"window2d of {x.name!r}: a {r}x{s} kernel does not fit the padded {h * u}x{w * u} image")
        p, q = hp // st + 1, wp // st + 1
        self._dim(rows, n * p * q)
        self._dim(cols, -(-r * s * c // int(k_align)) * int(k_align))
        index = window2d_index(rows, cols, c, (p, q), s, st, (pad_y, pad_x), u)
        if layout == "nchw":
            index = (index[0], index[3], index[1], index[2])
        return self._emit(Op("window", self._fresh("window", name), (rows, cols), (Access(x.name, index),), x.name))

    def pool_window2d(self, x: Tensor, kernel: int, stride: int, pad: int, name: str | None = None,
                      zero_padded: bool = False) -> Tensor:
        """The pooling view of a channels-last image ``x`` [n, h, w, c]: ``A[n, p, q, ky, kx, c] = x[n, s*p + ky -
        pad, s*q + kx - pad, c]`` (output pixel (p, q), tap (ky, kx)), with the taps outside the image masked to
        -1e30 (torch's -inf padding; the view alone would read zero there).  The conditions are linear in the
        view's own dims, so the mask needs no division.  A max pool is its max over (ky, kx), per channel.
        ``zero_padded``: no mask, the taps outside read zero (a convolution's zero padding: a depthwise
        convolution is this view times a per-channel filter, summed over the taps)."""
        self._own(x)
        index = self._window_index("pool_window2d", x, kernel, stride, pad)
        n, c = x.dims[0], x.dims[3]
        st, pd = int(stride), int(pad)
        h, w = self.dims[x.dims[1]], self.dims[x.dims[2]]
        view = self._emit(Op("window", self._fresh("window", None if pd and not zero_padded else name),
                             (n, "p", "q", "ky", "kx", c), (Access(x.name, index),), x.name))
        if not pd or zero_padded:
            return view
        keep = (f"({st}*p + ky >= {pd}) & ({st}*p + ky <= {h - 1 + pd}) & ({st}*q + kx >= {pd}) & "
                f"({st}*q + kx <= {w - 1 + pd})")
        return self.mask(view, keep, name=name)

    def _window_index(self, what: str, x: Tensor, kernel: int, stride: int, pad: int) -> tuple[str, ...]:
        """The dims p, q (output pixels) and ky, kx (taps) of a ``kernel`` x ``kernel`` window over the
        channels-last image ``x`` [n, h, w, c], declared here, and the window's index into ``x``."""
        if len(x.dims) != 4:
            raise ShapeError(f"{what} takes a channels-last image [n, h, w, c]; {x.name!r} has dims {x.dims}")
        n, y, xx, c = x.dims
        h, w = self.dims[y], self.dims[xx]
        k, st, pd = int(kernel), int(stride), int(pad)
        if min(k, st) < 1 or pd < 0 or 2 * pd > k:
            raise ShapeError(f"{what} of {x.name!r}: kernel {kernel} and stride {stride} must be positive and "
                             f"pad {pad} between 0 and half the kernel")
        if h + 2 * pd < k or w + 2 * pd < k:
            raise ShapeError(f"{what} of {x.name!r}: a {k}x{k} window does not fit the padded {h}x{w} image")
        for d, size in (("p", (h + 2 * pd - k) // st + 1), ("q", (w + 2 * pd - k) // st + 1), ("ky", k), ("kx", k)):
            self._dim(d, size)
        return (n, f"{st}*p + ky - {pd}", f"{st}*q + kx - {pd}", c)

    def depthwise_window2d(self, x: Tensor, w: Tensor, kernel: int, stride: int, pad: int,
                           name: str | None = None) -> Tensor:
        """A depthwise convolution of the channels-last image ``x`` [n, h, w, c] by ``w`` [ky, kx, c] as one op:
        ``Y[n, p, q, c] = sum_{ky, kx} w[ky, kx, c] * x[n, s*p + ky - pad, s*q + kx - pad, c]`` (zero outside
        the image).  The channel is One-to-One (no GEMM), the taps All-to-One.  One op, not the pooling view
        times ``w``: its reduction reads ``x`` through the window itself, so a kernel keeps no per-thread tile
        of the window's taps (a 7x7 filter's 98 values a thread, one block of 256 threads per SM)."""
        self._own(x, w)
        if len(x.dims) == 4 and w.dims != ("ky", "kx", x.dims[3]):
            raise ShapeError(f"depthwise_window2d: the filter {w.name!r} must be [ky, kx, {x.dims[3]}]; it has "
                             f"dims {w.dims}")
        if len(x.dims) == 4 and w.shape[:2] != (int(kernel), int(kernel)):
            raise ShapeError(f"depthwise_window2d: the filter {w.name!r} is {w.shape[0]}x{w.shape[1]}, the window "
                             f"{kernel}x{kernel}")
        index = self._window_index("depthwise_window2d", x, kernel, stride, pad)
        n, c = x.dims[0], x.dims[3]
        op = Op("dwconv", self._fresh("dwconv", name), (n, "p", "q", c),
                (Access(w.name, w.dims), Access(x.name, index)), f"{w.name}*{x.name}", ("ky", "kx"), "sum")
        return self._emit(op)

    def upsample_window2d(self, x: Tensor, kernel: int, pad: int, factor: int = 2,
                          name: str | None = None) -> Tensor:
        """The im2col view of a stride-1 ``kernel`` x ``kernel`` window over ``x`` [n, h, w, c] nearest-upsampled
        ``factor`` times, by output parity: ``A[nh, a, b, j, k]`` is output pixel (n, factor * i + a,
        factor * j + b) (``nh`` = n * h + i) at merged tap ``k`` = (ty, tx, channel) of the small image
        (``upsample_taps``; zero outside).  Each parity (a, b) is then a GEMM over the small image with its own
        merged weight [a, b, k, co] (``upsample_fold``), and an output [nh, a, j, b, co] lies exactly as the
        upsampled image [n, factor * h, factor * w, co]: an ``Upsample -> Conv`` pair costs the small conv's
        FLOPs, and the upsampled image is never written."""
        self._own(x)
        if len(x.dims) != 4:
            raise ShapeError(f"upsample_window2d takes a channels-last image [n, h, w, c]; {x.name!r} has dims "
                             f"{x.dims}")
        n, h, w, c = (self.dims[d] for d in x.dims)
        if 2 * pad != kernel - 1:
            raise ShapeError(f"upsample_window2d of {x.name!r}: kernel {kernel} with pad {pad} is not a 'same' "
                             f"convolution (pad (kernel - 1) / 2)")
        t = upsample_taps(int(kernel), int(pad), int(factor))[0][1][-1] + 1
        for d, size in zip(UPSAMPLE_VIEW, (n * h, factor, factor, w, t * t * c), strict=True):
            self._dim(d, size)
        index = upsample_window2d_index(c, h, int(kernel), int(pad), int(factor))
        return self._emit(Op("window", self._fresh("window", name), UPSAMPLE_VIEW,
                             (Access(x.name, index),), x.name))

    def matmul(self, a: Tensor, b: Tensor, reduce: str, name: str | None = None,
               order: tuple[str, ...] | None = None) -> Tensor:
        """Generalised (batched) matmul: contract ``reduce``; shared dims are batch dims.  The output's
        dims are A's then B's others, or ``order`` (a permutation of them: the output's memory order, e.g.
        stacked GEMMs' [t, m, n] where B carries t)."""
        self._own(a, b)
        for t in (a, b):
            if reduce not in t.dims:
                raise UnknownAxisError(
                    f"matmul contracts {reduce!r} but {t.name!r} has dims {t.dims}"
                )
        out_dims = tuple(d for d in a.dims if d != reduce) + tuple(
            d for d in b.dims if d != reduce and d not in a.dims
        )
        if order is not None:
            if sorted(order) != sorted(out_dims):
                raise UnknownAxisError(f"matmul output order {order} is not a permutation of {out_dims}")
            out_dims = tuple(order)
        accs = (Access(a.name, a.dims), Access(b.name, b.dims))
        if a.name == b.name:
            if a.dims != b.dims:
                raise ShapeError(f"matmul of {a.name!r} with itself needs one index")
            accs = (Access(a.name, a.dims),)
        op = Op("matmul", self._fresh("matmul", name), out_dims, accs, f"{a.name}*{b.name}",
                (reduce,), "sum")
        return self._emit(op)

    def softmax(self, x: Tensor, dim: str, name: str | None = None) -> Tensor:
        """Softmax as its max -> sub -> exp -> sum -> div composition."""
        base = name or f"{x.name}_softmax"
        with self.group(base):
            mx = self.reduce(x, dim, "max", name=f"{base}_max")
            sh = self.binary("sub", x, mx, name=f"{base}_sub")
            ex = self.unary("exp", sh, name=f"{base}_exp")
            sm = self.reduce(ex, dim, "sum", name=f"{base}_sum")
            return self.binary("div", ex, sm, name=name or base)

    def layernorm(self, x: Tensor, dim: str | tuple[str, ...], weight: Tensor | None = None,
                  bias: Tensor | None = None, eps: float = 1e-5, name: str | None = None) -> Tensor:
        """LayerNorm over ``dim`` (or several dims: GroupNorm) as its primitives: mean,
        centred square, variance, scale."""
        base = name or f"{x.name}_layernorm"
        dims = (dim,) if isinstance(dim, str) else tuple(dim)
        for d in dims:
            if d not in x.dims:
                raise UnknownAxisError(f"cannot normalise {x.name!r} over {d!r}: its dims are {x.dims}")
        inv_n = 1.0 / math.prod(self.dims[d] for d in dims)
        with self.group(base):
            mean = self.scale(self.reduce(x, dim, "sum", name=f"{base}_sum"), inv_n, name=f"{base}_mean")
            xc = self.binary("sub", x, mean, name=f"{base}_xc")
            sq = self.map(f"{xc.name}**2", xc, name=f"{base}_sq")
            var = self.scale(self.reduce(sq, dim, "sum", name=f"{base}_sqsum"), inv_n, name=f"{base}_var")
            rstd = self.map(f"1/sqrt({var.name} + {float(eps)!r})", var, name=f"{base}_rstd")
            return self._affine(self.binary("mul", xc, rstd, name=None if weight or bias else name),
                                weight, bias, name)

    def rmsnorm(self, x: Tensor, dim: str, weight: Tensor | None = None, eps: float = 1e-6,
                name: str | None = None) -> Tensor:
        """RMSNorm over ``dim``: x / sqrt(mean(x^2) + eps) * weight."""
        base = name or f"{x.name}_rmsnorm"
        with self.group(base):
            rstd = self.rms_rstd(x, dim, eps, base)
            return self._affine(self.binary("mul", x, rstd, name=None if weight else name), weight, None, name)

    def rms_rstd(self, x: Tensor, dim: str, eps: float, base: str, name: str | None = None) -> Tensor:
        """RMSNorm's row statistic ``1 / sqrt(mean(x^2 over dim) + eps)`` (``{base}_sq``, ``{base}_sqsum``,
        ``{base}_ms``, then ``name`` or ``{base}_rstd``): ``rmsnorm``'s, and what a training forward's RMSNorm
        outputs for its backward (``patterns.rmsnorm_stats``), so both spell it once."""
        sq = self.map(f"{x.name}**2", x, name=f"{base}_sq")
        ms = self.scale(self.reduce(sq, dim, "sum", name=f"{base}_sqsum"), 1.0 / self.dims[dim], name=f"{base}_ms")
        return self.map(f"1/sqrt({ms.name} + {float(eps)!r})", ms, name=name or f"{base}_rstd")

    def _affine(self, y: Tensor, weight: Tensor | None, bias: Tensor | None, name: str | None) -> Tensor:
        if weight is not None:
            y = self.binary("mul", y, weight, name=None if bias else name)
        if bias is not None:
            y = self.binary("add", y, bias, name=name)
        return y

    def build(self, *outputs: Tensor, name: str | None = None) -> SMG:
        """Join the operator SMGs into one fused SMG computing ``outputs``."""
        if not self.graphs:
            raise ValueError(f"graph {self.name!r} has no operators")
        self._own(*outputs)
        outs = tuple(t.name for t in outputs) or None
        return join_smgs(self.graphs, name or self.name, outputs=outs)
