"""Partition the real configs (issue 18's models) and print what is fused and what torch keeps.

Models are built on the meta device (no memory, no compute: shapes only), in fp16, so even the 32-layer
LLaMA-2-7B stack partitions in seconds on this machine.

    python experiments/e2e_partition.py [--json out.json] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from spacefusion.api import capture, partition
from spacefusion.models import BertConfig, BertModel, LlamaConfig, LlamaModel, ViTConfig, ViTModel


def cases(layers: int | None):
    def n(c):
        from dataclasses import replace

        return replace(c, num_hidden_layers=layers) if layers else c

    yield "bert-base seq128", BertModel(n(BertConfig())), lambda m: m.example_inputs(1, 128)
    yield "bert-base seq512", BertModel(n(BertConfig())), lambda m: m.example_inputs(1, 512)
    yield "vit-b/16 197 tokens", ViTModel(n(ViTConfig())), lambda m: m.example_inputs(1)
    for kv in (32, 8):
        c = n(LlamaConfig()).gqa(kv)
        yield f"llama-2-7b kv{kv} prefill 2048", LlamaModel(c), lambda m: m.example_inputs(1, 2048)
        yield f"llama-2-7b kv{kv} decode kv 4096", LlamaModel(c), lambda m: m.example_inputs(1, 1, past=4095)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default=None)
    ap.add_argument("--layers", type=int, default=None, help="override every model's layer count")
    args = ap.parse_args()
    out = {}
    with torch.device("meta"):
        for name, model, inputs in cases(args.layers):
            t0 = time.perf_counter()
            model = model.half()
            x = tuple(t.half() if t.is_floating_point() else t for t in inputs(model))
            p = partition(capture(model, *x).module)
            print(f"== {name} ({time.perf_counter() - t0:.1f} s)\n{p}\n")
            out[name] = {"subgraphs": dict(p.counts()), "distinct": len(p.distinct),
                         "distinct_labels": [s[0].label for s in p.distinct.values()],
                         "left": dict(p.left_reasons())}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
