"""Whether a baked weight may have changed since its kernels' constants were derived from it.

The Dynamo backend bakes weights: a linear's W is transposed into the GEMM's B once, a BatchNorm folded
into its conv, T5's position bias evaluated once (``fused.FusedKernel``, ``constants.fold_constants``).
Those derived tensors are copies, so every kind of write to the weight must be seen, or the kernels read
stale values:

- an in-place op under ``torch.no_grad()`` (``w.mul_()``, ``load_state_dict``'s ``copy_``) moves
  ``Tensor._version``;
- ``w.data = t`` moves ``w.data_ptr()``; another Parameter object is another identity;
- a write through ``w.data`` (``w.data.mul_()``, ``w.data.copy_()``: EMA updates, weight surgery) moves
  neither: ``.data`` is an alias with a version counter of its own, made to escape autograd's checks.

Inductor's freezing assumes none of these happen.  Here the last is seen by watching ``.data`` itself:
``watch`` puts a property on ``torch.Tensor`` that counts each get or set of ``.data`` on a watched tensor
(any other tensor pays one weak-dictionary lookup), and ``Stamp`` compares identities, versions, addresses
and those counts.  A read of ``.data`` that writes nothing also counts: the constants are derived again,
which costs time, never a wrong answer.  The backend's own reads are not counted (``own_reads``): deriving
one graph's constants (fx's ``ShapeProp`` deep-copies the module to fake tensors, reading each Parameter's
``.data``) must not mark every other graph over the same weights as changed, or graphs sharing weights (a
symbolic graph's specialisations, a static graph beside its dynamic recompile) rebuild each other on every
call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

#: watched tensor -> how many times its ``.data`` was read or set
_TOUCHES: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: bumped on every touch of any watched tensor, so an unchanged model costs one int compare a call
_EPOCH = [0]
_DATA = torch._C.TensorBase.__dict__["data"]
#: set in a thread while the backend itself reads weights (``own_reads``)
_OWN = threading.local()


def _get_data(self: torch.Tensor) -> torch.Tensor:
    if self in _TOUCHES and not getattr(_OWN, "on", False):
        _TOUCHES[self] += 1
        _EPOCH[0] += 1
    return _DATA.__get__(self)


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    if self in _TOUCHES:
        _TOUCHES[self] += 1
        _EPOCH[0] += 1
    _DATA.__set__(self, value)


def _install() -> None:
    if not isinstance(torch.Tensor.__dict__.get("data"), property):
        torch.Tensor.data = property(_get_data, _set_data, doc=_DATA.__doc__)  # type: ignore[assignment]


def watch(tensors: Iterable[torch.Tensor]) -> None:
    """Count the ``.data`` reads and writes of ``tensors`` from now on (held weakly)."""
    _install()
    for t in tensors:
        if t not in _TOUCHES:
            _TOUCHES[t] = 0


@contextmanager
def own_reads() -> Iterator[None]:
    """Within this block (in this thread) reads of ``.data`` are the backend's own and are not counted; a
    set is still counted, as is anything another thread does."""
    was = getattr(_OWN, "on", False)
    _OWN.on = True
    try:
        yield
    finally:
        _OWN.on = was


def epoch() -> int:
    """Moves whenever any watched tensor's ``.data`` is touched."""
    return _EPOCH[0]


def state(t: torch.Tensor) -> tuple[int, int, int, int]:
    """What moves when ``t``'s values may have changed: its identity, its version (in-place writes), its
    address (``.data = t``) and its ``.data`` touches (writes through ``.data``); ``t`` is watched from now on.
    Equal states: the values derived from ``t`` are still right."""
    n = _TOUCHES.get(t)
    if n is None:
        _install()
        _TOUCHES[t] = n = 0
    return id(t), t._version, t.data_ptr(), n


@dataclass(frozen=True)
class Stamp:
    """The state of the weights at the argument positions ``positions`` when constants were derived."""

    positions: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]
    addresses: tuple[int, ...]
    touches: tuple[int, ...]
    epoch: int

    @staticmethod
    def take(baked: dict[int, torch.Tensor]) -> Stamp:
        watch(baked.values())
        ts = tuple(baked.values())
        return Stamp(tuple(baked), ts, tuple(t._version for t in ts), tuple(t.data_ptr() for t in ts),
                     tuple(_TOUCHES.get(t, 0) for t in ts), epoch())

    def changed(self, args: Sequence[object]) -> str | None:
        """What moved since the stamp (None: nothing), checked against the call's arguments."""
        for i, t, v in zip(self.positions, self.tensors, self.versions):
            if args[i] is not t:
                return f"argument {i} is another tensor than the one baked"
            if t._version != v:
                return f"argument {i} was written in place"
        if _EPOCH[0] != self.epoch:
            for i, t, n, p in zip(self.positions, self.tensors, self.touches, self.addresses):
                if _TOUCHES.get(t, 0) != n or t.data_ptr() != p:
                    return f"argument {i}'s .data was read or set"
        return None


__all__ = ["Stamp", "epoch", "own_reads", "state", "watch"]
