"""Measure callback: hand the cost model every record of the tune's key after each batch."""

from __future__ import annotations

from search.tuning.callback import MeasureCallback, MeasuredBatch, TuneState


class UpdateCostModel(MeasureCallback):
    """``state.cost_model.update`` with the database's whole history of the key, oldest first (records of
    another tune on a shared database too).  It reads the database, so it follows ``AddToDatabase``."""

    def after_batch(self, state: TuneState, batch: MeasuredBatch) -> None:
        history = state.database.records(state.key)
        state.cost_model.update(state.context, [s for s, _ in history], [r for _, r in history])
