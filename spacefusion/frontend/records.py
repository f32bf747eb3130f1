"""What a partition decides, as plain frozen records: fused subgraphs, their bindings, ops left to torch."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property

from smg.ir import SMG


@dataclass(frozen=True)
class Operand:
    """How one SMG input is fed: a graph value or a model parameter, viewed with the space's shape.

    ``transpose``: an ``nn.Linear`` stores W[n, k]; the GEMM patterns take B[k, n] (torch's ``A @ B``).
    ``permute``: the value is viewed through this permutation of its dims before the reshape: a
    [b, h, s, d] value lying as [b, s, h, d] (after RoPE) is bound to a bshd space without a copy.
    ``stack``: a "param" operand that is these parameters (each transposed where ``transpose``) stacked
    along a new first dim, once at build time: the stacked Q/K/V weights of one GEMM (``ref`` is the first).
    ``split``: the value is first viewed with this shape (dims split), then permuted: an image [b, c, H, W]
    as [b, c, nh, kh, nw, kw] -> [b, nh, nw, c, kh, kw], one patch per GEMM row (a copy: torch's im2col).
    A parameter of more than two dims is transposed as [dim 0, the rest] (a conv weight as a linear's).
    ``select`` and ``cast``: an attention mask [b, 1, m, l] that torch broadcast from [b, 1, 1, l] is read
    as the [b, l] it is (its stride-0 dims at index 0), a boolean one as 0/1 in the scores' dtype.
    """

    space: str
    source: str  # "value" (an fx node's output) | "param" (a parameter or buffer, by qualified name)
    ref: str
    shape: tuple[int, ...]
    transpose: bool = False
    permute: tuple[int, ...] | None = None
    stack: tuple[str, ...] = ()
    split: tuple[int, ...] | None = None
    select: tuple[int, ...] = ()  # dims read at index 0 first: broadcast (stride-0 or size-1) dims of a mask
    cast: str | None = None  # converted to this dtype (a boolean attention mask as 0/1 of the scores' dtype)
    conv: bool = False  # a conv weight [co, c, kh, kw] laid out as the implicit GEMM's B [kh * kw * c, co]
    #: a BatchNorm folded in at build time, (running mean, running var, weight, bias, eps) ("" for an absent
    #: affine part): a conv weight is scaled by ``w / sqrt(var + eps)`` per output channel, a bias (``ref`` ""
    #: where the conv has none) becomes ``(bias - mean) * scale + b``
    fold_bn: tuple[str, ...] = ()
    #: a conv weight merged per output parity for a conv after a nearest upsampling, (kernel, pad, factor):
    #: ``smg.ops.upsample_fold`` takes [kh, kw, c, co] to the parity GEMMs' B [factor, factor, taps * c, co]
    fold_upsample: tuple[int, int, int] = ()
    #: a "param" read as these rows [start, stop) of its first dim (before any transpose): one half of a
    #: chunked projection's weight or bias (GEGLU's gate and value halves of one linear)
    rows: tuple[int, int] | None = None
    #: (the norm's weight, its offset): a linear weight [.., n, k] multiplied by ``offset + w[k]`` once, its
    #: norm taken as the GEMM's prologue (``frontend.prologue``)
    fold_norm: tuple[str, float] | None = None
    #: a vector of group ends (MoE ``offs``: rows ``[offs[e - 1], offs[e])`` are expert e's) read as each of the
    #: ``shape[0]`` rows' group, ``searchsorted(offs, arange(rows), right=True)`` (int64): the ids of an indexed
    #: load (``smg.loads``) of the experts' weights; a row past the last end gets ``len(offs)``, outside the table
    ends: bool = False


@dataclass(frozen=True)
class Result:
    """An SMG output standing for an fx node, viewed back to the node's shape.

    ``permute``: the output is viewed through this permutation of its dims before the reshape: RoPE's
    [b, s, h, d] output goes back as the [b, h, s, d] view torch's RoPE returns (same strides, no copy).
    ``index``: the node is this slice of the output's first dim (one linear of a stacked GEMM: contiguous).
    ``split``: the output is first viewed with this shape, then permuted: a patch GEMM's Y[b * nh * nw, c]
    as [b, nh, nw, c] -> the conv's [b, c, nh, nw] (channels-last strides, no copy).
    ``strides``: the node's strides (torch's op lays it out so, and a later ``view`` or op may rely on it):
    where the view's differ, the output is copied into a tensor of these (the training forward's attention
    LSE, which torch's CPU flash attention returns lying as [b, m, heads]); None: the view as it comes."""

    space: str
    node: str
    shape: tuple[int, ...]
    permute: tuple[int, ...] | None = None
    index: int | None = None
    split: tuple[int, ...] | None = None
    strides: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Subgraph:
    """Fx nodes fused into one SMG (one kernel); ``kind`` is attention, gemm, stacked_gemm, gated_gemm, norm,
    residual_norm, rope."""

    kind: str
    label: str
    nodes: tuple[str, ...]
    smg: SMG
    operands: tuple[Operand, ...]
    results: tuple[Result, ...]
    #: the graph values (inputs: a decoder's KV caches) the kernel writes in place (``smg.stores``): every
    #: other reader of one runs after the kernel where it came after the write in the graph, before it else
    writes: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The SMG's content key: subgraphs with equal keys share one schedule and one kernel."""
        return self.smg.key


#: the reasons an op the partition left to torch does not run per call after all (``frontend.constants``)
DEAD = "unused once the kernels took its readers: removed"
FOLDED = "reads no input (only constants, or weights baked in): evaluated once, at compile time (a buffer)"


@dataclass(frozen=True)
class LeftOp:
    """An fx node torch runs, and why no SMG subgraph took it."""

    node: str
    op: str
    reason: str
    #: the reason's code (``frontend.refusals.CODES``): what the report counts
    code: str = "left.no_pattern"


#: the canonical ops (``frontend.canon``) a coverage count calls matmuls and convolutions: the FLOPs of a model
#: (an attention call counts once; a grouped GEMM, MoE experts' ``grouped_mm``, once)
HEAVY_OPS = frozenset({"linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "einsum", "conv1d", "conv2d", "conv3d",
                       "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "scaled_dot_product_attention",
                       "grouped_mm", "_grouped_mm", "grouped_mm_fallback"})


@dataclass(frozen=True)
class Coverage:
    """How many of a graph's matmuls and convolutions (``HEAVY_OPS``) run in fused kernels.

    ``fused``: the nodes a kept subgraph took; ``left``: those torch runs per call, each with its refusal
    (code and sentence); ``once``: those torch does not run per call after all (dead once the kernels took
    their readers, or folded at compile time).  ``fraction`` is fused over what runs per call (fused + left):
    an op computed once is neither."""

    fused: tuple[str, ...]
    left: tuple[LeftOp, ...]
    once: tuple[LeftOp, ...] = ()

    @property
    def total(self) -> int:
        return len(self.fused) + len(self.left)

    @property
    def fraction(self) -> float:
        """Fused over run per call; 1.0 for a graph with none (nothing to leave)."""
        return len(self.fused) / self.total if self.total else 1.0

    def __add__(self, other: Coverage) -> Coverage:
        return Coverage(self.fused + other.fused, self.left + other.left, self.once + other.once)


@dataclass(frozen=True)
class Partition:
    subgraphs: tuple[Subgraph, ...]
    left: tuple[LeftOp, ...]
    #: (SMG key, "as N kernels: why"): a split reduction's or a barrier's kernels, the backend's decision, said
    #: in the summary
    splits: tuple[tuple[str, str], ...] = ()
    #: (conv SMG key, why it reads its image in that layout): the search's layout decisions (``frontend.layouts``)
    layouts: tuple[tuple[str, str], ...] = ()
    #: the names of the graph's matmul and convolution nodes (``HEAVY_OPS``): what ``coverage`` counts
    heavy: tuple[str, ...] = ()

    def coverage(self) -> Coverage:
        """The graph's matmuls and convolutions: fused, left to torch (with why) or not run per call."""
        heavy = set(self.heavy)
        taken = {n for s in self.subgraphs for n in s.nodes}
        left = [op for op in self.left if op.node in heavy]
        once = tuple(op for op in left if op.code in ("left.dead", "left.folded"))
        return Coverage(tuple(n for n in self.heavy if n in taken), tuple(op for op in left if op not in once), once)

    @cached_property
    def distinct(self) -> dict[str, tuple[Subgraph, ...]]:
        """Subgraphs grouped by SMG content key, in first-seen order (each key is scheduled once)."""
        out: dict[str, list[Subgraph]] = {}
        for s in self.subgraphs:
            out.setdefault(s.key, []).append(s)
        return {k: tuple(v) for k, v in out.items()}

    def counts(self) -> Counter[str]:
        return Counter(s.kind for s in self.subgraphs)

    def left_reasons(self) -> Counter[str]:
        return Counter(op.reason for op in self.left)

    def left_codes(self) -> Counter[str]:
        """The ops left to torch counted by their refusal code (``frontend.refusals``)."""
        return Counter(op.code for op in self.left)

    def summary(self) -> str:
        lines = [f"{len(self.subgraphs)} fused subgraphs ({len(self.distinct)} distinct SMGs), "
                 f"{len(self.left)} ops left to torch"]
        split, layout = dict(self.splits), dict(self.layouts)
        for key, subs in self.distinct.items():
            lines.append(f"  {len(subs):3d} x {subs[0].label}  [{subs[0].key[:10]}]")
            if key in split:
                lines.append(f"        {split[key]}")
            if key in layout:
                lines.append(f"        image {layout[key]}")
        reasons = self.left_reasons().most_common()
        for title, once in (("left to torch:", False), ("not run per call:", True)):
            rows = [(r, n) for r, n in reasons if (r in (DEAD, FOLDED)) == once]
            if rows or not once:
                lines.append(title)
            for reason, n in rows:
                ops = sorted({op.op for op in self.left if op.reason == reason})
                codes = sorted({op.code for op in self.left if op.reason == reason})
                lines.append(f"  {n:3d} x {', '.join(ops)}: {reason} [{', '.join(codes)}]")
        if self.left:
            lines.append("by code: " + ", ".join(f"{c} {n}" for c, n in sorted(self.left_codes().items())))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
