#!/usr/bin/env python3
"""Registers nvcc gives the warp-tile (tensor-core) kernels: the corpus ``warp_tile_registers`` is checked on.

Usage:  python experiments/tuning/register_corpus.py [ROOT ...] [--out experiments/tuning/register_corpus.json]

Every tensor-core schedule found in the JSON files under the ROOTs (tuning records, calibration rows,
batch and model manifests: any ``spacefusion-schedule/1`` object; the default ROOTs are this
repository's ``experiments`` folder) plus the ``extra_schedules`` below (head dims and knobs the
records lack) is lowered with the current code (``spacefusion.lower.build.build_cuda``, TVM on the CPU:
no GPU needed) and compiled as the runners compile it (``nvcc -cubin -arch=sm_90a -O3`` and the
kernel's own ``nvcc_flags``) with ``-Xptxas -v``; the JSON keeps each schedule with the registers
per thread ptxas reports and the bytes it spilled.  A warp-specialised kernel launches every thread with
one count and raises the MMA warpgroups' with ``setmaxnreg``; ptxas reports the launch's, so their need is
found by lowering that raise until ptxas spills (``consumer_registers``; at the launch's share it may
need less).  The schedules' SMGs and plans
are stored once each (``parts``) and referred to by a short hash.  ``tests/test_warp_tile_registers.py``
reads it.  With the default roots plus a checkout's ``.art`` folder of exported rounds (the committed
corpus: 753 kernels), it takes about 35 minutes on two cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

FORMAT = "spacefusion-register-corpus/1"
OUT = ROOT / "experiments" / "tuning" / "register_corpus.json"
ARCH = "sm_90a"
#: fields of a schedule's JSON that many schedules share: stored once in ``parts``
SHARED_FIELDS = ("smg", "plan", "spatial", "memory")
_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _schedules_in(x: Any) -> Iterator[dict[str, Any]]:
    if isinstance(x, dict):
        if x.get("format") == "spacefusion-schedule/1" and "smg" in x:
            yield x
            return
        for v in x.values():
            yield from _schedules_in(v)
    elif isinstance(x, list):
        for v in x:
            yield from _schedules_in(v)


def found_schedules(roots: Iterable[Path]) -> dict[str, tuple[dict[str, Any], str]]:
    """Tensor-core schedules with a warp-tile program in the JSON files under ``roots``: key -> (JSON, file)."""
    from spacefusion.api import Schedule

    out: dict[str, tuple[dict[str, Any], str]] = {}
    for root in roots:
        files = [root] if root.is_file() else sorted(root.rglob("*.json"))
        for f in files:
            if f.name == "kernel.json" or f.resolve() == OUT.resolve():
                continue
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            for d in _schedules_in(data):
                if not d.get("tensor_cores"):
                    continue
                try:
                    s = Schedule.from_json(json.dumps(d))
                    if s.warp_tile is None:
                        continue
                except Exception:  # a schedule the current code no longer reads
                    continue
                where = str(f.relative_to(root.parent)) if root.is_dir() else f.name
                out.setdefault(s.key, (s.to_dict(), where))
    return out


def extra_schedules() -> dict[str, tuple[dict[str, Any], str]]:
    """Search-space candidates of workloads the records hold few of: attention at head dims 80, 96, 128
    and 256 with every knob value, causal and not, and GEMMs with an epilogue on both MMA forms."""
    import numpy as np

    from spacefusion.api import H100, gated_gemm, patterns
    from spacefusion.tuning import SearchSpace

    workloads = [
        patterns.attention(4, 16, 512, 512, 64, dtype="float16"),
        patterns.attention(2, 16, 1024, 1024, 80, causal=True, dtype="float16"),
        patterns.attention(2, 16, 1024, 1024, 96, dtype="float16"),
        patterns.attention(2, 16, 1024, 1024, 128, causal=True, dtype="float16"),
        patterns.attention(1, 8, 1024, 1024, 256, dtype="float16"),
        patterns.gemm_epilogue(2048, 2048, 1024, "gelu", dtype="float16"),
        patterns.gemm_epilogue(2048, 1024, 512, "sigmoid", dtype="float16"),
        gated_gemm(1024, 2048, 1024, dtype="float16"),
    ]
    out: dict[str, tuple[dict[str, Any], str]] = {}
    rng = np.random.default_rng(0)
    for g in workloads:
        cands = [s for s in SearchSpace(g, H100).candidates() if s.tensor_cores and s.warp_tile is not None]
        take = rng.choice(len(cands), size=min(24, len(cands)), replace=False)
        for i in sorted(take):
            out.setdefault(cands[i].key, (cands[i].to_dict(), f"search space of {g.name} {g.dim_sizes}"))
    return out


#: the CUDA-core corpus's file (``--simt``): ``resources.simt_registers`` is checked on it
SIMT_OUT = ROOT / "experiments" / "tuning" / "simt_register_corpus.json"


def simt_schedules(per_workload: int = 28, top: int = 8) -> dict[str, tuple[dict[str, Any], str]]:
    """CUDA-core candidates of the workloads that run on CUDA cores: decode GEMVs (plain, gated, with the
    RMSNorm prologue; W stored [n, k] as ``nn.Linear`` keeps it), row norms, softmax and decode attention.
    Of each, the ``top`` the analytical model ranks first (the kernels a first pick would run) and a seeded
    sample of the rest (every vector width, lane count and step the space holds)."""
    import numpy as np

    from spacefusion.api import H100, estimate, gated_gemm, patterns
    from spacefusion.tuning import SearchSpace

    workloads = [
        patterns.gemm_epilogue(1, 4096, 4096, "none", bias=False, dtype="float16", b_layout="nk"),
        patterns.gemm_epilogue(8, 4864, 896, "none", bias=False, dtype="float16", b_layout="nk"),
        patterns.gemm_epilogue(1, 4096, 11008, "none", bias=False, dtype="float16", b_layout="nk", residual=True),
        gated_gemm(1, 11008, 4096, "silu", "float16", "nk", bias=False),
        gated_gemm(4, 4864, 896, "silu", "float16", "nk", bias=False),
        patterns.gemm_epilogue(1, 4096, 4096, "none", bias=False, dtype="float16", b_layout="nk", norm="rmsnorm",
                               norm_weight=True, eps=1e-6),
        patterns.rmsnorm(2048, 4096, dtype="float16"),
        patterns.layernorm(1024, 768, dtype="float16"),
        patterns.softmax(1024, 2048, dtype="float16"),
        patterns.attention(1, 32, 1, 2048, 128, kv_heads=8, dtype="float16"),
    ]
    out: dict[str, tuple[dict[str, Any], str]] = {}
    rng = np.random.default_rng(0)
    for g in workloads:
        cands = [s for s in SearchSpace(g, H100).candidates() if not s.tensor_cores]
        order = sorted(range(len(cands)), key=lambda i: estimate(cands[i], H100))
        rest = order[top:]
        take = order[:top] + [rest[i] for i in sorted(rng.choice(len(rest), size=min(per_workload, len(rest)),
                                                                  replace=False))]
        for i in take:
            out.setdefault(cands[i].key, (cands[i].to_dict(), f"search space of {g.name} {g.dim_sizes}"))
    return out


def _ptxas(source: str, flags: tuple[str, ...]) -> tuple[int, int]:
    """(registers, spill store bytes) of the one kernel in ``source``."""
    from spacefusion.runtime import find_nvcc

    nvcc = find_nvcc() or "nvcc"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.cu"
        src.write_text(source)
        cmd = [nvcc, "-cubin", f"-arch={ARCH}", "-O3", "-diag-suppress=177,1046", *flags, "-Xptxas", "-v",
               "-o", str(Path(tmp) / "kernel.cubin"), str(src)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    used, spill = _USED.findall(res.stderr), _SPILL.findall(res.stderr)
    if len(used) != 1 or len(spill) != 1:
        raise RuntimeError(f"expected one kernel in ptxas's report:\n{res.stderr[-2000:]}")
    return int(used[0]), int(spill[0][0])


def consumer_registers(source: str, flags: tuple[str, ...], threads: int) -> int | None:
    """What the MMA warpgroups of a ``setmaxnreg`` kernel need: the least count, from the launch's share
    (65536 / ``threads``, to a multiple of 8: ``setmaxnreg.inc`` only raises) up to the lowering's
    ``CONSUMER_REGS``, that they may be raised to without ptxas spilling (it reports the launch's count for
    the whole kernel); None if it spills even at ``CONSUMER_REGS``."""
    from schedulers.warp_tile import CONSUMER_REGS

    inc = f"setmaxnreg.inc.sync.aligned.u32 {CONSUMER_REGS}"
    if inc not in source:
        raise RuntimeError("no setmaxnreg.inc in the kernel")
    caps = list(range(65536 // threads // 8 * 8, CONSUMER_REGS + 1, 8))
    if _ptxas(source, flags)[1]:
        return None
    lo, hi = 0, len(caps) - 1
    while lo < hi:  # the least cap without spills (spills only grow as the cap falls)
        mid = (lo + hi) // 2
        if _ptxas(source.replace(inc, f"setmaxnreg.inc.sync.aligned.u32 {caps[mid]}"), flags)[1]:
            lo = mid + 1
        else:
            hi = mid
    return caps[lo]


def _measure(item: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any] | str]:
    key, d = item
    try:
        from spacefusion.api import Schedule, build

        s = Schedule.from_json(json.dumps(d))
        art = build(s, f"cuda:{ARCH}")
        flags = tuple(art.meta.get("nvcc_flags", ()))
        regs, stores = _ptxas(art.source, flags)
        row = {"registers": regs, "spill_bytes": stores, "threads": s.threads,
               "lowering": art.meta.get("lowering", "").split(" ")[0].removeprefix("tensorcore-")}
        if "setmaxnreg.inc" in art.source:
            row["consumer_registers"] = consumer_registers(art.source, flags, s.threads)
        return key, row
    except Exception as exc:  # noqa: BLE001 - recorded, not raised: one schedule must not stop the corpus
        return key, f"{type(exc).__name__}: {str(exc)[-300:]}"


def _part(parts: dict[str, Any], value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    h = hashlib.sha256(text.encode()).hexdigest()[:10]
    parts.setdefault(h, value)
    return h


def pack(d: dict[str, Any], parts: dict[str, Any]) -> dict[str, Any]:
    """A schedule's JSON with its ``SHARED_FIELDS`` replaced by references into ``parts`` (no ``format``)."""
    return {k: (_part(parts, v) if k in SHARED_FIELDS else v) for k, v in d.items() if k != "format"}


