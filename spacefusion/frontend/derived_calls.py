"""Putting kernels derived from an SMG (``smg.autodiff``) in place of a training backward's ATen op, and marking
the ops left to torch: the one way ``training`` (attention) and ``derived_norms`` (LayerNorm) both do it."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx, nn

from spacefusion.frontend.errors import first_line
from spacefusion.frontend.refusals import DERIVED, META, refusal


def mark(node: fx.Node, code: str, sentence: str) -> None:
    """``node`` left to torch with ``code`` and ``sentence`` (``refusals.META``), and its tuple results too."""
    node.meta[META] = refusal(code, sentence)
    for u in node.users:  # its tuple results: the same reason
        if u.op == "call_function" and u.target is operator.getitem:
            u.meta[META] = refusal(code, sentence)


def install(gm: fx.GraphModule, node: fx.Node, name: str, module: nn.Module, args: Sequence[Any]) -> fx.Node:
    """Replace ``node`` by a call of ``module`` (added to ``gm`` as submodule ``name``) on ``args``.

    Contract: the call returns what ``node`` did (the same tuple positions its getitems read); it and its
    getitems carry ``refusals.DERIVED`` and no refusal (they are not left to torch: the kernels run them).
    The caller lints and recompiles ``gm``."""
    gm.add_submodule(name, module)
    with gm.graph.inserting_before(node):
        call = gm.graph.call_module(name, tuple(args))
    call.meta = dict(node.meta)
    call.meta.pop(META, None)
    call.meta[DERIVED] = True
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)
    for u in call.users:  # its gradients' getitems: part of the derived call, not a backward op left
        u.meta.pop(META, None)
        u.meta[DERIVED] = True
    return call


def derived_kernels(cache: dict[tuple, Any], key: tuple, kernels: Any, forward: Callable[..., Any], *args: Any,
                    wrt: Sequence[str] | None = None) -> tuple | str:
    """(derivation, passes, their kernels) of ``smg.autodiff.derive_backward(forward(*args), wrt)`` cut by
    ``backward_passes`` and built on ``kernels``, once per ``key`` in ``cache`` (kept by the caller across
    rebuilds); where it cannot be derived or scheduled at this size, the reason (a str, cached as well), which
    the caller reports with torch's op left to run."""
    if key not in cache:
        from schedulers.passes import backward_passes
        from smg.autodiff import derive_backward

        try:
            bw = derive_backward(forward(*args), **({"wrt": tuple(wrt)} if wrt is not None else {}))
            passes = backward_passes(bw)
            cache[key] = (bw, passes, [kernels.compile(p.smg) for p in passes])
        except Exception as exc:  # not derivable or not schedulable at this size: torch's op, said so
            cache[key] = f"{type(exc).__name__}: {first_line(exc)}"
    return cache[key]
