"""Measurement runners: build each candidate, check it against the unfused numpy reference, then time it.

All runners implement ``search.records.Runner``: ``measure(inputs)`` gives one ``MeasureResult`` per
input, in order, and never raises for a bad candidate (build failures, wrong numerics, launch errors
become results with ``error``).  Numerics come first: a kernel that computes the wrong thing is never
timed, so the tuner can never prefer a fast wrong kernel.

* ``LLVMRunner``      TVM llvm on this CPU; what CI uses to exercise the whole tuning loop.
* ``LocalGPURunner``  TVM CUDA artefact run through ``spacefusion.runtime`` on a local GPU.
* ``OfflineBatchRunner`` / ``export_batch`` / ``import_batch``
                      the remote-GPU flow: export artefacts + manifest here (TVM), run
                      ``experiments/measure_batch.py`` on the GPU machine (no TVM), import its results.
* ``RayRunner``       spreads candidates over a Ray cluster, each worker running an inner runner.

TVM, torch, cupy and ray are imported lazily, so this module imports on any machine.
"""

from __future__ import annotations

import importlib.util
import json
import math
import platform
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from schedulers.schedule import Schedule
from search.records import RECORD_FORMAT, MeasureInput, MeasureResult
from smg.ir import SMG
from smg.reference import check_numerics, evaluate, random_inputs
from smg.serialize import smg_to_dict

MANIFEST_FORMAT = "spacefusion-batch/1"
RESULTS_FORMAT = "spacefusion-batch-results/1"
MANIFEST_FILE = "manifest.json"
RESULTS_FILE = "results.json"


# ---- numerics ---------------------------------------------------------------------------------


class _References:
    """Seeded inputs and float64 reference outputs, computed once per workload (SMG key) and seed."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int], tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = {}

    def get(self, smg: SMG, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        key = (smg.key, seed)
        if key not in self._cache:
            x = random_inputs(smg, seed)
            self._cache[key] = (x, evaluate(smg, x))
        return self._cache[key]


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _fail(inp: MeasureInput, error: str, meta: Mapping[str, Any] | None = None,
          max_abs_err: float | None = None) -> MeasureResult:
    return MeasureResult(inp.key, inp.target, (), max_abs_err, error, tuple(sorted((meta or {}).items())))


def _ok(inp: MeasureInput, latencies_us: Sequence[float], max_abs_err: float | None,
        meta: Mapping[str, Any]) -> MeasureResult:
    return MeasureResult(inp.key, inp.target, tuple(float(x) for x in latencies_us), max_abs_err, None,
                         tuple(sorted(meta.items())))


def build_candidate(schedule: Schedule, target: str) -> Any:
    """Lower ``schedule`` with TVM (``spacefusion.api.build``); the one seam tests monkeypatch."""
    from spacefusion.api import build

    return build(schedule, target)


def _target_kind(target: str) -> str:
    from spacefusion.lower.build import parse_target

    return parse_target(target)[0]


def _prepare(inp: MeasureInput, kind: str, refusal: str, refs: Any, seed: int,
             meta: Mapping[str, Any]) -> tuple[Any, Any] | MeasureResult:
    """(inputs, numpy reference) for ``inp``, or the failed result that says why not (a target of
    another kind, an unknown target, a reference that cannot be computed)."""
    try:
        if _target_kind(inp.target) != kind:
            return _fail(inp, f"target: {refusal}, got {inp.target!r}", meta)
    except Exception as exc:
        return _fail(inp, f"target: {_describe(exc)}", meta)
    try:
        return refs.get(inp.schedule.smg, seed)
    except Exception as exc:
        return _fail(inp, f"reference: {_describe(exc)}", meta)


# ---- LLVM (CPU) ---------------------------------------------------------------------------------


class LLVMRunner:
    """Builds with TVM's llvm backend and times on this CPU with ``time.perf_counter``.

    Each latency is one call of the compiled function on pre-bound TVM tensors (no host copies), after
    ``warmup`` untimed calls.  CPU latencies say nothing about GPU speed; this runner exists so the
    tuning loop (build -> check -> time -> record) runs, and is tested, on machines without a GPU.
    """

    name = "llvm"

    def __init__(self, repeats: int = 5, warmup: int = 1, seed: int = 0) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.repeats, self.warmup, self.seed = repeats, warmup, seed
        self._refs = _References()

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        return [self._one(inp) for inp in inputs]

    def _one(self, inp: MeasureInput) -> MeasureResult:
        meta: dict[str, Any] = {"runner": self.name, "warmup": self.warmup, "repeats": self.repeats,
                                "seed": self.seed, "device": f"cpu ({platform.machine()})"}
        got = _prepare(inp, "llvm", f"{self.name} runner measures target 'llvm' only", self._refs, self.seed, meta)
        if isinstance(got, MeasureResult):
            return got
        x, ref = got
        s = inp.schedule
        t0 = time.perf_counter()
        try:
            kernel = build_candidate(s, inp.target)
        except Exception as exc:
            return _fail(inp, f"build: {_describe(exc)}", meta)
        meta["build_s"] = round(time.perf_counter() - t0, 4)
        try:
            got = kernel(x)
        except Exception as exc:
            return _fail(inp, f"run: {_describe(exc)}", meta)
        err, problem = check_numerics(s.smg, ref, got)
        if problem is not None:
            return _fail(inp, problem, meta, err)
        try:
            fn = _cpu_launcher(kernel, x)
            for _ in range(self.warmup):
                fn()
            lat = []
            for _ in range(self.repeats):
                t = time.perf_counter()
                fn()
                lat.append((time.perf_counter() - t) * 1e6)
        except Exception as exc:
            return _fail(inp, f"timing: {_describe(exc)}", meta, err)
        return _ok(inp, lat, err, meta)


def _cpu_launcher(kernel: Any, inputs: Mapping[str, np.ndarray]) -> Callable[[], object]:
    """A zero-argument call of the kernel on tensors bound once, so timing excludes numpy<->TVM copies.

    Anything that is not a ``CpuKernel`` (e.g. a test double) is simply called on the numpy inputs.
    """
    from spacefusion.lower.build import CpuKernel

    if not isinstance(kernel, CpuKernel):
        return lambda: kernel(inputs)
    import tvm

    smg = kernel.schedule.smg
    args = [tvm.runtime.tensor(np.ascontiguousarray(inputs[n], dtype=smg.space(n).dtype)) for n in smg.inputs]
    args += [tvm.runtime.tensor(np.zeros(smg.shape(n), smg.space(n).dtype)) for n in smg.outputs]
    main = kernel.module["main"]
    return lambda: main(*args)


# ---- local GPU ----------------------------------------------------------------------------------


def gpu_unavailable_reason() -> str | None:
    """Why this process cannot run CUDA kernels (None when it can): torch, cupy and a visible GPU."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed"
    return None


