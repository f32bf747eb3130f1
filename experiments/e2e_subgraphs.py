#!/usr/bin/env python3
"""Each fused subgraph of a whole model against the same ops unfused, torch.compile and (attention) SDPA.

Reads an artefact folder of ``experiments/e2e_gpu.py build`` (its manifest and kernels) and runs on the GPU
machine (torch + cupy, no TVM):

    python experiments/e2e_subgraphs.py run ART --out subgraphs.json             # times, on the GPU
    ncu --metrics dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum \\
        --csv --print-units base --log-file ART/ncu.csv \\
        python experiments/e2e_subgraphs.py bytes ART                             # device-memory bytes
    python experiments/e2e_subgraphs.py merge subgraphs.json ART/ncu.csv           # bytes into the results
    python experiments/e2e_subgraphs.py bytes-only ART ART/ncu.csv --out bytes.json  # bytes, no timings

For every distinct subgraph (``Partition.distinct``) ``run`` cuts the subgraph's own fx nodes out of the
captured model into a graph module of their own: that module run eagerly *is* the unfused PyTorch of the
subgraph (the ops the model runs, one kernel or more each), and ``torch.compile`` of it is inductor's
fusion of the same ops.  Attention also runs SDPA's math (unfused matmul/softmax/matmul), flash and cuDNN
backends.  Inputs are the real intermediate values of one forward pass of the seeded model, so the kernels
see the same data they see in the model; each system is checked against the eager module before timing
(CUDA events, warm-up, median, L2 flushed by a read between runs; the systems take turns).

``bytes`` launches each system once between marker kernels named ``sf_mark_<i>`` under Nsight Compute,
whose cache control flushes the caches before every kernel, so the DRAM bytes it reads are a cold run's;
``merge`` sums them per (subgraph, system) and puts them beside the traffic model's bytes (islpy
footprints: ``schedulers.traffic``) that ``build`` recorded for the fused schedule and the unfused chain.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

FORMAT = "spacefusion-e2e-subgraphs/1"
SDPA_BACKENDS = ("math", "flash", "cudnn")


def cut(gm: Any, sub: Any) -> tuple[Any, list[str]]:
    """(graph module of ``sub``'s own nodes, the names of the values it reads from outside): the unfused
    PyTorch of the subgraph, parameters read from ``gm``'s (shared) modules.  The values the fused kernel
    binds are among them even where the unfused ops read views of them (RoPE's kernel reads the cos/sin
    tables, its ops their ``unsqueeze(1)``): both systems take the same arguments."""
    from torch import fx

    inside = set(sub.nodes)
    nodes = [n for n in gm.graph.nodes if n.name in inside]
    outside: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a.name not in inside and a.op != "get_attr" and a not in outside:
                outside.append(a)
    by_ref = {n.name: n for n in gm.graph.nodes}
    for op in sub.operands:
        if op.source == "value" and by_ref[op.ref] not in outside:
            outside.append(by_ref[op.ref])
    g, env = fx.Graph(), {}
    for a in outside:
        env[a] = g.placeholder(a.name)
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = g.get_attr(a.target)
        env[n] = g.node_copy(n, lambda x: env[x])
    by_name = {n.name: n for n in nodes}
    g.output(tuple(env[by_name[r.node]] for r in sub.results))
    return fx.GraphModule(gm, g, f"unfused_{sub.kind}"), [a.name for a in outside]


def values_of(gm: Any, args: tuple, names: set[str]) -> dict[str, Any]:
    """The outputs of the nodes ``names`` in one run of ``gm`` on ``args`` (an fx Interpreter)."""
    from torch import fx

    got: dict[str, Any] = {}

    class Keep(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if n.name in names:
                got[n.name] = out
            return out

    Keep(gm).run(*args)
    return got


def _sdpa(backend: str, fn: Any) -> Any:
    """``fn`` (the attention's unfused module) with SDPA restricted to one backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}

    def call(*a: Any) -> Any:
        with sdpa_kernel(which[backend]):
            return fn(*a)

    return call


def systems_of(sub: Any, gm: Any, kernel: Any, use_compile: bool) -> tuple[dict[str, Any], list[str]]:
    """name -> callable on the subgraph's outside values, for every system measured."""
    import torch

    from spacefusion.api import FusedKernel

    mod, ins = cut(gm, sub)
    fk = FusedKernel(sub, kernel, gm)
    order = [op.ref for op in fk.values]
    pos = [ins.index(r) for r in order]
    out: dict[str, Any] = {"spacefusion": lambda *a: fk(*(a[i] for i in pos))}
    if sub.kind == "attention":
        for b in SDPA_BACKENDS:
            out[f"sdpa-{b}"] = _sdpa(b, mod)
    else:
        out["eager"] = mod
    if use_compile:
        out["torch.compile"] = torch.compile(mod)
    return out, ins


def _close(got: Any, ref: Any) -> float:
    got, ref = (got if isinstance(got, tuple) else (got,)), (ref if isinstance(ref, tuple) else (ref,))
    err = 0.0
    for g, r in zip(got, ref):
        err = max(err, float((g.float() - r.float()).abs().max()))
        tol = 5e-2 * max(1.0, float(r.float().abs().max()))
        if not err <= tol:
            raise ValueError(f"max abs error {err:.3g} against the eager subgraph, over {tol:.3g}")
    return err


def _setup(art: Path) -> tuple[Any, Any, tuple, Any]:
    """(manifest, captured graph module, its inputs, partition) of the artefact's model on the GPU."""
    import torch
    from e2e_gpu import FORMAT as E2E
    from e2e_gpu import _half, make_model

    from spacefusion.api import capture, partition

    man = json.loads((art / "manifest.json").read_text())
    if man.get("format") != E2E:
        raise SystemExit(f"{art / 'manifest.json'}: format {man.get('format')!r}, expected {E2E!r} (e2e_gpu.py build)")
    model, inputs = make_model(man["model"], man["layers"])
    model = model.half().eval().cuda()
    x = _half(inputs(model, man["batch"], man["seq"]), "cuda")
    with torch.no_grad():
        cap = capture(model, *x)
    return man, cap.module, cap.args, partition(cap.module)


def _prepared(art: Path, use_compile: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The manifest and, per distinct subgraph, its systems and inputs (checked against eager)."""
    import torch

    from spacefusion.api import CudaBackend

    man, gm, args, part = _setup(art)
    backend = CudaBackend(art / "kernels")
    picked = {k["key"]: k for k in man["kernels"]}
    cases = []
    with torch.no_grad():
        needed = {n for subs in part.distinct.values() for n in cut(gm, subs[0])[1]}
        vals = values_of(gm, args, needed)
        for key, subs in part.distinct.items():
            sub = subs[0]
            row: dict[str, Any] = {"key": key, "label": sub.label, "kind": sub.kind, "uses": len(subs),
                                   **{k: picked.get(key, {}).get(k) for k in ("traffic", "summary")}}
            try:
                systems, ins = systems_of(sub, gm, backend.compile(sub.smg), use_compile)
                a = tuple(vals[n] for n in ins)
                ref = (systems.get("eager") or systems["sdpa-math"])(*a)
                row["systems"] = {}
                for name, fn in systems.items():
                    try:
                        row["systems"][name] = {"max_abs_err": _close(fn(*a), ref), "fn": fn}
                    except Exception as exc:
                        row["systems"][name] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:400]}
                row["args"] = a
            except Exception as exc:
                row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:600], traceback=traceback.format_exc())
            cases.append(row)
    return man, cases


def run(art: Path, out_path: Path, warmup: int, iters: int, repeats: int, use_compile: bool) -> int:
    import torch
    from e2e_gpu import _graphed
    from gpu_runtime import runtime_module

    timing = runtime_module("timing")
    man, cases = _prepared(art, use_compile)
    with torch.no_grad():
        for row in cases:  # replayed as CUDA graphs: the GPU's time, not the Python launch path's
            for sysrow in row.get("systems", {}).values():
                if "fn" in sysrow:
                    try:
                        sysrow["fn"] = _graphed(sysrow["fn"], row["args"])
                        sysrow["cuda_graph"] = True
                    except Exception as exc:
                        sysrow.update(cuda_graph=False, graph_error=f"{type(exc).__name__}: {exc}"[:300])
                        torch.cuda.synchronize()
        for _ in range(repeats):
            for row in cases:
                for name, sysrow in row.get("systems", {}).items():
                    if "fn" in sysrow:
                        print(f"timing {row['label'][:50]} / {name}", flush=True)  # a sticky CUDA error names it
                        f = sysrow["fn"]
                        call = f if sysrow.get("cuda_graph") else (lambda f=f, a=row["args"]: f(*a))
                        try:
                            t = timing.time_cuda(call, warmup=warmup, iters=iters)
                        except Exception as exc:  # recorded; the other systems and subgraphs go on
                            sysrow.update(status="error", error=f"{type(exc).__name__}: {exc}"[:400])
                            del sysrow["fn"]
                            torch.cuda.synchronize()
                            continue
                        sysrow.setdefault("medians_us", []).append(t.median_us)
    for row in cases:
        row.pop("args", None)
        for sysrow in row.get("systems", {}).values():
            sysrow.pop("fn", None)
            if sysrow.get("medians_us"):
                sysrow.update(status="ok", median_us=statistics.median(sysrow["medians_us"]))
        line = "  ".join(f"{n} {s.get('median_us', float('nan')):.1f}" for n, s in row.get("systems", {}).items())
        print(f"{row['uses']:3d} x {row['label'][:60]:<60} {line} {row.get('error', '')[:200]}", flush=True)
    result = {"format": FORMAT, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": man["model"], "batch": man["batch"],
              "seq": man["seq"], "layers": man["layers"], "subgraphs": cases}
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    return 0


#: ncu metric -> bytes field: DRAM reads of a cold run (ncu flushes the caches before each kernel), and
#: what the SMs read from and write to L2, in 32-byte sectors (DRAM writes are not counted: a kernel's
#: output stays in the 50 MB L2 after it ends, written back whenever, so ncu sees about none of it)
METRICS = {"dram__bytes_read.sum": "dram_read_bytes", "lts__t_sectors_srcunit_tex_op_read.sum": "l2_read_bytes",
           "lts__t_sectors_srcunit_tex_op_write.sum": "l2_write_bytes"}
FIRST = "dram_read_bytes"
SECTOR = 32

#: the marker that closes a marked launch (what follows belongs to no system)
END = 999999


def _marker(i: int) -> Any:
    import cupy

    return cupy.RawKernel(f'extern "C" __global__ void sf_mark_{i}(int* p) {{ if (p) *p = {i}; }}', f"sf_mark_{i}")


def bytes_pass(art: Path, use_compile: bool) -> int:
    """One launch of every (subgraph, system) between a marker kernel ``sf_mark_<i>`` and ``sf_mark_<END>``
    (its warm-up calls before both); the legend of markers goes to ART/ncu_markers.json for ``merge``."""
    import cupy
    import torch

    man, cases = _prepared(art, use_compile)
    legend, i = [], 0
    with torch.no_grad():
        for row in cases:
            for name, sysrow in row.get("systems", {}).items():
                if "fn" not in sysrow:
                    continue
                for _ in range(2):  # compile / autotune / first-launch work outside the marked launch
                    sysrow["fn"](*row["args"])
                torch.cuda.synchronize()
                _marker(i)((1,), (1,), (cupy.intp(0),))
                sysrow["fn"](*row["args"])
                _marker(END)((1,), (1,), (cupy.intp(0),))
                torch.cuda.synchronize()
                legend.append({"marker": i, "key": row["key"], "system": name})
                i += 1
    (art / "ncu_markers.json").write_text(json.dumps(legend, indent=1) + "\n")
    return 0


def ncu_bytes(csv_path: Path, legend: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """(key, system) -> bytes per metric and kernels, from ncu's ``--csv`` log: every kernel after marker
    i and before the END marker belongs to legend entry i."""
    text = csv_path.read_text().splitlines()
    start = next((i for i, line in enumerate(text) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"{csv_path}: no ncu CSV table (no '\"ID\"' header); was it written by ncu --csv --log-file?")
    by_marker = {e["marker"]: (e["key"], e["system"]) for e in legend}
    out: dict[tuple[str, str], dict[str, float]] = {}
    cur: tuple[str, str] | None = None
    scale = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "sector": float(SECTOR)}
    for r in csv.DictReader(text[start:]):
        name = r["Kernel Name"]
        if name.startswith("sf_mark_"):
            cur = by_marker.get(int(name.removeprefix("sf_mark_").split("(")[0]))  # END: None
            continue
        if cur is None or r["Metric Name"] not in METRICS:
            continue
        d = out.setdefault(cur, {**dict.fromkeys(METRICS.values(), 0.0), "kernels": 0})
        field = METRICS[r["Metric Name"]]
        d[field] += float(r["Metric Value"].replace(",", "")) * scale[r["Metric Unit"]]
        d["kernels"] += field == FIRST  # one row per metric: count each kernel once
    return out


def _ncu_of(csv_path: Path) -> dict[tuple[str, str], dict[str, float]]:
    """``ncu_bytes`` of an ncu log and the marker legend ``bytes`` wrote beside it."""
    legend = csv_path.parent / "ncu_markers.json"
    if not legend.is_file() or not csv_path.is_file():
        raise SystemExit(f"{csv_path} and {legend} must both exist: run the bytes pass under ncu and copy "
                         f"ART/ncu_markers.json beside the CSV")
    return ncu_bytes(csv_path, json.loads(legend.read_text()))


def merge(results: Path, csv_path: Path) -> int:
    if not results.is_file():
        raise SystemExit(f"{results}: no results file; write it with e2e_subgraphs.py run, or use bytes-only")
    res = json.loads(results.read_text())
    got = _ncu_of(csv_path)
    for row in res["subgraphs"]:
        for name, sysrow in row.get("systems", {}).items():
            if (row["key"], name) in got:
                sysrow["ncu"] = got[(row["key"], name)]
    results.write_text(json.dumps(res, indent=1) + "\n")
    print(f"merged ncu bytes of {len(got)} (subgraph, system) pairs into {results}")
    return 0


def bytes_only(art: Path, csv_path: Path, out: Path) -> int:
    """Results with the ncu bytes alone (no timings), one row per distinct subgraph of the manifest: for a
    model whose ``run`` did not complete (the bytes pass launches each system once, outside graphs)."""
    man = json.loads((art / "manifest.json").read_text())
    got = _ncu_of(csv_path)
    rows = [{"key": k["key"], "label": k["label"], "kind": k["kind"], "uses": k["uses"], "traffic": k.get("traffic"),
             "summary": k.get("summary"), "systems": {s: {"ncu": v} for (key, s), v in got.items() if key == k["key"]}}
            for k in man["kernels"]]
    res = {"format": FORMAT, "model": man["model"], "batch": man["batch"], "seq": man["seq"], "layers": man["layers"],
           "timed": False, "subgraphs": rows}
    out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    from gpu_runtime import timing_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("art", type=Path)
    r.add_argument("--out", type=Path, required=True)
    timing_args(r)
    r.add_argument("--no-compile", action="store_true")
    b = sub.add_parser("bytes")
    b.add_argument("art", type=Path)
    b.add_argument("--no-compile", action="store_true")
    m = sub.add_parser("merge")
    m.add_argument("results", type=Path)
    m.add_argument("csv", type=Path)
    o = sub.add_parser("bytes-only")
    o.add_argument("art", type=Path)
    o.add_argument("csv", type=Path)
    o.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "bytes-only":
        return bytes_only(a.art, a.csv, a.out)
    if a.cmd == "run":
        return run(a.art, a.out, a.warmup, a.iters, a.repeats, not a.no_compile)
    if a.cmd == "bytes":
        return bytes_pass(a.art, not a.no_compile)
    return merge(a.results, a.csv)


if __name__ == "__main__":
    sys.exit(main())
