"""torch <-> numpy for the CPU backends, bfloat16 included.

numpy has no bfloat16 of its own (``tensor.numpy()`` raises ``TypeError: Got unsupported ScalarType
BFloat16``); ``ml_dtypes`` (a TVM dependency) registers one, bit for bit the same 16-bit format as torch's.
So a bf16 tensor crosses as its raw bits: viewed as int16 on one side and reinterpreted on the other, no
copy and no rounding.  Every other dtype crosses as ``Tensor.numpy()`` / ``torch.from_numpy`` do.

``to_numpy`` and ``to_torch`` are exact inverses for every dtype the SMG takes (``smg.ir.FLOAT_DTYPES``);
``round_to`` is the one place where a float64 result becomes a stored dtype, as a kernel's does.

``ml_dtypes`` is imported on first use of a bf16 array only: ``backends`` (and so this module) loads on the GPU
machine too, which has torch but need not have ml_dtypes.
"""

from __future__ import annotations

import functools

import numpy as np
import torch


@functools.cache
def bf16() -> np.dtype:
    """numpy's dtype of torch's bfloat16 (``ml_dtypes``, which also registers the name "bfloat16" with numpy)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """``t`` on the CPU as a numpy array of its dtype; bf16 as ``ml_dtypes.bfloat16`` (the same bits)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(bf16())
    return t.numpy()


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A numpy array as a torch tensor (sharing memory where it can); an ``ml_dtypes.bfloat16`` array as a
    ``torch.bfloat16`` tensor of the same bits."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` (the reference's float64) stored as ``dtype``, packed.  A 16-bit dtype goes through float32
    first: a kernel computes in float32 and rounds that to 16 bits at its store, so the reference's output
    is the kernel's exact result rounded the kernel's way (float64 -> bf16 directly can differ by one bf16
    ulp where float32 rounding makes a tie)."""
    if dtype in ("bfloat16", "float16"):
        a = np.asarray(a, dtype=np.float32)
    return np.ascontiguousarray(np.asarray(a).astype(bf16() if dtype == "bfloat16" else np.dtype(dtype)))
