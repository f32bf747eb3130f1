"""Tensor-core lowering for GEMM-with-epilogue schedules, through TVM's own tensorizer.

When the temporal plan of a Schedule is one GEMM state (fp16 operands, the
serial dim is its contraction) followed only by element-wise post ops, the
fused kernel is exactly "matmul + epilogue".  That class is lowered from the
SMG to TE (each op a ``te.compute``, bodies through the same sympy -> TIR
printer as the scalar path), then TVM's ``MatmulTensorization`` rule tiles it
for WMMA tensor cores with the epilogue fused into the store.  TVM picks the
tiles inside the block; the Schedule decides what is fused and that it runs on
tensor cores.  Launch configuration is read from the lowered device function.
"""

from __future__ import annotations

import inspect
import linecache
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from schedulers.errors import ScheduleError
from schedulers.schedule import Schedule
from schedulers.tensorcore_fit import plan_refusal
from smg.expr import body_expr

F32 = "float32"


def _te_graph(s: Schedule) -> tuple[list[Any], list[Any]]:
    from tvm import te

    smg = s.smg
    sizes = smg.dim_sizes
    tensors: dict[str, Any] = {n: te.placeholder(smg.shape(n), smg.space(n).dtype, name=n) for n in smg.inputs}
    for op in smg.ops:
        out_dtype = smg.space(op.out).dtype if op.out in smg.outputs else F32
        raxes = {d: te.reduce_axis((0, sizes[d]), name=d) for d in op.reduce}
        tensors[op.out] = te.compute(tuple(sizes[d] for d in op.out_index), _body(op, raxes, out_dtype, tensors, sizes),
                                     name=op.out)
    return [tensors[n] for n in smg.inputs], [tensors[n] for n in smg.outputs]


def _body(op: Any, raxes: dict[str, Any], out_dtype: str, tensors: dict[str, Any], sizes: dict[str, int]):
    """The ``fcompute`` of one op (TE wants positional index arguments only)."""
    from tvm import te, tirx

    from spacefusion.lower.exprs import to_tir  # TVM only when lowering, not when checking eligibility

    def body(*idx: Any) -> Any:
        env = dict(zip(op.out_index, idx)) | raxes

        def load(name: str) -> Any:
            if name in sizes:
                return tirx.Cast(F32, env[name])
            acc = op.access(name)
            val = tensors[name][tuple(env[d] for d in acc.index)]
            return val if val.dtype == F32 else tirx.Cast(F32, val)

        val = to_tir(body_expr(op), load)
        if op.reduce:
            return te.sum(val, axis=[raxes[d] for d in op.reduce])
        return val if out_dtype == F32 else tirx.Cast(out_dtype, val)

    return body


@contextmanager
def _cheap_stack() -> Iterator[None]:
    """``inspect.stack`` without ``inspect.getmodule``: TVMScript calls it once per intrinsic it parses, and
    each call scans ``sys.modules`` per frame (seconds each in a process that has imported torch: importing
    TVM's tensor intrinsics took 190 s in the test suite).  The source line comes from ``linecache``, as
    ``inspect`` would read it, so TVMScript's class-scope check sees the same ``code_context``."""
    saved = inspect.stack

    def stack(context: int = 1) -> list[inspect.FrameInfo]:
        out, frame = [], sys._getframe(1)
        while frame is not None:
            name, line = frame.f_code.co_filename, frame.f_lineno
            text = linecache.getline(name, line)
            out.append(inspect.FrameInfo(frame, name, line, frame.f_code.co_name, [text] if text else None,
                                         0 if text else None))
            frame = frame.f_back
        return out

    inspect.stack = stack
    try:
        yield
    finally:
        inspect.stack = saved


def build_tensorcore(s: Schedule, arch: str) -> Any:
    """The IRModule of the tensor-core (WMMA) kernel of ``s``, scheduled by TVM's tensorizer."""
    refused = plan_refusal(s.smg, s.plan, s.serial)
    if refused is not None:
        raise ScheduleError(f"no tensor-core lowering for {s.smg.name!r}: {refused.sentence}", code=refused.code)
    import tvm
    from tvm import te
    from tvm.s_tir.dlight.gpu.matmul import MatmulTensorization

    with _cheap_stack():  # TVM parses its ~250 tensor intrinsics on first use
        import tvm.s_tir.tensor_intrin  # noqa: F401

    ins, outs = _te_graph(s)
    func = te.create_prim_func([*ins, *outs])
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    with target:
        sch = MatmulTensorization().apply(func, target, False)
    if sch is None:
        raise ScheduleError(f"TVM's tensorizer does not accept {s.smg.name!r} (shapes must be multiples of 16)",
                            code="lower.wmma_tensorizer")
    return sch.mod
