"""The patterns the partition matches, as a declared table: one ``Row`` per pattern, in priority order.

A row names its pattern, the canonical ops (``frontend.canon``) its anchor node may be, a guard on that
node's canonical call (a cheap predicate; None: any call of those ops), its builder (``(node, Context) ->
Subgraph | None``: the pattern read around the anchor and its SMG built, None where it is not there) and the
refusal codes (``frontend.refusals``) that builder may record.  ``partition.partition`` walks ``ROWS`` in order
over the graph: a node is offered to a row only where its canonical op is one of the row's anchors and the
guard holds, and a node an earlier row took is offered to no later one.

This table is the one place patterns are listed.  A new op is one row here and one builder (its own module,
or beside its family's: ``attention``, ``gemms``, ``convs``, ``norms``, ``rope``, ``concat``), plus any
refusal codes it records, declared in ``refusals.CODES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import fx

from spacefusion.frontend.alibi import match_alibi_attention, match_bmm_attention
from spacefusion.frontend.attention import match_attention, match_attention_lse
from spacefusion.frontend.canon import Call
from spacefusion.frontend.concat import match_concat
from spacefusion.frontend.convs import match_conv, match_max_pool
from spacefusion.frontend.eager_attention import match_eager_attention, match_masked_fill_attention
from spacefusion.frontend.embeddings import match_embedding_norm
from spacefusion.frontend.experts import match_expert_gemm
from spacefusion.frontend.gemms import (
    match_gated_gemm,
    match_linear,
    match_patch_conv,
    match_stacked_linears,
    match_weight_gradient,
)
from spacefusion.frontend.matchers import Context
from spacefusion.frontend.norm_stats import match_norm_stats
from spacefusion.frontend.norms import match_group_norm, match_guard, match_norm
from spacefusion.frontend.records import Subgraph
from spacefusion.frontend.rope import match_rope
from spacefusion.frontend.value_gemm import ANCHORS as VALUE_GEMM_OPS
from spacefusion.frontend.value_gemm import match_value_gemm

Build = Callable[[fx.Node, Context], Subgraph | None]

#: codes any builder may record (its SMG raised; ``_build``), and the partition for a builder that crashed
COMMON = ("build.smg", "build.crashed")
LINEAR_OPS = frozenset({"linear", "matmul", "mm", "addmm"})
CASTS = frozenset({"to", "float", "half", "bfloat16", "type_as"})


@dataclass(frozen=True)
class Row:
    """One pattern: ``name``, the canonical ops it anchors on, its ``guard``, its ``build`` and its refusal
    ``codes``."""

    name: str
    anchors: frozenset[str]
    build: Build
    codes: tuple[str, ...] = ()
    guard: Callable[[Call], bool] | None = None

    def offered(self, call: Call | None) -> bool:
        """Whether a node of canonical ``call`` is this row's to try."""
        return call is not None and call.op in self.anchors and (self.guard is None or self.guard(call))


def _ops(*names: str) -> frozenset[str]:
    return frozenset(names)


def _along_channels(c: Call) -> bool:
    """A concatenation along dim 1 of 4-d images (-3): the only one ``match_concat`` builds."""
    return c.arg(1, "dim", 0) in (1, -3)


#: in priority order: a node taken by an earlier row is not offered to later ones
ROWS: tuple[Row, ...] = (
    Row("eager_attention", _ops("matmul"), match_eager_attention,
        ("attention.head_dims", "attention.mask", "attention.kv_repeat")),
    Row("masked_fill_attention", _ops("matmul"), match_masked_fill_attention,
        ("attention.head_dims", "attention.mask", "masked_fill.form", "attention.kv_repeat")),
    Row("alibi_attention", _ops("bmm"), match_alibi_attention, ("alibi.form", "attention.mask")),
    Row("bmm_attention", _ops("bmm"), match_bmm_attention,
        ("alibi.form", "attention.head_dims", "masked_fill.form")),
    Row("attention", _ops("scaled_dot_product_attention"), match_attention,
        ("attention.dropout", "attention.rank", "attention.head_dims", "attention.mask", "attention.kv_repeat")),
    # a training forward's attention whose logsumexp the backward reads (``frontend.training.read_aten``
    # leaves it whole): O and LSE from one kernel
    Row("attention_lse", _ops("_scaled_dot_product_flash_attention_for_cpu"), match_attention_lse,
        ("attention.dropout", "attention.rank", "attention.head_dims", "attention.mask", "attention.kv_repeat")),
    Row("gated_gemm", _ops("mul"), match_gated_gemm),
    Row("stacked_linears", LINEAR_OPS, match_stacked_linears),
    Row("linear", LINEAR_OPS, match_linear, ("linear.input",)),
    # MoE experts' grouped GEMMs: the weight an indexed load along the expert dim (CPU targets)
    Row("expert_gemm", _ops("grouped_mm_fallback"), match_expert_gemm,
        ("library.first",)),
    # after the linears (a GEMM with a weight is theirs) and the attention rows (their two-value matmuls)
    Row("weight_gradient", _ops("mm", "matmul"), match_weight_gradient,
        ("weight_gradient.form", "library.first")),
    # any other batched GEMM of two graph values (DeBERTa's c2p / p2c scores): after the attention rows, which
    # take (or refuse, leaving whole) the score GEMMs they read, and the weight gradient's
    Row("value_gemm", frozenset(VALUE_GEMM_OPS), match_value_gemm, ("left.value_gemm", "library.first")),
    Row("conv", _ops("conv1d", "conv2d"), match_conv,
        ("conv.form", "conv.upsample_apart", "conv1d.depthwise", "dwconv.form", "library.first")),
    Row("patch_conv", _ops("conv2d"), match_patch_conv, ("patch_conv.input", "patch_conv.remainder")),
    # (a training forward's RMSNorm whose rsqrt the backward reads: that rsqrt a third output, ``Rstd``)
    # a norm of embeddings (gathered rows, ``frontend.embeddings``) before the plain norms
    Row("embedding_norm", _ops("layer_norm", "rms_norm", "mul") | CASTS, match_embedding_norm,
        ("embedding.prologue", "embedding.form", "library.first")),
    Row("norm", _ops("layer_norm", "rms_norm", "mul") | CASTS, match_norm,
        ("norm.prologue", "norm.form", "norm.saved_stats")),
    # a training forward's LayerNorm whose mean and rstd the backward reads (``training.read_aten`` leaves
    # ``native_layer_norm`` whole): out, mean and rstd from one kernel, bound to the op's three elements
    Row("norm_stats", _ops("native_layer_norm"), match_norm_stats, ("norm.form",)),
    Row("group_norm", _ops("group_norm"), match_group_norm, ("group_norm.form",)),
    Row("max_pool", _ops("max_pool2d"), match_max_pool, ("max_pool.form", "max_pool.input")),
    # with the KV-cache writes of its output (and of V beside it) where a decoder step has them
    Row("rope", _ops("add"), match_rope, ("rope.form", "rope.strided", "kv_cache.write", "kv_cache.value")),
    Row("concat", _ops("cat"), match_concat, ("concat.parts",), guard=_along_channels),
    Row("guard", _ops("clamp"), match_guard),
)
