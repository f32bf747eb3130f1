"""The search-strategy interface: which candidates to measure next."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence, Set

from search.tuning.context import TuningContext
from search.tuning.cost_model import CostModel


class SearchStrategy(ABC):
    """Picks the next batch from the ranked space.

    ``ranked``: the keys of the candidates not measured yet, best-predicted first (the tune's cost model
    ranked them, ties by key); ``measured``: the schedule keys the database holds measurements of under this
    tune's key (another tune's on a shared database too); ``cost_model``: the model that ranked them (whether
    it is ``fitted`` yet, or to score candidates again).  Returns between 1 and ``n`` distinct keys of
    ``ranked``, the batch to measure; the tuner refuses anything else (ValueError naming the strategy).  A
    strategy that draws at random should seed its draws from what is measured, so a rerun picks the same."""

    @abstractmethod
    def pick(self, context: TuningContext, ranked: Sequence[str], n: int, measured: Set[str],
             cost_model: CostModel) -> list[str]:
        """The keys to measure next (see the class docstring)."""


def checked_pick(strategy: SearchStrategy, picked: Sequence[str], ranked: Sequence[str], n: int) -> list[str]:
    """``picked`` if it is a batch ``strategy`` may return (1 to ``n`` distinct keys of ``ranked``); else a
    ValueError that names the strategy and the problem, before anything is claimed or measured."""
    who = type(strategy).__name__
    picked = list(picked)
    if not picked:
        raise ValueError(f"search strategy {who} picked no candidate of {len(ranked)} (it must pick 1 to {n})")
    if len(picked) > n:
        raise ValueError(f"search strategy {who} picked {len(picked)} candidates; the batch holds at most {n}")
    if len(set(picked)) != len(picked):
        raise ValueError(f"search strategy {who} picked a candidate twice")
    known = set(ranked)
    stray = [k for k in picked if k not in known]
    if stray:
        raise ValueError(f"search strategy {who} picked {len(stray)} key(s) not among the unmeasured candidates "
                         f"(first {str(stray[0])[:12]!r})")
    return picked
