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


class ExpressionError(SpaceFusionError, ValueError):
    """An op body is not an expression the SMG can evaluate: a syntax error, a name that is none of the op's
    inputs or index dims, or a function no evaluator knows.  Raised when the op is built, naming the body."""


class BadNameError(SpaceFusionError, ValueError):
    """A space or dim name the SMG cannot use: not an ASCII identifier, reserved, or already taken.  Space
    and dim names become CUDA parameter and variable names and artefact param names, so they are ASCII;
    a graph's own name may be any text (its kernel symbol is made ASCII, ``spacefusion.lower.build``)."""


class BackwardError(SpaceFusionError, ValueError):
    """The backward of a forward SMG cannot be derived (``smg.autodiff``): the message names the op, the
    space it reads and the mapping or function at fault (a max that is no stabiliser, a gathered or windowed
    access, a body with no derivative)."""
