"""A (batched) GEMM of two run-time graph values -> ``patterns.value_gemm`` (the table's ``value_gemm`` row).

The forms: ``bmm(a, b)``, ``matmul(a, b)`` (``@``; batch dims broadcast as torch does) and a two-operand
``einsum`` with one contracted letter, one letter of A alone (m), one of B alone (n) and the rest shared batch
letters, of two values that are not parameters (a GEMM with a weight is the linear rows'), either possibly a
transposed or permuted view (``graph.permutation``): the operand is then bound where its input lies, its SMG
dims in that input's memory order, so no transposed copy is made (DeBERTa's ``bmm(q, k_pos.transpose(-1, -2))``
reads ``k_pos`` [b, n, k] as it is: B K-major).  A size-1 dim one operand broadcasts is dropped from its space
(the binding's reshape drops it; the other operand or Y carries the dim).  The epilogue: a multiplication or
division by a number, then an add of a value or parameter of Y's shape or of its last dim (a residual, a bias),
where the GEMM's result is read by nothing else and no norm reads the sum (that add is the norm row's).

Not taken (earlier rows first, ``table.ROWS``): a GEMM an attention row took or refused (its code stands: the
attention is left whole); one ``training.read_aten`` marked for another reason; mixed or non-float dtypes, a
1-D operand, a contraction of one element, symbolic sizes and an einsum this form does not state: each refused
as ``left.value_gemm`` with what it is.

On the GPU: both operands arrive each call, so there is no build-time layout; A [.., m, k] and B either way
([.., k, n] or [.., n, k], read where it lies) is the form the tensor-core path (``schedulers.warp_tile``: A
k-last, B k- or n-last) takes in fp16/bf16, so an A stored k-first (a transposed view) is bound as a packed
copy with k last (``_operand``), on every target: its tensor-core kernel as it lies returned NaN on an H100.
"""

from __future__ import annotations

import operator
import re

import torch
from torch import fx

from smg import patterns
from spacefusion.frontend.canon import canonical, op_of
from spacefusion.frontend.graph import (
    ADD,
    MUL,
    contiguous,
    dtype,
    is_function,
    param_ref,
    permutation,
    shape,
    single_user,
)
from spacefusion.frontend.matchers import Context, _build
from spacefusion.frontend.records import Operand, Result, Subgraph
from spacefusion.frontend.refusals import META

#: the canonical ops the row anchors on
ANCHORS = ("bmm", "matmul", "einsum")
#: ``CudaBackend.library_first``'s key, should a backend leave these GEMMs to its library
LIBRARY_KEY = "value_gemm"
DIV = (operator.truediv, torch.div)

Labels = tuple[str, ...]


class Refused(Exception):
    """The node is a GEMM of two values in a form the row does not take: the sentence says what it is."""


def _is_value(node: object) -> bool:
    """A graph value: an fx node that is neither a parameter (``get_attr``) nor a permuted view of one."""
    if not isinstance(node, fx.Node) or param_ref(node) is not None:
        return False
    p = permutation(node)
    return p is None or param_ref(p[0]) is None


def _operands(call) -> tuple[object, object, str | None]:
    """(A, B, the einsum equation or None) of a ``bmm`` / ``matmul`` / ``einsum`` call; Refused otherwise."""
    if call.op == "einsum":
        eq = call.args[0] if call.args else call.kwargs.get("equation")
        ops = call.args[1:]
        if len(ops) == 1 and isinstance(ops[0], list | tuple):
            ops = tuple(ops[0])
        if not isinstance(eq, str) or len(ops) != 2:
            raise Refused("an einsum of other than two operands")
        return ops[0], ops[1], eq
    if len(call.args) != 2 or call.kwargs:
        raise Refused(f"a {call.op} with arguments {sorted(call.kwargs)} besides its two operands")
    return call.args[0], call.args[1], None


