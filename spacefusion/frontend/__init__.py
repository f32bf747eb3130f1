"""From a PyTorch model to SMGs: capture (``torch.fx``), partition into fusable subgraphs, run fused.

    from spacefusion.frontend import fuse
    fused = fuse(model, *example_inputs, backend="llvm")
    print(fused.partition)          # fused subgraphs by kind, ops left to torch and why
    out = fused(*example_inputs)
"""

from spacefusion.frontend.backends import CudaBackend, LLVMBackend, ReferenceBackend
from spacefusion.frontend.capture import Captured, capture
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.fused import FusedModel, fuse
from spacefusion.frontend.partition import partition
from spacefusion.frontend.records import LeftOp, Operand, Partition, Result, Subgraph

__all__ = ["Captured", "CudaBackend", "FrontendError", "FusedModel", "LLVMBackend", "LeftOp", "Operand", "Partition",
           "ReferenceBackend", "Result", "Subgraph", "capture", "fuse", "partition"]
