"""Every GPU of this host, one measuring worker each: what ``spacefusion tune`` and ``tune_model`` measure on by
default (``gpu_runner``)."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

from search.records import Runner
from spacefusion.runners.common import RunnerUnavailable
from spacefusion.runners.local_gpu import LocalGPURunner
from spacefusion.runners.processes import ProcessRunner, visible_gpus

#: how ``gpu_runner`` starts its workers: Ray where it is installed (the same engine as a cluster), else one
#: subprocess per GPU
ENGINES = ("auto", "ray", "processes")


def gpu_runner(gpus: int | None = None, engine: str = "auto", **inner_kwargs: Any) -> Runner:
    """A runner measuring on ``gpus`` of this host's visible GPUs at once (None: all of them), one worker per GPU
    so timings never share a device, each a ``LocalGPURunner(**inner_kwargs)``.

    One GPU (or none: its ``check`` then says why) is measured in this process, as before; several through
    ``engine``: ``"ray"`` (a local Ray instance, or the Ray this process is connected to), ``"processes"`` (one
    subprocess per GPU, ``CUDA_VISIBLE_DEVICES`` set to it), ``"auto"``: Ray where it is installed.  Asking
    for more GPUs than are visible, or an unknown engine, is ``RunnerUnavailable`` / ValueError at once."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    if gpus is not None and gpus < 1:
        raise ValueError(f"gpus must be at least 1, got {gpus}")
    ids = visible_gpus()
    if gpus is not None and gpus > max(1, len(ids)):
        raise RunnerUnavailable(f"{gpus} GPUs asked for, {len(ids)} visible here"
                                + (f" ({', '.join(ids)})" if ids else ""))
    n = len(ids) if gpus is None else gpus
    if n <= 1:
        return LocalGPURunner(**inner_kwargs)
    inner = functools.partial(LocalGPURunner, **inner_kwargs)
    if engine == "ray" or (engine == "auto" and importlib.util.find_spec("ray") is not None):
        from spacefusion.runners.ray import RayRunner

        return RayRunner(address="local", num_workers=n, num_gpus=1, inner=inner,
                         init_kwargs={"num_gpus": len(ids), "include_dashboard": False})
    return ProcessRunner(gpus=ids[:n], inner=inner)