class LocalGPURunner:
    """Builds the CUDA artefact with TVM and runs it through ``spacefusion.runtime`` on a local GPU.

    Needs TVM *and* a GPU in the same process; with a remote GPU use the offline batch flow instead.
    ``latencies_us`` holds one value, the median of ``iters`` CUDA-event timings from
    ``timing.time_cuda`` (the same timer as every other benchmark); p10/p90 are in ``meta``.
    Without a usable GPU every result is an error naming what is missing.
    """

    name = "cuda-local"

    def __init__(self, warmup: int = 10, iters: int = 100, flush_l2: bool = True, seed: int = 0,
                 workdir: str | Path | None = None) -> None:
        self.warmup, self.iters, self.flush_l2, self.seed = warmup, iters, flush_l2, seed
        self.workdir = None if workdir is None else Path(workdir)
        self._refs = _References()

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        reason = gpu_unavailable_reason()
        if reason is not None:
            msg = (f"no GPU: {reason}; {self.name} runner needs torch + cupy with a CUDA device "
                   "(use OfflineBatchRunner for a remote GPU)")
            return [_fail(inp, msg, {"runner": self.name}) for inp in inputs]
        with tempfile.TemporaryDirectory(prefix="sf-measure-") as tmp:
            root = self.workdir or Path(tmp)
            return [self._one(inp, root) for inp in inputs]

    def _one(self, inp: MeasureInput, root: Path) -> MeasureResult:
        import torch

        from spacefusion.runtime import artefact as art_mod
        from spacefusion.runtime import gpu, timing

        meta: dict[str, Any] = {"runner": self.name, "warmup": self.warmup, "iters": self.iters,
                                "flush_l2": self.flush_l2, "seed": self.seed,
                                "device": torch.cuda.get_device_name()}
        got = _prepare(inp, "cuda", f"{self.name} runner measures CUDA targets", self._refs, self.seed, meta)
        if isinstance(got, MeasureResult):
            return got
        x, ref = got
        s = inp.schedule
        t0 = time.perf_counter()
        try:
            folder = build_candidate(s, inp.target).save(root / f"{inp.key}-{inp.target.replace(':', '_')}")
            kernel = gpu.CudaKernel(art_mod.KernelArtefact.load(folder))
            meta["backend"] = kernel.compile()
        except Exception as exc:
            return _fail(inp, f"build: {_describe(exc)}", meta)
        meta["build_s"] = round(time.perf_counter() - t0, 4)
        try:
            art = kernel.artefact
            dev_in = {p.name: torch.from_numpy(np.ascontiguousarray(x[p.name])).to("cuda") for p in art.inputs}
            outs = {p.name: torch.full(p.shape, math.nan, dtype=gpu.torch_dtype(p.dtype), device="cuda")
                    for p in art.outputs}  # NaN: an element the kernel never writes fails the check
            kernel.launch(dev_in, outs)
            torch.cuda.synchronize()
            got = {n: t.double().cpu().numpy() for n, t in outs.items()}
        except Exception as exc:
            return _fail(inp, f"run: {_describe(exc)}", meta)
        err, problem = check_numerics(s.smg, ref, got)
        if problem is not None:
            return _fail(inp, problem, meta, err)
        try:
            t = timing.time_cuda(lambda: kernel.launch(dev_in, outs), warmup=self.warmup, iters=self.iters,
                                 flush_l2=self.flush_l2)
        except Exception as exc:
            return _fail(inp, f"timing: {_describe(exc)}", meta, err)
        meta.update(p10_us=t.p10_us, p90_us=t.p90_us)
        return _ok(inp, [t.median_us], err, meta)


