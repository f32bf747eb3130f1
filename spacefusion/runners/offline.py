"""The remote-GPU flow: export artefacts and a manifest here (TVM), measure them on the GPU machine
with ``spacefusion-measure`` (the GPU runtime, no TVM), import the results back."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from schedulers.hardware import DEFAULT_GPU, HardwareModel, preset_of_device
from schedulers.schedule import Schedule
from search.database import TuningDatabase, key_parts, tuning_key
from search.records import RECORD_FORMAT, Builder, MeasureInput, MeasureResult
from smg.errors import SpaceFusionError
from smg.serialize import smg_to_dict
from spacefusion.runners.builder import TVMBuilder
from spacefusion.runners.common import fail
from spacefusion.runtime.batch import (
    COMMAND,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    RESULTS_FILE,
    describe,
    load_manifest,
    read_results,
)

import_batch = read_results  # what the GPU command wrote, as records
log = logging.getLogger("spacefusion")


class BatchError(SpaceFusionError, ValueError):
    """An offline batch folder that cannot be imported (a damaged manifest or results file, results of
    another batch); nothing of it was stored."""


def export_batch(inputs: Sequence[MeasureInput], folder: str | Path, seed: int = 0, cubin: bool = True,
                 builder: Builder | None = None) -> Path:
    """Write one CUDA artefact folder per candidate plus ``manifest.json``; return the folder.

    Artefact folders are named by schedule key (``<key>-<arch>`` if one schedule is exported for two
    archs).  Every input gets a manifest entry, in order; one that fails to lower carries its ``error``
    instead of an artefact, so the GPU command reports it and every input still gets a result back.
    The manifest holds the schedule JSON and the workload SMG as plain data, so the GPU machine can
    rebuild the reference without TVM.  ``cubin=False`` skips nvcc (the GPU machine then compiles).
    """
    builder = builder if builder is not None else TVMBuilder()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    names: dict[tuple[str, str], str] = {}
    for i, inp in enumerate(inputs):
        s = inp.schedule
        entry: dict[str, Any] = {"index": i, "schedule_key": inp.key, "target": inp.target, "artefact": None,
                                 "schedule": s.to_dict(), "workload": smg_to_dict(s.smg),
                                 "workload_key": s.smg.key, "seed": seed, "error": None}
        if inp.inputs_from is not None:  # the check's inputs come from this graph (a split's partial)
            entry["inputs_from"] = smg_to_dict(inp.inputs_from)
        try:
            if builder.target_kind(inp.target) != "cuda":
                raise ValueError(f"offline batches hold CUDA artefacts; target {inp.target!r} is not CUDA")
            art = builder.build(s, inp.target)
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
            entry["error"] = f"build: {describe(exc)}"
        entries.append(entry)
    manifest = {"format": MANIFEST_FORMAT, "record_format": RECORD_FORMAT, "seed": seed,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "candidates": entries}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return folder


class OfflineBatchRunner:
    """The remote-GPU flow as a runner: export here, measure on the GPU machine, import back.

    Two-step use::

        runner = OfflineBatchRunner("batch/")
        runner.export(inputs)                 # artefacts + manifest.json (needs TVM)
        #   on the GPU machine:  spacefusion-measure batch/ --out batch/results.json
        results = runner.collect(inputs)      # reads batch/results.json, in the order of ``inputs``

    As a ``Runner`` in a tuning loop, ``measure(inputs)`` returns the imported results when
    ``results.json`` in the folder already covers every input (so re-running the tuner after the GPU run
    picks them up); otherwise it exports and returns *pending* error results (``meta["pending"]``)
    saying what to run, rather than blocking or raising.
    """

    name = "cuda-offline"

    def __init__(self, folder: str | Path, seed: int = 0, cubin: bool = True, builder: Builder | None = None) -> None:
        self.folder, self.seed, self.cubin = Path(folder), seed, cubin
        self.builder: Builder = builder if builder is not None else TVMBuilder()

    @property
    def results_path(self) -> Path:
        return self.folder / RESULTS_FILE

    def command(self) -> str:
        """What to run on the GPU machine (after ``pip install -e ".[gpu]"`` in a checkout there)."""
        return f"{COMMAND} {self.folder} --out {self.results_path}"

    def export(self, inputs: Sequence[MeasureInput]) -> Path:
        return export_batch(inputs, self.folder, seed=self.seed, cubin=self.cubin, builder=self.builder)

    def collect(self, inputs: Sequence[MeasureInput], results_json: str | Path | None = None) -> list[MeasureResult]:
        """Results for ``inputs`` in their order; an input with no record gets an error result."""
        path = Path(results_json) if results_json is not None else self.results_path
        found = {(r.schedule_key, r.target): r for r in read_results(path)}
        return [found.get((inp.key, inp.target)) or fail(inp, f"missing: no record for this candidate in {path}",
                                                            {"runner": self.name})
                for inp in inputs]

    def measure(self, inputs: list[MeasureInput]) -> list[MeasureResult]:
        note = ""
        if self.results_path.is_file():
            try:
                done = {(r.schedule_key, r.target): r for r in read_results(self.results_path)}
            except ValueError as exc:
                done, note = {}, f"; the existing results file was unreadable: {exc}"
            if all((inp.key, inp.target) in done for inp in inputs):
                return [done[(inp.key, inp.target)] for inp in inputs]
        self.export(inputs)
        msg = (f"pending: exported {len(inputs)} candidates to {self.folder}; measure them on the GPU machine "
               f"and import the results ({self.command()}){note}")
        return [fail(inp, msg, {"runner": self.name, "pending": True}) for inp in inputs]


def measured_on(results: Sequence[MeasureResult], folder: Path) -> HardwareModel:
    """The preset of the GPU the results say they were measured on (each record's ``meta["device"]``, which the
    GPU command writes); ``DEFAULT_GPU``, logged, where they name none; BatchError where they name several, or
    a device no preset matches (its records would be filed under another machine's key)."""
    devices = {str(dict(r.meta).get("device")) for r in results if dict(r.meta).get("device")}
    if len(devices) > 1:
        raise BatchError(f"{folder}: results measured on several devices ({', '.join(sorted(devices))}); import "
                         f"each device's with its hw")
    if not devices:
        log.warning("%s: the results name no device: filed under the %s by default (give hw=)", folder,
                    DEFAULT_GPU.name)
        return DEFAULT_GPU
    (device,) = devices
    hw = preset_of_device(device)
    if hw is None:
        raise BatchError(f"{folder}: measured on {device!r}, which no hardware preset matches: give hw= to file "
                         f"its records under a machine's key")
    return hw


def import_offline(db: TuningDatabase | str | Path, folder: str | Path, hw: HardwareModel | None = None,
                   builder: Builder | None = None) -> int:
    """Add the records of an offline batch (its manifest + the GPU command's results.json) to ``db``.

    The schedules come from the manifest, so a batch can be imported whatever ranking chose it; the
    records go under the tuning key the tuner would use (the builder's flags, and fast_math's) for ``hw``:
    None, the preset of the device the results were measured on (``measured_on``); a given ``hw`` wins, with
    a log line where the results name another machine.
    """
    folder = Path(folder)
    try:  # every result read and matched to the manifest before any is stored: all of a batch or none
        manifest = load_manifest(folder)
        by_key = {c["schedule_key"]: c for c in manifest["candidates"]}
        results = read_results(folder / RESULTS_FILE)
    except (ValueError, KeyError, TypeError) as e:
        raise BatchError(f"{folder}: not an offline batch this code can import: {e}") from None
    missing = [r.schedule_key[:12] for r in results if r.schedule_key not in by_key]
    if missing:
        raise BatchError(f"{folder}: results for {', '.join(missing)} have no manifest entry (another batch's "
                         f"results.json?); nothing imported")
    if hw is None:
        hw = measured_on(results, folder)
    else:
        named = {preset_of_device(str(dict(r.meta).get("device", ""))) for r in results} - {None}
        if any(m.name != hw.name for m in named):
            log.warning("%s: measured on the %s, filed under the %s as given", folder,
                        ", ".join(sorted(m.name for m in named)), hw.name)  # type: ignore[union-attr]
    scheds = [Schedule.from_json(json.dumps(by_key[r.schedule_key]["schedule"])) for r in results]
    fast = any(c.get("schedule", {}).get("fast_math") for c in manifest["candidates"])
    flags = (*(builder if builder is not None else TVMBuilder()).flags, *(("fast_math",) if fast else ()))
    own = not isinstance(db, TuningDatabase)
    database = TuningDatabase(db) if own else db
    try:
        for sched, res in zip(scheds, results):
            key = tuning_key(sched.smg, hw, res.target, flags)
            database.add(key, sched, res, key_parts(sched.smg, hw, res.target, flags))
        return len(results)
    finally:
        if own:
            database.close()
