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

from functools import lru_cache
from typing import Any

from schedulers.errors import ScheduleError
from schedulers.schedule import Schedule
from smg.expr import body_expr
from smg.ir import Op

F32 = "float32"


def tensorcore_reason(s: Schedule) -> str | None:
    """Why ``s`` cannot use the tensor-core path (None when it can)."""
    smg, plan = s.smg, s.plan
    if len(plan.states) != 1:
        return f"the plan has {len(plan.states)} running states; the tensor-core path takes one GEMM"
    op = smg.producer(plan.states[0].state)
    if op.reduce != (s.serial,) or op.combiner != "sum" or len(op.inputs) != 2:
        return f"state {op.out!r} is not a two-operand sum over the serial dim {s.serial!r}"
    if not _is_product(op):
        return f"state {op.out!r} has body {op.body!r}, not a product of its operands"
    for a in op.inputs:
        if smg.space(a.space).dtype != "float16" or a.space not in smg.inputs:
            return f"GEMM operand {a.space!r} must be a float16 input"
    for other in smg.ops:
        if other is not op and (other.reduce or s.serial in other.iter_dims):
            return f"op {other.out!r} is not an element-wise epilogue"
        if any(not a.plain for a in other.inputs):
            return f"op {other.out!r} gathers through an index expression"
    if plan.second_pass:
        return "outputs keep the serial dim"
    return None


@lru_cache(maxsize=1024)
def _is_product(op: Op) -> bool:
    """Whether ``op``'s body is the product of its two operands (cached: the search asks per candidate)."""
    return str(body_expr(op)) in (f"{op.inputs[0].space}*{op.inputs[1].space}",
                                  f"{op.inputs[1].space}*{op.inputs[0].space}")


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


def build_tensorcore(s: Schedule, arch: str) -> Any:
    """The IRModule of the tensor-core (WMMA) kernel of ``s``, scheduled by TVM's tensorizer."""
    reason = tensorcore_reason(s)
    if reason is not None:
        raise ScheduleError(f"no tensor-core lowering for {s.smg.name!r}: {reason}")
    import tvm
    from tvm import te
    from tvm.s_tir.dlight.gpu.matmul import MatmulTensorization

    ins, outs = _te_graph(s)
    func = te.create_prim_func([*ins, *outs])
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    with target:
        sch = MatmulTensorization().apply(func, target, False)
    if sch is None:
        raise ScheduleError(f"TVM's tensorizer does not accept {s.smg.name!r} (shapes must be multiples of 16)")
    return sch.mod
