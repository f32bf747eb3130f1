"""How a knob is declared: ``knob(...)``, a dataclass field whose metadata says everything the layers above need.

A knob's declaration is its default, a sentence of help, the values it may take, the learned model's feature
that sees it, the refusal codes of its own checks and what the search offers: a function of the point being
enumerated (``Where``: the graph's forms, the hardware, the block and step, and the knobs chosen before it)
that returns the values to try there.  ``schedulers.options`` declares the groups with it; the schedule, the
search, the features, the CLI and the table of refusal codes are derived from the declarations.

A check returns a ``Rejection`` (a stable code, the knob to blame, a sentence) instead of raising prose: the
search counts rejections by code, and drops a knob that was offered where it cannot apply by its name, never by
reading the sentence.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class Rejection:
    """Why an option value cannot apply: ``code`` is stable (the search counts by it), ``knob`` names the
    option to blame (None when the schedule as a whole is at fault), ``sentence`` is for people."""

    code: str
    knob: str | None
    sentence: str


#: how a knob's own feature column encodes its value (``search.features`` applies them)
ENCODINGS = ("value", "flag", "log2")


class Where(Protocol):
    """What a knob's offer reads: the point of the search space being enumerated (``search.offers.Point``).

    Besides these facts, ``where.<knob>`` is the value of a knob chosen before this one in the search's walk
    (``schedulers.options.SEARCH_ORDER``), or its default.  The facts:"""

    cuda: bool  #: the kernels are for a GPU (False: llvm, the CPU)
    hopper: bool  #: the target runs wgmma, TMA and a producer warpgroup (sm_90a)
    fast_math_asked: bool  #: the user asked for fast_math candidates (``spacefusion tune --fast-math``)
    analyse_forms: bool  #: what the graph's forms refuse whatever the knobs is left out (the search's default)
    num_sms: int  #: the hardware's SMs
    max_threads: int  #: the threads a block may have on the hardware
    widest_item: int  #: bytes of the graph's widest element type
    one_reduction: bool  #: one reduction, or only GEMMs of the inputs (a plain or gated GEMM + epilogue, or one beside
    #: a norm's row statistics: its prologue)
    running_max: bool  #: an op is a max reduction (a candidate reference for lazy_rescale)
    row_sum: bool  #: an op sums one computed tile over a dim (attention's row sum of P)
    gathers: bool  #: an op reads an input through an index expression (a convolution's im2col view)
    serial_size: int  #: the serial dim's extent
    others: int  #: elements of the other dims reduced with the serial one (a step's positions times these)
    no_program: bool  #: the graph has no warp-tile program along the serial dim, whatever the block and knobs
    gemm_per_step: bool  #: the first op is a GEMM of two inputs over dims other than the serial one (attention)
    blocks: int  #: blocks of the grid of the block's tiles
    small_grid: bool  #: at most two waves of one block per SM (where deep rings and 192-column tiles are offered)
    threads: int  #: elements of the block's tile (a CUDA-core block's threads before lanes)
    threads_floor: int  #: fewest threads a CUDA-core block may have
    step: int  #: the serial step
    steps: int  #: serial steps of a row: ceil(serial_size / step)

    def __getattr__(self, knob: str) -> Any: ...


#: what a knob's offer is: the values to try at a point (each valid for the knob's declaration), or mappings
#: that set several knobs at once (a variant: a producer warpgroup with its own ring), none of them offered again
Offer = Callable[[Where], Iterable[Any]]


def knob(default: Any, help: str, feature: str, choices: tuple[Any, ...] | None = None, lo: int | None = None,
         hi: int | None = None, valid: str | None = None, encode: str | None = None, offer: Offer | None = None,
         droppable: bool = False, refusals: Mapping[str, str] | None = None, says: str | None = None) -> Any:
    """A group field that is a knob: its default, a sentence of help, the learned model's feature that
    sees it (``search.features``), the values it may take (``choices``, or bounds ``lo``..``hi``) and,
    optionally, how a refusal says what is valid.

    With ``encode`` (one of ``ENCODINGS``) the feature is the knob's own column, generated from this field:
    ``value`` (the number), ``flag`` (1 when set or nonzero) or ``log2`` (log2(1 + value)).  Without it,
    ``feature`` names a schedule-level feature through which the model sees the knob (threads, blocks).

    ``offer`` says what the search tries (``Offer``; None: the default only, a user's knob); ``droppable``
    that a schedule refusing the offered value is built again without it (the knob is offered on where it
    may apply, not searched both ways).  ``refusals`` maps the reasons of the group's own checks of this knob
    to what each refuses: their codes are ``<knob>.<reason>`` (``schedulers.codes``).  ``says`` is what the
    schedule's summary says where the knob is set (``{value}`` its value; None: the summary words it itself, or
    not at all)."""
    if encode is not None and encode not in ENCODINGS:
        raise ValueError(f"encode {encode!r} is not one of {ENCODINGS}")
    return field(default=default, metadata={"help": help, "feature": feature, "choices": choices, "lo": lo,
                                            "hi": hi, "valid": valid, "encode": encode, "offer": offer,
                                            "droppable": droppable, "refusals": dict(refusals or {}),
                                            "says": says})


def is_int_knob(f: dataclasses.Field) -> bool:
    return f.type in ("int", int)


@functools.cache
def fields_of(cls: type) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(cls)


def value_refusal(f: dataclasses.Field, v: Any) -> Rejection | None:
    """Why knob ``f`` cannot take ``v`` by its declaration alone (its type, choices or bounds), or None."""
    m = f.metadata
    ok_type = (isinstance(v, int) and not isinstance(v, bool)) if is_int_knob(f) else isinstance(v, bool)
    if not ok_type:
        kind = "a whole number" if is_int_knob(f) else "True or False"
        return Rejection(f"{f.name}.type", f.name, f"{f.name} {v!r} must be {kind}")
    lo, hi, choices = m.get("lo"), m.get("hi"), m.get("choices")
    if (choices is not None and v not in choices) or (lo is not None and v < lo) or (hi is not None and v > hi):
        valid = m.get("valid") or (f"one of {choices}" if choices is not None else
                                   f"{lo}..{hi}" if hi is not None else f">= {lo}")
        return Rejection(f"{f.name}.range", f.name, f"{f.name} {v} must be {valid}")
    return None


def typed_key(group: Any) -> tuple | None:
    """``group``'s class and its values each with its type (``True`` is not ``1`` here): the key of the
    caches below, which the search's tens of thousands of candidates hit with a few dozen groups.  None
    where a value cannot be a key (a list given by hand): that group is checked uncached."""
    key = (type(group), tuple((type(v), v) for v in (getattr(group, f.name) for f in fields_of(type(group)))))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def check_values(group: Any) -> Rejection | None:
    """The value checks every knob declares (type, choices, bounds), in field order.  Cached per group
    instance (``split_knobs`` hands the search's schedules shared ones), then per ``typed_key``."""
    seen = _BY_ID.get(id(group))
    if seen is not None and seen[0] is group:
        return seen[1]
    key = typed_key(group)
    if key is None:
        return _check_values(group)
    got = _CHECKED.get(key, _MISSING)
    if got is _MISSING:
        got = _CHECKED[key] = _check_values(group)
    if len(_BY_ID) < _BY_ID_MAX:  # the instance is held, so its id names no other object meanwhile
        _BY_ID[id(group)] = (group, got)
    return got


_MISSING = object()
#: check_values by ``typed_key`` (a bounded set: the groups the search and the users make)
_CHECKED: dict[tuple, Rejection | None] = {}
#: and by instance, for the instances ``split_knobs`` shares (at most this many held)
_BY_ID: dict[int, tuple[Any, Rejection | None]] = {}
_BY_ID_MAX = 4096


def _check_values(group: Any) -> Rejection | None:
    for f in fields_of(type(group)):
        bad = value_refusal(f, getattr(group, f.name))
        if bad is not None:
            return bad
    return None


def coerce(f: dataclasses.Field, v: Any) -> Any:
    """numpy and other integral values as Python ints, 0/1 as bools; anything else is left for the check."""
    if is_int_knob(f):
        return int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool | np.bool_) else v
    return bool(v) if isinstance(v, bool | np.bool_) or (isinstance(v, numbers.Integral) and v in (0, 1)) else v


def changed(group: Any) -> list[str]:
    """The names of ``group``'s knobs that differ from their defaults, in field order."""
    return [f.name for f in fields_of(type(group)) if getattr(group, f.name) != f.default]
