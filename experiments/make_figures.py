#!/usr/bin/env python3
"""Draw the figures of paper_figures/ from the committed H100 results (needs matplotlib: ``pip install
-e ".[figures]"``), and print the tables paper_figures/README.md carries (``tests/test_figures.py`` checks
them against the results files, so they cannot go stale).

    python experiments/make_figures.py            # writes paper_figures/*.png, prints the tables
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
FIGURES = ROOT / "paper_figures"
sys.path.insert(0, str(ROOT / "experiments"))

#: whole-model systems in the figure's order, with their labels
E2E_SYSTEMS = (("eager", "eager PyTorch"), ("torch.compile", "torch.compile"),
               ("eager+graph", "eager + CUDA graph"), ("torch.compile(reduce-overhead)", "torch.compile (graphs)"),
               ("spacefusion+graph", "spacefusion + CUDA graph"))
E2E_MODELS = (("bert", "BERT-base 8x128"), ("bert512", "BERT-base 8x512"), ("vit", "ViT-B/16 8x197"),
              ("llama", "LLaMA-2-7B 4 layers 1x2048"), ("llama32", "LLaMA-2-7B 32 layers 1x2048"),
              ("llama_decode", "LLaMA-2-7B 32 layers decode, KV 4096"),
              ("llama_gqa_decode", "LLaMA-2-7B GQA (8 KV heads) decode, KV 4096"))


def e2e_speedups() -> dict[str, dict[str, float]]:
    """Per model, each system's speedup over eager PyTorch (HuggingFace-style), from e2e_h100.json."""
    models = json.loads((RESULTS / "e2e_h100.json").read_text())["models"]
    out = {}
    for key, _ in E2E_MODELS:
        t = {k: v["median_us"] for k, v in models[key]["systems"].items() if v.get("status") == "ok"}
        out[key] = {s: t["eager"] / t[s] for s, _ in E2E_SYSTEMS if s in t}
    return out


#: the `transformers` models through TorchDynamo (dynamo_h100.json): systems and models in the figure's order
HF_SYSTEMS = (("eager", "eager PyTorch"), ("torch.compile default", "torch.compile"),
              ("torch.compile reduce-overhead", "torch.compile (reduce-overhead)"),
              ("torch.compile max-autotune", "torch.compile (max-autotune)"),
              ("spacefusion+graph", "spacefusion + CUDA graph"))
HF_MODELS = (("bert_base_8x128", "BERT-base 8x128"), ("bert_base_8x128_padding", "BERT-base 8x128, padding mask"),
             ("bert_base_8x512", "BERT-base 8x512"), ("albert_base_8x128", "ALBERT-base 8x128"),
             ("t5_base_encoder_8x128", "T5-base encoder 8x128"), ("vit_b16_8", "ViT-B/16 batch 8"),
             ("gpt2_4x512", "GPT-2 4x512"), ("llama2_7b_4layers_1x2048", "LLaMA-2-7B 4 layers 1x2048"),
             ("llama2_7b_4layers_decode_1x2048", "LLaMA-2-7B 4 layers, decode at 2048"))
#: the paper's own model set (its 3.54x average over HuggingFace eager)
PAPER_SET = ("bert_base_8x128", "albert_base_8x128", "t5_base_encoder_8x128", "vit_b16_8", "llama2_7b_4layers_1x2048")


def transformers_speedups() -> dict[str, dict[str, float]]:
    """Per `transformers` model, each system's speedup over eager, from dynamo_h100.json (every system there
    was checked against float32 eager before it was timed)."""
    models = json.loads((RESULTS / "dynamo_h100.json").read_text())["models"]
    out = {}
    for key, _ in HF_MODELS:
        us, ok = models[key]["us"], models[key]["check"]
        out[key] = {s: us["eager"] / us[s] for s, _ in HF_SYSTEMS if s in us and ok[s]["ok"]}
    return out


