"""The frontend's own error type, and the one line of an exception a report gives."""

from smg.errors import SpaceFusionError


class FrontendError(SpaceFusionError):
    """A model cannot be captured or a fused model cannot be assembled; the message says which part."""


def first_line(exc: BaseException, limit: int = 400) -> str:
    """An exception's first line, cut to ``limit`` characters: a report line, not torch's stack of frames."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[:limit] + "..."
