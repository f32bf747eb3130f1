"""Errors raised by the SMG layer; each names the op, space or dim at fault."""


class SpaceFusionError(Exception):
    """Base class of every error spacefusion raises on purpose."""


class ShapeError(SpaceFusionError, ValueError):
    """Two spaces disagree on the size of a dimension they share."""


class UnknownOperatorError(SpaceFusionError, KeyError):
    """An operator name, unary function or combiner is not defined."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnknownAxisError(SpaceFusionError, KeyError):
    """A dimension name is not present in the tensor it is applied to."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DTypeError(SpaceFusionError, ValueError):
    """A dtype the SMG ops cannot compute in (unknown, or an integer type)."""
