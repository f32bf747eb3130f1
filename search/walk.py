"""The search's points as a product over the knobs' declarations (``schedulers.options``).

Each knob declares what the search offers (``knob(offer=...)``): a function of the point being enumerated
(``schedulers.knobs.Where``: facts of the graph, the hardware, the block and the step, and the knobs chosen
before it) that gives the values to try.  ``walk`` nests one loop per knob in ``SEARCH_ORDER``, each over its
offer at the values the loops outside it chose, so the points come out in the order of the hand-written loops
they replace.  A knob whose offer gives a mapping sets several knobs at once (a variant: a producer warpgroup with
its own ring); the knobs a variant sets are not offered again inside it.  A value an offer gives is checked
against its knob's declaration once (``ValueError`` naming both): the search offers only what the knob takes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from typing import Any

from schedulers.knobs import Offer, value_refusal
from schedulers.options import KNOB_FIELDS, KNOB_GROUP, SEARCH_ORDER

_FIELDS = {f.name: f for f in KNOB_FIELDS}
#: the knobs' names in field order (``walk`` yields their values in this order) and their defaults
NAMES = tuple(_FIELDS)
DEFAULTS: dict[str, Any] = {f.name: f.default for f in KNOB_FIELDS}
#: the knobs walked for CUDA-core points and for tensor-core points, in walk order
SIMT_WALK = tuple(n for n in SEARCH_ORDER if KNOB_GROUP[n] == "simt")
TENSOR_CORE_WALK = tuple(n for n in SEARCH_ORDER if KNOB_GROUP[n] != "simt")
if set(SEARCH_ORDER) != {n for n, f in _FIELDS.items() if f.metadata["offer"]}:  # each offer walked, once
    raise ValueError(f"SEARCH_ORDER {SEARCH_ORDER} must name the knobs that declare an offer, each once")
_VALUES = operator.itemgetter(*NAMES)


class Point:
    """What an offer reads (``Where``): the facts, and each knob's value chosen so far (else its default), as
    plain attributes (an offer runs at every node of the walk: attribute reads must be cheap)."""

    def __init__(self, facts: Mapping[str, Any]) -> None:
        clash = set(facts) & set(DEFAULTS)
        if clash:
            raise ValueError(f"facts {sorted(clash)} are named like knobs")
        self.__dict__.update(facts)
        self.__dict__.update(DEFAULTS)

    def __getattr__(self, name: str) -> Any:  # only reached for a name that is neither
        raise AttributeError(f"an offer read {name!r}, which is neither a knob nor a fact of schedulers.knobs.Where")


#: (knob, offered values) already checked against the knob's declaration (``_key`` where a variant's mapping is
#: among them; values that equal checked ones pass: True once checked, an offer of 1 is not checked again)
_CHECKED: set[tuple[str, tuple[Any, ...]]] = set()


def _valid(name: str, values: tuple[Any, ...]) -> None:
    """ValueError if the search offers ``name`` a value its declaration refuses (checked once per offer tuple;
    a variant's mapping is checked knob by knob)."""
    for v in values:
        if type(v) is dict:
            for k, x in v.items():
                _valid(k, (x,))
            continue
        bad = value_refusal(_FIELDS[name], v)
        if bad is not None:
            raise ValueError(f"the search offers {name}={v!r}, which its declaration refuses: {bad.sentence}")


#: a level whose knob a variant outside it has set: one pass, nothing chosen
_KEEP = object()
_KEEP_ONLY = (_KEEP,)


def _key(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """A hashable form of an offer's values (a variant's mapping as its items), each with its type."""
    return tuple((dict, tuple(v.items())) if type(v) is dict else (type(v), v) for v in values)


def walk(knobs: tuple[str, ...], facts: Mapping[str, Any],
         offers: Mapping[str, Offer] | None = None) -> Iterator[tuple[Any, ...]]:
    """Every point of the product over ``knobs``' offers at ``facts``: the values of all knobs in ``NAMES``
    order, each one's default where no offer chose it.  The loops are nested in ``knobs``' order (the first
    outermost); each offer is called once per choice of the knobs before it, with those choices in place.
    ``offers`` replaces declared offers by name (the tests walk made-up ones)."""
    point = Point(facts)
    d = point.__dict__
    n = len(knobs)
    if n == 0:
        yield _VALUES(d)
        return
    offer = [(offers or {}).get(k) or _FIELDS[k].metadata["offer"] for k in knobs]
    choices: list[tuple[Any, ...]] = [()] * n
    at = [0] * n
    undo: list[dict[str, Any] | None] = [None] * n  # the values a level's variant replaced
    newly: list[set[str]] = [set() for _ in range(n)]  # and the knobs it fixed
    fixed: set[str] = set()
    last = n - 1
    i, entering = 0, True
    while i >= 0:
        name = knobs[i]
        if entering:  # the level's choices, given the levels outside it
            entering = False
            at[i] = 0
            if name in fixed:
                choices[i] = _KEEP_ONLY
            else:
                got = choices[i] = tuple(offer[i](point))
                try:
                    key = (name, got)
                    seen = key in _CHECKED
                except TypeError:  # a variant's mapping among them
                    key = (name, _key(got))
                    seen = key in _CHECKED
                if not seen:
                    _valid(name, got)
                    _CHECKED.add(key)
        elif undo[i] is not None:  # leave the level's last variant
            d.update(undo[i])
            fixed.difference_update(newly[i])
            undo[i] = None
        if at[i] == len(choices[i]):  # done: the knob back at its default for the loops around it
            if choices[i] is not _KEEP_ONLY:
                d[name] = DEFAULTS[name]
            i -= 1
            continue
        v = choices[i][at[i]]
        at[i] += 1
        if type(v) is dict:  # a variant: these knobs together, not offered again inside it
            undo[i] = {k: d[k] for k in v}
            newly[i] = set(v) - fixed
            fixed.update(newly[i])
            d.update(v)
        elif v is not _KEEP:
            d[name] = v
        if i == last:
            yield _VALUES(d)
        else:
            i, entering = i + 1, True
