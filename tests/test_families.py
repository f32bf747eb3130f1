"""First picks of a new set of sizes from the ranking of the same graph at other sizes (``frontend.families``,
``schedulers.retarget``): families keyed without sizes, decisions made again on new sizes (checked against the
numpy reference on llvm), the scope that turns it on, and what a store from other code or a broken file does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from schedulers.hardware import get_hardware
from schedulers.retarget import decisions, remake
from search.cost import estimate_us
from smg import patterns
from smg.reference import evaluate, random_inputs
from spacefusion.api import build
from spacefusion.frontend import families
from spacefusion.frontend.schedules import model_pick, ranked

H100 = get_hardware("H100")


def test_a_family_is_the_graph_without_its_sizes() -> None:
    a, b = patterns.gemm_epilogue(64, 96, 32, act="gelu"), patterns.gemm_epilogue(200, 96, 48, act="gelu")
    assert a.key != b.key and families.family_key(a) == families.family_key(b)
    assert families.family_key(a) != families.family_key(patterns.gemm_epilogue(64, 96, 32, act="tanh"))
    # a size written into the ops (the norm's mean divides by n) tells families apart: n is not free there
    assert families.family_key(patterns.layernorm(64, 128)) == families.family_key(patterns.layernorm(96, 128))
    assert families.family_key(patterns.layernorm(64, 128)) != families.family_key(patterns.layernorm(64, 256))


@pytest.mark.parametrize("graph", [patterns.gemm_epilogue(64, 96, 32, act="gelu", dtype="float16"),
                                   patterns.attention(2, 2, 64, 64, 32),
                                   patterns.layernorm(64, 128, dtype="float16")], ids=lambda g: g.name)
def test_decisions_made_again_on_their_own_graph_give_the_same_schedule(graph) -> None:
    for s in ranked(graph, H100)[:12]:  # folds, tensor-core programs and CUDA-core kernels among them
        again = remake(decisions(s, graph), graph, H100)
        assert again is not None and again.key == s.key, s


def test_a_gqa_decode_attention_folded_twice_is_recorded_and_made_again() -> None:
    """A GQA decode step with a key mask (Qwen2.5's 14/2 heads, batch 1, one query): its first picks cut a
    graph folded twice (the unit batch into the kv heads, the query group into the rows).  Recording only one
    fold made ``decisions`` raise, and that failed the whole first pick of every exported decode attention,
    which then built the slicers' CUDA-core default."""
    mods = (patterns.ScoreMod("{s} + Mask", (("Mask", ("l",)),)),)
    graph = patterns.attention(1, 14, 1, 2112, 64, kv_heads=2, dtype="float16", mods=mods)
    order = ranked(graph, get_hardware("H200"))
    twice = [s for s in order[:40] if len(s.smg.dims) == len(graph.dims) - 2]
    assert twice, "the ranking's head holds no schedule of the twice-folded graph"
    for s in twice[:4]:
        d = decisions(s, graph)
        assert len(d["fold"]) == 2
        again = remake(d, graph, get_hardware("H200"))
        assert again is not None and again.key == s.key
    longer = patterns.attention(1, 14, 1, 4160, 64, kv_heads=2, dtype="float16", mods=mods)
    assert remake(decisions(twice[0], graph), longer, get_hardware("H200")) is not None


def test_records_of_one_fold_are_still_made_again() -> None:
    """The record before fold sequences held one pair; ``remake`` reads both forms."""
    graph = patterns.attention(1, 14, 1, 2112, 64, kv_heads=2, dtype="float16")
    once = [s for s in ranked(graph, H100)[:40] if len(s.smg.dims) == len(graph.dims) - 1]
    if not once:
        pytest.skip("no once-folded schedule in the head")
    d = decisions(once[0], graph)
    assert len(d["fold"]) == 1
    again = remake(d | {"fold": d["fold"][0]}, graph, H100)
    assert again is not None and again.key == once[0].key


@pytest.mark.parametrize("make, old, new", [
    (lambda m: patterns.gemm_epilogue(m, 48, 40, act="gelu"), 64, 37),
    (lambda m: patterns.layernorm(m, 96), 128, 29),
    (lambda s: patterns.attention(1, 2, s, s, 16, dtype="float32"), 64, 23),
])
def test_remade_schedules_on_new_sizes_match_the_reference(make, old, new) -> None:
    """Each decision of the old size's head that the new sizes take builds for llvm and computes what numpy
    computes at the new sizes (the update functions derived again, the tails of odd sizes masked)."""
    g_old, g_new = make(old), make(new)
    made = [s for s in (remake(decisions(s, g_old), g_new, H100) for s in ranked(g_old, H100)[:6]) if s is not None]
    assert made
    x = random_inputs(g_new, seed=4)
    want = evaluate(g_new, x)
    for s in made[:3]:
        got = build(s, "llvm")(x)
        for name in g_new.outputs:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-4, atol=2e-4)


