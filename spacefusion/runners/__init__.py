"""Builders and runners, the implementations the tuner (``search.tuner``) is handed.

Every runner implements ``search.records.Runner``: ``measure(inputs)`` gives one ``MeasureResult`` per
input, in order, and never raises for a bad candidate (build failures, wrong numerics, launch errors
become results with ``error``).  Numerics come first: a kernel that computes the wrong thing is never
timed, so the tuner can never prefer a fast wrong kernel.  One file per runner:

* ``LLVMRunner``         (llvm.py) TVM llvm on this CPU; what CI uses to exercise the tuning loop.
* ``LocalGPURunner``     (local_gpu.py) builds here, measures with the GPU runtime on a local GPU.
* ``OfflineBatchRunner`` (offline.py) exports a batch here; ``spacefusion-measure`` measures it on the
                         GPU machine (no TVM there); ``import_batch``/``import_offline`` read it back.
* ``RayRunner``          (ray.py) spreads candidates over a Ray cluster, each actor with an inner runner.
* ``ProcessRunner``      (processes.py) the same over subprocesses of this host, one per GPU (no Ray needed).
* ``gpu_runner``         (all_gpus.py) every GPU of this host, one worker each: the CLI's and tune_model's default.

``RayRunner`` and ``ProcessRunner`` are ``PoolRunner``s (pool.py): one candidate per worker at a time, thread-safe
``measure``, a lost worker's candidate retried on another; ``worker.py`` is the worker's side.

``TVMBuilder`` (builder.py) lowers candidates; each runner takes a ``builder`` (default TVM's).
TVM, torch, cupy and ray are imported lazily, so this package imports on any machine.
"""

from spacefusion.runners.all_gpus import gpu_runner
from spacefusion.runners.builder import TVMBuilder
from spacefusion.runners.common import RunnerUnavailable
from spacefusion.runners.llvm import LLVMRunner
from spacefusion.runners.local_gpu import LocalGPURunner, gpu_unavailable_reason
from spacefusion.runners.offline import OfflineBatchRunner, export_batch, import_batch, import_offline
from spacefusion.runners.pool import PoolRunner
from spacefusion.runners.processes import ProcessRunner, cpu_cores, visible_gpus
from spacefusion.runners.ray import RayRunner
from spacefusion.runtime.batch import MANIFEST_FILE, MANIFEST_FORMAT, RESULTS_FILE, RESULTS_FORMAT

__all__ = [
    "MANIFEST_FILE", "MANIFEST_FORMAT", "RESULTS_FILE", "RESULTS_FORMAT",
    "LLVMRunner", "LocalGPURunner", "OfflineBatchRunner", "PoolRunner", "ProcessRunner", "RayRunner",
    "RunnerUnavailable", "TVMBuilder", "cpu_cores", "export_batch", "gpu_runner", "gpu_unavailable_reason",
    "import_batch", "import_offline", "visible_gpus",
]
