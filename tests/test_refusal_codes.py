"""Every refusal carries a code of one table (``schedulers.codes``), the search reports its refusals by those
codes, a graph's tensor-core forms are derived once, and target capabilities are checked before the search.

The source scan walks every library and experiment module's syntax tree: a ``ScheduleError``,
``TemporalSliceError`` or ``ResourceError`` made without ``code=`` fails it (and ``HardwareError`` outside
``schedulers/hardware.py``, whose own raises are the model's validation, under the class's ``hardware``
code), as does a literal code that is not in the table or a table code no source raises."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from schedulers import codes
from schedulers.errors import ScheduleError
from schedulers.hardware import A100, H100, H200, NPU, V100, HardwareModel
from schedulers.schedule import make_schedule
from search.space import SearchSpace
from smg import patterns, workloads
from smg.ops import Builder

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("smg", "schedulers", "search", "spacefusion", "experiments")
#: errors that refuse a request, and so must say why by a code
REFUSALS = {"ScheduleError", "TemporalSliceError", "ResourceError", "HardwareError"}
#: where a refusal class's own default code stands (the hardware model validating its fields)
DEFAULT_CODE_OK = {("HardwareError", "schedulers/hardware.py")}


def _name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def scan(source: str, path: str) -> tuple[list[str], set[str]]:
    """(refusals made without a code, as ``path:line``; the literal codes given) of one module's source."""
    uncoded, literal = [], set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = _name(node)
        if name not in REFUSALS | {"Rejection"}:
            continue
        if name == "Rejection":
            code = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "code"), None)
        else:
            code = next((k.value for k in node.keywords if k.arg == "code"), None)
            if code is None and (name, path) not in DEFAULT_CODE_OK:
                uncoded.append(f"{path}:{node.lineno}")
        if isinstance(code, ast.Constant) and isinstance(code.value, str):
            literal.add(code.value)
    return sorted(uncoded, key=lambda w: int(w.rpartition(":")[2])), literal


def _modules() -> list[Path]:
    return sorted(p for part in SOURCES for p in (ROOT / part).rglob("*.py"))


def test_every_refusal_is_raised_with_a_code_of_the_table() -> None:
    uncoded, literal = [], set()
    for p in _modules():
        u, lit = scan(p.read_text(), str(p.relative_to(ROOT)))
        uncoded += u
        literal |= lit
    assert not uncoded, f"refusals raised without code=: {uncoded}"
    unknown = sorted(c for c in literal if not codes.known(c))
    assert not unknown, f"codes not in schedulers.codes.REFUSALS: {unknown}"
    assert all("." in c for c in literal - {"hardware"}), sorted(c for c in literal if "." not in c)


def test_every_code_of_the_table_is_raised_somewhere() -> None:
    """No stale entry: each code of the table is a string in some library source (a knob's generated codes,
    ``<knob>.range``/``.type``, are made from the groups; ``.target`` ones are written out)."""
    text = "\n".join(p.read_text() for p in _modules() if p.name != "codes.py")
    missing = [c for c in (*codes.REFUSALS, *codes.knob_refusals()) if f'"{c}"' not in text]
    assert not missing, missing


def test_the_scan_catches_a_planted_refusal_without_a_code() -> None:
    planted = '''
from schedulers.errors import ScheduleError
def f(x):
    if x:
        raise ScheduleError(f"bad {x}")
    err = errors.TemporalSliceError("no code either")
    raise ScheduleError("fine", code="warp_tile.step")
'''
    uncoded, literal = scan(planted, "planted.py")
    assert uncoded == ["planted.py:5", "planted.py:6"] and literal == {"warp_tile.step"}
    assert scan('raise HardwareError("x")', "schedulers/hardware.py")[0] == []  # the model's validation
    assert scan('raise HardwareError("x")', "search/space.py")[0] == ["search/space.py:1"]
    assert not codes.known("warp_tile.nonsense") and codes.known("stages.range") and codes.known("wgmma.target")


GRAPHS = {  # fp16: tensor-core knob sets are enumerated (where a form may exist)
    "mha": lambda: workloads.mha(2, 4, 128, 128, 64),
    "attention_causal": lambda: patterns.attention(1, 2, 128, 128, 64, causal=True),
    "softmax_gemm": lambda: workloads.softmax_gemm(256, 512, 64),
    "layernorm": lambda: patterns.layernorm(64, 256, dtype="float16"),
    "residual_layernorm": lambda: patterns.residual_layernorm(256, 1024, "float16"),
}


