"""Per-step wall time of a training step: eager against ``torch.compile(model, backend="spacefusion")``.

Tiny BERT / LLaMA (the configurations of ``tests/test_training.py``: one layer, hidden 64, batch 2, sequence
16), SGD (lr 0.1), loss = mean of the last hidden state squared (plus the pooler's sum for BERT).  Each run:
``--warmup`` steps (the compile, the first builds), then ``--steps`` timed steps, each one zero_grad, forward,
backward and optimiser step; the median and the mean are printed, with the number of times either stage of the
compiled graph derived its constants again or re-partitioned.  ``--profile`` prints cProfile's top functions
over the timed steps of the compiled run.  ``--measure on``: each stage measures its fused path against torch's
ATen graph on its first calls and keeps the faster (``frontend.measure``); the warm-up is then made long enough
for both stages to decide before the timed steps, and the stages' measured lines are printed.

    PYTHONPATH=. python experiments/training_step.py --model bert --target llvm [--measure on]
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
    return loss_of_output(run(input_ids=ids))


def loss_of_output(out: object) -> torch.Tensor:
    """A model output's loss: the mean square of its last hidden state (plus a tenth of the pooler's sum where
    it has one), in float32 whatever the model's dtype (the GPU script's bf16 models are checked against
    float32 on it)."""
    loss = out.last_hidden_state.float().pow(2).mean()
    pooled = getattr(out, "pooler_output", None)
    return loss + pooled.float().sum() * 0.1 if pooled is not None else loss


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
    ap.add_argument("--aot-eager", action="store_true",
                    help="also time torch.compile(backend='aot_eager'): the same ATen graphs through Dynamo and "
                         "aot_autograd, run by torch (what Dynamo's guards and aot's wrappers cost)")
    ap.add_argument("--measure", choices=["default", "on", "off"], default="default",
                    help="the backend's measure option (default: off on the CPU targets)")
    ap.add_argument("--without", action="append", default=[],
                    help="a pattern table row left out (stacked_linears: Q/K/V as three GEMMs, no stacked weight)")
    a = ap.parse_args(argv)
    if a.without:
        import importlib

        partition = importlib.import_module("spacefusion.frontend.partition")  # (the package names a function so)
        partition.ROWS = tuple(r for r in partition.ROWS if r.name not in a.without)
    torch.set_num_threads(1)
    model = model_of(a.model)
    eager = copy.deepcopy(model)
    measure = {"default": None, "on": True, "off": False}[a.measure]
    backend = SpaceFusionBackend(a.target, measure=measure)
    if backend.measuring:  # both stages decide within the warm-up (one call of each stage a step)
        from spacefusion.frontend.measure import SAMPLES, WARMUP

        a.warmup = max(a.warmup, 1 + 2 * (WARMUP + SAMPLES))
    compiled = torch.compile(model, backend=backend, dynamic=False)
    prof = cProfile.Profile() if a.profile else None
    from spacefusion.frontend.compiled import CompiledGraph
    from spacefusion.frontend.derived_epilogues import DerivedActGemmBackward
    from spacefusion.frontend.derived_norms import DerivedNormBackward
    from spacefusion.frontend.fused import FusedKernel
    from spacefusion.frontend.training import DerivedAttentionBackward

    spent: dict[str, list[float]] = {"refresh": [], "kernels": []}
    timed_fns = [(CompiledGraph, "_refresh", "refresh"), (FusedKernel, "forward", "kernels"),
                 (DerivedAttentionBackward, "forward", "kernels"), (DerivedNormBackward, "forward", "kernels"),
                 (DerivedActGemmBackward, "forward", "kernels")]
    originals = [getattr(cls, attr) for cls, attr, _ in timed_fns]

    def timer(fn: object, into: list[float]) -> object:
        def timed(*args: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                into.append(time.perf_counter() - t0)
        return timed

    steps(model, compiled, a.warmup, 0)  # the warm-up: compiles and first builds
    for (cls, attr, what), fn in zip(timed_fns, originals):
        setattr(cls, attr, timer(fn, spent[what]))
    ours = steps(model, compiled, a.steps, 0, prof)
    for (cls, attr, _), fn in zip(timed_fns, originals):
        setattr(cls, attr, fn)
    base = steps(eager, eager, a.steps, a.warmup)
    aot = None
    if a.aot_eager:
        plain = copy.deepcopy(eager)
        aot = steps(plain, torch.compile(plain, backend="aot_eager", dynamic=False), a.steps, a.warmup)
    ms = lambda xs: f"median {statistics.median(xs) * 1e3:7.2f} ms, mean {statistics.mean(xs) * 1e3:7.2f} ms"  # noqa: E731
    graph = backend.graphs[0]
    again = [(r.rebuilds, getattr(r, "refreshes", 0)) for r in (graph.forward, graph.backward) if r is not None]
    print(f"{a.model} {a.target}, {a.steps} steps after {a.warmup}, 1 thread"
          + (f", without {', '.join(a.without)}" if a.without else ""))
    print(f"  eager:       {ms(base)}")
    if aot is not None:
        print(f"  aot_eager:   {ms(aot)}")
    print(f"  spacefusion: {ms(ours)}  (forward, backward: (rebuilds, weight refreshes) {again})")
    for stage, r in (("forward", graph.forward), ("backward", graph.backward)):
        if r is not None and (r.measured or r.measuring):
            print(f"  {stage} {r.measured or 'still measuring'}")
    per_step = {k: sum(v) / a.steps * 1e3 for k, v in spent.items()}
    print(f"  of which the fused kernels' calls {per_step['kernels']:.2f} ms a step, the weights' refresh "
          f"{per_step['refresh']:.2f} ms a step")
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main(sys.argv[1:])
