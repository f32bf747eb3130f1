"""Build a schedule with one dim a run-time size (``lower.symbolic``) for the CPU: one llvm module serves
every size of the dim in the kernel's range.  The CUDA build is ``build.build_cuda(s, arch, symbolic)``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from schedulers.schedule import Schedule
from smg.errors import ShapeError
from spacefusion.lower import stores
from spacefusion.lower.build import _pass_context, _tvm
from spacefusion.lower.symbolic import SymbolicDim, check, param_dims
from spacefusion.lower.tir import build_primfunc, signature


class SizeOutOfRange(ShapeError):
    """The inputs give the symbolic dim a size outside the kernel's range, or disagree on it."""


@dataclass
class SymbolicCpuKernel:
    """A schedule compiled for the CPU with ``symbolic.dim``'s size read from its inputs at each call.

    Called like ``build.CpuKernel``: {parameter name: array} -> {output name: array}; each parameter's shape
    must be its shape in the schedule's signature but along the dim (``symbolic.param_dims``: the graph's
    buffers, an indexed load's ids, a store's positions), where every input holding it gives one size in
    ``symbolic.lo..hi`` (``SizeOutOfRange`` otherwise, naming the range).  A load's table and a store's tensor
    keep their shapes; the store's tensor is written in place, as ``CpuKernel`` writes it."""

    schedule: Schedule
    symbolic: SymbolicDim
    module: object

    def _shape(self, name: str, shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        """Parameter ``name`` (of signature shape ``shape``) at ``size``."""
        dims = param_dims(self.schedule.smg, name)
        return shape if not dims else tuple(size if x == self.symbolic.dim else shape[i] for i, x in enumerate(dims))

    def size_of(self, inputs: dict[str, np.ndarray]) -> int:
        """The dim's size the inputs give (checked: one size, in range, every other axis the signature's)."""
        smg, d, sym = self.schedule.smg, self.symbolic.dim, self.symbolic
        params = [p for p in signature(self.schedule).params if p[3] in ("input", stores.INOUT)]
        seen = {}
        for name, _, _, _ in params:
            if name not in inputs:
                raise KeyError(f"missing input {name!r}")
            dims = param_dims(smg, name) or ()
            if d in dims and np.ndim(inputs[name]) == len(dims):
                seen[name] = np.shape(inputs[name])[dims.index(d)]
        sizes = set(seen.values())
        if len(sizes) != 1:
            raise SizeOutOfRange(f"{smg.name}: the inputs give dim {d!r} the sizes {seen}; they must agree")
        size = int(sizes.pop())
        if not sym.contains(size):
            raise SizeOutOfRange(f"{smg.name}: dim {d!r} of size {size} is outside the kernel's range "
                                 f"[{sym.lo}, {sym.hi}]: another kernel serves it")
        for name, shape, _, role in params:
            want = self._shape(name, shape, size)
            if role == "input" and np.shape(inputs[name]) != want:
                raise ShapeError(f"input {name!r} has shape {np.shape(inputs[name])}, the kernel expects {want} "
                                 f"(dim {d!r} at its run-time size {size})")
        return size

    def _args(self, inputs: dict[str, np.ndarray]) -> tuple[list, dict[str, object], list[Callable[[], None]]]:
        tvm = _tvm()
        size = self.size_of(inputs)
        args, outs, after = [], {}, []
        for name, shape, dtype, role in signature(self.schedule).params:
            shape = self._shape(name, shape, size)
            if role == stores.INOUT:  # the caller's tensor, written in place (``lower.stores``)
                arg, back = stores.in_place(tvm, inputs[name], shape, dtype)
                args.append(arg)
                after.append(back)
                continue
            arr = np.ascontiguousarray(inputs[name], dtype=dtype) if role == "input" else np.zeros(shape, dtype)
            args.append(tvm.runtime.tensor(arr))
            if role == "output":
                outs[name] = args[-1]
        return args, outs, after

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args, outs, after = self._args(inputs)
        self.module["main"](*args)
        for back in after:
            back()
        return {k: v.numpy() for k, v in outs.items()}

    def launcher(self, inputs: dict[str, np.ndarray]) -> Callable[[], object]:
        """A zero-argument call on tensors bound once (as ``CpuKernel.launcher``)."""
        args, _, _ = self._args(inputs)
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
