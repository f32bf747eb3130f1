"""Build a schedule with one dim a run-time size (``lower.symbolic``) for the CPU: one llvm module serves
every size of the dim in the kernel's range.  The CUDA build is ``build.build_cuda(s, arch, symbolic)``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from schedulers.schedule import Schedule
from smg.errors import ShapeError
from spacefusion.lower.build import _pass_context, _tvm
from spacefusion.lower.symbolic import SymbolicDim, check
from spacefusion.lower.tir import build_primfunc, signature


class SizeOutOfRange(ShapeError):
    """The inputs give the symbolic dim a size outside the kernel's range, or disagree on it."""


@dataclass
class SymbolicCpuKernel:
    """A schedule compiled for the CPU with ``symbolic.dim``'s size read from its inputs at each call.

    Called like ``build.CpuKernel``: {input name: array} -> {output name: array}; each input's shape must be
    its shape in the schedule's SMG but along the dim, where every input holding it gives one size in
    ``symbolic.lo..hi`` (``SizeOutOfRange`` otherwise, naming the range)."""

    schedule: Schedule
    symbolic: SymbolicDim
    module: object

    def _shape(self, name: str, size: int) -> tuple[int, ...]:
        smg, d = self.schedule.smg, self.symbolic.dim
        return tuple(size if x == d else smg.dim_sizes[x] for x in smg.space(name).dims)

    def size_of(self, inputs: dict[str, np.ndarray]) -> int:
        """The dim's size the inputs give (checked: one size, in range, every other axis the SMG's)."""
        smg, d, sym = self.schedule.smg, self.symbolic.dim, self.symbolic
        seen = {}
        for n in smg.inputs:
            if n not in inputs:
                raise KeyError(f"missing input {n!r}")
            dims = smg.space(n).dims
            if d in dims and np.ndim(inputs[n]) == len(dims):
                seen[n] = np.shape(inputs[n])[dims.index(d)]
        sizes = set(seen.values())
        if len(sizes) != 1:
            raise SizeOutOfRange(f"{smg.name}: the inputs give dim {d!r} the sizes {seen}; they must agree")
        size = int(sizes.pop())
        if not sym.contains(size):
            raise SizeOutOfRange(f"{smg.name}: dim {d!r} of size {size} is outside the kernel's range "
                                 f"[{sym.lo}, {sym.hi}]: another kernel serves it")
        for n in smg.inputs:
            want = self._shape(n, size)
            if np.shape(inputs[n]) != want:
                raise ShapeError(f"input {n!r} has shape {np.shape(inputs[n])}, the kernel expects {want} "
                                 f"(dim {d!r} at its run-time size {size})")
        return size

    def _args(self, inputs: dict[str, np.ndarray]) -> tuple[list, dict[str, object]]:
        tvm = _tvm()
        size = self.size_of(inputs)
        args, outs = [], {}
        for name, _, dtype, role in signature(self.schedule).params:
            shape = self._shape(name, size)
            arr = np.ascontiguousarray(inputs[name], dtype=dtype) if role == "input" else np.zeros(shape, dtype)
            args.append(tvm.runtime.tensor(arr))
            if role == "output":
                outs[name] = args[-1]
        return args, outs

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args, outs = self._args(inputs)
        self.module["main"](*args)
        return {k: v.numpy() for k, v in outs.items()}

    def launcher(self, inputs: dict[str, np.ndarray]) -> Callable[[], object]:
        """A zero-argument call on tensors bound once (as ``CpuKernel.launcher``)."""
        args, _ = self._args(inputs)
        main = self.module["main"]
        return lambda: main(*args)


def build_llvm_symbolic(s: Schedule, sym: SymbolicDim) -> SymbolicCpuKernel:
    """``s`` lowered with ``sym.dim`` a run-time size (``symbolic.check`` refuses what cannot be) for llvm."""
    check(s, sym)
    tvm = _tvm()
    f = build_primfunc(s, "llvm", symbolic=sym)
    with _pass_context(tvm):
        ex = tvm.compile(tvm.IRModule({"main": f}), target=tvm.target.Target({"kind": "llvm"}))
    return SymbolicCpuKernel(s, sym, ex)


__all__ = ["SizeOutOfRange", "SymbolicCpuKernel", "build_llvm_symbolic"]
