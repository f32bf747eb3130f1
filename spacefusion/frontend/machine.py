"""Which hardware model the CUDA path ranks for: the GPU in hand, a model the user gives, or a reported default.

A first pick is the analytical model's best schedule for one machine's numbers (``schedules.model_pick``),
and so are a reduction's split (``schedulers.split.decide_split``) and a convolution's image layout
(``layouts.decide``).  An H200 differs from an H100 in its DRAM bandwidth (4.8 against 3.35 TB/s), so ranking
an H200's kernels with the H100's numbers is a silent mistake.  ``ranking_hardware`` says which model ranks and
why (``schedulers.hardware.choose_hardware``): ``hw`` where the caller gives one; else the preset of CUDA
device 0 (by name, then by compute capability); else ``DEFAULT_GPU`` (an export on a CPU machine for a GPU
one), which is logged once per reason here and recorded with the kernels (``CudaBackend``'s
``hardware.json`` and ``timing.json``) and in the backend's report.
"""

from __future__ import annotations

import logging

import torch

from schedulers.hardware import HardwareChoice, HardwareModel, choose_hardware

log = logging.getLogger("spacefusion")
#: the defaults already logged in this process (each reason once, not once per backend)
_LOGGED: set[str] = set()


def gpu_in_hand() -> tuple[str, tuple[int, int] | None] | None:
    """(name, compute capability) of the current CUDA device, as torch sees it; None without one."""
    if not torch.cuda.is_available():
        return None
    try:
        capability = tuple(torch.cuda.get_device_capability())
    except Exception:  # a device torch lists but cannot query: its name still says which it is
        capability = None
    return torch.cuda.get_device_name(), capability  # type: ignore[return-value]


def ranking_hardware(hw: HardwareModel | str | None = None) -> HardwareChoice:
    """The model the CUDA path ranks for, and why: ``hw`` (a model or a preset's name) where given, else the
    GPU in hand's preset, else ``DEFAULT_GPU``, which is logged (a warning, once per reason)."""
    choice = choose_hardware(hw, None if hw is not None else gpu_in_hand())
    if choice.defaulted and choice.why not in _LOGGED:
        _LOGGED.add(choice.why)
        log.warning("spacefusion ranks CUDA kernels for the %s: %s", choice.model.name, choice.why)
    return choice


def hardware_dir(hw: HardwareModel) -> str:
    """The folder name of ``hw``'s kernels in the kernel cache: the preset's name, lower case."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in hw.name.lower())


__all__ = ["gpu_in_hand", "hardware_dir", "ranking_hardware"]
