"""Capture a model's forward as a ``torch.fx`` graph with the shape and dtype of every value.

Why ``torch.fx.symbolic_trace`` and not ``torch.export``: symbolic tracing takes milliseconds and keeps
module calls (``call_module`` on an ``nn.Linear`` or ``nn.LayerNorm``), so a subgraph's weights are the
model's own parameters under their HF names, and ``F.scaled_dot_product_attention`` stays one node;
``torch.export`` lowers to ATen, lifts the parameters into inputs and takes seconds per model.  What
tracing cannot do is data-dependent control flow; the models in ``spacefusion.models`` have none, and
``None`` arguments (a missing KV cache) are specialised as constants, so ``if past is None`` branches are
fine.  A model that fails to trace raises ``FrontendError`` with fx's message.  Shapes come from running
the graph once on the example inputs (``ShapeProp``), so every partition decision sees concrete sizes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp

from spacefusion.frontend.errors import FrontendError


@dataclass(frozen=True)
class Captured:
    """A traced forward (nodes carry ``tensor_meta``) and the example arguments it was traced with."""

    module: fx.GraphModule
    args: tuple[Any, ...]


def capture(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Captured:
    """Trace ``model.forward`` and propagate shapes with the example ``args``/``kwargs``."""
    sig = inspect.signature(model.forward).parameters
    params = list(sig)
    if len(args) > len(params):
        raise FrontendError(f"{type(model).__name__}.forward takes {len(params)} arguments, got {len(args)}")
    bound = {p: sig[p].default for p in params if sig[p].default is None} | dict(zip(params, args)) | kwargs
    concrete = {k: v for k, v in bound.items() if v is None}
    tracer = fx.Tracer()
    tracer.record_stack_traces = True  # the partition report names the function an op came from
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as exc:  # fx raises plain TraceError/TypeError on data-dependent control flow
        raise FrontendError(f"torch.fx could not trace {type(model).__name__}.forward: {exc}") from exc
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    values = tuple(bound[p] for p in params if p in bound and bound[p] is not None)
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*values)
    except Exception as exc:  # the example inputs do not fit the model: say so in our terms
        raise FrontendError(f"running the traced {type(model).__name__} on the example inputs failed: {exc}") from exc
    return Captured(gm, values)
