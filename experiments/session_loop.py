"""A user's session over input shapes: BERT-base called at one length after another with torch.compile's
defaults (issue 55), against eager, torch.compile (default: dynamic after its recompile) and
``mode="reduce-overhead"``, in one run.

    python experiments/session_loop.py export art/session          # where TVM is (meta tensors, no GPU)
    python experiments/session_loop.py run art/session --out r.json  # on the GPU (torch + cupy, no TVM)
    python experiments/session_loop.py inplace --out r.json          # on the GPU with TVM there, as a user runs

``inplace`` compiles on the GPU machine itself from an empty kernel cache (``SPACEFUSION_CACHE`` in a new
folder): the pass that compiles then pays each new length's specialisation (first picks, builds) as a user's
session does, and each call's wall time in it is kept (``first_calls_s``) beside torch.compile's recompiles.

``export`` calls the model on the meta device at every length of every loop through
``torch.compile(model, backend=SpaceFusionBackend(..., export_only=True))`` with torch's defaults, so the
kernels are those of the symbolic graph's specialisations (``compiled.PerShape``), and writes each first
pick's CUDA artefact.  ``run`` builds the model with random weights in fp16 on the GPU and, for each system
and loop: one pass over the lengths that compiles (its wall time kept), then ``--passes`` timed passes
(CUDA events around each pass, median), each call's output checked against float32 eager (within twice
eager fp16's own error, the rule of ``dynamo_gpu.py``).  For spacefusion
it also records every call's fusion: the symbolic graph's specialisation for that length, its fused
subgraphs and whether it replays as a CUDA graph (``GraphReport.shapes``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: the issue's loop, and one of lengths of our own (short prompts to long documents, not multiples of 8)
LOOPS: dict[str, list[int]] = {
    "issue": [128, 64, 100, 37, 200, 128, 512, 64],
    "own": [16, 77, 256, 45, 384, 16, 300, 77],
}
BATCH = 8


def build(device: str) -> torch.nn.Module:
    """BERT-base (its config's defaults), random weights (seeded), fp16, eval."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        return transformers.BertModel(transformers.BertConfig()).eval().half()


def ids(length: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(length)
    return torch.randint(0, 30522, (BATCH, length), generator=gen).to(device)


def export(art: Path) -> int:
    from spacefusion.api import CudaBackend, SpaceFusionBackend, first_pick

    torch._dynamo.reset()
    model = build("meta")
    backend = SpaceFusionBackend(CudaBackend(art / "kernels", schedule_for=first_pick, build_missing=True,
                                             load=False), export_only=True)
    compiled = torch.compile(model, backend=backend)  # torch's defaults: dynamic after a recompile
    lengths = list(dict.fromkeys(n for loop in LOOPS.values() for n in loop))
    with torch.no_grad():
        for n in lengths:
            t = time.perf_counter()
            compiled(input_ids=ids(n, "meta"))
            print(f"length {n}: {time.perf_counter() - t:.1f} s", flush=True)
    (art / "partition.txt").write_text(str(backend) + "\n")
    print(backend)
    return 0


def _pass(fn: Any, loop: list[int], inputs: dict[int, torch.Tensor]) -> float:
    """One pass over the loop's lengths, ms (CUDA events around the whole pass)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for n in loop:
        fn(input_ids=inputs[n])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _fused_calls(backend: Any) -> dict[str, Any]:
    """Per Dynamo graph and set of sizes: fused subgraphs, ops left to torch, replayed or not, and how often
    its constants were derived again (a weight seen as changed: each costs about a compile)."""
    out = {}
    for g in backend.graphs:
        shapes = g.shapes or {"static": g}
        for sizes, r in shapes.items():
            p = r.partition
            out[f"graph {g.index} [{sizes}]"] = {
                "fused": len(p.subgraphs) if p else 0, "left": len(p.left) if p else None,
                "skipped": r.skipped, "replayed": r.replayed,
                "rebuilds": r.rebuilds, "rebuilt": r.rebuilt}
    return out


SYSTEMS = ("eager", "torch.compile", "reduce-overhead", "spacefusion")


def run(art: Path | None, out_path: Path, passes: int, loops: list[str] | None = None,
        systems: list[str] | None = None) -> int:
    """Every system over every loop; ``art`` None: spacefusion builds its kernels here (TVM on this machine)."""
    from spacefusion.api import CudaBackend, SpaceFusionBackend

    model = build("cuda")
    ref_model = build("cuda").float()
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "batch": BATCH, "loops": LOOPS, "passes": passes, "systems": {}}
    for loop_name, loop in LOOPS.items():
        if loops and loop_name not in loops:
            continue
        inputs = {n: ids(n, "cuda") for n in loop}
        with torch.no_grad():
            refs = {n: ref_model(input_ids=inputs[n]).last_hidden_state for n in loop}
            # the whole-model rule of dynamo_gpu.py: within twice eager fp16's own error against float32
            eager_err = {n: (model(input_ids=inputs[n]).last_hidden_state.float() - refs[n]).abs().max().item()
                         for n in loop}
        for system in systems or SYSTEMS:  # in the order given
            torch._dynamo.reset()
            backend = None
            if system == "eager":
                fn = model
            elif system == "torch.compile":
                fn = torch.compile(model)
            elif system == "reduce-overhead":
                fn = torch.compile(model, mode="reduce-overhead")
            else:
                backend = SpaceFusionBackend("cuda" if art is None else CudaBackend(art / "kernels"))
                fn = torch.compile(model, backend=backend)
            errors, calls = [], []
            with torch.no_grad():
                t = time.perf_counter()
                for n in loop:  # the pass that compiles, each output checked, each call's wall time kept
                    c = time.perf_counter()
                    err = (fn(input_ids=inputs[n]).last_hidden_state.float() - refs[n]).abs().max().item()
                    calls.append({"length": n, "s": time.perf_counter() - c})
                    errors.append({"length": n, "ok": err <= 2 * eager_err[n], "max_abs_err": err,
                                   "vs_eager_fp16": err / eager_err[n]})
                torch.cuda.synchronize()
                first = time.perf_counter() - t
                _pass(fn, loop, inputs)  # warm
                times = [_pass(fn, loop, inputs) for _ in range(passes)]
            row = {"first_pass_s": first, "first_calls_s": calls, "pass_ms": statistics.median(times),
                   "passes_ms": times, "checks": errors}
            if backend is not None:
                row["fusion"] = _fused_calls(backend)
                row["report"] = str(backend)
            results["systems"].setdefault(loop_name, {})[system] = row
            print(f"{loop_name} {system}: {row['pass_ms']:.2f} ms a pass (first pass {first:.1f} s), "
                  f"all correct: {all(e['ok'] for e in errors)}", flush=True)
            out_path.write_text(json.dumps(results, indent=1))  # after each system: a run cut short keeps them
    out_path.write_text(json.dumps(results, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("export", "run", "inplace"))
    ap.add_argument("art", type=Path, nargs="?", help="the artefacts' folder (export, run)")
    ap.add_argument("--out", type=Path, default=Path("session_loop.json"))
    ap.add_argument("--passes", type=int, default=5, help="timed passes per system and loop (median)")
    ap.add_argument("--loops", nargs="+", choices=tuple(LOOPS), help="only these loops (default: all)")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, help="only these systems, in this order (default: all)")
    args = ap.parse_args(argv)
    if args.phase == "inplace":
        import os
        import tempfile

        os.environ["SPACEFUSION_CACHE"] = tempfile.mkdtemp(prefix="sf-session-")  # cold kernel caches, ours
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-session-")  # and Inductor's
        return run(None, args.out, args.passes, args.loops, args.systems)
    if args.art is None:
        ap.error(f"{args.phase} needs the artefacts' folder")
    if args.phase == "export":
        return export(args.art)
    return run(args.art, args.out, args.passes, args.loops, args.systems)


if __name__ == "__main__":
    raise SystemExit(main())