# ---- offline batch (remote GPU) -----------------------------------------------------------------


def export_batch(inputs: Sequence[MeasureInput], folder: str | Path, seed: int = 0, cubin: bool = True) -> Path:
    """Write one CUDA artefact folder per candidate plus ``manifest.json``; return the folder.

    Artefact folders are named by schedule key (``<key>-<arch>`` if one schedule is exported for two
    archs).  Every input gets a manifest entry, in order; one that fails to lower carries its ``error``
    instead of an artefact, so the GPU script reports it and every input still gets a result back.
    The manifest holds the schedule JSON and the workload SMG as plain data, so the GPU machine can
    rebuild the reference without TVM.  ``cubin=False`` skips nvcc (the GPU machine then compiles).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    names: dict[tuple[str, str], str] = {}
    for i, inp in enumerate(inputs):
        s = inp.schedule
        entry: dict[str, Any] = {"index": i, "schedule_key": inp.key, "target": inp.target, "artefact": None,
                                 "schedule": s.to_dict(), "workload": smg_to_dict(s.smg),
                                 "workload_key": s.smg.key, "seed": seed, "error": None}
        try:
            if _target_kind(inp.target) != "cuda":
                raise ValueError(f"offline batches hold CUDA artefacts; target {inp.target!r} is not CUDA")
            art = build_candidate(s, inp.target)
            arch = art.meta["arch"]
            name = names.get((inp.key, arch))
            if name is None:
                name = inp.key if inp.key not in {k for k, _ in names} else f"{inp.key}-{arch}"
                t0 = time.perf_counter()
                art.save(folder / name, compile_cubin=cubin)
                entry["build_s"] = round(time.perf_counter() - t0, 4)
                names[(inp.key, arch)] = name
            entry["artefact"] = name
        except Exception as exc:
            entry["error"] = f"build: {_describe(exc)}"
        entries.append(entry)
    manifest = {"format": MANIFEST_FORMAT, "record_format": RECORD_FORMAT, "seed": seed,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "candidates": entries}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return folder


def import_batch(results_json: str | Path) -> list[MeasureResult]:
    """Read what ``experiments/measure_batch.py`` wrote (or a bare list of records), validating every record.

    A malformed file raises ValueError naming the file and, for a bad record, its position (a missing
    file raises FileNotFoundError).
    """
    path = Path(results_json)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict):
        if data.get("format") != RESULTS_FORMAT or not isinstance(data.get("results"), list):
            raise ValueError(f"{path}: not a measure_batch results file (expected format {RESULTS_FORMAT!r} "
                             f"and a 'results' list, got format {data.get('format')!r})")
        records = data["results"]
    elif isinstance(data, list):
        records = data
    else:
        raise ValueError(f"{path}: expected a results object or a list of records, got {type(data).__name__}")
    out = []
    for i, rec in enumerate(records):
        try:
            out.append(MeasureResult.from_dict(rec))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: record {i} is malformed: {_describe(exc)}") from None
    return out


class OfflineBatchRunner:
    """The remote-GPU flow as a runner: export here, measure on the GPU machine, import back.

    Two-step use::

        runner = OfflineBatchRunner("batch/")
        runner.export(inputs)                 # artefacts + manifest.json (needs TVM)
        #   on the GPU machine:  python experiments/measure_batch.py batch/ --out batch/results.json
        results = runner.collect(inputs)      # reads batch/results.json, in the order of ``inputs``

    As a ``Runner`` in a tuning loop, ``measure(inputs)`` returns the imported results when
    ``results.json`` in the folder already covers every input (so re-running the tuner after the GPU run
    picks them up); otherwise it exports and returns *pending* error results (``meta["pending"]``)
    saying what to run, rather than blocking or raising.
    """

    name = "cuda-offline"

    def __init__(self, folder: str | Path, seed: int = 0, cubin: bool = True) -> None:
        self.folder, self.seed, self.cubin = Path(folder), seed, cubin

    @property
    def results_path(self) -> Path:
        return self.folder / RESULTS_FILE

    def command(self) -> str:
        return f"python experiments/measure_batch.py {self.folder} --out {self.results_path}"

    def export(self, inputs: Sequence[MeasureInput]) -> Path:
        return export_batch(inputs, self.folder, seed=self.seed, cubin=self.cubin)

    def collect(self, inputs: Sequence[MeasureInput], results_json: str | Path | None = None) -> list[MeasureResult]:
        """Results for ``inputs`` in their order; an input with no record gets an error result."""
        path = Path(results_json) if results_json is not None else self.results_path
        found = {(r.schedule_key, r.target): r for r in import_batch(path)}
        return [found.get((inp.key, inp.target)) or _fail(inp, f"missing: no record for this candidate in {path}",
                                                             {"runner": self.name})
                for inp in inputs]

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        note = ""
        if self.results_path.is_file():
            try:
                done = {(r.schedule_key, r.target): r for r in import_batch(self.results_path)}
            except ValueError as exc:
                done, note = {}, f"; the existing results file was unreadable: {exc}"
            if all((inp.key, inp.target) in done for inp in inputs):
                return [done[(inp.key, inp.target)] for inp in inputs]
        self.export(inputs)
        msg = (f"pending: exported {len(inputs)} candidates to {self.folder}; run experiments/measure_batch.py "
               f"there and import the results ({self.command()}){note}")
        return [_fail(inp, msg, {"runner": self.name, "pending": True}) for inp in inputs]


# ---- Ray ----------------------------------------------------------------------------------------


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError("RayRunner needs Ray, an optional extra: pip install spacefusion[ray]") from exc
    return ray


class _RayWorker:
    """Runs in a Ray actor: keeps one inner runner (and so its reference cache) across candidates.

    Schedules arrive as JSON and results leave as record dicts, so nothing TVM-side is ever pickled.
    """

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.runner = factory()

    def measure(self, schedule_json: str, target: str) -> dict[str, Any]:
        inp = MeasureInput(Schedule.from_json(schedule_json), target)
        return self.runner.measure([inp])[0].to_dict()


def _ship(s: Schedule) -> tuple[str, str | None]:
    """The schedule as JSON, and an error if that JSON does not read back to the same schedule.

    A lossy round trip would make the worker build a different kernel than the one the key names, so
    its result would be recorded under the wrong schedule; refuse instead.
    """
    text = s.to_json()
    try:
        back = Schedule.from_json(text)
    except Exception as exc:
        return text, f"schedule: its JSON does not read back: {_describe(exc)}"
    if back == s:
        return text, None
    fields = [f for f in ("smg", "block", "thread_dim", "serial", "step", "plan", "memory", "spatial")
              if getattr(back, f) != getattr(s, f)]
    return text, (f"schedule: does not survive Schedule.to_json/from_json (differs in {fields}); "
                  "a Ray worker would build a different kernel")


class RayRunner:
    """Spreads candidates over a Ray cluster: ``num_workers`` actors, each with its own inner runner.

    ``inner`` is a zero-argument factory run inside each actor (default ``LLVMRunner``; on a GPU
    cluster e.g. ``functools.partial(LocalGPURunner, iters=200)`` with ``num_gpus=1``, so each actor
    owns one GPU and timings never share a device).  Connects with ``ray.init(address)`` unless Ray is
    already initialised (``address=None`` starts a local instance).  Actors are started on first use and
    reused; call ``close()`` to stop them.  Results come back in input order; a crashed task becomes an
    error result.
    """

    def __init__(self, address: str | None = None, num_workers: int | None = None,
                 inner: Callable[[], Any] | None = None, num_gpus: float = 0, num_cpus: float = 1,
                 init_kwargs: Mapping[str, Any] | None = None) -> None:
        if importlib.util.find_spec("ray") is None:  # fail at construction, not mid-tuning
            raise ImportError("RayRunner needs Ray, an optional extra: pip install spacefusion[ray]")
        self.address, self.num_workers = address, num_workers
        self.inner = inner or LLVMRunner
        self.num_gpus, self.num_cpus = num_gpus, num_cpus
        self.init_kwargs = dict(init_kwargs or {})
        inner_name = getattr(self.inner, "name", None) or getattr(getattr(self.inner, "func", None), "name", "?")
        self.name = f"ray[{inner_name}]"
        self._actors: list[Any] = []

    def _start(self) -> list[Any]:
        ray = _import_ray()
        if not ray.is_initialized():
            ray.init(address=self.address, **self.init_kwargs)
        if not self._actors:
            n = self.num_workers
            if n is None:
                res = ray.cluster_resources()  # one actor per GPU (or CPU) share the cluster has
                per, have = (self.num_gpus, res.get("GPU", 0)) if self.num_gpus else (self.num_cpus, res.get("CPU", 1))
                n = int(have // per) if per else 1
            actor_cls = ray.remote(_RayWorker).options(num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                                                       max_restarts=-1)  # a crashed build kills only its task
            self._actors = [actor_cls.remote(self.inner) for _ in range(max(1, n))]
        return self._actors

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        if not inputs:
            return []
        ray = _import_ray()
        actors = self._start()
        pending: dict[Any, tuple[int, Any]] = {}  # object ref -> (input index, actor running it)
        idle = list(actors)
        queue = deque(enumerate(inputs))
        out: list[MeasureResult | None] = [None] * len(inputs)
        while queue or pending:
            while queue and idle:  # one candidate per actor at a time: a slow build never holds up the rest
                i, inp = queue.popleft()
                text, problem = _ship(inp.schedule)
                if problem is not None:
                    out[i] = _fail(inp, problem, {"runner": self.name})
                    continue
                actor = idle.pop()
                pending[actor.measure.remote(text, inp.target)] = (i, actor)
            if not pending:
                continue
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            i, actor = pending.pop(ref)
            idle.append(actor)
            try:
                r = MeasureResult.from_dict(ray.get(ref))
                out[i] = MeasureResult(r.schedule_key, r.target, r.latencies_us, r.max_abs_err, r.error,
                                       tuple(sorted({**dict(r.meta), "via": "ray"}.items())))
            except Exception as exc:  # the actor died or the task raised: this candidate fails, the rest go on
                out[i] = _fail(inputs[i], f"ray: {_describe(exc)}", {"runner": self.name})
        return cast(list[MeasureResult], out)  # every index was filled above

    def close(self) -> None:
        """Stop the actors (the Ray instance itself is left to whoever started it)."""
        if self._actors:
            ray = _import_ray()
            for a in self._actors:
                ray.kill(a)
            self._actors = []

    def __enter__(self) -> RayRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "MANIFEST_FILE", "MANIFEST_FORMAT", "RESULTS_FILE", "RESULTS_FORMAT",
    "LLVMRunner", "LocalGPURunner", "OfflineBatchRunner", "RayRunner", "build_candidate", "check_numerics",
    "export_batch", "gpu_unavailable_reason", "import_batch",
]
