"""Stable content keys: sha256 over canonical JSON, never Python's hash()."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any


def canonical(obj: Any) -> Any:
    """Turn dataclasses/tuples/dicts into plain JSON data with a fixed order."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: canonical(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): canonical(v) for k, v in sorted(obj.items())}
    if isinstance(obj, (list, tuple)):
        return [canonical(v) for v in obj]
    if isinstance(obj, float):
        return repr(obj)  # exact and platform independent
    return obj


def canonical_text(obj: Any) -> str:
    """The canonical JSON text of ``obj`` (sorted keys, no spaces): what ``content_key`` hashes."""
    return json.dumps(canonical(obj), sort_keys=True, separators=(",", ":"))


def text_key(text: str) -> str:
    """sha256 hex digest of a canonical text (``canonical_text``)."""
    return hashlib.sha256(text.encode()).hexdigest()


def content_key(obj: Any) -> str:
    """sha256 hex digest of the canonical JSON form of ``obj``."""
    return text_key(canonical_text(obj))
