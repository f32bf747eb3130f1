"""The frontend's own error type."""

from smg.errors import SpaceFusionError


class FrontendError(SpaceFusionError):
    """A model cannot be captured or a fused model cannot be assembled; the message says which part."""
