"""Whether a schedule is a GEMM plus element-wise epilogue, the class TVM's WMMA tensorizer lowers.

A legality check with no TVM in it, so the schedulers can refuse a tensor-core request (and the search
can prune it) on a machine that never lowers; ``spacefusion.lower.tensorcore`` lowers what it accepts.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from schedulers.knobs import Rejection
from smg.expr import body_expr
from smg.ir import Op

if TYPE_CHECKING:
    from schedulers.schedule import Schedule


def tensorcore_reason(s: Schedule) -> str | None:
    """Why ``s`` cannot use the tensor-core path (None when it can).  The graph, the plan and the serial dim
    decide it, no knob: one answer serves a search's every candidate of a plan (``plan_reason``)."""
    return plan_reason(s.smg, s.plan, s.serial)


def plan_reason(smg, plan, serial: str) -> str | None:
    """``tensorcore_reason`` of any schedule of ``smg`` with this plan and serial dim."""
    r = plan_refusal(smg, plan, serial)
    return None if r is None else r.sentence


@lru_cache(maxsize=1024)
def plan_refusal(smg, plan, serial: str) -> Rejection | None:
    """``plan_reason`` with its code (``wmma.*`` of ``schedulers.codes``): the search asks it once per graph and
    serial dim (``SearchSpace.forms``)."""
    if len(plan.states) != 1:
        return Rejection("wmma.states", None, f"the plan has {len(plan.states)} running states; the tensor-core "
                         f"path takes one GEMM")
    op = smg.producer(plan.states[0].state)
    if op.reduce != (serial,) or op.combiner != "sum" or len(op.inputs) != 2:
        return Rejection("wmma.not_sum", None, f"state {op.out!r} is not a two-operand sum over the serial dim "
                         f"{serial!r}")
    if not _is_product(op):
        return Rejection("wmma.not_product", None, f"state {op.out!r} has body {op.body!r}, not a product of its "
                         f"operands")
    for a in op.inputs:
        if smg.space(a.space).dtype != "float16" or a.space not in smg.inputs:
            return Rejection("wmma.operand", None, f"GEMM operand {a.space!r} must be a float16 input")
    for other in smg.ops:
        if other is not op and (other.reduce or serial in other.iter_dims):
            return Rejection("wmma.epilogue", None, f"op {other.out!r} is not an element-wise epilogue")
        if any(not a.plain for a in other.inputs):
            return Rejection("wmma.gather", None, f"op {other.out!r} gathers through an index expression")
    if plan.second_pass:
        return Rejection("wmma.second_pass", None, "outputs keep the serial dim")
    return None


@lru_cache(maxsize=1024)
def _is_product(op: Op) -> bool:
    """Whether ``op``'s body is the product of its two operands (cached: the search asks per candidate)."""
    return str(body_expr(op)) in (f"{op.inputs[0].space}*{op.inputs[1].space}",
                                  f"{op.inputs[1].space}*{op.inputs[0].space}")