@pytest.mark.parametrize("hw", [H100, A100], ids=lambda h: h.name)
@pytest.mark.parametrize("name", list(GRAPHS))
def test_the_search_report_counts_every_refusal_by_its_code(name: str, hw: HardwareModel) -> None:
    """Before codes, 14,156 of BERT's 28,479 pruned knob sets (H100) were ``tensor_cores.no_form`` with five
    reasons in prose behind it; now each is counted under its own code."""
    space = SearchSpace(GRAPHS[name](), hw)
    assert space.candidates()
    pruned = space.report.pruned
    assert all(codes.known(c) and "." in c for c in pruned), pruned
    assert not set(pruned) & {"tensor_cores.no_form", "warp.no_program", "schedule", "temporal"}, pruned


@pytest.mark.parametrize("name", ["layernorm", "residual_layernorm"])
def test_a_graph_without_a_tensor_core_form_is_told_once_and_gets_no_tensor_core_knobs(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import search.space as space_module

    calls = []
    real = space_module.program_form

    def counted(*args):  # noqa: ANN002, ANN202
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(space_module, "program_form", counted)
    space = SearchSpace(GRAPHS[name](), H100)
    assert space.tensor_cores and space.tensor_core_dtypes  # fp16 on a GPU: tensor cores were asked for
    cands = space.candidates()
    assert cands and not any(s.tensor_cores for s in cands)
    assert not any(k.tensor_cores for k in space.knobs())
    assert space.report.no_form == {space.serials[0]: "warp_tile.second_pass"}
    assert len(calls) == len(space.serials) == 1  # derived once for the graph, not per knob set
    assert "no tensor-core form" in str(space.report)
    monkeypatch.setattr(SearchSpace, "analyse_forms", False)  # without the analysis they were enumerated
    assert any(k.tensor_cores for k in SearchSpace(GRAPHS[name](), H100).knobs())


def test_a_gemm_without_a_warp_tile_program_gets_only_gemm_epilogue_knob_sets() -> None:
    """``gelu(A @ v)`` with v [k]: its state has no column dim, so no warp-tile GEMM state (B [n, k] was the
    example here until K-major operands became warp-tile GEMM states: ``test_k_major.py``)."""
    b = Builder("gemv_gelu", "float16")
    a, v = b.input("A", {"m": 96, "k": 64}), b.input("v", {"k": 64})
    g = b.build(b.unary("gelu", b.matmul(a, v, reduce="k", name="C"), name="Y"))
    space = SearchSpace(g, H100)
    cands = space.candidates()
    assert any(s.tensor_cores for s in cands)  # TVM's WMMA tensorizer takes it
    assert space.report.no_program == {"k": "warp_tile.no_gemm_state"} and not space.report.no_form
    tc = [k for k in space.knobs() if k.tensor_cores]
    assert tc and all((k.stages, k.warps, k.split, k.slices, k.producer) == (1, 0, 1, 1, False) for k in tc)


def test_wgmma_is_not_offered_with_a_split() -> None:
    """make_schedule refused every wgmma knob set with split > 1 (``warp_tile.wgmma_split``, no knob to drop), so
    on Hopper, where wgmma is on, the space leaves split out; elsewhere it keeps offering split."""
    g = workloads.softmax_gemm(256, 512, 64)
    assert {k.split for k in SearchSpace(g, H100).knobs()} == {1}  # the split knob's offer
    assert {k.split for k in SearchSpace(g, A100).knobs()} == {1, 4}
    with pytest.raises(ScheduleError) as info:
        make_schedule(g, {"m": 64}, serial="l", step=64, tensor_cores=True, wgmma=True, split=4)
    assert info.value.code == "warp_tile.wgmma_split"


# -- target capabilities


def test_the_hardware_model_states_what_its_targets_can_do() -> None:
    for hw in (H100, H200):
        c = hw.capabilities()
        assert (c.arch, c.wgmma, c.tma, c.clusters) == ("sm_90a", True, True, True)
        assert (c.max_dynamic_smem_bytes, c.max_threads_per_block) == (227 * 1024, 1024)
    for hw in (A100, V100):
        c = hw.capabilities()
        assert not (c.wgmma or c.tma or c.clusters) and c.max_threads_per_block == 1024
    assert A100.capabilities().max_dynamic_smem_bytes == 163 * 1024
    assert not NPU.capabilities().clusters
    plain = H100.capabilities("sm_90")  # no 'a': no wgmma (nor setmaxnreg), but clusters and TMA
    assert (plain.wgmma, plain.tma, plain.clusters) == (False, True, True)
    assert not H100.capabilities("sm_100a").wgmma  # Blackwell has no wgmma
    assert "capabilities" not in H100.to_dict()  # derived: the record and its fingerprint are unchanged


@pytest.mark.parametrize("graph", [lambda: workloads.mha(2, 4, 128, 128, 64),
                                   lambda: patterns.gemm_epilogue(256, 256, 64, "relu", True, "float16"),
                                   lambda: patterns.group_norm(2, 256, 32, 1280, "silu", dtype="float16")])
def test_no_wgmma_tma_producer_or_cluster_knob_set_is_enumerated_for_an_sm_80_target(graph) -> None:
    g = graph()

    def hopper(k) -> bool:  # noqa: ANN001
        return k.wgmma or k.tma or k.producer or k.persistent or k.pingpong

    assert not any(hopper(k) or k.cluster != 1 for k in SearchSpace(g, A100).knobs())
    sm90 = dataclasses.replace(H100, name="H100 sm_90", arch="sm_90")  # a model without the 'a' features
    assert not any(hopper(k) for k in SearchSpace(g, sm90).knobs())
    h100 = list(SearchSpace(g, H100).knobs())
    if any(k.tensor_cores for k in h100):
        assert any(k.wgmma for k in h100)  # on sm_90a they are offered
    assert not any(k.cluster != 1 for k in h100)  # the search offers no cluster (a user's knob: docs/knobs.md)


def test_make_schedule_refuses_what_the_target_cannot_run_with_its_code() -> None:
    g = patterns.gemm_epilogue(256, 256, 64, "relu", True, "float16")
    kw = {"tiles": {"m": 128, "n": 128}, "serial": "k", "step": 64, "tensor_cores": True, "warps": 4}
    assert make_schedule(g, hw=H100, wgmma=True, **kw).wgmma
    for knobs in ({"wgmma": True}, {"wgmma": True, "tma": True, "stages": 2}):
        with pytest.raises(ScheduleError) as info:
            make_schedule(g, hw=A100, **kw, **knobs)
        assert (info.value.code, info.value.knob) == ("wgmma.target", "wgmma")
    norm = patterns.group_norm(2, 256, 32, 1280, "silu", dtype="float16")
    ckw = {"tiles": {"n": 1, "g": 1}, "serial": "s", "step": 256, "lanes": 256, "cluster": 8}
    assert make_schedule(norm, hw=H100, **ckw).cluster == 8
    with pytest.raises(ScheduleError, match="clusters exist on sm_90") as info:
        make_schedule(norm, hw=A100, **ckw)
    assert (info.value.code, info.value.knob) == ("cluster.target", "cluster")


def test_the_lowering_keeps_the_target_check_as_a_safety_net() -> None:
    """A schedule made for the H100 and built for sm_80 (a file from another machine) is refused by the same
    rules before TVM is called."""
    from spacefusion.lower.build import build_cuda

    g = patterns.gemm_epilogue(256, 256, 64, "relu", True, "float16")
    s = make_schedule(g, {"m": 128, "n": 128}, serial="k", step=64, tensor_cores=True, warps=4, wgmma=True)
    for arch in ("sm_80", "sm_90"):
        with pytest.raises(ScheduleError, match="wgmma exists on sm_90a only") as info:
            build_cuda(s, arch)
        assert info.value.code == "wgmma.target"


def test_a_v100_gets_no_warp_tile_program_but_keeps_wmma() -> None:
    """The warp-tile programs run mma.sync m16n8k16 (sm_80+): on a V100 (sm_70) none is enumerated and one
    asked for is refused with ``warp_tile.target``; a GEMM's WMMA form (sm_70) stays; an A100 keeps both."""
    from schedulers.hardware import A100, V100
    from schedulers.schedule import make_schedule
    from search.space import SearchSpace
    from smg import patterns

    att = patterns.attention(2, 4, 128, 128, 64, dtype="float16")
    with pytest.raises(ScheduleError) as e:
        make_schedule(att, {"b": 1, "h": 1, "m": 64}, serial="l", step=64, tensor_cores=True, hw=V100)
    assert e.value.code == "warp_tile.target" and "sm_80" in str(e.value)
    assert not [s for s in SearchSpace(att, V100).candidates() if s.warp_tile is not None]
    assert [s for s in SearchSpace(att, A100).candidates() if s.warp_tile is not None]
    gemm = patterns.gemm_epilogue(256, 256, 256, act="relu", dtype="float16")
    wmma = [s for s in SearchSpace(gemm, V100).candidates() if s.tensor_cores]
    assert wmma and all(s.warp_tile is None for s in wmma)
