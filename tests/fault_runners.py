"""Inner runners for the pool tests, importable by a worker process (``tests.fault_runners:...``: the workers get
the test process's ``sys.path``): a worker that dies on a candidate, and the golden runs' keyed runner slowed
down so that tunes side by side overlap."""

from __future__ import annotations

import os
import time
from pathlib import Path

from search.records import MeasureInput, MeasureResult
from tests.tuner_golden import KeyedRunner


class DyingRunner(KeyedRunner):
    """The keyed runner (a latency fixed by the key, nothing built), whose process dies (``os._exit(3)``) on a
    candidate whose key starts with ``die_on`` (``""``: every candidate): every time, or only the first time
    where ``once`` names a file that marks it done."""

    name = "dying"

    def __init__(self, die_on: str, once: str | None = None) -> None:
        super().__init__()
        self.die_on, self.once = die_on, once

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        for i in inputs:
            if i.key.startswith(self.die_on):
                if self.once is None or not Path(self.once).exists():
                    if self.once is not None:
                        Path(self.once).write_text(str(os.getpid()))
                    os._exit(3)
        return super().measure(inputs)


class SlowKeyedRunner(KeyedRunner):
    """The keyed runner taking ``delay_s`` per candidate, as a measurement would."""

    name = "slow-keyed"

    def __init__(self, delay_s: float = 0.2) -> None:
        super().__init__()
        self.delay_s = delay_s

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        time.sleep(self.delay_s * len(inputs))
        return super().measure(inputs)