def unpack(d: dict[str, Any], parts: dict[str, Any]) -> dict[str, Any]:
    return {"format": "spacefusion-schedule/1", **{k: (parts[v] if k in SHARED_FIELDS else v) for k, v in d.items()}}


def load(path: Path = OUT) -> list[tuple[Any, dict[str, Any]]]:
    """(Schedule, row) of every corpus kernel: the row's ``registers`` and ``spill_bytes`` are ptxas's."""
    from spacefusion.api import Schedule

    data = json.loads(Path(path).read_text())
    return [(Schedule.from_json(json.dumps(unpack(r["schedule"], data["parts"]))), r) for r in data["rows"]]


def write(path: Path, measured: list[tuple[dict[str, Any], str, dict[str, Any]]], failed: dict[str, str],
          command: str = "experiments .art") -> None:
    """The corpus file: one row a line, (schedule JSON, where found, ptxas's report) each."""
    parts: dict[str, Any] = {}
    rows = [{"from": where, **r, "schedule": pack(d, parts)} for d, where, r in measured]
    nvcc = subprocess.run([_nvcc(), "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    head = {"format": FORMAT, "nvcc": nvcc,
            "how": f"python experiments/tuning/register_corpus.py {command}: nvcc -cubin -arch={ARCH} -O3 "
                   f"and the kernel's nvcc_flags, registers per thread and spill store bytes from -Xptxas -v",
            "created": time.strftime("%Y-%m-%d"), "failed": failed}
    lines = [json.dumps(head)[:-1] + ', "rows": [']
    lines += [json.dumps(r, separators=(",", ":")) + ("," if i < len(rows) - 1 else "") for i, r in enumerate(rows)]
    lines += ['], "parts": ' + json.dumps(parts, separators=(",", ":"), sort_keys=True) + "}"]
    Path(path).write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="*", type=Path, default=[ROOT / "experiments"])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-extra", action="store_true", help="only the schedules found under the roots")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--simt", action="store_true",
                    help=f"the CUDA-core corpus instead (search-space candidates only; default --out {SIMT_OUT.name})")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.simt:
        found = simt_schedules()
        args.out = SIMT_OUT if args.out == OUT else args.out
    else:
        found = found_schedules(args.roots)
    if not args.no_extra and not args.simt:
        for k, v in extra_schedules().items():
            found.setdefault(k, v)
    print(f"{len(found)} {'CUDA-core' if args.simt else 'warp-tile'} schedules", flush=True)
    with ProcessPoolExecutor(args.workers) as ex:
        got = dict(ex.map(_measure, [(k, d) for k, (d, _) in found.items()], chunksize=4))
    measured, failed = [], {}
    for k, (d, where) in sorted(found.items(), key=lambda kv: (kv[1][1], kv[0])):
        if isinstance(got[k], str):
            failed[k] = got[k]
        else:
            measured.append((d, where, got[k]))
    write(args.out, measured, failed, "--simt" if args.simt else "experiments .art")
    print(f"{len(measured)} kernels ({len(failed)} failed to build) written to {args.out} in "
          f"{time.perf_counter() - t0:.0f} s")
    return 0


def _nvcc() -> str:
    from spacefusion.runtime import find_nvcc

    return find_nvcc() or "nvcc"


if __name__ == "__main__":
    raise SystemExit(main())
