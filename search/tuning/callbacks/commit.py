"""Measure callback: store every record of a batch in the tune's database as it arrives."""

from __future__ import annotations

from search.tuning.callback import MeasureCallback, MeasuredBatch, TuneState


class AddToDatabase(MeasureCallback):
    """Each record goes to ``state.database`` under the tune's key, committed one by one (an interrupted tune
    keeps what it measured).  Leave it out and nothing is stored: the tune then reports no best."""

    def after_batch(self, state: TuneState, batch: MeasuredBatch) -> None:
        for inp, res in zip(batch.inputs, batch.results):
            state.database.add(state.key, inp.schedule, res, state.parts)
