"""A Dynamo graph with symbolic sizes, specialised to the sizes of one call.

After a recompile with automatic dynamic shapes (torch.compile's default), Dynamo hands the backend one
graph whose sizes are symbols: its SymInt inputs (``s27``) and the tensors whose dims vary.  The SMG kernels
are built for concrete sizes, so the backend keeps that one graph and specialises it per distinct set of
sizes it is called with (``compiled.PerShape``); Dynamo's own guards and recompiles stay as they are (one
symbolic graph serves every length, so Dynamo never reaches its recompile limit).

``concrete`` runs the graph once on the call's arguments and replaces every node whose value is a plain
scalar (a size, ``x.size(1)``, ``s27 * 32``, a tuple of them) by that value: the copy has the call's sizes
written in its ops (``view(linear, 2, 24, -1, 32)``), which is what the matchers read.  ``SizeKey`` says
which arguments decide the sizes, so a call is matched to its specialisation by a tuple of ints.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from spacefusion.frontend.replay import mutated_inputs, unwritten_copies


def symbolic(value: Any) -> bool:
    """Whether ``value`` is a symbolic scalar or a tensor with a symbolic dim or stride."""
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if isinstance(value, torch.Tensor):
        try:
            return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride()))
        except RuntimeError:  # a sparse or nested tensor: no strides
            return any(isinstance(s, torch.SymInt) for s in value.shape)
    return False


@dataclass(frozen=True)
class SizeKey:
    """The positions of a graph's arguments whose sizes are symbolic: ``scalars`` (SymInt inputs) and
    ``tensors`` (tensors with a symbolic dim or stride).  ``of(args)`` is the tuple of concrete values that
    tells two calls' sizes apart."""

    scalars: tuple[int, ...]
    tensors: tuple[int, ...]

    @staticmethod
    def of_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> SizeKey:
        """From the placeholders' fake values (Dynamo's ``example_value``); where a placeholder has none,
        its example input decides, and a tensor without a fake value counts as sized per call."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        scalars, tensors = [], []
        for i, x in enumerate(example_inputs):
            fake = placeholders[i].meta.get("example_value") if i < len(placeholders) else None
            value = fake if fake is not None else x
            if isinstance(x, torch.Tensor):
                if fake is None or symbolic(value):
                    tensors.append(i)
            elif symbolic(value):
                scalars.append(i)
        return SizeKey(tuple(scalars), tuple(tensors))

    def of(self, args: Sequence[Any]) -> tuple:
        return (tuple(args[i] for i in self.scalars),  # a float too (an unspecialised scale): not int()
                tuple((tuple(args[i].shape), args[i].stride()) for i in self.tensors))

    def describe(self, args: Sequence[Any], names: Sequence[str]) -> str:
        """The sizes of one call, named: ``s27=24, l_kwargs_input_ids_=2x24``."""
        parts = [f"{names[i]}={args[i]}" for i in self.scalars]
        parts += [f"{names[i]}={'x'.join(map(str, args[i].shape))}" for i in self.tensors if i not in self.scalars]
        return ", ".join(parts) or "no symbolic sizes"


def symbolic_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether Dynamo traced ``gm`` with symbolic sizes: a symbolic example input, or a placeholder whose
    fake value is symbolic (the example tensors themselves are real, of the first call's sizes)."""
    fakes = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    return any(symbolic(x) for x in (*example_inputs, *fakes))


def _plain(value: Any) -> Any:
    """A scalar result as a constant an FX graph can hold (a ``torch.Size`` as a tuple), else None."""
    if isinstance(value, bool | int | float) and not isinstance(value, torch.SymInt):
        return value
    if isinstance(value, torch.Size | tuple | list) and all(isinstance(v, int) for v in value):
        return tuple(value) if isinstance(value, torch.Size | tuple) else list(value)
    return None


class _Scalars(fx.Interpreter):
    """Runs the graph and keeps the value of every node that computed a plain scalar."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.scalars: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        plain = _plain(value)
        if plain is not None and n.op != "output":
            self.scalars[n] = plain
        return value


def concrete(gm: fx.GraphModule, args: Sequence[Any]) -> fx.GraphModule:
    """A copy of ``gm`` whose scalar nodes are the constants ``args`` give them (see the module's doc).
    The placeholders stay (Dynamo's calling convention); a SymInt input is then read by nothing.  The graph
    runs once on ``args``, with copies of the tensors it writes in place, so the caller's state is not
    written by the specialisation."""
    inputs = unwritten_copies(args, mutated_inputs(gm))
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    run = _Scalars(out)
    with torch.no_grad():
        run.run(*inputs)
    for node in list(out.graph.nodes):
        if node not in run.scalars or node.op == "get_attr":
            continue
        value = run.scalars[node]
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, lambda n, node=node, value=value: value if n is node else n)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda n, node=node, value=value: value if n is node else n)
        if node.op != "placeholder" and not node.users and not (node.op == "call_function" and node.is_impure()):
            out.graph.erase_node(node)
    for node in out.graph.nodes:
        node.meta.pop("example_value", None)  # symbolic fakes: ShapeProp's tensor_meta is what the passes read
    out.graph.lint()
    out.recompile()
    return out


__all__ = ["SizeKey", "concrete", "symbolic", "symbolic_graph"]
