"""The search strategies a tune can pick its batches with, one file each."""

from search.tuning.strategies.explore_exploit import ExploreExploit

__all__ = ["ExploreExploit"]
