"""Thread-block clusters (sm_90) for CUDA-core reductions: one row's lanes spread over a cluster's blocks.

A GroupNorm at batch 2 has 64 rows for 132 SMs.  Split across blocks through a global workspace it takes three
launches (``schedulers.split``); with ``cluster`` blocks per row, each block reduces its share of the row, the
blocks' results meet in distributed shared memory (each block's thread 0 reads every block's value, in one
order, so all hold the same total) and the second pass stores each block's share, in one launch.  The
lowering (``lower.tir``) emits the calls below (``lower.build`` defines them in the source); ``with_cluster``
gives the kernel its compile-time cluster shape, so a plain launch (the runtime's ``cuLaunchKernelEx``, a CUDA
graph) runs it as clusters.  TVM's codegen has no cluster attribute, and these two helpers are a few lines of PTX.
"""

from __future__ import annotations

import re

#: the device functions a cluster kernel calls (defined in its source before the kernel)
SYNC, LOAD = "sf_cluster_sync", "sf_cluster_load"

SOURCE = f"""
// every thread of the cluster arrives; its shared-memory writes are visible cluster-wide after the wait
__device__ __forceinline__ void {SYNC}() {{
  asm volatile("barrier.cluster.arrive.release.aligned;\\n\\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}}
// the float at shared address p in block `rank` of this cluster (distributed shared memory)
__device__ __forceinline__ float {LOAD}(const float* p, int rank) {{
  unsigned int a = static_cast<unsigned int>(__cvta_generic_to_shared(p)), r;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
  return v;
}}
"""

_KERNEL = re.compile(r'extern "C" __global__ void ')


def with_cluster(src: str, blocks: int) -> str:
    """``src`` with its kernels declared ``__cluster_dims__(blocks, 1, 1)`` (the grid is one-dimensional: a
    cluster is ``blocks`` consecutive block ids)."""
    if blocks == 1:
        return src
    out, n = _KERNEL.subn(f'extern "C" __global__ void __cluster_dims__({blocks}, 1, 1) ', src)
    if n == 0:
        raise RuntimeError("no __global__ kernel to give a cluster shape")
    return out


__all__ = ["LOAD", "SOURCE", "SYNC", "with_cluster"]
