"""Space-Mapping Graph: the IR of spacefusion and its analyses."""

from smg.errors import ShapeError, SpaceFusionError, UnknownAxisError, UnknownOperatorError
from smg.ir import SMG, Access, DataSpace, Dim, Edge, Kind, Op, join_smgs
from smg.ops import Builder, Tensor
from smg.reference import evaluate, random_inputs

__all__ = [
    "SMG", "Access", "Builder", "DataSpace", "Dim", "Edge", "Kind", "Op", "ShapeError",
    "SpaceFusionError", "Tensor", "UnknownAxisError", "UnknownOperatorError", "evaluate",
    "join_smgs", "random_inputs",
]
