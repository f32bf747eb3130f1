"""Attention over the projections' own layout (``patterns.attention(..., layout="bshd")``): the SMG, its
CUDA-core and tensor-core lowerings, the tensor maps of a TMA ring, the frontend's view through HF's
split_heads / merge_heads transposes, and the GPU runner's reference (CPU only: compile, no launch)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from schedulers.errors import ScheduleError
from schedulers.warp_tile import staged_output, tma_dims, tma_maps
from smg import patterns
from smg.fold import foldable
from smg.reference import evaluate, reduction_length
from smg.tolerance import assert_close
from spacefusion.api import build, schedule
from spacefusion.frontend import CudaBackend, capture, fuse, partition
from spacefusion.frontend.schedules import default_schedule
from spacefusion.models import BertConfig, BertModel, LlamaConfig, LlamaModel, ViTConfig, ViTModel
from spacefusion.runtime.artefact import ArtefactError, KernelArtefact
from spacefusion.runtime.tensormap import TensorMapError, tiled_args

REPO = Path(__file__).resolve().parents[1]


def _pair(*args, **kw):
    return (patterns.attention(*args, dtype="float32", **kw),
            patterns.attention(*args, dtype="float32", layout="bshd", **kw))


def _permuted(x: np.ndarray, src: tuple[str, ...], dst: tuple[str, ...]) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(x, [src.index(d) for d in dst]))


def _bshd_inputs(g0, g1, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    x0 = {n: rng.standard_normal(g0.shape(n)).astype(np.float32) for n in g0.inputs}
    return x0, {n: _permuted(x0[n], g0.space(n).dims, g1.space(n).dims) for n in g1.inputs}


CONFIGS = [((2, 3, 20, 40, 16), {}), ((1, 6, 17, 33, 16), {"kv_heads": 2, "causal": True}),
           ((2, 4, 9, 40, 8), {"kv_heads": 1})]


def test_bshd_declares_memory_order_and_keeps_the_default_key() -> None:
    g0, g1 = _pair(1, 8, 50, 60, 80, kv_heads=2)
    assert g1.space("Q").dims == ("b", "m", "h", "r", "d") and g1.space("K").dims == ("b", "l", "h", "d")
    assert g1.space("V").dims == ("b", "l", "h", "n") and g1.space("O").dims == ("b", "m", "h", "r", "n")
    assert dict(g1.attrs)["layout"] == "bshd" and "layout" not in dict(g0.attrs)
    assert g0.key == patterns.attention(1, 8, 50, 60, 80, kv_heads=2, dtype="float32", layout="bhsd").key
    assert g1.key != g0.key
    # a query head is h * group + r: the unflatten of a [b, s, 8 * d] projection's columns
    assert g1.shape("Q") == (1, 50, 2, 4, 80)
    with pytest.raises(ValueError, match="layout 'sbhd'"):
        patterns.attention(1, 1, 8, 8, 16, layout="sbhd")
    # the query group and its rows are not adjacent in bshd: no fold (the group may be the row dim itself)
    assert ("r", "m") not in foldable(g1) and ("r", "m") in foldable(g0)


@pytest.mark.parametrize("args, kw", CONFIGS)
def test_bshd_reference_is_bhsd_on_permuted_inputs(args, kw) -> None:
    g0, g1 = _pair(*args, **kw)
    x0, x1 = _bshd_inputs(g0, g1)
    want = _permuted(evaluate(g0, x0)["O"], g0.space("O").dims, g1.space("O").dims)
    np.testing.assert_allclose(evaluate(g1, x1)["O"], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("args, kw", CONFIGS)
@pytest.mark.parametrize("how", ["default", "rows"])
def test_bshd_llvm_build_matches_numpy(args, kw, how) -> None:
    """The CUDA-core TIR path addresses every space through its own dims: the frontend's default
    schedule (threads over the heads, bshd's innermost cut output dim) and row tiles of m."""
    g0, g1 = _pair(*args, **kw)
    x0, x1 = _bshd_inputs(g0, g1, seed=1)
    if how == "default":
        s = default_schedule(g1)
    else:
        tiles = {"m": 8, "h": 1} | ({"r": 1} if "r" in g1.dim_sizes else {})
        s = schedule(g1, tiles=tiles, step=16, thread_dim="m")
    got = build(s, "llvm")(x1)["O"]
    assert_close(got, evaluate(g1, x1)["O"], g1.space("O").dtype, reduction_length(g1))  # smg/tolerance.py


def _tc(g, tiles: dict[str, int], step: int, stages: int, **kw):
    return schedule(g, tiles=tiles, serial="l", step=step, tensor_cores=True, stages=stages, **kw)


def _bshd(*args, **kw):
    return patterns.attention(*args, layout="bshd", **kw)


TC = {
    "mma": (lambda: _bshd(2, 3, 70, 90, 64), {"m": 32, "h": 1}, 32, 2, {}),
    "gqa": (lambda: _bshd(1, 8, 50, 60, 64, kv_heads=2), {"m": 16, "h": 1, "r": 1}, 16, 2, {}),
    "causal_split2": (lambda: _bshd(1, 2, 100, 100, 64, causal=True), {"m": 64, "h": 1}, 32, 2, {"split": 2}),
    "wgmma_d80": (lambda: _bshd(1, 2, 128, 192, 80), {"m": 128, "h": 1}, 64, 2,
                  {"warps": 4, "reload_a": True, "wgmma": True}),
    "wgmma_tma_gqa_causal": (lambda: _bshd(1, 8, 200, 200, 128, kv_heads=2, causal=True),
                             {"m": 128, "h": 1, "r": 1}, 64, 2,
                             {"warps": 4, "reload_a": True, "mma_row_sums": True, "wgmma": True, "tma": True}),
    "ws_d80": (lambda: _bshd(1, 2, 200, 200, 80, causal=True), {"m": 128, "h": 1}, 64, 2,
               {"warps": 8, "reload_a": True, "wgmma": True, "tma": True, "producer": True}),
    "slices": (lambda: _bshd(1, 4, 16, 1024, 128), {"m": 16, "h": 1}, 64, 2, {"slices": 8}),
    "gqa_rows_r": (lambda: _bshd(2, 8, 1, 300, 128, kv_heads=2), {"r": 16, "m": 1, "h": 1}, 64, 2, {"slices": 2}),
}


@pytest.mark.parametrize("name", sorted(TC))
def test_bshd_tensor_core_schedules_build_for_sm90a(name) -> None:
    """mma.sync, wgmma, TMA and a producer warpgroup over bshd operands: the row (m) and serial (l) dims
    sit before the heads, the column dim stays last; outputs leave in 16-byte chunks of O's rows."""
    mk, tiles, step, stages, kw = TC[name]
    s = _tc(mk(), tiles, step, stages, **kw)
    p = s.warp_tile
    assert (p.row, p.serial, p.gemm.k, p.gemm.b_trans) == (max(tiles, key=tiles.get), "l", "d", False)
    assert {(g.x, g.n) for g in p.gemm_states} == {("V", "n")}
    art = build(s, "cuda:sm_90a")
    src = art.source
    assert ("wgmma.mma_async" in src) == s.wgmma and ("cp.async.bulk.tensor.4d" in src) == s.tma
    if staged_output(s, p, "O") is not None:
        assert "*(uint4*)(O_ptr" in src
    maps = {q["name"]: q["tensor_map"] for q in art.meta["params"] if q["role"] == "tensormap"}
    if s.tma:  # K, V [b, l, h, d] mapped as (d, l, h, b): the box's rows run along l
        assert maps == {f"{n}__tmap": {"tensor": n, "box": [64, step, 1, 1], "swizzle": 128, "dims": [3, 1, 2, 0]}
                        for n in ("K", "V")}
        assert tma_dims(s.smg, p, "K") == ("d", "l", "h", "b")


def test_bhsd_tensor_maps_keep_their_json() -> None:
    s = _tc(patterns.attention(2, 3, 70, 90, 64), {"m": 64}, 32, 3, mma_row_sums=True, wgmma=True, tma=True)
    assert all("dims" not in m for m in tma_maps(s, s.warp_tile).values())


def test_bshd_needs_single_head_blocks_for_tensor_cores() -> None:
    """make_schedule's default spreads threads over bshd's innermost cut output dim (h): a block of
    several heads is no warp-tile program, and the refusal says which plane it wanted."""
    with pytest.raises(ScheduleError, match=r"not on the \(m, l\) plane"):
        _tc(_bshd(1, 4, 64, 64, 64), {"m": 32}, 32, 2)


def test_tiled_args_take_the_maps_dim_order() -> None:
    """A bshd K [b, l, h, d] (contiguous) mapped as (d, l, h, b): each dim keeps its own stride."""
    b, l, h, d = 2, 90, 3, 64
    strides = (l * h * d, h * d, d, 1)
    dims, byte_strides, box = tiled_args((b, l, h, d), strides, 2, (64, 32, 1, 1), 128, (3, 1, 2, 0))
    assert (dims, byte_strides, box) == ([d, l, h, b], [h * d * 2, d * 2, l * h * d * 2], [64, 32, 1, 1])
    assert tiled_args((b, l, h, d), strides, 2, (64, 32, 1, 1), 128) == \
        ([d, h, l, b], [d * 2, h * d * 2, l * h * d * 2], [64, 32, 1, 1])
    with pytest.raises(TensorMapError, match="stride 192"):
        tiled_args((b, l, h, d), strides, 2, (64, 32, 1, 1), 128, (1, 3, 2, 0))
    with pytest.raises(TensorMapError, match="not a permutation"):
        tiled_args((b, l, h, d), strides, 2, (64, 32, 1, 1), 128, (3, 1, 1, 0))
    with pytest.raises(TensorMapError, match="multiples of 16"):  # d = 4 halfs: 8-byte head strides
        tiled_args((b, l, h, 4), (l * h * 4, h * 4, 4, 1), 2, (4, 32, 1, 1), 128, (3, 1, 2, 0))


def test_artefact_keeps_the_tensor_map_order(tmp_path) -> None:
    mk, tiles, step, stages, kw = TC["wgmma_tma_gqa_causal"]
    folder = build(_tc(mk(), tiles, step, stages, **kw), "cuda:sm_90a").save(tmp_path / "a", compile_cubin=False)
    art = KernelArtefact.load(folder)
    k = art.param("K__tmap")
    assert k.tensor_map_dims == (3, 1, 2, 0) and k.to_json()["tensor_map"]["dims"] == [3, 1, 2, 0]
    assert art.workload["layout"] == "bshd"
    meta = json.loads((folder / "kernel.json").read_text())
    next(q for q in meta["params"] if q["name"] == "K__tmap")["tensor_map"]["dims"] = [3, 1, 2, 2]
    (folder / "kernel.json").write_text(json.dumps(meta))
    with pytest.raises(ArtefactError, match="must be a permutation of 0..3"):
        KernelArtefact.load(folder)


# -- frontend ---------------------------------------------------------------------------------------

def _attention_subgraphs(p):
    return [s for s in p.subgraphs if s.kind == "attention"]


def _around_attention(gm, p) -> list[str]:
    """Ops torch still runs that read an attention node or feed one."""
    by_name = {n.name: n for n in gm.graph.nodes}
    att = {n for s in _attention_subgraphs(p) for n in s.nodes}
    left = {op.node for op in p.left}
    return sorted(n for n in left if any(u.name in att for u in by_name[n].users)
                  or any(i.name in att for i in by_name[n].all_input_nodes))


@pytest.mark.parametrize("name", ["bert", "vit"])
def test_hf_encoders_take_bshd_attention_without_transposes(name) -> None:
    if name == "bert":
        m = BertModel(BertConfig.tiny(layers=2), seed=1)
        x = m.example_inputs(2, 16, seed=2)
    else:
        m = ViTModel(ViTConfig.tiny(layers=2), seed=1)
        x = m.example_inputs(2, seed=2)
    gm = capture(m, *x).module
    p = partition(gm)
    att = _attention_subgraphs(p)
    assert len(att) == 2 and all(dict(s.smg.attrs)["layout"] == "bshd" for s in att)
    # the three split_heads transposes, SDPA and merge_heads' transpose are one subgraph; what torch
    # runs next to it are the unflatten views of the projections and the flatten view of the output
    assert all(len(s.nodes) == 5 for s in att)
    around = {next(op.op for op in p.left if op.node == n) for n in _around_attention(gm, p)}
    assert around == {"Tensor.unflatten", "Tensor.flatten"}
    (q,) = [o for o in att[0].operands if o.space == "Q"]
    assert q.ref.startswith("unflatten") and q.shape == att[0].smg.shape("Q")
    assert att[0].results[0].node.startswith("transpose") and att[0].results[0].shape == att[0].smg.shape("O")
    fused = fuse(m, *x, backend="llvm")
    with torch.no_grad():
        for got, want in zip(fused(*x), m(*x)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_llama_binds_ropes_outputs_where_they_lie() -> None:
    """RoPE runs after split_heads, so Q and K are computed [b, h, s, d] tensors, not views; but torch gives
    them split_heads' strides, so they lie as [b, s, h, d] and the bshd pattern reads them through a permuted
    view: no copy before the kernel, merge_heads' transpose after it is the kernel's."""
    m = LlamaModel(LlamaConfig.tiny(layers=1, kv_heads=2))
    p = partition(capture(m, *m.example_inputs(1, 16)).module)
    att = _attention_subgraphs(p)
    assert [dict(s.smg.attrs).get("layout", "bhsd") for s in att] == ["bshd"]
    assert {o.permute for o in att[0].operands} == {(0, 2, 1, 3)}


class _Scaled(nn.Module):
    """An element-wise op between split_heads and the attention; ``packed``: its output made contiguous."""

    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.proj, self.packed = nn.Linear(32, 32), packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).unflatten(-1, (4, 8)).transpose(1, 2) * 0.5
        q = q.contiguous() if self.packed else q
        return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("packed", [False, True])
def test_operands_are_bound_by_their_strides_and_the_fused_model_matches(packed: bool) -> None:
    """Laid out as [b, s, h, d] (an element-wise op keeps split_heads' strides) the operands are read through
    a permuted view; made contiguous ([b, h, s, d] in memory) they keep the bhsd pattern.  Both fused models
    match eager."""
    torch.manual_seed(0)
    model, x = _Scaled(packed).eval(), torch.randn(2, 16, 32)
    fused = fuse(model, x, backend="reference")
    att = _attention_subgraphs(fused.partition)
    assert [dict(s.smg.attrs).get("layout", "bhsd") for s in att] == ["bhsd" if packed else "bshd"]
    assert {o.permute for o in att[0].operands} == ({None} if packed else {(0, 2, 1, 3)})
    torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)


