"""The mask of a training backward's CPU flash attention, for the kernels derived from the attention SMG
(``training.derive_attention_backwards``).

torch's CPU flash attention (forward and backward) takes SDPA's mask as a float tensor added to the scaled
scores: HF's boolean padding masks (BERT's, LLaMA's causal + padding) reach it as ``where(keep, 0, -inf)``,
and HF's older extended masks (and any user's 4-D float mask) add ``finfo.min``.  The derived backward reads
the same mask as the score mod ``{s} + Mask`` (``attention._mask_mod``: over the mask's own dims, its
broadcast dims selected away), so its recomputed probabilities are the forward's exactly.

Why the row statistics are recomputed: with a mask, ``smg.autodiff.derive_backward`` recomputes
``P = exp((X - LSE_max) - LSE_log)`` from the row max and the log of the row sum saved apart
(``backward._split_statistics``), since for a row masked whole with ``finfo.min`` the single logsumexp
``max + log(sum)`` rounds to ``max`` and ``exp(X - LSE)`` is 1 per key, not ``1/L`` (dV L times too big: the flaw
torch's own CPU flash backward has).  torch's forward saves only that single logsumexp for the backward
(aot_autograd fixes what the forward returns), so the derived backward runs the derived forward (``bw.forward``:
O, LSE, LSE_max, LSE_log) once more on the saved Q, K, V and mask for the two parts: one more attention kernel
per backward, the price of the right gradient; O stays the one the forward saved.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from smg.patterns import ScoreMod
from spacefusion.frontend.attention import _mask_mod
from spacefusion.frontend.records import Operand


def backward_mask(mask: fx.Node, want: tuple[int, int, int, int], kv_heads: int, dt: str
                  ) -> tuple[ScoreMod, Operand] | str:
    """(score mod, its operand) of the float ``attn_mask`` a CPU flash attention backward reads, for scores
    ``want`` = (b, heads, m, l) over ``kv_heads``; a reason (str) where the derived backward cannot take it:
    not a traced tensor, a boolean or integer mask (the ATen op receives SDPA's masks as floats), or one that
    does not broadcast to the scores."""
    val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return "attention whose mask is not a traced tensor"
    if not val.dtype.is_floating_point:
        return f"attention with a {val.dtype} mask: the derived backward adds a float mask to the scores"
    if "tensor_meta" not in mask.meta:  # aot's graphs carry ``val``; ShapeProp's metadata comes later
        mask.meta["tensor_meta"] = _extract_tensor_metadata(val)
    got = _mask_mod(mask, want, kv_heads, dt)
    if isinstance(got, str):
        return got
    _, (mod,), (operand,) = got
    return mod, operand


def bind_mask(mask: torch.Tensor, operand: Operand) -> torch.Tensor:
    """The mask tensor as the ``Mask`` space: its broadcast dims dropped, cast to the scores' dtype where it is
    not, laid out packed in the operand's shape (what ``fused`` binds for the forward's kernel)."""
    from spacefusion.frontend.fused import _bind

    return _bind(mask, operand)
