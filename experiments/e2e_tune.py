"""Tune every distinct fused subgraph of issue 18's models into one database (part 2's CPU half).

``--runner llvm`` measures on this CPU (small configs: ``--layers``, ``--tiny``); ``--runner offline``
exports one batch per subgraph under ``--out`` for the GPU machine (``spacefusion-measure`` on each
folder) and picks the results up when run again.  The total tuning time is printed.

    python experiments/e2e_tune.py --model bert128 --runner offline --out batches/ --db e2e.db --trials 16
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch

from spacefusion.api import capture, get_hardware, partition
from spacefusion.models import BertConfig, BertModel, LlamaConfig, LlamaModel, ViTConfig, ViTModel
from spacefusion.tuning import LLVMRunner, OfflineBatchRunner, tune_partitions

MODELS = {
    "bert128": (BertModel, BertConfig, lambda m, b: m.example_inputs(b, 128)),
    "bert512": (BertModel, BertConfig, lambda m, b: m.example_inputs(b, 512)),
    "vit": (ViTModel, ViTConfig, lambda m, b: m.example_inputs(b)),
    "llama-prefill": (LlamaModel, LlamaConfig, lambda m, b: m.example_inputs(b, 2048)),
    "llama-decode": (LlamaModel, LlamaConfig, lambda m, b: m.example_inputs(b, 1, past=4095)),
    "llama-gqa-prefill": (LlamaModel, lambda **k: LlamaConfig(**k).gqa(8), lambda m, b: m.example_inputs(b, 2048)),
    "llama-gqa-decode": (LlamaModel, lambda **k: LlamaConfig(**k).gqa(8),
                         lambda m, b: m.example_inputs(b, 1, past=4095)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["bert128"])
    ap.add_argument("--runner", choices=["llvm", "offline"], default="offline")
    ap.add_argument("--out", default="e2e_batches", help="offline: one batch folder per subgraph below it")
    ap.add_argument("--db", default="e2e_tuning.db")
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--layers", type=int, default=1, help="layers per model (identical layers share subgraphs)")
    ap.add_argument("--tiny", action="store_true", help="the tiny configs (for --runner llvm)")
    ap.add_argument("--batch", type=int, default=1, help="batch size (e2e_gpu.py's runs: 8 for BERT and ViT)")
    ap.add_argument("--kinds", nargs="+", default=None,
                    help="tune only subgraphs of these kinds (attention, gemm, stacked_gemm, gated_gemm, norm, "
                         "residual_norm, rope)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    parts = []
    for name in args.model:
        model_cls, config, inputs = MODELS[name]
        with torch.device("meta"):  # shapes only: the partition needs no weights
            cfg = config.tiny(layers=args.layers) if args.tiny and hasattr(config, "tiny") else \
                config(num_hidden_layers=args.layers)
            model = model_cls(cfg)
            if not args.tiny:
                model = model.half()
            x = tuple(t.half() if t.is_floating_point() and not args.tiny else t for t in inputs(model, args.batch))
            part = partition(capture(model, *x).module)
            if args.kinds:
                part = replace(part, subgraphs=tuple(s for s in part.subgraphs if s.kind in args.kinds))
            parts.append(part)
    print(f"captured and partitioned {len(parts)} models in {time.perf_counter() - t0:.1f} s")
    if args.runner == "llvm":
        report = tune_partitions(parts, LLVMRunner(), args.db, target="llvm", trials=args.trials)
    else:
        out = Path(args.out)
        report = tune_partitions(parts, lambda smg: OfflineBatchRunner(out / smg.key[:16]), args.db,
                                 hw=get_hardware("H100"), target="cuda:sm_90a", trials=args.trials,
                                 batch=args.trials)
    print(report)


if __name__ == "__main__":
    main()