def _matmul_labels(sa: tuple[int, ...], sb: tuple[int, ...], bmm: bool) -> tuple[Labels, Labels, Labels]:
    """Each operand's dims and Y's as labels: batch dims ``b0..`` (right-aligned, as torch broadcasts), then
    A's ``m, k`` and B's ``k, n``."""
    if len(sa) < 2 or len(sb) < 2:
        raise Refused("a matmul of a 1-D operand (a GEMV or a dot product)")
    if bmm and (len(sa) != 3 or len(sb) != 3):
        raise Refused("a bmm not of two 3-D operands")
    nb = max(len(sa), len(sb)) - 2
    batch = tuple(f"b{i}" for i in range(nb))
    la = batch[nb - (len(sa) - 2) :] + ("m", "k")
    lb = batch[nb - (len(sb) - 2) :] + ("k", "n")
    return la, lb, (*batch, "m", "n")


def _einsum_labels(eq: str) -> tuple[Labels, Labels, Labels]:
    """An einsum ``ab..,cd..->..`` as the same labels: one contracted letter ``k``, the letter of A alone ``m``,
    of B alone ``n``, the shared ones in Y batch dims ``b0..`` (in Y's order)."""
    m = re.fullmatch(r"\s*([a-zA-Z]+)\s*,\s*([a-zA-Z]+)\s*->\s*([a-zA-Z]*)\s*", eq)
    if m is None:
        raise Refused(f"an einsum {eq!r} not of two operands with an explicit output (or with '...')")
    a, b, o = m.groups()
    if len(set(a)) != len(a) or len(set(b)) != len(b) or len(set(o)) != len(o) or not set(o) <= set(a) | set(b):
        raise Refused(f"an einsum {eq!r} with a repeated letter (a diagonal) or an output letter of no operand")
    contracted = (set(a) & set(b)) - set(o)
    only_a, only_b = set(a) - set(b), set(b) - set(a)
    if len(contracted) != 1 or len(only_a) != 1 or len(only_b) != 1 or not (only_a | only_b) <= set(o):
        raise Refused(
            f"an einsum {eq!r} that is not one GEMM (one contracted letter, one letter of each operand "
            f"alone, the rest shared batch letters)"
        )
    names = {next(iter(contracted)): "k", next(iter(only_a)): "m", next(iter(only_b)): "n"}
    names |= {c: f"b{i}" for i, c in enumerate(c for c in o if c not in names)}
    return tuple(names[c] for c in a), tuple(names[c] for c in b), tuple(names[c] for c in o)


def _sizes(la: Labels, sa: tuple[int, ...], lb: Labels, sb: tuple[int, ...]) -> dict[str, int]:
    """Each label's extent (a batch dim's broadcast one); Refused where the operands disagree."""
    size: dict[str, int] = {}
    for lab, s in (*zip(la, sa), *zip(lb, sb)):
        if lab not in size or (size[lab] == 1 and lab != "k"):
            size[lab] = s
        elif s != size[lab] and (s != 1 or lab == "k"):
            raise Refused(f"operands of sizes {sa} and {sb} that disagree along {lab}")
    if size["k"] == 1:
        raise Refused("a contraction of one element (an outer product)")
    return size


def _operand(space: str, x: fx.Node, labels: Labels, k_last: bool = False) -> tuple[Operand, dict[str, int]]:
    """``x`` (dims ``labels``) bound where it lies: a permuted view as its input, the SMG dims in that input's
    memory order; a size-1 dim the other operand or Y broadcasts is dropped (the binding's reshape drops it).
    An input not packed row-major is copied packed (an identity ``permute``: ``fused._bind``).  ``k_last``: an
    input whose contracted dim is not last is copied with it last (A: below)."""
    src, labs = x, labels
    p = permutation(x)
    if p is not None and shape(p[0]) is not None:
        src = p[0]
        inv = [""] * len(labels)
        for i, d in enumerate(p[1]):
            inv[d] = labels[i]
        labs = tuple(inv)
    sshape = shape(src)
    order = list(range(len(sshape)))
    if k_last and labs[-1] != "k":
        order = [i for i in order if labs[i] != "k"] + [labs.index("k")]
    dims = {labs[i]: sshape[i] for i in order if not (labs[i].startswith("b") and sshape[i] == 1)}
    keep = None if contiguous(src) and order == sorted(order) else tuple(order)
    return Operand(space, "value", src.name, tuple(dims.values()), permute=keep), dims


