"""experiments/mask_attention.py on the CPU: the export phase at shrunk shapes (two cases, one candidate each),
the run phase's reference against the SMG's own float64 evaluation and a plain numpy attention, the
baselines' masks and mods against that reference, and the whole run phase with ``--device cpu`` in a
process that must never import spacefusion, smg, schedulers or TVM."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import mask_attention as ma  # noqa: E402

torch = pytest.importorskip("torch")

EXPORTED = ("causal", "alibi_causal")


def tiny(name: str, seq: int = 48, head_dim: int = 16) -> ma.Case:
    """A case at a size numpy evaluates in a blink (window and lengths scaled to it)."""
    c = ma.CASES[name]
    window = max(1, c.window * seq // c.seq_kv) if c.window else 0
    lengths = ma.padding_lengths(3, seq) if c.mod == "padding" else ()
    return ma.Case(c.name, 3 if c.mod == "padding" else 2, 2, seq, seq, head_dim, c.causal, c.mod, window, c.softcap,
                   lengths)


def numpy_attention(case: ma.Case, x: dict[str, np.ndarray]) -> np.ndarray:
    """Plain float64 attention: scores, the mod, the causal mask, softmax, @ V."""
    q, k, v = (x[n].astype(np.float64) for n in ("Q", "K", "V"))
    s = np.einsum("bhmd,bhld->bhml", q, k) / math.sqrt(case.head_dim)
    m, l = np.arange(case.seq_q)[:, None], np.arange(case.seq_kv)[None, :]  # noqa: E741
    if case.mod == "padding":
        s = np.where(x["Keep"][:, None, None, :] > 0.5, s, -1e30)
    elif case.mod == "window":
        s = np.where(m - l < case.window, s, -1e30)
    elif case.mod == "alibi":
        s = s + x["Slope"].astype(np.float64)[None, :, None, None] * (l - m)
    elif case.mod == "softcap":
        s = case.softcap * np.tanh(s / case.softcap)
    if case.causal:
        s = np.where(l <= m, s, -1e30)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhml,bhld->bhmd", p / p.sum(-1, keepdims=True), v)


def test_cases_are_the_issue_s() -> None:
    assert list(ma.CASES) == ["bert_padding", "window1024_causal", "alibi_causal", "softcap30_causal", "causal"]
    lengths = ma.CASES["bert_padding"].lengths
    assert len(lengths) == 32 and min(lengths) == 128 and max(lengths) == 512
    assert ma.CASES["softcap30_causal"].mods()[0][0] == "30.0*tanh({s}/30.0)"
    assert ma.CASES["window1024_causal"].mods()[0][0] == "Piecewise(({s}, m - l < 1024), (-1e30, True))"
    small = ma.CASES["window1024_causal"].shrunk()
    assert (small.seq_q, small.window, small.heads) == (256, 64, 2)
    assert ma.Case.from_dict(json.loads(json.dumps(ma.CASES["bert_padding"].to_dict()))) == ma.CASES["bert_padding"]
    assert ma.alibi_slopes(32)[0] == 2 ** -0.25 and ma.alibi_slopes(32)[-1] == 2 ** -8


@pytest.mark.parametrize("name", list(ma.CASES))
def test_reference_matches_the_smg_and_numpy(name: str) -> None:
    """The run phase's float32 torch reference is the function the kernel computes: the SMG evaluated
    unfused in float64 (smg.reference), and a plain numpy attention."""
    from smg.reference import evaluate
    from smg.tolerance import assert_close

    case = tiny(name)
    x = ma.make_inputs(case, "cpu", seed=1)
    got = ma.reference(case, x, chunk_bytes=1).numpy()  # one batch a chunk
    xn = {k: v.float().numpy() for k, v in x.items()}
    want = evaluate(ma.build_smg(case), xn)["O"]
    assert_close(got, want, "float32", case.seq_kv, "O")
    assert_close(got, numpy_attention(case, xn), "float32", case.seq_kv, "O")


@pytest.mark.parametrize("name", list(ma.CASES))
def test_baseline_masks_and_mods_compute_the_reference(name: str) -> None:
    """FlexAttention's score_mod/mask_mod (eager), SDPA's mask (default CPU backend) and the eager mask,
    in float32, against the reference."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    case = tiny(name, seq=64)
    x = ma.make_inputs(case, "cpu", seed=2)
    x32 = {k: v.float() for k, v in x.items()}
    ref = ma.reference(case, x32)
    q, k, v = x32["Q"], x32["K"], x32["V"]
    score_mod, mask_mod, batch = ma.flex_mods(case, x32)
    bm = None if mask_mod is None else create_block_mask(mask_mod, batch, None, case.seq_q, case.seq_kv, device="cpu")
    with torch.no_grad():
        flex = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=case.scale)
    torch.testing.assert_close(flex, ref, atol=2e-5, rtol=1e-4)
    if case.mod != "softcap":
        mask, is_causal, _ = ma.sdpa_mask(case, x32)
        mask = mask.float() if mask is not None and mask.dtype != torch.bool else mask
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=case.scale)
        torch.testing.assert_close(sdpa, ref, atol=2e-5, rtol=1e-4)
    else:
        with pytest.raises(NotImplementedError):
            ma.sdpa_mask(case, x32)
    mask = ma.eager_mask(case, x)  # fp16, as the eager baseline adds it: compare loosely
    s = q @ k.transpose(-1, -2) * case.scale
    if case.mod == "softcap":
        s = torch.tanh(s / case.softcap) * case.softcap
    eager = torch.softmax(s + (0 if mask is None else mask.float()), -1) @ v
    torch.testing.assert_close(eager, ref, atol=2e-2, rtol=2e-2)