class _FusedQKV(nn.Module):
    """Q, K and V sliced from one projection: their [b, s, h, d] views are not packed tensors."""

    def __init__(self, gqa: bool = False, out_view: bool = True) -> None:
        super().__init__()
        self.qkv, self.gqa, self.out_view = nn.Linear(32, 96), gqa, out_view
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 16 if gqa else 32), nn.Linear(32, 16 if gqa else 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gqa:  # separate projections, 4 query heads over 2 kv heads
            q = self.q(x).unflatten(-1, (4, 8)).transpose(1, 2)
            k = self.k(x).unflatten(-1, (2, 8)).transpose(1, 2)
            v = self.v(x).unflatten(-1, (2, 8)).permute(0, 2, 1, 3)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            qkv = self.qkv(x)
            q, k, v = (qkv[..., i * 32:(i + 1) * 32].unflatten(-1, (4, 8)).transpose(1, 2) for i in range(3))
            o = F.scaled_dot_product_attention(q, k, v)
        return o.transpose(1, 2).flatten(2) if self.out_view else o.flatten(2)


@pytest.mark.parametrize("gqa, out_view, layout", [(False, True, "bhsd"), (True, True, "bshd"),
                                                   (True, False, "bhsd")])
def test_bshd_only_where_the_operands_are_packed_projections(gqa, out_view, layout) -> None:
    """Sliced projections (strided views) and an output not transposed back keep the bhsd path; GQA
    projections take bshd with Q as [b, s, kv_heads, group, d]; the fused model matches torch."""
    torch.manual_seed(0)
    model = _FusedQKV(gqa, out_view).eval()
    x = torch.randn(2, 8, 32)
    fused = fuse(model, x, backend="llvm")
    (att,) = _attention_subgraphs(fused.partition)
    assert dict(att.smg.attrs).get("layout", "bhsd") == layout
    if layout == "bshd":
        assert att.smg.shape("Q") == (2, 8, 2, 2, 8)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)


