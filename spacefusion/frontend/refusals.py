"""Why an op is left to torch, as a code plus a sentence: the codes are declared here, once.

A pattern that recognises a node but cannot fuse it records a ``Refusal`` (``matchers.Context.refuse``); an
op no pattern recognised gets its kind's code from ``reasons.classify``.  The partition report counts the ops
left to torch by code (``records.Partition.left_codes``); the sentence says what of this op the pattern could
not take, and stays word for word what it was before codes (tests and users grep it).

The measured choice of a whole compiled graph (``measure.Choice``: its fused path or torch's graph, whichever
its first calls timed faster) is said with a code too, ``kept.fused`` or ``kept.torch``, declared here with the
others; a fused op of a graph whose torch graph was kept counts as left to torch under ``kept.torch``
(``compiled.GraphReport.coverage``).

Contract: a code is ``<pattern, "left" or "kept">.<what>`` and is in ``CODES``; ``refusal`` raises ``KeyError`` for an
undeclared one, so a new refusal is declared here before it is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

#: every refusal code, with what it means
CODES: dict[str, str] = {
    # any pattern
    "build.smg": "the pattern matched but its SMG builder raised (a size or form the IR refuses)",
    "build.crashed": "a pattern's builder raised an unexpected error on the node (a bug, reported, never a crash)",
    "library.first": "the backend leaves this form to torch's library kernel (``CudaBackend.library_first``)",
    # attention (SDPA, written out, ALiBi)
    "attention.dropout": "attention with dropout: random, not an index expression",
    "attention.rank": "attention on tensors that are not [batch, heads, seq, head_dim]",
    "attention.head_dims": "attention with unequal head dims or an unsupported dtype",
    "attention.mask": "an attention mask the score mods cannot express",
    "attention.kv_repeat": "K/V repeated over the heads in a form GQA cannot read per kv head (tiled, or K and V "
                           "repeated differently)",
    "alibi.form": "an ALiBi ``baddbmm`` attention whose bias, shapes or coefficients the pattern does not take",
    "masked_fill.form": "a ``masked_fill`` of written-out attention scores whose fill or mask the score mod does not "
                        "take (a fill that is not a number below +inf, a mask that is not boolean or does not "
                        "broadcast to the scores)",
    # GEMMs
    "linear.input": "a linear of a non-float or unshaped input",
    "patch_conv.input": "a patch convolution of a non-float or non-4-D input",
    "patch_conv.remainder": "an image that is not a whole number of patches",
    "weight_gradient.form": "a GEMM of two values, one transposed, that is not a float 2-D weight gradient grad.T @ x",
    # convolutions and pools
    "conv.form": "a convolution the implicit GEMM does not take (groups, dilation, kernel shape, channels, dtype)",
    "conv.upsample_apart": "an upsampling the conv after it does not take in (run apart)",
    "conv1d.depthwise": "a depthwise 1-D convolution (the depthwise window is 2-D)",
    "dwconv.form": "a depthwise convolution the depthwise pattern does not take",
    "max_pool.form": "a max pool with dilation, ceil mode, indices or a non-square window",
    "max_pool.input": "a max pool of a non-float or non-image input",
    # norms
    "norm.prologue": "a norm read only by linears: their GEMMs' prologue",
    "norm.form": "a norm over several dims or without its affine parameters",
    "norm.saved_stats": "a training forward's RMSNorm whose rstd the backward reads, in a form the statistics-saving "
                        "pattern does not take (input, weight and output of mixed dtypes; an offset weight, a guard "
                        "or a clamp)",
    "group_norm.form": "a GroupNorm of an unsupported rank or with one affine parameter",
    # element-wise patterns
    "rope.form": "a rotate-half RoPE in all but a detail",
    "rope.strided": "RoPE on a value strided so that it cannot be bound without a copy",
    "kv_cache.write": "a KV-cache ``index_copy_`` of RoPE's K that its kernel cannot take (along another dim, into "
                      "a cache made in the graph, strided or of another dtype, K read elsewhere): torch writes it",
    "kv_cache.value": "a V-cache ``index_copy_`` beside a K write the RoPE kernel took, that it cannot carry (V of "
                      "another shape or layout, or read elsewhere): torch writes it",
    "embedding.prologue": "an embedding whose norm is the prologue of the GEMMs reading it (no norm kernel to "
                          "gather into): torch gathers the rows",
    "embedding.form": "an embedding under a norm in all but a detail (terms of other shapes or dtypes, a norm "
                      "over several dims or without its affine weight)",
    "concat.parts": "a concatenation along the channels of parts the pattern does not take",
    # ops no pattern recognised (``reasons.classify``)
    "left.guard": "a trace guard: no compute",
    "left.shape": "a shape or device query: no compute",
    "left.layout": "a layout op (view, permute, index): kernels bind views of its input",
    "left.rope_tables": "RoPE's cos/sin tables",
    "left.rope": "RoPE not in HF's rotate-half form",
    "left.gather": "a data-dependent gather",
    "left.conv": "a convolution no pattern took (with what of it the patterns cannot express)",
    "left.identity": "an identity at inference",
    "left.module": "a module no pattern covers",
    "left.linear_weight": "a linear whose weight is not a parameter the backend lifted",
    "left.concat": "a concatenation or stack",
    "left.creation": "tensor creation: no input to fuse with",
    "left.elementwise": "an element-wise op with no fusable neighbour",
    "left.no_pattern": "an op no pattern covers",
    "left.unclassified": "an op whose classification failed",
    # a training step's ATen graphs (``frontend.training``)
    "left.saved_stats": "a norm whose statistics (mean, rstd) the backward reads, in a form no statistics-saving "
                        "norm takes (not a float input, several dims, no affine parameters)",
    "left.saved_lse": "attention whose row log-sum-exp the backward reads, where no derived forward outputs it",
    "left.value_gemm": "a GEMM of two graph values in a form no row takes (the value-GEMM row takes bmm / matmul / "
                       "one-GEMM einsums of floats, the weight-gradient row grad.T @ x; an attention's GEMMs the "
                       "attention rows did not take stay whole with it)",
    "left.grouped_mm": "a grouped GEMM of MoE experts: each row's weight is picked by data (the routing's offsets)",
    "left.backward_op": "an ATen backward op (tanh_backward, embedding_dense_backward, ...) no pattern or derived "
                        "kernel covers",
    "left.derived_backward": "an attention, LayerNorm or GEMM-epilogue backward whose derived kernels "
                             "(smg.autodiff) could not be built",
    "left.act_epilogue": "a GELU/SiLU backward after the input-gradient GEMM of a weight, plain or of a gated MLP's "
                         "product silu(G) * U, in a form its derived epilogue does not take (mixed dtypes, or one "
                         "not float32, bfloat16 or float16; a gated one whose dH has readers besides dH * U and "
                         "dH * silu(G), or its G or U computed after the gradients; untraced values; an input "
                         "not the GEMM's shape)",
    "left.norm_backward": "a LayerNorm backward the derived kernels do not take (mixed dtypes of grad, input and "
                          "weight, several normalised dims, symbolic sizes): torch's native_layer_norm_backward",
    "left.random": "a random op of a training step (dropout): torch draws it, from torch's generator",
    "left.kernel_build": "a fused subgraph whose kernel could not be built",
    "left.dead": "unused once the kernels took its readers: removed (not run per call)",
    "left.folded": "reads no input: evaluated once at compile time (not run per call)",
    # the measured choice of a whole compiled graph (``frontend.measure``)
    "kept.fused": "the graph's fused path, measured no slower than torch's graph (within ``measure.MARGIN``)",
    "kept.torch": "torch's graph, measured faster than the graph's fused path: the fused kernels do not run",
}


#: an fx node's ``meta`` key under which a pass that read the graph before the partition (``training.read_aten``)
#: leaves the ``Refusal`` of a node it knows no pattern will take, and why (the partition reports it as is)
META = "spacefusion_refusal"
#: an fx node's ``meta`` key marking a call of kernels a pass put there itself (``training``: the attention
#: backward derived from the SMG): not left to torch, and no table row's; its stage's report says what it runs
DERIVED = "spacefusion_derived"


@dataclass(frozen=True)
class Refusal:
    """Why a node is left to torch: a declared ``code`` and the ``sentence`` the report gives."""

    code: str
    sentence: str


def known(code: str) -> bool:
    return code in CODES


def refusal(code: str, sentence: str) -> Refusal:
    """A ``Refusal``; ``KeyError`` where ``code`` is not declared in ``CODES``."""
    if code not in CODES:
        raise KeyError(f"undeclared refusal code {code!r}: declare it in spacefusion.frontend.refusals.CODES")
    return Refusal(code, sentence)
