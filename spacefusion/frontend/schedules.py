"""Which schedule a subgraph's kernel is built from: a tuned best from a database, else the slicers' default."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from schedulers.hardware import CPU_STAND_IN, HardwareModel
from schedulers.schedule import Schedule, make_schedule, pick_serial
from schedulers.spatial import analyse_spatial
from smg.ir import SMG

ScheduleFor = Callable[[SMG], Schedule]


def default_schedule(smg: SMG) -> Schedule:
    """``make_schedule``'s defaults (64 threads along the output's innermost cut dim, the serial dim the
    slicer picks) with a step no longer than that dim: a correct kernel for any shape, not a fast one."""
    serial = pick_serial(smg, analyse_spatial(smg))
    return make_schedule(smg, serial=serial)  # make_schedule's default step is capped at the serial dim


def from_database(db, hw: HardwareModel = CPU_STAND_IN, target: str = "llvm",
                  fallback: ScheduleFor = default_schedule) -> ScheduleFor:
    """Schedules from a ``search.database.TuningDatabase``'s best record of each SMG (as ``spacefusion tune``
    stored it for ``hw`` and ``target``), ``fallback`` for SMGs it has not measured.  The defaults read an
    llvm tune's records, which are filed under ``CPU_STAND_IN`` (the CPU has no model); a CUDA lookup names
    its machine."""
    from search.database import tuning_key
    from spacefusion.lower.build import COMPILE_FLAGS

    def pick(smg: SMG) -> Schedule:
        best = db.best(tuning_key(smg, hw, target, COMPILE_FLAGS))
        return best[0] if best is not None else fallback(smg)

    return pick


#: the last orders ``ranked`` computed, by (SMG key, hardware, head): a conv's space takes seconds to rank, and an
#: export, the frontend's upsampling rule and the round scripts rank the same SMG again
_RANKED: OrderedDict[tuple[str, HardwareModel, int | None], tuple[Schedule, ...]] = OrderedDict()
RANKED_CACHE = 64


def _ranking(hw: HardwareModel | None) -> HardwareModel:
    """``hw``, else the model the CUDA path ranks for here (``machine.ranking_hardware``: the GPU in hand's
    preset, else the reported default)."""
    if hw is not None:
        return hw
    from spacefusion.frontend.machine import ranking_hardware

    return ranking_hardware().model


def ranked(smg: SMG, hw: HardwareModel | None = None, head: int | None = None) -> list[Schedule]:
    """``smg``'s candidates in the order the tuner's first round measures them: the analytical model's
    estimates for ``hw`` (None: the GPU in hand's preset, ``machine.ranking_hardware``), ties broken by the
    prior learned from the committed measurements of that machine (``search.prior.prior_for``).  The last
    ``RANKED_CACHE`` orders are kept (schedules are immutable; a new list each call).

    With ``head``, only the first ``head`` of that order are sure to be there and in place (what a first
    pick needs), with what a family keeps of it (``families.kept``) and the prior's scored prefix: the
    CUDA-core candidates are not enumerated where their floor is above every estimate that can reach the head
    (``head_veto``), and of those enumerated only the ones whose estimate's lower bound can reach one of those
    are estimated (``search.cost.within_reach``): a depthwise conv's candidates were estimated by the tens of
    thousands for a head of five."""
    from search.cost import either, estimate_us, head_veto, simt_veto, within_reach
    from search.prior import first_round_order, prior_for
    from search.space import SearchSpace

    hw = _ranking(hw)
    if head is not None and head < 1:
        raise ValueError(f"ranked: head {head} must be 1 or more (the candidates a first pick needs)")
    key = (smg.key, hw, head)
    for k in (key, (smg.key, hw, None)):  # a whole order serves any head
        if k in _RANKED:
            _RANKED.move_to_end(k)
            return list(_RANKED[k])
    est: dict[str, float] = {}  # each candidate estimated once: by the vetoes, then for the order

    def estimate(s: Schedule) -> float:
        if s.key not in est:
            est[s.key] = estimate_us(s, hw)
        return est[s.key]

    veto = simt_veto(hw, estimate)
    if head is not None:
        veto = either(veto, head_veto(hw, head, estimate))
    cands = {s.key: s for s in SearchSpace(smg, hw).candidates(skip_simt=veto)}
    if head is not None:  # only those that can reach the head, the prior's scored prefix or a family's entry
        from search.prior import PRIOR_CANDIDATES
        from spacefusion.frontend.families import KEEP, shape

        cands = within_reach(cands, hw, head, estimate, prefix=PRIOR_CANDIDATES, shape_of=shape, shapes=KEEP)
    est = {k: estimate(s) for k, s in cands.items()}
    order = tuple(cands[k] for k in first_round_order(cands, est, prior_for(hw).model))
    _RANKED[key] = order
    while len(_RANKED) > RANKED_CACHE:
        _RANKED.popitem(last=False)
    return list(order)


#: how many of the best candidates a first pick tries to build (the head ``ranked`` computes for it)
ATTEMPTS = 5


def _order(smg: SMG, hw: HardwareModel, attempts: int) -> list[Schedule]:
    """``ranked``'s head, or inside ``families.transferring(folder, True)`` the head of the family's nearest
    ranked sizes made again on ``smg`` (``families.ranked_from``) where the folder holds one; a full ranking
    made inside a ``transferring`` scope keeps its head there for the family's next sizes."""
    from spacefusion.frontend import families

    where = families.scope()
    if where is not None and where[1]:
        entry = families.nearest(where[0], smg, hw)
        if entry is not None:
            order = families.ranked_from(entry, smg, hw)
            if order:
                families.ORIGIN[smg.key] = entry["sizes"]
                return order
    order = ranked(smg, hw, head=attempts)
    if where is not None and order:
        families.save(where[0], smg, hw, order)
    return order


def model_pick(smg: SMG, hw: HardwareModel | None = None, build: Callable[[Schedule], object] | None = None,
               attempts: int = ATTEMPTS) -> tuple[Schedule, int]:
    """The tuner's first pick for ``smg`` on ``hw`` (None: the GPU in hand's preset, else the reported
    default, ``machine.ranking_hardware``) with nothing measured, and how many candidates were tried:
    with ``build``, the first of the best ``attempts`` that ``build`` accepts (a lowering that refuses a
    schedule moves on to the next, the error of the last is raised if none builds)."""
    hw = _ranking(hw)
    order = _order(smg, hw, attempts)
    if not order:
        raise ValueError(f"no schedule of {smg.name!r} fits {hw.name}")
    last: Exception | None = None
    for i, s in enumerate(order[:attempts] if build is not None else order[:1]):
        if build is None:
            return s, 1
        try:
            build(s)
            return s, i + 1
        except Exception as exc:  # the next candidate; the error is kept for when none builds
            last = exc
    raise RuntimeError(f"none of the {attempts} best schedules of {smg.name!r} built: {last}") from last