class _Recorder:
    """A stand-in CudaKernel: the artefact it was loaded from, and the tensors it was launched on."""

    def __init__(self, art: KernelArtefact) -> None:
        self.artefact, self.seen = art, {}

    def __call__(self, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen = tensors
        return {p.name: torch.zeros(p.shape) for p in self.artefact.outputs}


def test_cuda_backend_binds_bshd_projections_without_a_copy(tmp_path, monkeypatch) -> None:
    """The kernel gets the linear's own memory: ``.contiguous()`` of the [b, s, h, d] view is itself."""
    import spacefusion.runtime.gpu as gpu

    g = _bshd(2, 4, 16, 16, 16, kv_heads=2, dtype="float16")
    be = CudaBackend(tmp_path, schedule_for=lambda smg: _tc(smg, {"m": 16, "h": 1, "r": 1}, 16, 2))
    be.export(g, cubin=False)
    rec: list[_Recorder] = []
    monkeypatch.setattr(gpu, "load_kernel", lambda folder: rec.append(_Recorder(KernelArtefact.load(folder)))
                        or rec[-1])
    run = be.compile(g)
    proj = {n: torch.randn(2, 16, (4 if n == "Q" else 2) * 16, dtype=torch.float16) for n in "QKV"}
    out = run({n: t.reshape(g.shape(n)) for n, t in proj.items()})
    assert {n: t.data_ptr() for n, t in rec[0].seen.items()} == {n: t.data_ptr() for n, t in proj.items()}
    assert out["O"].shape == g.shape("O")


# -- the GPU runner's reference ------------------------------------------------------------------------

def _runner():
    spec = importlib.util.spec_from_file_location("_run_artefacts_gpu_layout", REPO / "experiments" /
                                                  "run_artefacts_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("kw", [{}, {"kv_heads": 2, "causal": True}])
def test_gpu_runner_reference_reads_the_recorded_layout(layout, kw, monkeypatch) -> None:
    """``run_artefacts_gpu.build_attention`` (on CPU tensors here) equals the SMG's numpy reference, and
    its SDPA baseline agrees, for both layouts: it reads the layout from the artefact's workload."""
    mod = _runner()
    g = patterns.attention(2, 4, 12, 20, 16, dtype="float32", layout=layout, **kw)
    params = {n: SimpleNamespace(name=n, shape=g.shape(n), role="output" if n == "O" else "input")
              for n in (*g.inputs, "O")}
    art = SimpleNamespace(params=tuple(params.values()), param=params.__getitem__,
                          workload=dict(g.attrs) | {"name": "attention"})
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(mod, "_random_inputs", lambda art, names, seed: {
        n: torch.randn(art.param(n).shape, generator=gen) for n in names})
    case = mod.build_attention(art, 0, False)
    want = evaluate(g, {n: v.double().numpy() for n, v in case.inputs.items()})["O"]
    np.testing.assert_allclose(case.reference.double().numpy(), want, atol=1e-5)
    sdpa = case.baselines["sdpa"]()
    assert mod.max_abs_err(sdpa, case.reference) < 1e-5


def test_mma_cases_cover_bshd() -> None:
    from tests.test_mma import CASES

    names = [n for n in CASES if n.startswith("bshd")]
    assert len(names) >= 5 and all(re.fullmatch(r"bshd_\w+", n) for n in names)