def test_summary_picks_and_ratios() -> None:
    rows = [{"system": "flex", "us": 200.0}, {"system": "sdpa_cudnn", "us": None, "status": "error"},
            {"system": "spacefusion[0]", "rank": 0, "status": "not built", "us": None, "checked": False},
            {"system": "spacefusion[1]", "rank": 1, "us": 100.0, "checked": True},
            {"system": "spacefusion[2]", "rank": 2, "us": 80.0, "checked": True},
            {"system": "spacefusion[3]", "rank": 3, "us": None, "checked": False, "error": "numerics"}]
    s = ma.summarize(rows)
    assert s["spacefusion_first_pick"]["rank"] == 1 and s["spacefusion_best"]["rank"] == 2
    assert s["ratios"] == {"flex_over_first_pick": 2.0, "flex_over_best": 2.5}
    none_timed = ma.summarize([{"system": "spacefusion[1]", "rank": 1, "us": None, "error": "x"}])
    assert none_timed["spacefusion_first_pick"]["rank"] == 1 and "spacefusion_best" not in none_timed


@pytest.fixture(scope="module")
def small_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    art = tmp_path_factory.mktemp("mask_art")
    assert ma.main(["export", str(art), "--small", "--candidates", "1", "--cases", *EXPORTED]) == 0
    return art


def test_export_small(small_export: Path) -> None:
    manifest = json.loads((small_export / "manifest.json").read_text())
    assert manifest["format"] == ma.FORMAT and manifest["small"] is True
    assert sorted(manifest["cases"]) == sorted(EXPORTED)
    for name in EXPORTED:
        entry = manifest["cases"][name]
        assert entry["shape"] == ma.CASES[name].shrunk().shape
        built = [c for c in entry["candidates"] if c.get("folder")]
        assert len(built) == 1 and built[0]["summary"]["block"] and len(entry["smg_key"]) == 64
        folder = small_export / built[0]["folder"]
        assert (folder / "kernel.json").is_file() and (folder / "kernel.cu").is_file()
        params = {p["name"]: p["shape"] for p in json.loads((folder / "kernel.json").read_text())["params"]}
        assert params["Q"] == [2, 2, 256, 128]
    assert manifest["cases"]["alibi_causal"]["mods"][0]["inputs"] == [["Slope", ["h"]]]


def test_run_phase_on_cpu_imports_no_lowering(small_export: Path, tmp_path: Path) -> None:
    """The run phase end to end with --device cpu (one child process per case): baselines checked and
    timed, spacefusion's kernels reported as errors (no GPU), ratios absent, JSON written; and neither it
    nor its children import the lowering's packages (only the runtime and smg.tolerance)."""
    out = tmp_path / "r.json"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "experiments")!r})
        import mask_attention as ma
        rc = ma.main(["run", {str(small_export)!r}, "--out", {str(out)!r}, "--device", "cpu", "--warmup", "0",
                      "--iters", "1", "--repeats", "2", "--cases", "alibi_causal", "--no-isolate"])
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("schedulers", "search", "tvm")
                     or (m.startswith("spacefusion.") and not m.startswith("spacefusion.runtime"))
                     or (m.startswith("smg.") and m != "smg.tolerance"))
        assert not bad, bad
        sys.exit(rc)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    case = json.loads(out.read_text())["cases"]["alibi_causal"]
    rows = {r["system"]: r for r in case["rows"]}
    assert rows["flex"]["status"] == "ok" and rows["flex"]["us"] > 0 and len(rows["flex"]["us_rounds"]) == 2
    assert rows["eager"]["checked"] and rows["eager"]["max_abs_err"] < 0.01
    assert rows["spacefusion[0]"]["status"] == "error" and rows["spacefusion[0]"]["rank"] == 0
    assert case["spacefusion_first_pick"]["rank"] == 0 and case["ratios"] == {}

    # the default, one child process per case, merges what the children write
    out2 = tmp_path / "r2.json"
    cmd = [sys.executable, str(ROOT / "experiments" / "mask_attention.py"), "run", str(small_export), "--out",
           str(out2), "--device", "cpu", "--warmup", "0", "--iters", "1", "--repeats", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out2.read_text())
    assert res["complete"] and sorted(res["cases"]) == sorted(EXPORTED) and res["torch"] == torch.__version__
    assert all(c["child_rc"] == 0 and c["rows"] for c in res["cases"].values())
    assert "spacefusion_first_pick: rank 0" in proc.stdout


def test_help_needs_no_torch() -> None:
    script = ("import sys; sys.modules['torch'] = None; sys.argv = ['mask_attention.py', '--help']; "
              f"sys.path.insert(0, {str(ROOT / 'experiments')!r}); import runpy; "
              f"runpy.run_path({str(ROOT / 'experiments' / 'mask_attention.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "export" in proc.stdout and "FlexAttention" in proc.stdout, proc.stderr