def _epilogue(node: fx.Node, ctx: Context) -> tuple[list[fx.Node], float | None, fx.Node | None]:
    """(the epilogue's nodes, the scale, the added tensor) after the GEMM ``node``: ``* c`` or ``/ c`` of a
    number, then ``+ r`` of a value of Y's shape or its last dim, each the only reader of what it reads."""
    nodes: list[fx.Node] = []
    y, scale, added = node, None, None
    u = single_user(y)
    if (
        u is not None
        and ctx.free(u)
        and len(u.args) == 2
        and not u.kwargs
        and u.args[0] is y
        and isinstance(u.args[1], int | float)
        and not isinstance(u.args[1], bool)
        and u.args[1] != 0
    ):
        if is_function(u, MUL):
            scale = float(u.args[1])
        elif is_function(u, DIV):
            scale = 1.0 / float(u.args[1])
        if scale is not None:
            nodes.append(u)
            y = u
    u = single_user(y)
    if (
        u is not None
        and ctx.free(u)
        and is_function(u, ADD)
        and len(u.args) == 2
        and not u.kwargs
        and u.name not in ctx.norm_inputs
    ):
        other = u.args[1] if u.args[0] is y else u.args[0]
        ys = shape(y)
        if (
            isinstance(other, fx.Node)
            and other is not y
            and ys
            and dtype(other) == dtype(y)
            and shape(other) in (ys, ys[-1:])
            and shape(u) == ys
        ):
            nodes.append(u)
            added = other
    return nodes, scale, added


#: ops between an attention's score GEMM and its softmax (scale, bias, mask, cap, casts and views), and between
#: the softmax and the probabilities' GEMM (dropout, casts, views): an attention's two GEMMs are seen through them
SCORE_PATH = frozenset(
    {
        "mul",
        "div",
        "truediv",
        "add",
        "iadd",
        "sub",
        "masked_fill",
        "where",
        "tanh",
        "to",
        "type_as",
        "float",
        "half",
        "bfloat16",
        "view",
        "reshape",
        "contiguous",
        "dropout",
        "_to_copy",
        "_unsafe_view",
        "clone",
        "expand",
    }
)
#: a softmax in any spelling (an ATen graph's ``_softmax``)
SOFTMAX = frozenset({"softmax", "_softmax", "_safe_softmax"})
#: how far (in ops) an attention GEMM is looked for from its softmax
SCORE_DEPTH = 8


def _reaches_softmax(node: fx.Node, ctx: Context, forward: bool) -> bool:
    """Whether a softmax reads ``node`` (``forward``: its output; else it reads a softmax's output, as an
    attention's ``P @ V``) through at most ``SCORE_DEPTH`` ops of ``SCORE_PATH``."""
    frontier, seen = [node], set()
    for _ in range(SCORE_DEPTH):
        nxt = []
        for n in frontier:
            for m in n.users if forward else n.all_input_nodes:
                op = op_of(m, ctx.gm)
                if op in SOFTMAX:
                    return True
                if op in SCORE_PATH and m.name not in seen:
                    seen.add(m.name)
                    nxt.append(m)
        frontier = nxt
    return False


