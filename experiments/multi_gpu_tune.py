"""Tuning a model on one GPU against all of the host's GPUs (issue 61): wall-clock, per-GPU utilisation, bests.

    python experiments/multi_gpu_tune.py --models bert_base_8x128 --trials 16 \\
        --out experiments/results/multi_gpu_tune_h100.json                     # on a multi-GPU machine with TVM

Captures every distinct fused SMG of the models (``dynamo_gpu.build`` on the meta device, as ``spacefusion.compile``
partitions them), then tunes them all from an empty database once per GPU count of ``--gpus`` (default: 1 and
every visible GPU) with ``runners.gpu_runner`` -- one GPU measured in this process, as before; several with one
worker per GPU (Ray where installed, else a subprocess per GPU), several SMGs side by side and the artefacts
built here -- and records per run: the wall-clock of the tune, each GPU's utilisation
sampled by ``nvidia-smi`` every 0.5 s (mean, max, share of samples busy), how many candidates each worker
measured, and each SMG's best (schedule key and µs).  The JSON's ``compare`` says, per SMG, whether the runs
found the same best and the ratio of their bests; the speed-up is the 1-GPU run's wall-clock over each other's.

``--cpu N`` runs the same comparison on this CPU instead (llvm, 1 and N worker processes; no utilisation):
how the script is tested without a GPU.  Results go to ``--out`` only; the databases to a temporary folder
(``--keep DIR`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

FORMAT = "spacefusion-multi-gpu-tune/1"


def _llvm_runner() -> Any:
    from spacefusion.tuning import LLVMRunner

    return LLVMRunner(repeats=3)


#: what each ``--cpu`` worker measures with (an importable factory: the workers are processes)
CPU_INNER: Any = _llvm_runner


class Utilisation:
    """``nvidia-smi`` sampling every GPU's utilisation every ``period_ms`` in a thread, between ``start`` and
    ``stop``; where there is no ``nvidia-smi`` it samples nothing (``available`` False)."""

    def __init__(self, period_ms: int = 500) -> None:
        self.period_ms = period_ms
        self.samples: dict[str, list[float]] = {}
        self.proc: subprocess.Popen[str] | None = None
        self.thread: threading.Thread | None = None
        self.available = shutil.which("nvidia-smi") is not None

    def start(self) -> None:
        if not self.available:
            return
        query = ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits"]
        self.proc = subprocess.Popen([*query, f"-lms={self.period_ms}"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[1].replace(".", "", 1).isdigit():
                self.samples.setdefault(parts[0], []).append(float(parts[1]))

    def stop(self) -> dict[str, dict[str, float]]:
        """Per GPU (nvidia-smi's index): mean and max utilisation in %, the share of samples above 0, samples."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
        if self.thread is not None:
            self.thread.join(timeout=5)
        return {gpu: {"mean_pct": round(sum(xs) / len(xs), 1), "max_pct": max(xs),
                      "busy_share": round(sum(x > 0 for x in xs) / len(xs), 3), "samples": len(xs)}
                for gpu, xs in sorted(self.samples.items()) if xs}


def capture(models: list[str]) -> list[Any]:
    """The partitions of each model as ``spacefusion.compile`` makes them (meta tensors: nothing runs)."""
    import torch
    from dynamo_gpu import build

    from spacefusion.tuning import captured_partitions

    parts = []
    for name in models:
        torch._dynamo.reset()
        model, x = build(name, "meta")
        parts += captured_partitions(model, **x)
    return parts


def toy_partitions() -> list[Any]:
    """The ``--cpu`` comparison's model: a Linear + GELU + LayerNorm block's two SMGs (a GEMM with its epilogue,
    the LayerNorm), as one partition (built directly: nothing to capture)."""
    from spacefusion.api import Partition, Subgraph, patterns

    smgs = [patterns.gemm_epilogue(32, 128, 64, "gelu", True), patterns.layernorm(32, 128)]
    return [Partition(tuple(Subgraph("toy", g.name, (), g, (), ()) for g in smgs), ())]


def one_run(parts: list[Any], n: int, cpu: bool, db: Path, trials: int, batch: int, workers: int,
            engine: str) -> dict[str, Any]:
    """Tune ``parts`` from the empty database ``db`` on ``n`` GPUs (or ``n`` llvm worker processes)."""
    from spacefusion.tuning import ProcessRunner, TuningDatabase, gpu_runner, tune_partitions

    if cpu:
        from spacefusion.api import CPU_STAND_IN

        runner: Any = ProcessRunner(workers=n, inner=CPU_INNER)
        hw, target = CPU_STAND_IN, "llvm"
    else:
        import torch

        from spacefusion.api import device_hardware

        runner = gpu_runner(gpus=n, engine=engine)
        major, minor = torch.cuda.get_device_capability()
        hw, target = device_hardware(), f"cuda:sm_{major}{minor}{'a' if major == 9 else ''}"
    connect = getattr(runner, "connect", None)
    if callable(connect):
        connect()  # the workers' start is not the tune's time
    util = Utilisation()
    util.start()
    t0 = time.perf_counter()
    try:
        report = tune_partitions(parts, runner, db, hw=hw, target=target, trials=trials, batch=batch,
                                 workers=workers, progress=False)
    finally:
        wall = time.perf_counter() - t0
        usage = util.stop()
        close = getattr(runner, "close", None)
        if callable(close):
            close()
    per_worker: Counter[str] = Counter()
    subgraphs = []
    with TuningDatabase(db, readonly=True) as d:
        for t in report.tuned:
            s = t.summary
            for _, r in d.records(s.key):
                per_worker[str(dict(r.meta).get("worker") or "this process")] += 1
            subgraphs.append({"label": t.label, "uses": t.uses, "key": s.key, "measured": s.measured,
                              "failed": s.failed, "wall_s": round(s.wall_s, 2),
                              "best": None if s.best is None else s.best.key,
                              "best_us": None if s.best_us is None else round(s.best_us, 3)})
    return {"workers": n, "engine": type(runner).__name__, "wall_s": round(wall, 2), "utilisation": usage,
            "candidates_per_worker": dict(sorted(per_worker.items())), "subgraphs": subgraphs}


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each run against the first: speed-up (wall-clock ratio) and, per SMG, the same best or the ratio of bests."""
    base = runs[0]
    out = []
    for run in runs[1:]:
        rows, same = [], 0
        by_key = {s["key"]: s for s in run["subgraphs"]}
        for s in base["subgraphs"]:
            o = by_key.get(s["key"])
            if o is None:
                continue
            same += s["best"] == o["best"]
            ratio = (o["best_us"] / s["best_us"]) if s["best_us"] and o["best_us"] else None
            rows.append({"label": s["label"], "same_best": s["best"] == o["best"],
                         "best_us": [s["best_us"], o["best_us"]], "ratio": None if ratio is None else round(ratio, 4)})
        ratios = [r["ratio"] for r in rows if r["ratio"]]
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else None
        out.append({"workers": [base["workers"], run["workers"]],
                    "speedup": round(base["wall_s"] / run["wall_s"], 3) if run["wall_s"] else None,
                    "same_best": same, "subgraphs": len(rows),
                    "best_ratio_geomean": None if geo is None else round(geo, 4), "per_subgraph": rows})
    return {"runs": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["bert_base_8x128"], help="dynamo_gpu.MODELS names")
    ap.add_argument("--gpus", nargs="+", type=int, default=None,
                    help="the GPU counts to compare (default: 1 and every visible GPU)")
    ap.add_argument("--cpu", type=int, default=None, metavar="N",
                    help="compare 1 and N llvm worker processes on this CPU instead, on a toy block (no GPU)")
    ap.add_argument("--trials", type=int, default=16, help="candidates per SMG")
    ap.add_argument("--batch", type=int, default=16, help="candidates per round")
    ap.add_argument("--workers", type=int, default=None, help="build processes (default: the CPU cores)")
    ap.add_argument("--engine", default="auto", choices=("auto", "ray", "processes"), help="how GPU workers start")
    ap.add_argument("--keep", type=Path, default=None, help="keep the tuning databases in this folder")
    ap.add_argument("--out", type=Path, required=True, help="the results JSON")
    a = ap.parse_args(argv)
    from spacefusion.tuning import cpu_cores, visible_gpus

    cpu = a.cpu is not None
    if cpu:
        counts, device, parts = [1, a.cpu], "cpu", toy_partitions()
    else:
        gpus = visible_gpus()
        if not gpus:
            print("multi_gpu_tune: no GPU visible here (--cpu N compares worker processes on the CPU)",
                  file=sys.stderr)
            return 2
        counts = a.gpus or sorted({1, len(gpus)})
        import torch

        device = torch.cuda.get_device_name(0)
        parts = capture(a.models)
    folder = Path(tempfile.mkdtemp(prefix="sf-multi-gpu-")) if a.keep is None else a.keep
    folder.mkdir(parents=True, exist_ok=True)
    runs = []
    for n in counts:
        db = folder / f"tune_{n}.db"
        if db.exists():
            print(f"multi_gpu_tune: {db} exists; each run starts from an empty database", file=sys.stderr)
            return 2
        run = one_run(parts, n, cpu, db, a.trials, a.batch, a.workers or cpu_cores(), a.engine)
        print(f"{n} {'workers' if cpu else 'GPUs'}: {run['wall_s']} s, {len(run['subgraphs'])} SMGs, "
              f"candidates per worker {run['candidates_per_worker']}", flush=True)
        runs.append(run)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, check=False).stdout.strip() or None
    except OSError:
        commit = None
    result = {"format": FORMAT, "device": device, "visible": counts[-1] if cpu else len(visible_gpus()),
              "models": ["toy block"] if cpu else a.models, "trials": a.trials, "batch": a.batch, "commit": commit,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs, "compare": compare(runs)}
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    if a.keep is None:
        shutil.rmtree(folder, ignore_errors=True)
    for c in result["compare"]["runs"]:
        print(f"{c['workers'][0]} -> {c['workers'][1]}: {c['speedup']}x faster; the same best on {c['same_best']} of "
              f"{c['subgraphs']} SMGs, bests' ratio {c['best_ratio_geomean']} (geomean)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
