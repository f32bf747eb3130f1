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
E2E_MODELS = (("bert", "BERT-base 8x128"), ("vit", "ViT-B/16 8x197"), ("llama", "LLaMA-2-7B 4 layers 1x2048"))


def e2e_speedups() -> dict[str, dict[str, float]]:
    """Per model, each system's speedup over eager PyTorch (HuggingFace-style), from e2e_h100.json."""
    models = json.loads((RESULTS / "e2e_h100.json").read_text())["models"]
    out = {}
    for key, _ in E2E_MODELS:
        t = {k: v["median_us"] for k, v in models[key]["systems"].items() if v.get("status") == "ok"}
        out[key] = {s: t["eager"] / t[s] for s, _ in E2E_SYSTEMS if s in t}
    return out


def unseen_ratios() -> list[tuple[str, float, float, float]]:
    """(shape, first pick / cuDNN speed, best / cuDNN, best / flash) for the 20 unseen shapes."""
    import unseen_shapes as U

    rows = []
    for name in ("unseen_shapes_h100.json", "unseen_shapes_validation_h100.json"):
        for e in json.loads((RESULTS / name).read_text())["shapes"]:
            m = U.summarize(e)
            rows.append((m["key"], m["first_vs_sdpa_cudnn"], m["best_vs_sdpa_cudnn"], m["best_vs_sdpa_flash"]))
    return rows


def e2e_table() -> str:
    sp = e2e_speedups()
    head = "| model | " + " | ".join(label for _, label in E2E_SYSTEMS) + " |"
    lines = [head, "|---" * (len(E2E_SYSTEMS) + 1) + "|"]
    for key, label in E2E_MODELS:
        lines.append(f"| {label} | " + " | ".join(f"{sp[key][s]:.2f}x" for s, _ in E2E_SYSTEMS) + " |")
    return "\n".join(lines)


def _bars(ax: Any, groups: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / len(series)
    for i, (label, vals) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], vals, width, label=label)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, rotation=30, ha="right", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.6)


def draw() -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    FIGURES.mkdir(exist_ok=True)
    out = []
    sp = e2e_speedups()
    fig, ax = plt.subplots(figsize=(8, 4))
    series = {label: [sp[k][s] for k, _ in E2E_MODELS] for s, label in E2E_SYSTEMS}
    _bars(ax, [label for _, label in E2E_MODELS], series)
    ax.set_ylabel("speedup over eager PyTorch")
    ax.set_title("Whole models on the H100 (fp16); paper: 3.54x average over HuggingFace")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.append(FIGURES / "e2e_h100.png")
    fig.savefig(out[-1], dpi=120)
    rows = unseen_ratios()
    fig, ax = plt.subplots(figsize=(10, 4))
    _bars(ax, [r[0] for r in rows], {"first pick / cuDNN": [r[1] for r in rows],
                                     "best of round / cuDNN": [r[2] for r in rows],
                                     "best of round / FlashAttention-2": [r[3] for r in rows]})
    ax.set_ylabel("speedup (higher is faster)")
    ax.set_title("Attention on shapes nobody hand-tuned, one tuning round each (H100, fp16); "
                 "paper: MHA ~ FlashAttention-2")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.append(FIGURES / "attention_unseen_h100.png")
    fig.savefig(out[-1], dpi=120)
    plt.close("all")
    return out


def main() -> int:
    for p in draw():
        print(f"wrote {p.relative_to(ROOT)}")
    print(e2e_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