def transformers_table() -> str:
    """Speedups over eager, and spacefusion's over the best of torch.compile's modes (the same rows)."""
    sp = transformers_speedups()
    head = "| model | " + " | ".join(label for _, label in HF_SYSTEMS) + " | spacefusion vs best torch.compile |"
    lines = [head, "|---" * (len(HF_SYSTEMS) + 2) + "|"]
    for key, label in HF_MODELS:
        best = max(v for s, v in sp[key].items() if s.startswith("torch.compile"))
        lines.append(f"| {label} | " + " | ".join(f"{sp[key][s]:.2f}x" for s, _ in HF_SYSTEMS)
                     + f" | {sp[key]['spacefusion+graph'] / best:.2f}x |")
    mean = {s: sum(sp[k][s] for k in PAPER_SET) / len(PAPER_SET) for s, _ in HF_SYSTEMS}
    lines.append("| mean of BERT, ALBERT, T5, ViT, LLaMA (the paper's set) | "
                 + " | ".join(f"{mean[s]:.2f}x" for s, _ in HF_SYSTEMS) + " | |")
    return "\n".join(lines)


def unseen_ratios() -> list[tuple[str, float, float, float]]:
    """(shape, first pick / cuDNN speed, best / cuDNN, best / flash) for the 20 unseen shapes."""
    import unseen_shapes as U

    rows = []
    for name in ("unseen_shapes_h100.json", "unseen_shapes_validation_h100.json"):
        for e in json.loads((RESULTS / name).read_text())["shapes"]:
            m = U.summarize(e)
            rows.append((m["key"], m["first_vs_sdpa_cudnn"], m["best_vs_sdpa_cudnn"], m["best_vs_sdpa_flash"]))
    return rows


#: the subgraph results' baselines: the unfused ops (attention: SDPA's math backend) and the fused libraries
UNFUSED = {"attention": "sdpa-math"}
LIBRARIES = {"attention": ("sdpa-flash", "sdpa-cudnn", "torch.compile")}
MODEL_NAMES = {"bert": "BERT", "vit": "ViT", "llama": "LLaMA", "llama_decode": "LLaMA decode"}


def _subgraph_results() -> dict[str, Any]:
    return json.loads((RESULTS / "e2e_subgraphs_h100.json").read_text())["models"]


def _short(model: str, row: dict[str, Any]) -> str:
    label = row["label"].replace(" float16", "").replace("gated gemm silu(X@Wg)*(X@Wu)", "gated gemm")
    return f"{MODEL_NAMES.get(model, model)}: {label}"


def subgraph_speedups() -> list[dict[str, Any]]:
    """Per distinct subgraph of each model: the times (us) of spacefusion, the unfused ops and the best
    fused library, the speedups over both, and the device-memory bytes (model and ncu)."""
    rows = []
    for model, res in _subgraph_results().items():
        if not res.get("timed", True):
            continue
        for r in res["subgraphs"]:
            t = {k: v["median_us"] for k, v in r.get("systems", {}).items() if v.get("status") == "ok"}
            if "spacefusion" not in t:
                continue
            unfused = t.get(UNFUSED.get(r["kind"], "eager"))
            libs = {k: t[k] for k in LIBRARIES.get(r["kind"], ("torch.compile",)) if k in t}
            lib = min(libs, key=libs.get) if libs else None
            ncu = {k: v.get("ncu") for k, v in r["systems"].items()}
            rows.append({"name": _short(model, r), "uses": r["uses"], "kind": r["kind"], "us": t["spacefusion"],
                         "unfused_us": unfused, "library": lib, "library_us": libs.get(lib),
                         "vs_unfused": unfused / t["spacefusion"] if unfused else None,
                         "vs_library": libs[lib] / t["spacefusion"] if lib else None,
                         "traffic": r.get("traffic"), "ncu": ncu})
    return rows


def _dram(ncu: dict[str, float] | None) -> float | None:
    """Device-memory bytes of one cold run: DRAM reads (ncu flushed the caches) plus what the SMs wrote
    (to L2, on its way to DRAM; ncu's DRAM write counter misses what is still in L2 when a kernel ends)."""
    return None if not ncu else ncu["dram_read_bytes"] + ncu["l2_write_bytes"]


