"""Per-step wall time of a training step: eager against ``torch.compile(model, backend="spacefusion")``.

Tiny BERT / LLaMA (the configurations of ``tests/test_training.py``: one layer, hidden 64, batch 2, sequence
16), SGD (lr 0.1), loss = mean of the last hidden state squared (plus the pooler's sum for BERT).  Each run:
``--warmup`` steps (the compile, the first builds), then ``--steps`` timed steps, each one zero_grad, forward,
backward and optimiser step; the median and the mean are printed, with the number of times either stage of the
compiled graph derived its constants again or re-partitioned.  ``--profile`` prints cProfile's top functions
over the timed steps of the compiled run.

    PYTHONPATH=. python experiments/training_step.py --model bert --target llvm
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import sys
import time

import torch


def model_of(name: str) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(1)
    if name == "bert":
        return T.BertModel(T.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=128, vocab_size=100, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0))
    return T.LlamaModel(T.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=100))


def loss_of(run: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = run(input_ids=ids)
    loss = out.last_hidden_state.pow(2).mean()
    pooled = getattr(out, "pooler_output", None)
    return loss + pooled.sum() * 0.1 if pooled is not None else loss


def steps(model: torch.nn.Module, run: torch.nn.Module, n: int, warmup: int,
          profile: cProfile.Profile | None = None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = [torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2 + i)) for i in range(n + warmup)]
    times = []
    for i in range(n + warmup):
        if i == warmup and profile is not None:
            profile.enable()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_of(run, ids[i]).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    if profile is not None:
        profile.disable()
    return times[warmup:]


def main(argv: list[str]) -> None:
    from spacefusion.api import SpaceFusionBackend

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert", choices=["bert", "llama"])
    ap.add_argument("--target", default="llvm", choices=["llvm", "reference"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = model_of(a.model)
    eager = copy.deepcopy(model)
    backend = SpaceFusionBackend(a.target)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    prof = cProfile.Profile() if a.profile else None
    from spacefusion.frontend.compiled import CompiledGraph

    spent: list[float] = []
    refresh = CompiledGraph._refresh

    def timed(self: CompiledGraph, *args: object) -> bool:  # the weights' refresh, timed
        t0 = time.perf_counter()
        try:
            return refresh(self, *args)
        finally:
            spent.append(time.perf_counter() - t0)

    CompiledGraph._refresh = timed
    ours = steps(model, compiled, a.steps, a.warmup, prof)
    CompiledGraph._refresh = refresh
    spent = spent[-2 * a.steps:]  # the timed steps' (a forward's and a backward's each)
    base = steps(eager, eager, a.steps, a.warmup)
    ms = lambda xs: f"median {statistics.median(xs) * 1e3:7.2f} ms, mean {statistics.mean(xs) * 1e3:7.2f} ms"  # noqa: E731
    graph = backend.graphs[0]
    again = [(r.rebuilds, getattr(r, "refreshes", 0)) for r in (graph.forward, graph.backward) if r is not None]
    print(f"{a.model} {a.target}, {a.steps} steps after {a.warmup}, 1 thread")
    print(f"  eager:       {ms(base)}")
    print(f"  spacefusion: {ms(ours)}  (forward, backward: (rebuilds, weight refreshes) {again})")
    print(f"  of which the weights' refresh: {sum(spent) / a.steps * 1e3:.3f} ms a step")
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main(sys.argv[1:])
