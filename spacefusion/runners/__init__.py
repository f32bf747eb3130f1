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

``TVMBuilder`` (builder.py) lowers candidates; each runner takes a ``builder`` (default TVM's).
TVM, torch, cupy and ray are imported lazily, so this package imports on any machine.
"""

from spacefusion.runners.builder import TVMBuilder
from spacefusion.runners.common import RunnerUnavailable
from spacefusion.runners.llvm import LLVMRunner
from spacefusion.runners.local_gpu import LocalGPURunner, gpu_unavailable_reason
from spacefusion.runners.offline import OfflineBatchRunner, export_batch, import_batch, import_offline
from spacefusion.runners.ray import RayRunner
from spacefusion.runtime.batch import MANIFEST_FILE, MANIFEST_FORMAT, RESULTS_FILE, RESULTS_FORMAT

__all__ = [
    "MANIFEST_FILE", "MANIFEST_FORMAT", "RESULTS_FILE", "RESULTS_FORMAT",
    "LLVMRunner", "LocalGPURunner", "OfflineBatchRunner", "RayRunner", "RunnerUnavailable", "TVMBuilder",
    "export_batch", "gpu_unavailable_reason", "import_batch", "import_offline",
]
