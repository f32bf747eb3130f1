"""experiments/e2e_subgraphs.py on the CPU: a fused subgraph cut out of a captured model is the model's own
unfused ops (same values as the whole model gives), its llvm kernel matches it, and ncu's CSV is read back
per marker."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

from e2e_subgraphs import END, _close, cut, ncu_bytes, systems_of, values_of  # noqa: E402

from spacefusion.frontend import LLVMBackend, capture, partition  # noqa: E402
from spacefusion.models import BertConfig, BertModel, LlamaConfig, LlamaModel  # noqa: E402

BACKEND = LLVMBackend()


def _captured(name: str):
    if name == "bert":
        m = BertModel(BertConfig.tiny(), seed=1)
        x = m.example_inputs(2, 16, seed=2)
    else:
        m = LlamaModel(LlamaConfig.tiny(kv_heads=2), seed=1)
        x = m.example_inputs(1, 16, seed=2)
    cap = capture(m.eval(), *x)
    return cap.module, cap.args, partition(cap.module)


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_cut_subgraphs_are_the_models_own_ops(name: str) -> None:
    gm, args, part = _captured(name)
    cuts = {k: cut(gm, subs[0]) for k, subs in part.distinct.items()}
    results = {r.node for subs in part.distinct.values() for r in subs[0].results}
    with torch.no_grad():
        vals = values_of(gm, args, {n for _, ins in cuts.values() for n in ins} | results)
        kinds = set()
        for key, subs in part.distinct.items():
            mod, ins = cuts[key]
            got = mod(*(vals[n] for n in ins))
            assert len(got) == len(subs[0].results)
            for g, r in zip(got, subs[0].results):
                torch.testing.assert_close(g, vals[r.node], rtol=0, atol=0)  # the very same ops
            systems, ins2 = systems_of(subs[0], gm, BACKEND.compile(subs[0].smg), use_compile=False)
            assert ins2 == ins and "spacefusion" in systems
            a = tuple(vals[n] for n in ins)
            ref = (systems.get("eager") or systems["sdpa-math"])(*a)
            assert _close(systems["spacefusion"](*a), ref) < 1e-3
            kinds.add(subs[0].kind)
    assert {"attention", "gemm"} <= kinds


def test_close_refuses_a_wrong_kernel() -> None:
    ref = (torch.ones(4, 4),)
    with pytest.raises(ValueError, match="max abs error"):
        _close((torch.ones(4, 4) * 2,), ref)


def test_ncu_bytes_per_marker(tmp_path: Path) -> None:
    rows = [
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"',
    ]

    def add(i: int, kernel: str, metric: str, unit: str, value: str) -> None:
        rows.append(f'"{i}","1","python3","h","{kernel}","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0",'
                    f'"Command line profiler metrics","{metric}","{unit}","{value}"')

    w = "lts__t_sectors_srcunit_tex_op_write.sum"
    add(0, "sf_mark_0", "dram__bytes_read.sum", "byte", "0")
    add(1, "sf_attention_ab", "dram__bytes_read.sum", "Mbyte", "1.5")
    add(1, "sf_attention_ab", w, "sector", "16")
    add(2, f"sf_mark_{END}", "dram__bytes_read.sum", "byte", "0")
    add(3, "warm_up_kernel_of_the_next", "dram__bytes_read.sum", "byte", "77")
    add(4, "sf_mark_1", "dram__bytes_read.sum", "byte", "0")
    for i in (5, 6):
        add(i, "ampere_gemm", "dram__bytes_read.sum", "byte", "1,000")
        add(i, "ampere_gemm", w, "sector", "10")
    add(7, f"sf_mark_{END}", "dram__bytes_read.sum", "byte", "0")
    path = tmp_path / "ncu.csv"
    path.write_text("==PROF== Connected\n" + "\n".join(rows) + "\n")
    legend = [{"marker": 0, "key": "k1", "system": "spacefusion"}, {"marker": 1, "key": "k1", "system": "eager"}]
    got = ncu_bytes(path, legend)
    assert got[("k1", "spacefusion")] == {"dram_read_bytes": 1.5e6, "l2_read_bytes": 0.0, "l2_write_bytes": 512.0,
                                          "kernels": 1}
    assert got[("k1", "eager")] == {"dram_read_bytes": 2000.0, "l2_read_bytes": 0.0, "l2_write_bytes": 640.0,
                                    "kernels": 2}