def value_gemm_of(node: fx.Node, ctx: Context) -> Subgraph | None:
    """The subgraph of ``node``, a GEMM of two values; None where it is not one (a weight operand); Refused
    where it is one the row does not take."""
    call = canonical(node, ctx.gm)
    a, b, eq = _operands(call)
    if not (_is_value(a) and _is_value(b)):
        return None
    if _reaches_softmax(node, ctx, forward=True) or any(
        _reaches_softmax(x, ctx, forward=False) or op_of(x, ctx.gm) in SOFTMAX for x in (a, b)
    ):
        raise Refused(
            "a GEMM of an attention (its scores, which a softmax reads, or its probabilities @ V) that "
            "the attention rows did not take (any refusal of theirs is on its last GEMM): left whole "
            "with the attention"
        )
    sa, sb, so, dt = shape(a), shape(b), shape(node), dtype(node)
    if sa is None or sb is None or so is None or any(not isinstance(s, int) for s in (*sa, *sb, *so)):
        raise Refused("a GEMM of two values whose sizes are symbolic or unknown")
    if dt is None or dtype(a) != dt or dtype(b) != dt:
        raise Refused(
            f"a GEMM of {dtype(a) or 'non-float'} and {dtype(b) or 'non-float'} values into "
            f"{dt or 'a non-float'}: the GEMM reads and writes one float dtype"
        )
    la, lb, lo = _einsum_labels(eq) if eq is not None else _matmul_labels(sa, sb, call.op == "bmm")
    if len(la) != len(sa) or len(lb) != len(sb) or len(lo) != len(so):
        raise Refused(f"an einsum {eq!r} whose letters do not match operands of ranks {len(sa)}, {len(sb)}")
    size = _sizes(la, sa, lb, sb)
    if tuple(size[lab] for lab in lo) != so:
        raise Refused(f"a GEMM of sizes {sa} and {sb} whose output {so} is not their product's")
    # A with k last: a transposed A ([.., k, m], as ``a.transpose(-1, -2) @ b`` lies) is copied [.., m, k]. The
    # H100 first pick of a fp16 GEMM of an A stored k-first is an mma kernel that returned NaN there (the
    # tensor-core GEMM takes A with k last only, ``schedulers.warp_tile``; its check reads B's layout alone),
    # and the copy is m x k elements against the GEMM's m x n x k
    op_a, da = _operand("A", a, la, k_last=True)
    op_b, db = _operand("B", b, lb)
    out = {lab: size[lab] for lab in lo if not (lab.startswith("b") and size[lab] == 1)}
    nodes, scale, added = _epilogue(node, ctx)
    ops = [op_a, op_b]
    add = None
    if added is not None:
        add = out if shape(added) == so else {"n": size["n"]} if lo[-1] == "n" else None
        if param_ref(added) is not None and shape(added) != so[-1:]:
            add = None  # a parameter is bound as a bias over n only
        if add is None:  # an add over Y's last dim that is not n, or of a parameter of Y's shape: left to torch
            nodes, added = nodes[:-1], None
    if added is not None:
        ref = param_ref(added)
        if ref is not None:
            ops.append(Operand("R", "param", ref, tuple(add.values())))
        else:
            ops.append(
                Operand(
                    "R",
                    "value",
                    added.name,
                    tuple(add.values()),
                    permute=None if contiguous(added) else tuple(range(len(shape(added)))),
                )
            )
    smg = _build(ctx, node, lambda: patterns.value_gemm(da, db, tuple(out), scale=scale, add=add, dtype=dt))
    if smg is None:
        return None
    tail = nodes[-1] if nodes else node
    form = "A@B" if eq is None else eq.replace(" ", "")
    epi = (f" * {scale:g}" if scale is not None else "") + (" + add" if added is not None else "")
    batch = "x".join(str(out[lab]) for lab in out if lab.startswith("b"))
    label = (
        f"value gemm {call.op} {form}{epi} {batch + ' x ' if batch else ''}{size['m']}x{size['n']}x{size['k']} "
        f"A {''.join(lab[0] for lab in da)} B {''.join(lab[0] for lab in db)} {dt}"
    )
    meta = tail.meta.get("tensor_meta")  # torch's einsum may return a permuted layout a later view relies on
    strides = None if contiguous(tail) else tuple(meta.stride)
    return Subgraph(
        "value_gemm",
        label,
        (node.name, *(n.name for n in nodes)),
        smg,
        tuple(ops),
        (Result("Y", tail.name, shape(tail), strides=strides),),
    )


def match_value_gemm(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``bmm`` / ``matmul`` / ``einsum`` of two graph values -> ``patterns.value_gemm`` (the module's forms);
    a form it does not take is refused as ``left.value_gemm``, saying what it is.  A node an earlier row
    refused (an attention the attention rows left whole), or that a pass marked for another reason, keeps
    that reason."""
    if not ctx.free(node) or node.name in ctx.refused:
        return None
    mark = node.meta.get(META)
    if mark is not None and mark.code != "left.value_gemm":
        return None
    try:
        sub = value_gemm_of(node, ctx)
    except Refused as exc:
        ctx.refuse(node, "left.value_gemm", f"{exc}: the value-GEMM row does not take it; torch runs it")
        return None
    if sub is not None and ctx.library.get(LIBRARY_KEY):
        ctx.refuse(node, "library.first", ctx.library[LIBRARY_KEY])
        return None
    return sub