def traffic_rows() -> list[dict[str, Any]]:
    """Per subgraph, the traffic model against ncu: the unfused chain (one kernel per operator, each reading
    its inputs and writing its output) against the unfused ops' device-memory bytes; the fused schedule's
    block footprints (what its blocks read, islpy) against what the SMs read from and wrote to L2; each
    tensor once against the fused kernel's device-memory bytes."""
    out = []
    for model, res in _subgraph_results().items():
        for r in res["subgraphs"]:
            tr, sys_ = r.get("traffic"), r.get("systems", {})
            unf = sys_.get(UNFUSED.get(r["kind"], "eager"), {}).get("ncu")
            fus = sys_.get("spacefusion", {}).get("ncu")
            if not tr or not unf or not fus:
                continue
            out.append({"name": _short(model, r), "model_unfused": tr["unfused_bytes"], "ncu_unfused": _dram(unf),
                        "model_blocks": tr["fused_bytes"], "ncu_l2": fus["l2_read_bytes"] + fus["l2_write_bytes"],
                        "compulsory": tr["compulsory_bytes"], "ncu_fused": _dram(fus),
                        "model_reduction": tr["unfused_bytes"] / tr["compulsory_bytes"],
                        "ncu_reduction": _dram(unf) / _dram(fus)})
    return out


def subgraph_table() -> str:
    lines = ["| subgraph (uses) | spacefusion us | unfused us | best fused library | vs unfused | vs library |",
             "|---|---|---|---|---|---|"]
    for r in subgraph_speedups():
        lines.append(f"| {r['name']} ({r['uses']}) | {r['us']:.1f} | {r['unfused_us']:.1f} | {r['library']} "
                     f"{r['library_us']:.1f} | {r['vs_unfused']:.2f}x | {r['vs_library']:.2f}x |")
    return "\n".join(lines)


def traffic_table() -> str:
    lines = ["| subgraph | unfused MB: model / ncu | fused, each tensor once MB: model / ncu | fused blocks' reads MB: "
             "islpy / ncu L2 | reduction: model / ncu |", "|---|---|---|---|---|"]
    for r in traffic_rows():
        lines.append(f"| {r['name']} | {r['model_unfused'] / 1e6:.1f} / {r['ncu_unfused'] / 1e6:.1f} | "
                     f"{r['compulsory'] / 1e6:.1f} / {r['ncu_fused'] / 1e6:.1f} | {r['model_blocks'] / 1e6:.1f} / "
                     f"{r['ncu_l2'] / 1e6:.1f} | {r['model_reduction']:.2f}x / {r['ncu_reduction']:.2f}x |")
    return "\n".join(lines)


def tuning_times() -> dict[str, dict[str, float]]:
    """Per model, search + build (nvcc included) of its distinct subgraphs' first picks from an empty cubin
    cache on the 2-core machine (tuning_time_cpu.json), and the first whole-model run's (under load)."""
    now = json.loads((RESULTS / "tuning_time_cpu.json").read_text())["models"]
    first = json.loads((RESULTS / "history" / "e2e_h100_first_picks.json").read_text())["models"]
    return {k: {"capture_s": m["capture_s"], "search_s": m["search_s"], "distinct": m["distinct"],
                "before_s": first[k]["manifest"]["search_s"]} for k, m in now.items()}


def e2e_table() -> str:
    sp = e2e_speedups()
    head = "| model | " + " | ".join(label for _, label in E2E_SYSTEMS) + " |"
    lines = [head, "|---" * (len(E2E_SYSTEMS) + 1) + "|"]
    for key, label in E2E_MODELS:
        lines.append(f"| {label} | " + " | ".join(f"{sp[key][s]:.2f}x" if s in sp[key] else "not run"
                                                  for s, _ in E2E_SYSTEMS) + " |")
    return "\n".join(lines)


def _bars(ax: Any, groups: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / len(series)
    for i, (label, vals) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], vals, width, label=label)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, rotation=30, ha="right", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.6)


def _save(fig: Any, ax: Any, name: str) -> Path:
    """Legend, layout and the PNG in paper_figures/ (the figures' common ending)."""
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(FIGURES / name, dpi=120)
    return FIGURES / name


