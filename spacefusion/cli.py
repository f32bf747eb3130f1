"""``spacefusion`` command line: ``demo`` (the embedded default), ``build`` and ``tune``."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from pathlib import Path
from typing import Any

from schedulers.hardware import CPU_STAND_IN, DEFAULT_GPU
from smg.errors import SpaceFusionError
from smg.serialize import smg_to_dict

#: the dtypes the commands take (the check's tolerance is smg/tolerance.py's); bfloat16 builds for CUDA, and runs
#: on llvm only where ml_dtypes gives numpy a bfloat16 (``llvm_dtypes_ok``)
DTYPES = ("float16", "bfloat16", "float32")


def _known() -> dict[str, Any]:
    from smg import patterns, workloads

    return {**patterns.PATTERNS, **workloads.WORKLOADS}


def size_params(fn: Any) -> list[inspect.Parameter]:
    """The parameters of a workload that ``--shape`` fills, in order: its leading whole-number ones (a later
    flag or name, such as attention's ``causal``, is not a size: a seventh number used to set it silently)."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "dtype" or str(p.annotation) not in ("int", "int | None", "int | tuple[int, int]"):
            break
        out.append(p)
    return out


def shapes_epilog() -> str:
    """The workloads and the sizes ``--shape`` gives each, in order ([optional])."""
    lines = ["workloads and their --shape (sizes in this order; [optional]):"]
    for name, fn in sorted(_known().items()):
        sizes = " ".join(p.name if p.default is inspect.Parameter.empty else f"[{p.name}]" for p in size_params(fn))
        lines.append(f"  {name:18s} {sizes}")
    return "\n".join(lines)


def _workload(name: str, shape: list[int], dtype: str):
    known = _known()
    if name not in known:
        raise SpaceFusionError(f"unknown workload {name!r}; known: {sorted(known)}")
    sizes = size_params(known[name])
    if len(shape) > len(sizes):
        raise SpaceFusionError(f"workload {name!r} takes at most {len(sizes)} sizes "
                               f"({' '.join(p.name for p in sizes)}); got {len(shape)}: {shape}")
    try:
        return known[name](*shape, dtype=dtype)
    except TypeError as e:
        raise SpaceFusionError(f"workload {name!r} does not take shape {shape}: {e}") from None


def llvm_dtypes_ok(smg: Any) -> None:
    """Raise naming the dtype if ``smg`` cannot run on llvm here.  The llvm kernel is checked on numpy arrays,
    and numpy has no bfloat16 of its own: ``ml_dtypes`` (installed with TVM) registers one, and importing it
    is what lets numpy name the dtype; without it the check would fail with numpy's "data type not understood"."""
    if not any(sp.dtype == "bfloat16" for sp in smg.spaces):
        return
    try:
        import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16')
    except ImportError:
        raise SpaceFusionError(f"{smg.name}: bfloat16 cannot run on llvm here: numpy has no bfloat16 and ml_dtypes, "
                               f"which gives it one, is not installed (pip install ml-dtypes); use --dtype float16 "
                               f"or float32 on llvm, or a cuda target") from None


def verify_llvm(s, seed: int = 0) -> tuple[float | None, str | None]:
    """Run the TVM llvm kernel against the numpy reference: ``(max abs error, None or why it is not close
    enough)`` under smg/tolerance.py's rule, as the runners check."""
    from spacefusion.api import build, check_numerics, evaluate, random_inputs

    llvm_dtypes_ok(s.smg)
    x = random_inputs(s.smg, seed)
    return check_numerics(s.smg, evaluate(s.smg, x), build(s, "llvm")(x), inputs=x)


def _verdict(err: float | None, problem: str | None) -> str:
    shown = "non-finite" if err is None else f"{err:.3e}"
    return f"max abs error {shown} ({'OK' if problem is None else 'MISMATCH: ' + problem})"


def demo(args: argparse.Namespace) -> int:
    from spacefusion.api import build, schedule, traffic

    b, h, sq, skv, d = args.shape
    writable_folder(args.out)
    g = _workload("mha", [b, h, sq, skv, d], args.dtype)
    llvm_dtypes_ok(g)  # before the printing: the demo checks its kernel on llvm
    if args.step is not None and args.step > skv:  # before the work, in the demo's own terms
        raise SpaceFusionError(f"--step {args.step} is longer than SKV ({skv}), the dim the demo steps through; "
                               f"give --step 1..{skv}, or leave it out (32, or SKV if shorter)")
    print(g, end="\n\n")
    s = schedule(g, tiles={"m": min(64, sq)}, step=args.step)  # step None: 32, or SKV if shorter (any shape)
    print(s, end="\n\n")
    t0 = time.perf_counter()
    err, problem = verify_llvm(s)
    ok = problem is None
    print(f"TVM llvm kernel vs unfused numpy reference: {_verdict(err, problem)} [{time.perf_counter() - t0:.1f}s]")
    out = Path(args.out) / "mha_sm_90a"
    art = build(s, "cuda:sm_90a")
    art.save(out)
    cubin = "with cubin (nvcc)" if (out / "kernel.cubin").exists() else "source only (no nvcc)"
    print(f"CUDA for sm_90a written to {out}/ ({cubin}); grid {art.meta['grid']}, "
          f"block {art.meta['block']}, params {art.meta['param_order']}")
    tr = traffic(s)
    print(f"device-memory traffic: fused {tr.fused_bytes / 1e6:.2f} MB vs unfused chain "
          f"{tr.unfused_bytes / 1e6:.2f} MB ({100 * tr.reduction:.1f}% less)")
    return 0 if ok else 1


def describe_smg(smg: Any) -> str:
    """``name (input[shape] dtype, ...)``: enough to tell two workloads apart in a message."""
    ins = ", ".join(f"{n}[{'x'.join(str(x) for x in smg.shape(n))}] {smg.space(n).dtype}" for n in smg.inputs)
    return f"{smg.name} ({ins})"


def schedule_for(s: Any, args: argparse.Namespace, path: Path) -> None:
    """Refuse a ``--schedule`` file saved for another workload than the one named beside it: the schedule
    carries its own SMG and was built as it says, so a gemm's schedule given with ``mha`` built the gemm.  The
    graphs are compared by content (ops, dims, sizes, dtypes; not the display name); without ``--dtype`` the
    schedule's dtype is taken, so only the workload and shape need to match."""
    if not args.workload:
        return
    if not args.shape:
        raise SpaceFusionError(f"build {args.workload} --schedule {path}: give the workload's --shape too, so the "
                               f"schedule can be checked to be for it (or leave out the workload)")
    dtype = args.dtype or s.smg.space(s.smg.inputs[0]).dtype
    g = _workload(args.workload, args.shape, dtype)
    mine, theirs = smg_to_dict(g), smg_to_dict(s.smg)
    mine.pop("name", None)
    theirs.pop("name", None)
    if mine != theirs:
        raise SpaceFusionError(f"--schedule {path} is a schedule of {describe_smg(s.smg)}, not of the workload "
                               f"asked for, {args.workload} --shape {' '.join(map(str, args.shape))}: "
                               f"{describe_smg(g)}; build it without the workload, or schedule {args.workload}")


def build_cmd(args: argparse.Namespace) -> int:
    from schedulers.options import KNOB_FIELDS
    from schedulers.schedule import Schedule
    from spacefusion.api import build, schedule

    if args.schedule:  # e.g. a tuning database's best, or Schedule.to_json() from a notebook
        path = Path(args.schedule)
        if not path.is_file():
            raise SpaceFusionError(f"--schedule {path}: no such file")
        s = Schedule.from_json(path.read_text())
        schedule_for(s, args, path)
    else:
        if not args.workload or not args.shape:
            raise SpaceFusionError("build needs a workload and --shape, or --schedule FILE")
        g = _workload(args.workload, args.shape, args.dtype or "float16")
        tiles = {d: t for d, t in (("m", args.tile_m), ("n", args.tile_n)) if t is not None} or None
        opts = {f.name: getattr(args, f.name) for f in KNOB_FIELDS if getattr(args, f.name) != f.default}
        s = schedule(g, tiles=tiles, serial=args.serial, step=args.step, tensor_cores=args.tensor_cores, **opts)
    if args.verify:
        err, problem = verify_llvm(s)
        print(f"llvm check: {_verdict(err, problem)}")
        if problem is not None:
            return 1
    if args.target == "llvm":  # a CPU kernel is a loaded module, not an artefact to save: built and checked
        err, problem = verify_llvm(s)
        print(s)
        print(f"llvm kernel built and run against the numpy reference: {_verdict(err, problem)} "
              f"(nothing written: --out is for CUDA artefacts)")
        return 0 if problem is None else 1
    writable_folder(args.out)  # before the compile, not after it
    art = build(s, args.target)
    path = art.save(args.out)
    print(s)
    print(f"wrote {path}/kernel.cu and kernel.json (grid {art.meta['grid']}, block {art.meta['block']})")
    return 0


#: --target: the hardware preset a tune searches with and files its records under, and the build target.  llvm's
#: is ``CPU_STAND_IN``: the CPU has no model, so the search space is a GPU preset's and the CPU measures
TARGETS = {"h100": ("H100", "cuda:sm_90a"), "h200": ("H200", "cuda:sm_90a"), "a100": ("A100", "cuda:sm_80"),
           "llvm": (CPU_STAND_IN.name, "llvm")}


def default_target(runner: str) -> tuple[str, str]:
    """--target where none is given, and why: llvm for --runner llvm; for --runner gpu, the GPU in hand's preset
    where it is one of ``TARGETS``; otherwise (a GPU elsewhere: offline, ray) ``DEFAULT_GPU``'s, said so."""
    if runner == "llvm":
        return "llvm", "--runner llvm measures on this CPU"
    if runner == "gpu":
        from schedulers.hardware import choose_hardware, local_device

        choice = choose_hardware(None, local_device())
        if choice.model.name.lower() in TARGETS and not choice.defaulted:
            return choice.model.name.lower(), choice.why
    return DEFAULT_GPU.name.lower(), (f"--runner {runner} measures on a GPU elsewhere (or none matched here): the "
                                      f"{DEFAULT_GPU.name} by default, give --target for another")


#: what to use instead of a runner that cannot measure here
ELSEWHERE = ("tune for this CPU with --runner llvm --target llvm, export the candidates for a GPU machine with "
             "--runner offline --batch-dir DIR, or measure on a Ray cluster with GPUs with --runner ray "
             "--ray-address HOST:PORT")


def tune_runner(args: argparse.Namespace, target: str) -> Any:
    """The runner ``--runner`` names, for ``target`` (``llvm`` or ``cuda:...``), checked able to measure before
    any candidate is built: a runner that cannot measure that target, or cannot run here at all, is refused with
    the reason and what to use instead (a GPU runner without a GPU recorded every candidate as failed, and a
    --target llvm tune quietly measured on llvm whatever --runner said)."""
    import functools

    from spacefusion import runners
    from spacefusion.runners.common import RunnerUnavailable

    cpu = target == "llvm"
    for flag, value, owner in (("--gpus", args.gpus, "gpu"), ("--ray-address", args.ray_address, "ray")):
        if value is not None and args.runner != owner:  # said, not ignored: the tune would run elsewhere than asked
            raise SpaceFusionError(f"{flag} is for --runner {owner}, not --runner {args.runner}")
    if args.runner == "llvm":
        if not cpu:
            raise SpaceFusionError(f"--runner llvm measures on this CPU, so it tunes --target llvm, not "
                                   f"--target {args.target}; for {args.target} use --runner gpu, offline or ray")
        return runners.LLVMRunner(repeats=args.iters or 5)
    if args.runner == "ray":
        try:
            runners.RayRunner.available()
        except ImportError as e:
            raise SpaceFusionError(f"--runner ray: {e}") from None
        if cpu:  # the cluster's CPUs, each actor an llvm runner
            runner = runners.RayRunner(address=args.ray_address, connect_timeout_s=args.ray_timeout,
                                       inner=functools.partial(runners.LLVMRunner, repeats=args.iters or 5))
        else:  # one GPU per actor, so timings never share a device
            runner = runners.RayRunner(address=args.ray_address, connect_timeout_s=args.ray_timeout, num_gpus=1,
                                       inner=functools.partial(runners.LocalGPURunner, iters=args.iters or 100))
        runner.connect()
        return runner
    if cpu:  # gpu and offline measure CUDA kernels
        what = "this machine's GPU" if args.runner == "gpu" else "a GPU machine (an offline batch of CUDA artefacts)"
        raise SpaceFusionError(f"--runner {args.runner} measures CUDA kernels on {what}, and --target llvm builds "
                               f"for this CPU: use --runner llvm (or --runner ray) with --target llvm, or a GPU "
                               f"--target ({', '.join(k for k in sorted(TARGETS) if k != 'llvm')})")
    if args.runner == "gpu":  # every visible GPU of this host (or --gpus of them), one worker each
        try:
            runner = runners.gpu_runner(gpus=args.gpus, iters=args.iters or 100)
            if isinstance(runner, runners.LocalGPURunner):
                runner.check()
            else:
                runner.connect()
        except RunnerUnavailable as e:
            raise RunnerUnavailable(f"--runner gpu (the default) cannot measure on this machine: {e}. Instead, "
                                    f"{ELSEWHERE}") from None
        return runner
    if not args.batch_dir:
        raise SpaceFusionError("--runner offline needs --batch-dir (where candidates are exported)")
    return runners.OfflineBatchRunner(args.batch_dir)


def tune_cmd(args: argparse.Namespace) -> int:
    """Tune one workload; the runner decides where candidates are measured."""
    import json

    from schedulers.hardware import get_hardware
    from search.tuner import summary_dict, tune

    if args.target is None:  # --runner llvm tunes for this CPU, gpu for its GPU; the others for DEFAULT_GPU, said so
        args.target, why = default_target(args.runner)
        print(f"spacefusion: --target {args.target} ({why})", file=sys.stderr)
    if args.target not in TARGETS:
        raise SpaceFusionError(f"unknown target {args.target!r}; known: {sorted(TARGETS)}")
    if args.json:
        writable_file(args.json, "--json")
    hw_name, target = TARGETS[args.target]
    g = _workload(args.workload, args.shape, args.dtype)
    if target == "llvm":
        llvm_dtypes_ok(g)
    if args.import_results:
        from spacefusion.runners import MANIFEST_FILE

        for need in (MANIFEST_FILE, "results.json"):
            if not (Path(args.import_results) / need).is_file():
                raise SpaceFusionError(f"--import-results {args.import_results}: no {need} there (an offline batch "
                                       f"folder holds the manifest it was exported with and the GPU's results.json)")
    from spacefusion import runners

    runner = tune_runner(args, target)
    try:
        if args.import_results:
            from spacefusion.runners import import_offline

            n = import_offline(args.db, args.import_results, get_hardware(hw_name))
            print(f"imported {n} records from {args.import_results}")
        summary = tune(g, runner, hw=get_hardware(hw_name), target=target, db=args.db, trials=args.trials,
                       batch=args.batch, workers=args.workers or runners.cpu_cores(), seed=args.seed,
                       progress=not args.quiet, fast_math=args.fast_math)
    finally:
        close = getattr(runner, "close", None)
        if callable(close):  # a pool's workers end with the tune
            close()
    print(summary)
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(summary_dict(summary), indent=1, default=str))
        except OSError as e:  # checked before the tune; gone since (the measurements are in the database)
            raise SpaceFusionError(f"--json {args.json}: cannot be written ({e.strerror}); the results are in "
                                   f"{args.db}") from None
    if summary.unmeasured:  # the runner stopped working mid-tune: not a success, though nothing is lost
        print(f"spacefusion: error: {args.runner} runner could not measure candidates here: {summary.unmeasured} "
              f"(nothing recorded for them: a rerun where it works measures them)", file=sys.stderr)
        return 1
    return 0


