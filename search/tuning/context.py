"""What one tune is about: the graph, the machine it is ranked and filed for, the target it is lowered to."""

from __future__ import annotations

from dataclasses import dataclass

from schedulers.hardware import HardwareModel
from smg.ir import SMG


@dataclass(frozen=True)
class TuningContext:
    """The workload of one tune, handed to every part (cost model, strategy, callbacks) so none of them needs
    the others to know it.

    ``smg``: the graph tuned; ``hw``: the hardware model the space is pruned and ranked with and the records
    are filed under; ``target``: what the candidates are lowered to (``"llvm"``, ``"cuda:sm_90a"``).
    ``fast_math``: candidates may compute tanh and logistics approximately (a key of their own);
    ``inputs_from``: the graph whose outputs ``smg`` reads, so each candidate is checked on inputs it computes
    (``MeasureInput.inputs_from``)."""

    smg: SMG
    hw: HardwareModel
    target: str
    fast_math: bool = False
    inputs_from: SMG | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.smg, SMG):
            raise TypeError(f"TuningContext.smg must be an SMG, got {type(self.smg).__name__}")
        if not isinstance(self.hw, HardwareModel):
            raise TypeError(f"TuningContext.hw must be a HardwareModel, got {type(self.hw).__name__} "
                            f"(search.tuner.tuning_hardware picks one for a target)")
        if not isinstance(self.target, str) or not self.target:
            raise TypeError(f"TuningContext.target must be a target string such as 'llvm' or 'cuda:sm_90a', "
                            f"got {self.target!r}")

    @property
    def cuda(self) -> bool:
        """Whether the candidates are GPU kernels (the analytical model and the prior are a GPU's)."""
        return not self.target.startswith("llvm")
