"""Inner runners for the pool tests, importable by a worker process (``tests.fault_runners:...``: the workers get
the test process's ``sys.path``): a worker that dies on a candidate, and the golden runs' keyed runner slowed
down so that tunes side by side overlap; and how a test kills a busy worker and waits for its pool to recover."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from search.records import MeasureInput, MeasureResult
from spacefusion.runners.pool import PoolRunner, WorkerPool
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


class ShippedKeyedRunner(KeyedRunner):
    """The keyed runner that also takes a shipped artefact (``measure_built``, as ``LocalGPURunner`` does): its
    result says which files arrived, the schedule their kernel.json names, and whether this process has TVM."""

    name = "shipped-keyed"

    def measure_built(self, inp: MeasureInput, folder: str) -> MeasureResult:
        files = sorted(p.name for p in Path(folder).iterdir())
        kernel = json.loads((Path(folder) / "kernel.json").read_text())
        r = super().measure([inp])[0]
        meta = (("files", files), ("kernel_of", kernel.get("schedule_key")), ("tvm_here", "tvm" in sys.modules))
        return MeasureResult(r.schedule_key, r.target, r.latencies_us, r.max_abs_err, r.error, meta)


def kill_first_busy(pool: WorkerPool, killed: list[int]) -> threading.Thread:
    """A thread that SIGKILLs the first worker it sees with a candidate in hand, once."""
    def run() -> None:
        for _ in range(3000):
            busy = pool.busy()
            if busy:
                os.kill(busy[0]["pid"], signal.SIGKILL)
                killed.append(busy[0]["pid"])
                return
            time.sleep(0.01)

    t = threading.Thread(target=run)
    t.start()
    return t


def back_to(runner: PoolRunner, n: int) -> int:
    """The runner's live workers once ``n`` are up again (a lost one restarts in the background), or after 60 s."""
    for _ in range(600):
        if runner.parallelism >= n:
            break
        time.sleep(0.1)
    return runner.parallelism