def test_a_new_size_is_picked_from_the_family_inside_the_scope(tmp_path) -> None:
    old, new = patterns.gemm_epilogue(1024, 768, 768, dtype="float16"), patterns.gemm_epilogue(800, 768, 768,
                                                                                               dtype="float16")
    with families.transferring(tmp_path, False):  # a full ranking files its head; nothing is transferred
        model_pick(old, H100)
        families.ORIGIN.pop(new.key, None)
        full = model_pick(new, H100)[0]
        assert new.key not in families.ORIGIN
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert len(saved["entries"]) == 2 and {e["sizes"]["m"] for e in saved["entries"]} == {1024, 800}
    newer = patterns.gemm_epilogue(600, 768, 768, dtype="float16")
    with families.transferring(tmp_path, True):
        got = model_pick(newer, H100)[0]
    assert families.ORIGIN[newer.key]["m"] == 800  # the nearest sizes ranked
    best = model_pick(newer, H100)[0]  # no scope: the full ranking
    assert got.smg.dim_sizes["m"] == 600 and estimate_us(got, H100) <= 1.1 * estimate_us(best, H100)
    assert full.smg.key == new.key
    # outside any scope, or with transfer off, the full ranking decides
    families.ORIGIN.pop(newer.key, None)
    model_pick(newer, H100)
    assert newer.key not in families.ORIGIN


def test_entries_of_other_code_or_machines_and_broken_files_are_not_used(tmp_path, monkeypatch) -> None:
    old, new = patterns.layernorm(512, 768, dtype="float16"), patterns.layernorm(300, 768, dtype="float16")
    with families.transferring(tmp_path, False):
        model_pick(old, H100)
    assert families.nearest(tmp_path, new, H100) is not None
    assert families.nearest(tmp_path, new, get_hardware("H200")) is None  # ranked for another machine
    monkeypatch.setattr(families, "_code", lambda: "other-code")
    assert families.nearest(tmp_path, new, H100) is None
    monkeypatch.undo()
    next(tmp_path.glob("*.json")).write_text("{not json")
    assert families.nearest(tmp_path, new, H100) is None
    with families.transferring(tmp_path, True):  # a broken file: ranked in full, and the file written anew
        families.ORIGIN.pop(new.key, None)
        assert model_pick(new, H100)[0].smg.key == new.key and new.key not in families.ORIGIN
    assert families.nearest(tmp_path, patterns.layernorm(200, 768, dtype="float16"), H100)["sizes"]["m"] == 300


def test_sizes_too_far_apart_are_ranked_in_full(tmp_path) -> None:
    with families.transferring(tmp_path, False):
        model_pick(patterns.layernorm(1024, 768, dtype="float16"), H100)
    assert families.nearest(tmp_path, patterns.layernorm(512, 768, dtype="float16"), H100) is not None
    assert families.nearest(tmp_path, patterns.layernorm(511, 768, dtype="float16"), H100) is None
    assert families.nearest(tmp_path, patterns.layernorm(2049, 768, dtype="float16"), H100) is None


def test_an_unwritable_family_folder_costs_nothing_but_the_transfer(tmp_path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder would be")
    with families.transferring(blocked / "families", True):
        s, _ = model_pick(patterns.layernorm(64, 128, dtype="float16"), H100)
    assert s.smg.dim_sizes["m"] == 64


def test_new_lengths_of_a_symbolic_graph_take_first_picks_from_the_family(tmp_path, monkeypatch) -> None:
    """torch's defaults on meta tensors (export only): the first length ranks in full, the graph turns symbolic
    at the second, whose specialisations (and the third's) are picked from the family; each artefact's
    timing.json says which."""
    from spacefusion.frontend.backends import CudaBackend
    from spacefusion.frontend.dynamo import SpaceFusionBackend, first_pick_for
    from spacefusion.frontend.parallel_build import WORKERS_ENV

    monkeypatch.setenv(WORKERS_ENV, "1")
    torch._dynamo.reset()
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).half()
    backend = SpaceFusionBackend(CudaBackend(tmp_path, schedule_for=first_pick_for(H100), build_missing=True,
                                             load=False, hardware="H100"), export_only=True)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for rows in (96, 64, 160):
            compiled(torch.zeros(rows, 64, dtype=torch.half, device="meta"))
    torch._dynamo.reset()
    picked = {}
    for t in tmp_path.glob("**/timing.json"):  # a CUDA-core pick of a symbolic graph's size: under symbolic/
        d = json.loads(t.read_text())
        m = json.loads((t.parent / "kernel.json").read_text())["workload"]["shape"]["m"]
        picked[(d["name"], m)] = d["picked_from_sizes"]
    assert {m for _, m in picked} == {96, 64, 160}, picked
    assert all((v is None) == (m == 96) for (_, m), v in picked.items()), picked
    assert all(v["m"] == 96 for (_, m), v in picked.items() if v is not None), picked