def _whole(least: int):
    """An argparse type: a whole number >= ``least``, else a usage error that names the value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is less than {least}")
        return value

    parse.__name__ = f"whole number >= {least}"
    return parse


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0, else a usage error that names the value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} seconds: give a positive finite number")
    return value


def writable_folder(path: str, flag: str = "--out") -> Path:
    """``path`` as a folder that exists (made if need be) and can be written, checked before any work: a file
    there, or a folder that cannot be made or written, is an error that names it (not a traceback after the
    compile)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise SpaceFusionError(f"{flag} {out}: a file is there, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpaceFusionError(f"{flag} {out}: cannot make the folder ({e.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise SpaceFusionError(f"{flag} {out}: the folder cannot be written")
    return out


def writable_file(path: str, flag: str) -> Path:
    """``path`` as a file that can be written (its folder exists and is writable; not a folder itself),
    checked before any work."""
    out = Path(path)
    if out.is_dir():
        raise SpaceFusionError(f"{flag} {out}: a folder is there, not a file")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise SpaceFusionError(f"{flag} {out}: no folder {parent}")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise SpaceFusionError(f"{flag} {out}: cannot be written")
    return out


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, and the workloads' list kept as written."""


def make_parser() -> argparse.ArgumentParser:
    """The command line's parser, apart from running it, so the docs' command lines can be checked against it."""
    p = argparse.ArgumentParser(prog="spacefusion", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="fuse MHA, verify on llvm, emit CUDA, show traffic")
    d.add_argument("--shape", type=int, nargs=5, default=[1, 2, 197, 197, 64],
                   metavar=("B", "H", "SQ", "SKV", "D"))
    d.add_argument("--dtype", default="float16", choices=DTYPES)
    d.add_argument("--step", type=_whole(1), default=None, help="serial step over SKV (default: 32, or SKV if "
                   "shorter)")
    d.add_argument("--out", default="spacefusion_out")
    from schedulers.knobs import is_int_knob
    from schedulers.options import KNOB_FIELDS, KNOB_GROUP

    b = sub.add_parser("build", help="build one workload for a target", epilog=shapes_epilog(), formatter_class=_Help)
    b.add_argument("workload", nargs="?", help="a workload named below (not with --schedule)")
    b.add_argument("--shape", type=int, nargs="+", default=None, help="the workload's sizes, in the order below")
    b.add_argument("--dtype", default=None, choices=DTYPES, help="the workload's dtype (default: float16; with "
                   "--schedule, the schedule's)")
    b.add_argument("--target", default="cuda:sm_90a", help="cuda:sm_XX (an artefact in --out) or llvm (built, run "
                   "and checked on this CPU, nothing written)")
    b.add_argument("--tile-m", type=_whole(1), default=None, help="rows per block (default: derived)")
    b.add_argument("--tile-n", type=_whole(1), default=None, help="a GEMM's output columns per block")
    b.add_argument("--serial", default=None, help="the dim sliced into serial steps (default: derived)")
    b.add_argument("--step", type=_whole(1), default=None, help="serial step (default: 32, or the dim if shorter)")
    b.add_argument("--tensor-cores", action="store_true", help="the warp-tile kernel: mma.sync, ldmatrix, cp.async")
    for f in KNOB_FIELDS:  # one flag per knob of the option groups, with the group's help and bounds
        flag, tc = f"--{f.name.replace('_', '-')}", " (tensor cores)" if KNOB_GROUP[f.name] != "simt" else ""
        if is_int_knob(f):
            b.add_argument(flag, type=_whole(f.metadata["lo"] or 0), default=f.default,
                           help=f"{f.metadata['help']}{tc} (default {f.default})")
        else:
            b.add_argument(flag, action="store_true", help=f"{f.metadata['help']}{tc}")
    b.add_argument("--schedule", default=None, help="a Schedule JSON file instead of the shape and knobs")
    b.add_argument("--verify", action="store_true", help="check the schedule's llvm kernel against the numpy "
                   "reference before building")
    b.add_argument("--out", required=True, help="the folder the CUDA artefact (kernel.cu, kernel.json, cubin) goes to")
    t = sub.add_parser("tune", help="search schedules of a workload, measure them, remember the best",
                       epilog=shapes_epilog(), formatter_class=_Help)
    t.add_argument("workload", help="a workload named below")
    t.add_argument("--shape", type=int, nargs="+", required=True, help="the workload's sizes, in the order below")
    t.add_argument("--dtype", default="float16", choices=DTYPES)
    t.add_argument("--target", default=None, help=f"one of {sorted(TARGETS)} (default: llvm with --runner llvm, "
                   f"else h100)")
    t.add_argument("--runner", default="gpu", choices=["gpu", "llvm", "offline", "ray"],
                   help="where candidates are measured: this GPU, this CPU (llvm), exported for a GPU machine, Ray")
    t.add_argument("--batch-dir", default=None, help="offline runner: where candidates are exported")
    t.add_argument("--ray-address", default=None, help="a Ray cluster to measure on (--runner ray; default: start "
                   "a local one); its actors run the llvm runner for --target llvm, else one GPU each")
    t.add_argument("--ray-timeout", type=_seconds, default=5.0, help="seconds to wait for --ray-address to answer")
    t.add_argument("--import-results", default=None, help="first add an offline batch's results (its folder)")
    t.add_argument("--db", default="spacefusion_tuning.db", help="the tuning database (SQLite), kept between tunes")
    t.add_argument("--trials", type=_whole(1), default=64, help="candidates measured at most")
    t.add_argument("--batch", type=_whole(1), default=16, help="candidates per round (ranked, built, measured)")
    t.add_argument("--gpus", type=_whole(1), default=None, help="--runner gpu: how many of this host's GPUs measure "
                   "at once, one worker each (default: every visible one)")
    t.add_argument("--workers", type=_whole(1), default=None, help="processes building candidates (default: this "
                   "machine's CPU cores)")
    t.add_argument("--iters", type=_whole(1), default=None, help="timed runs per candidate (default: the runner's)")
    t.add_argument("--seed", type=_whole(0), default=0, help="the random inputs' seed (default 0)")
    t.add_argument("--json", default=None, help="write the summary as JSON here")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--fast-math", action="store_true",
                   help="let tensor-core candidates compute tanh and sigmoid on tanh.approx (a separate database key)")
    return p


#: what ``spacefusion[tvm]`` brings; the core (IR, reference, GPU runtime) runs without them
COMPILER_MODULES = frozenset({"tvm", "tvm_ffi", "islpy", "xgboost", "tqdm"})


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return {"demo": demo, "build": build_cmd, "tune": tune_cmd}[args.cmd](args)
    except (SpaceFusionError, KeyError) as e:
        print(f"spacefusion: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name not in COMPILER_MODULES:
            raise
        print(f"spacefusion: error: {args.cmd} needs the compiler, and {e.name!r} is not installed: "
              f"pip install 'spacefusion[tvm]' (a GPU machine that only measures needs 'spacefusion[gpu]' "
              f"and the spacefusion-measure command)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
