#!/usr/bin/env python3
"""Run the whole ``cuda``-marked test suite on the GPU machine, in one call, and say what happened.

CI has no GPU, so the ``cuda`` tests are skipped on every commit: run this before resolving an issue that
touches kernels, lowering or the runtime, and put its final line in the closing note.  On the GPU machine,
after TVM is put there by the offline bundle (``tools/offline_bundle.py``; docs/architecture.md,
"Installing on the GPU machine")::

    python3 tools/offline_bundle.py install bundle/parts --target /root/sfdeps
    export PYTHONPATH=/root/sfdeps:$PWD && python3 experiments/gpu_suite.py --out $OUT

It prints the device, runs ``pytest tests -m cuda`` (over ``--workers`` processes with pytest-xdist where
installed: nvcc compiles are CPU-bound, the tests independent), then one final line with the passed,
failed, error and skipped counts, the device and the wall time.  With ``--out DIR`` it also writes the
JUnit XML (``gpu_suite.xml``) and a JSON summary (``gpu_suite.json``) there.  Its exit status is pytest's,
or 3 where nothing ran on a GPU (every test skipped: no device, no torch or cupy).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTHING_RAN = 3


def device_name() -> str:
    """The GPU as nvidia-smi names it (with its driver), else as torch does, else why there is none."""
    smi = shutil.which("nvidia-smi")
    if smi:
        proc = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=False)
        if proc.returncode == 0 and proc.stdout.strip():
            return "; ".join(f"{n.strip()} (driver {d.strip()})" for n, d in
                             (line.split(",", 1) for line in proc.stdout.strip().splitlines() if "," in line))
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
        return "no CUDA device visible to torch"
    except ImportError:
        return "no nvidia-smi and no torch"


def counts(junit_xml: Path) -> dict[str, Any]:
    """Passed / failed / errors / skipped from pytest's JUnit XML, and the failing tests with their message."""
    root = ET.parse(junit_xml).getroot()
    out: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "problems": []}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds or "error" in kinds:
            tag = "failure" if "failure" in kinds else "error"
            out["failed" if tag == "failure" else "errors"] += 1
            msg = (case.find(tag).get("message") or "").strip().splitlines()
            out["problems"].append({"test": name, "kind": tag, "message": msg[0][:400] if msg else ""})
        elif "skipped" in kinds:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    for suite in root.iter("testsuite"):  # collection errors are counted on the suite, with no testcase
        listed = sum(1 for case in suite.iter("testcase") if case.find("error") is not None)
        out["errors"] += max(0, int(suite.get("errors", 0)) - listed)
    out["total"] = out["passed"] + out["failed"] + out["errors"] + out["skipped"]
    return out


def summary_line(c: dict[str, Any], device: str, wall_s: float) -> str:
    return (f"GPU suite (pytest -m cuda): {c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
            f"{c['skipped']} skipped of {c['total']} on {device} in {wall_s:.0f} s")


def pytest_command(junit_xml: Path, workers: int, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "tests", "-m", "cuda", "-p", "no:cacheprovider", "-rfEs",
           "--continue-on-collection-errors", f"--junitxml={junit_xml}"]
    if importlib.util.find_spec("xdist") is not None:  # over the project's addopts (-n auto, a file a worker)
        cmd += ["-n", str(workers), "--dist", "load"] if workers > 1 else ["-n", "0"]
    return cmd + extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write gpu_suite.xml and gpu_suite.json here")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="pytest-xdist processes (default: up to 8; 1 runs in this process's order)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)

    device = device_name()
    print(f"device: {device}", flush=True)
    folder = args.out or Path(tempfile.mkdtemp(prefix="gpu_suite_"))
    folder.mkdir(parents=True, exist_ok=True)
    junit = folder / "gpu_suite.xml"
    cmd = pytest_command(junit, args.workers, args.pytest_args)
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=REPO_ROOT, check=False).returncode
    wall = time.perf_counter() - t0
    if not junit.is_file():
        print(f"GPU suite: pytest wrote no report (exit {rc}) on {device}", flush=True)
        return rc or 1
    c = counts(junit)
    summary = {**c, "device": device, "wall_s": round(wall, 1), "pytest_exit": rc, "command": cmd}
    if args.out:
        (folder / "gpu_suite.json").write_text(json.dumps(summary, indent=1) + "\n")
    for p in c["problems"]:
        print(f"  {p['kind']}: {p['test']}: {p['message']}")
    print(summary_line(c, device, wall), flush=True)
    if c["total"] and c["skipped"] == c["total"]:
        print("nothing ran on a GPU: every cuda test was skipped (see the skip reasons above)", flush=True)
        return NOTHING_RAN
    return rc


if __name__ == "__main__":
    sys.exit(main())
