"""Which models and graphs a kernel cache has compiled before: whether a compile is likely to build nothing.

Why: the export workers (``parallel_build.start_pool``) are started before Dynamo traces, so that their
imports (torch and TVM in each of up to 8 processes, 5-8 s) overlap the trace of a cold compile.  A warm
compile builds nothing, and those imports only compete with it: on the H200 host, BERT-base 8x128's warm
compile took 5.1-6.8 s with the workers started and 3.7-4.4 s without them
(``experiments/results/compile_time_bert_base_8x128_h200.json``).  So a compile starts the workers early
only where the cache has not compiled the same thing to the end before:

- ``model_signature``: before the trace, the model alone (its class and its parameters' and buffers'
  names, shapes and dtypes) and the kernel code's fingerprint;
- ``graph_signature``: at each Dynamo graph, its code and its inputs' sizes, strides and dtypes.

A signature is marked (an empty file under ``<cache>/seen/``) once a graph of it compiled.  This is a
hint for speed only: a graph whose kernels are missing after all (a new input size of a seen model, a
cache emptied by hand) still builds them, on workers started when they are needed (``export_many``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

#: the folder, beside the kernels, that holds one empty file per signature seen
SEEN_DIR = "seen"


def _digest(parts: Sequence[str]) -> str:
    from spacefusion.lower.fingerprint import code_fingerprint

    h = hashlib.sha256(code_fingerprint().encode())
    for p in parts:
        h.update(b"\0" + p.encode())
    return h.hexdigest()[:24]


def model_signature(model: nn.Module) -> str:
    """The model's class and every parameter's and buffer's name, shape, dtype and device type, with the
    kernel code's fingerprint (a code change rebuilds every kernel)."""
    cls = type(getattr(model, "_orig_mod", model))
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    for kind, named in (("p", model.named_parameters()), ("b", model.named_buffers())):
        parts += [f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type}" for name, t in named]
    return "model-" + _digest(parts)


def graph_signature(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """A Dynamo graph's code and its inputs' sizes, strides, dtypes and devices (symbolic sizes as their
    symbols), with the kernel code's fingerprint."""
    parts = [gm.code]
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            parts.append(f"{tuple(map(str, x.shape))}:{tuple(map(str, x.stride()))}:{x.dtype}:{x.device.type}")
        else:
            parts.append(type(x).__name__)
    return "graph-" + _digest(parts)


def seen(folder: Path, signature: str) -> bool:
    """Whether ``folder`` (a kernel cache) compiled a graph of ``signature`` before."""
    return (Path(folder) / SEEN_DIR / signature).is_file()


def mark(folder: Path, signatures: Sequence[str]) -> None:
    """Record that ``signatures`` compiled into ``folder``; a cache that cannot be written is left as it is
    (the mark only saves time)."""
    try:
        (Path(folder) / SEEN_DIR).mkdir(parents=True, exist_ok=True)
        for s in signatures:
            (Path(folder) / SEEN_DIR / s).touch()
    except OSError:
        pass


__all__ = ["SEEN_DIR", "graph_signature", "mark", "model_signature", "seen"]