def draw() -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    FIGURES.mkdir(exist_ok=True)
    out = []
    sp = e2e_speedups()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    series = {label: [sp[k].get(s, float("nan")) for k, _ in E2E_MODELS] for s, label in E2E_SYSTEMS}
    _bars(ax, [label for _, label in E2E_MODELS], series)
    ax.set_ylabel("speedup over eager PyTorch")
    ax.set_title("Whole models on the H100 (fp16); paper: 3.54x average over HuggingFace")
    out.append(_save(fig, ax, "e2e_h100.png"))
    hf = transformers_speedups()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    _bars(ax, [label for _, label in HF_MODELS],
          {label: [hf[k].get(s, float("nan")) for k, _ in HF_MODELS] for s, label in HF_SYSTEMS})
    ax.set_ylabel("speedup over eager PyTorch")
    ax.set_title("transformers models through torch.compile(backend='spacefusion') on the H100 (fp16, first picks)")
    out.append(_save(fig, ax, "e2e_transformers_h100.png"))
    rows = unseen_ratios()
    fig, ax = plt.subplots(figsize=(10, 4))
    _bars(ax, [r[0] for r in rows], {"first pick / cuDNN": [r[1] for r in rows],
                                     "best of round / cuDNN": [r[2] for r in rows],
                                     "best of round / FlashAttention-2": [r[3] for r in rows]})
    ax.set_ylabel("speedup (higher is faster)")
    ax.set_title("Attention on shapes nobody hand-tuned, one tuning round each (H100, fp16); "
                 "paper: MHA ~ FlashAttention-2")
    out.append(_save(fig, ax, "attention_unseen_h100.png"))
    if (RESULTS / "e2e_subgraphs_h100.json").is_file():
        out += _draw_subgraphs(plt)
    plt.close("all")
    return out


def _draw_subgraphs(plt: Any) -> list[Path]:
    out = []
    rows = subgraph_speedups()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    _bars(ax, [r["name"] for r in rows],
          {"over the unfused ops (attention: SDPA math)": [r["vs_unfused"] for r in rows],
           "over the best fused library / torch.compile": [r["vs_library"] for r in rows]})
    ax.set_yscale("log")
    ax.set_ylabel("spacefusion speedup (log)")
    ax.set_title("Fused subgraphs of the models, each in a CUDA graph, L2 flushed (H100, fp16)")
    out.append(_save(fig, ax, "subgraphs_h100.png"))
    rows = traffic_rows()
    fig, ax = plt.subplots(figsize=(13, 4.8))
    _bars(ax, [r["name"] for r in rows], {
        "unfused chain, model": [r["model_unfused"] / 1e6 for r in rows],
        "unfused ops, ncu": [r["ncu_unfused"] / 1e6 for r in rows],
        "fused, each tensor once (model)": [r["compulsory"] / 1e6 for r in rows],
        "fused kernel, ncu": [r["ncu_fused"] / 1e6 for r in rows]})
    ax.set_yscale("log")
    ax.set_ylabel("device-memory MB (log)")
    ax.set_title("Device-memory traffic, the traffic model against Nsight Compute (DRAM reads + SM writes; H100)")
    out.append(_save(fig, ax, "traffic_h100.png"))
    tt = tuning_times()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(tt)
    _bars(ax, names, {"first whole-model run (machine busy)": [tt[n]["before_s"] for n in names],
                      "now, empty cubin cache, machine idle": [tt[n]["search_s"] for n in names]})
    ax.lines[0].remove()  # _bars' speedup baseline at 1
    ax.axhline(60, color="black", linewidth=0.6, linestyle="--", label="goal: 60 s")
    ax.set_ylabel("seconds on a 2-core CPU")
    ax.set_title("Search + nvcc of the first picks per model (paper: BERT 68 s, ViT 77 s)")
    out.append(_save(fig, ax, "tuning_time.png"))
    return out


def main() -> int:
    for p in draw():
        print(f"wrote {p.relative_to(ROOT)}")
    print(e2e_table())
    print(transformers_table())
    if (RESULTS / "e2e_subgraphs_h100.json").is_file():
        print(subgraph_table())
        print(traffic_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
