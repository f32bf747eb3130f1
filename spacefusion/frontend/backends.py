"""Kernel backends: each turns an SMG into a callable on torch tensors keyed by the SMG's input names.

``reference`` evaluates the SMG unfused in numpy (float64, a check of the mapping, not of a kernel);
``llvm`` builds the schedule with TVM for the CPU; ``cuda`` is the seam for the GPU runtime (artefacts built
here, where TVM is, launched by ``spacefusion.runtime.gpu`` where it is not).  A backend compiles each
SMG content key once, so identical subgraphs across layers share one kernel.

bfloat16 runs on every target: the CPU backends cross it to numpy as its bits (``arrays``, ``ml_dtypes``), the
reference rounds each float64 output through float32 to bf16 as a kernel's store does, and llvm runs TVM's bf16
kernels (float32 compute, bf16 storage), as the CUDA kernels are (``tests/test_bf16.py``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from schedulers.barrier import Barrier, find_barrier, stages
from schedulers.hardware import CPU_STAND_IN, PRESETS, HardwareChoice, HardwareModel
from schedulers.split import SPLIT_RULE, SplitReduction, decide_split
from smg.ir import SMG
from smg.loads import check_ids, resolve
from smg.reference import evaluate
from smg.stores import scatter, stores_of
from spacefusion.frontend.arrays import round_to, to_numpy, to_torch
from spacefusion.frontend.errors import FrontendError
from spacefusion.frontend.layouts import LayoutChoice, decide
from spacefusion.frontend.schedules import ScheduleFor, default_schedule
from spacefusion.frontend.seen import mark, seen
from spacefusion.frontend.sequence import barrier_sequence, sequence

Kernel = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class _Cached:
    """Compile once per SMG key; ``built`` counts the distinct kernels.  With ``split_hw``, a graph whose
    reductions leave that machine's SMs idle runs as ``schedulers.split``'s two kernels (``splits`` says
    which and why)."""

    name = "?"

    def __init__(self, split_hw: HardwareModel | None = None) -> None:
        self._kernels: dict[str, Kernel] = {}
        self.split_hw = split_hw
        self.split_kw: dict[str, int] = {}  # decide_split's keywords (a test's smaller chunks)
        self.splits: dict[str, str] = {}
        self._layouts: dict[str, LayoutChoice] = {}

    @property
    def built(self) -> int:
        return len(self._kernels)

    def compile(self, smg: SMG) -> Kernel:
        if smg.key not in self._kernels:
            barrier = find_barrier(smg)
            if isinstance(barrier, Barrier):  # nothing of it can be cut into blocks: two graphs
                self.splits[smg.key] = barrier.reason
                parts = stages(barrier)  # each stage as it is: no split of its own (the barrier chose them)
                self._kernels[smg.key] = barrier_sequence(barrier, parts, [self._leaf(g) for g, _ in parts])
                return self._kernels[smg.key]
            split = self.split_of(smg)
            if split is None:
                self._kernels[smg.key] = self._compile(smg)
            else:
                self._kernels[smg.key] = sequence(split, [self._compile(k) for k in split.kernels])
        return self._kernels[smg.key]

    def _leaf(self, smg: SMG) -> Kernel:
        if smg.key not in self._kernels:
            self._kernels[smg.key] = self._compile(smg)
        return self._kernels[smg.key]

    def split_of(self, smg: SMG) -> SplitReduction | None:
        """``smg``'s split where ``split_hw`` asks for one (the reason kept in ``splits``), else None."""
        if self.split_hw is None or not any(op.reduce for op in smg.ops):
            return None
        got = decide_split(smg, self.split_hw, **self.split_kw)
        self.splits[smg.key] = got if isinstance(got, str) else got.reason
        return None if isinstance(got, str) else got

    def layout_of(self, nchw: SMG, nhwc: SMG) -> LayoutChoice:
        """How a conv reads an NCHW image (``layouts.decide`` on ``split_hw``; where none, as on llvm, on
        ``CPU_STAND_IN``: the CPU has no model, and either layout is a correct kernel), once per conv."""
        if nchw.key not in self._layouts:
            self._layouts[nchw.key] = decide(nchw, nhwc, self.split_hw or CPU_STAND_IN)
        return self._layouts[nchw.key]

    def _compile(self, smg: SMG) -> Kernel:
        raise NotImplementedError


def _numpy(inputs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: to_numpy(v) for k, v in inputs.items()}


class ReferenceBackend(_Cached):
    name = "reference"

    def _compile(self, smg: SMG) -> Kernel:
        def run(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            arrays = _numpy(inputs)
            check_ids(smg, arrays)  # an id past its table raises, as torch's embedding does (``smg.loads``)
            out = evaluate(smg, resolve(smg, arrays))
            for st in stores_of(smg):  # into the caller's tensor (``to_numpy`` shares a CPU tensor's memory)
                scatter(st, smg, round_to(out.pop(st.value), smg.space(st.value).dtype), arrays[st.into],
                        arrays[st.positions])
            # packed like a kernel's output (numpy's einsum may return a transposed array): the views the
            # graph takes of it then have the strides the partition read from ``tensor_meta``
            # rounded to the output's dtype as a kernel's store rounds its float32 (bf16 included: ``arrays``)
            return {k: to_torch(round_to(v, smg.space(k).dtype)) for k, v in out.items()}

        return run


class LLVMBackend(_Cached):
    """TVM's llvm build of each SMG's schedule (``schedule_for``: the default, or a tuning database's).

    Inside ``sizes_per_call`` (the specialisations of a graph with symbolic sizes, ``compiled.PerShape``) and
    with the default schedules, an SMG whose rows can be a run-time size is built so (``symbolic_kernels``),
    and a later size of its family within the range reuses that kernel: ``builds`` lists every TVM build
    (SMG name, "static" or "symbolic"), ``symbolic.reused`` the SMGs served without one."""

    name = "llvm"

    def __init__(self, schedule_for: ScheduleFor = default_schedule, split_hw: HardwareModel | None = None) -> None:
        from spacefusion.frontend.symbolic_kernels import SymbolicKernels

        super().__init__(split_hw)
        self.schedule_for = schedule_for
        self.per_call = False  # inside ``sizes_per_call``
        self.symbolic = SymbolicKernels()
        self.builds: list[tuple[str, str]] = []

    @contextlib.contextmanager
    def sizes_per_call(self) -> Iterator[None]:
        """Inside, SMGs are built with their rows a run-time size where they can be, and reuse such a kernel
        of their family (``symbolic_kernels``): a graph with symbolic sizes then builds a GEMM once for a range
        of lengths.  Only with the default schedules: a tuning database's pick is made per size."""
        was, self.per_call = self.per_call, self.schedule_for is default_schedule
        try:
            yield
        finally:
            self.per_call = was

    def _kernel_for(self, smg: SMG) -> object:
        """The kernel of ``smg``: a symbolic one of its family (found, or built here) inside ``sizes_per_call``,
        else the static build of its schedule."""
        from spacefusion.api import build

        if self.per_call:
            found = self.symbolic.find(smg)
            if found is not None:
                return found
            s = self.schedule_for(smg)
            kernel = self.symbolic.build(s, "llvm")
            if kernel is not None:
                self.builds.append((smg.name, "symbolic"))
                return kernel
        else:
            s = self.schedule_for(smg)
        self.builds.append((smg.name, "static"))
        return build(s, "llvm")

    def _compile(self, smg: SMG) -> Kernel:
        kernel = self._kernel_for(smg)

        def run(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            arrays = _numpy(inputs)
            check_ids(smg, arrays)  # the kernel would read zeros there; torch's embedding raises (``smg.loads``)
            return {k: to_torch(v) for k, v in kernel(arrays).items()}

        return run


def _stale(path: Path) -> bool:
    """Whether the artefact at ``path`` was built by other code than this (``lower.fingerprint``; an artefact
    that records none counts as other): a backend that can build rebuilds it rather than serve it."""
    from spacefusion.lower.fingerprint import code_fingerprint

    try:
        return json.loads((path / "kernel.json").read_text()).get("code") != code_fingerprint()
    except (OSError, ValueError):
        return True


#: the folder of a kernel folder that keeps each family's ranked heads (``families``)
FAMILIES = "families"
#: the file of a kernel folder that says which machine its first picks, splits and layouts were ranked for
HARDWARE_FILE = "hardware.json"
#: ``CudaBackend``'s ``split_hw`` default: the machine the backend ranks for (``hardware``)
RANKING = "ranking"


def recorded_hardware(folder: Path) -> tuple[HardwareModel, dict] | None:
    """The machine ``folder``'s kernels were ranked for (its ``HARDWARE_FILE``) and the record; None where the
    folder has none (empty, or exported before the record existed); FrontendError naming a damaged one."""
    path = Path(folder) / HARDWARE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        model = HardwareModel.from_dict(record["model"])
    except (ValueError, KeyError, TypeError) as exc:
        raise FrontendError(f"{path} is not a hardware record ({exc}); move it away, or export into another "
                            f"folder") from exc
    preset = PRESETS.get(model.name.lower())
    return (preset if preset == model else model), record  # the preset itself where it is one


#: the default of ``CudaBackend(symbolic=)``.  Off until the ``cuda`` tests of the run-time row count
#: (``tests/test_symbolic_kernels.py``, ``test_symbolic_tensorcore.py``) have passed on a GPU: those kernels
#: are compiled by nvcc and checked on llvm here, but their launches at run-time sizes have not run on a GPU
#: yet, and a dynamic-shape session must not be the first place they run.  ``symbolic=True`` opts in.
SYMBOLIC_ROWS_ON_GPU = False


class CudaBackend(_Cached):
    """The GPU backend: ``export`` builds each SMG's CUDA artefact (needs TVM, this machine);
    ``compile`` loads an exported artefact with ``spacefusion.runtime.gpu`` (needs torch + cupy and a
    GPU, no TVM) and launches it on torch tensors (``experiments/e2e_gpu.py`` runs whole models).

    ``hardware`` is the machine whose numbers rank what this backend decides (a ``HardwareChoice``, a
    ``HardwareModel`` or a preset's name; None: the GPU in hand's preset, else the reported default,
    ``machine.ranking_hardware``); ``split_hw`` defaults to it.  The folder records it (``HARDWARE_FILE``)
    when a decision is first written there, since artefacts are named by the SMG alone: a backend that builds
    (``build_missing``) refuses a folder ranked for another machine rather than serve or mix its kernels; one
    that only loads takes the folder's record as its own (the kernels are correct on any sm_90a GPU, only
    ranked for the recorded machine's numbers), saying so in a log line where it differs from the GPU's.
    ``schedule_for`` is the caller's: ranked for the same machine where it ranks (``dynamo.first_pick_for``)."""

    name = "cuda"
    #: forms left to torch's library kernels on the GPU, each with why (reported as the op's reason): where the
    #: fused kernel measured slower than the library's, fusing its epilogue does not pay it back.  Set it to
    #: ``{}`` on an instance to fuse them anyway (research on the kernels themselves).
    library_first: Mapping[str, str] = MappingProxyType({
        "dwconv": "a depthwise convolution stays with cuDNN on the GPU: the CUDA-core kernel (halo-staged window, "
                  "fp32 taps) measured 2.2-2.9x slower than cuDNN's (H100, ConvNeXt-T's 7x7 at 32x96x56x56: "
                  "208-368 us against 96), more than fusing its BatchNorm and activation saves",
        "stem_conv": "a convolution of input channels not a multiple of 8 (an RGB stem, a raw waveform) stays with "
                     "cuDNN on the GPU until measured: its K is padded (convs.k_align) and its tile gathered element "
                     "by element, and the model ranks ResNet-50's stem at batch 32 (fp16, H100, channels-last) at "
                     "131.8 us for the fused conv + BatchNorm + ReLU, where cuDNN's conv measured 61 us; fused on "
                     "the CPU targets",
        "kv_cache_write": "a KV-cache write (StaticCache's index_copy_) stays with torch on the GPU until the "
                          "fused writes' cuda tests have run there (tests/test_static_cache.py's CUDA-graph replay, "
                          "tests/test_indexed_stores.py): RoPE's kernel storing K and V into the caller's caches is "
                          "checked on the CPU targets and compiled by nvcc, not yet launched on a GPU",
        "embedding_gather": "an embedding (F.embedding's rows picked by token ids) stays with torch on the GPU until "
                            "the gathering norm kernel's cuda test has run there (tests/test_embedding_norm.py): "
                            "the kernel (frontend.embeddings) is checked on the CPU targets and compiled by nvcc, "
                            "not yet launched on a GPU",
        "expert_gemm": "an MoE experts' grouped GEMM stays with the library on the GPU: fused, each row reads its "
                       "expert's weight from global through its id (frontend.experts), a GEMV a row on CUDA cores "
                       "against the library's tensor-core GEMM per expert; fused on the CPU targets",
        "weight_gradient": "a weight gradient grad.T @ x stays with cuBLAS on the GPU: its A lies [k, m] (k the "
                           "tokens, outer in both operands) and the tensor-core GEMM takes A with k last only "
                           "(schedulers.warp_tile), so the fused kernel runs on CUDA cores against cuBLAS's tensor "
                           "cores in half precision; in float32 against cuBLAS's SGEMM, not measured yet"})

    def __init__(self, folder: str | Path, arch: str = "sm_90a", schedule_for: ScheduleFor = default_schedule,
                 build_missing: bool = False, load: bool = True, by_schedule: bool = False,
                 split_hw: HardwareModel | None | str = RANKING,
                 hardware: HardwareChoice | HardwareModel | str | None = None,
                 symbolic: bool | None = None) -> None:
        from spacefusion.frontend.machine import log, ranking_hardware

        folder = Path(folder)
        choice = hardware if isinstance(hardware, HardwareChoice) else ranking_hardware(hardware)
        recorded = recorded_hardware(folder)
        if recorded is not None and recorded[0] != choice.model:
            there = f"{folder} holds kernels ranked for the {recorded[0].name} ({recorded[1].get('why', '')})"
            if build_missing:
                raise FrontendError(f"{there}, and this backend builds for the {choice}: give it another folder "
                                    f"(one per machine), or hardware={recorded[0].name!r} to go on ranking for "
                                    f"the {recorded[0].name}")
            log.warning("%s; loaded as they are on the %s", there, choice)
            choice = HardwareChoice(recorded[0], f"recorded with the kernels in {folder / HARDWARE_FILE}")
        self.hardware = choice
        super().__init__(choice.model if isinstance(split_hw, str) and split_hw == RANKING else split_hw)
        self.folder, self.arch, self.schedule_for = folder, arch, schedule_for
        self.build_missing = build_missing  # export an artefact not found (TVM and the GPU in one process)
        self.load = load  # False: export only (where TVM is and no GPU); the kernel refuses to run
        # artefacts named by the schedule too (a tuning database's pick may change; a first pick may not)
        self.by_schedule = by_schedule
        self.stale_splits: dict[str, str] = {}  # SMG key -> why its exported split.json was not used
        # first picks of a new set of sizes from the family's ranking (``families``): on for the
        # specialisations of a graph with symbolic sizes (``sizes_per_call``), off for static graphs
        self.transfer = False
        #: kernels with a run-time row count for the specialisations of a symbolic graph (``symbolic_rows``)
        self.symbolic = SYMBOLIC_ROWS_ON_GPU if symbolic is None else bool(symbolic)

    @contextlib.contextmanager
    def sizes_per_call(self) -> Iterator[None]:
        """Inside, a first pick of an SMG whose family (its graph up to dim sizes) was ranked before comes
        from that ranking (``families``): what a graph with symbolic sizes needs at each new size, which the
        call waits for."""
        was, self.transfer = self.transfer, True
        try:
            yield
        finally:
            self.transfer = was

    @property
    def symbolic_rows(self) -> bool:
        """Whether kernels are built with their rows a run-time size and served to a family's later lengths
        (``symbolic_artefacts``): inside ``sizes_per_call``, and not with a tuning database's picks
        (``by_schedule``), whose best at each size wins."""
        return self.symbolic and self.transfer and not self.by_schedule

    def artefact_path(self, smg: SMG) -> Path:
        """Where ``smg``'s kernel is: with ``symbolic_rows``, a symbolic artefact of its family whose range
        holds its rows (``symbolic_artefacts.served``: built once for a range of lengths), else its own."""
        if self.symbolic_rows:
            from spacefusion.frontend.symbolic_artefacts import served

            got = served(self.folder, smg)
            if got is not None:
                return got
        return self.artefact_dir(smg)

    def artefact_dir(self, smg: SMG) -> Path:
        if self.by_schedule:
            return self.folder / f"{smg.key[:16]}-{self.schedule_for(smg).key[:16]}"
        return self.folder / smg.key[:16]

    def split_of(self, smg: SMG) -> SplitReduction | None:
        """The split exported with ``smg``'s artefacts (``split.json``: derived once, where they were built),
        or derived here and written there.  A decision to keep one kernel is recorded too (``one kernel``,
        with the rule and the machine it was decided for), so a warm compile does not derive a norm's
        update functions again (sympy: about a second for BERT's two LayerNorms) only to decide the same."""
        if self.split_hw is None:
            return None
        path = self.folder / smg.key[:16] / "split.json"
        if path.is_file():
            try:
                record = json.loads(path.read_text())
                if "one kernel" not in record:
                    got = SplitReduction.from_dict(smg, record)
                    self.splits[smg.key] = got.reason
                    return got
                if record == self._one_kernel(smg, record["one kernel"]):
                    self.splits[smg.key] = str(record["one kernel"])
                    return None
            except (ValueError, KeyError, TypeError, AttributeError) as e:  # another rule's split (or a damaged
                self.stale_splits[smg.key] = str(e)                          # file): derived again below
        got = super().split_of(smg)
        if got is None and path.exists():  # another rule's split stays, for the error that names it
            return None
        record = got.to_dict() if got is not None else self._one_kernel(smg, self.splits.get(smg.key, ""))
        try:
            self._record_hardware()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".json.{os.getpid()}.tmp")  # whole or not at all: workers share the folder
            tmp.write_text(json.dumps(record))
            tmp.replace(path)
        except OSError:
            if got is not None:  # a split must reach the GPU machine; a decision to keep one kernel need not
                raise
        return got

    def _record_hardware(self) -> None:
        """Write the folder's ``HARDWARE_FILE`` (which machine this backend ranks for) before its first
        decision there; a folder that has one keeps it (the constructor checked it is this backend's)."""
        path = self.folder / HARDWARE_FILE
        if path.is_file():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".json.{os.getpid()}.tmp")  # whole or not at all: workers share the folder
        tmp.write_text(json.dumps({**self.hardware.to_dict(), "model": self.hardware.model.to_dict()}, indent=1))
        tmp.replace(path)

    def _one_kernel(self, smg: SMG, reason: str) -> dict[str, object]:
        """The record of a decision to keep ``smg`` one kernel: what it was decided for, and why."""
        return {"smg": smg.key, "rule": SPLIT_RULE, "hw": self.split_hw.name, "kw": dict(sorted(self.split_kw.items())),
                "one kernel": reason}

    def layout_of(self, nchw: SMG, nhwc: SMG) -> LayoutChoice:
        """The layout recorded in ``layouts.json`` by the export (the GPU machine has no cost model to decide
        it), or decided here and recorded there.  A record of another rule is decided again; a file that is
        not a layouts record raises rather than be overwritten."""
        path, key = self.folder / "layouts.json", nchw.key[:16]
        try:
            records = json.loads(path.read_text()) if path.is_file() else {}
            if not isinstance(records, dict):
                raise ValueError(f"a {type(records).__name__}, not an object of records")
        except ValueError as exc:
            raise FrontendError(f"{path} is not a layouts record ({exc}); move it away to decide the layouts "
                                f"again") from exc
        if key in records:
            try:
                return LayoutChoice.from_dict(records[key])
            except ValueError:
                pass  # another rule's (or a damaged) record: decided again and replaced
        got = super().layout_of(nchw, nhwc)
        if not math.isnan(got.nchw_us):  # a decision made without the cost model is not recorded
            self._record_hardware()
            records[key] = got.to_dict()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(records, indent=1, sort_keys=True))
            tmp.replace(path)
        return got

    def warm_up(self, signature: str | None = None) -> None:
        """Start the export workers (``parallel_build.start_pool``) where this backend builds what it lacks, so
        that their imports overlap the partition that comes before the first ``prefetch``; not where this
        folder compiled a graph of ``signature`` before (``seen``): that compile is warm, and the workers'
        imports would only compete with it."""
        if self.build_missing and not (signature and seen(self.folder, signature)):
            from spacefusion.frontend.parallel_build import start_pool

            start_pool()

    def mark_seen(self, signatures: Sequence[str]) -> None:
        """Record in this folder that graphs of ``signatures`` compiled (``seen.mark``)."""
        if self.build_missing:
            mark(self.folder, signatures)

    def prefetch(self, smgs: list[SMG]) -> dict[str, str]:
        """Export, in parallel worker processes (``parallel_build``), the artefacts that ``compile`` would
        build one by one: those of ``smgs`` it has not compiled and that are not a barrier's, whose split is
        not decided yet (the worker decides it: a norm's update functions are derived there, not here) or
        whose kernels (the SMG's, or its split's) the folder lacks or holds from other code.  {SMG key:
        error} of the failed ones (their serial build reports it)."""
        from spacefusion.frontend.parallel_build import export_many

        if not self.build_missing:
            return {}
        todo: dict[str, SMG] = {}
        for smg in smgs:
            if smg.key in self._kernels or smg.key in todo or isinstance(find_barrier(smg), Barrier):
                continue
            undecided = self.split_hw is not None and not (self.folder / smg.key[:16] / "split.json").is_file()
            if undecided or self._missing(smg):  # the worker decides the split, then exports what is missing
                todo[smg.key] = smg
        if todo:
            self._record_hardware()  # before the workers: theirs would race to write it
        return export_many(self.folder, self.arch, self.schedule_for, self.by_schedule, list(todo.values()),
                           split=(self.split_hw, self.split_kw), hardware=self.hardware, transfer=self.transfer)

    def _missing(self, smg: SMG) -> list[SMG]:
        """The kernels ``compile`` would build for ``smg`` (its split's, or its own) that the folder lacks or
        holds from other code."""
        split = self.split_of(smg)
        return [k for k in (split.kernels if split is not None else [smg])
                if not (self.artefact_path(k) / "kernel.json").is_file() or _stale(self.artefact_path(k))]

    def export_all(self, smg: SMG) -> None:
        """What a worker does with one SMG of ``prefetch``: decide its split (recorded in ``split.json``) and
        export every kernel of it that is missing."""
        for k in self._missing(smg):
            self.export(k)

    def export(self, smg: SMG, cubin: bool = True) -> Path:
        """Write ``smg``'s kernel.cu + kernel.json (+ kernel.cubin where nvcc is and ``cubin``), and
        ``timing.json``: the seconds its schedule (the first pick's search), TVM's lowering and the save
        (nvcc) took, what a cold compile's time is made of (``experiments/compile_time.py`` reads them), the
        machine its schedule was ranked for, with why (a default says so), and the sizes of the family ranking
        its first pick came from (``families``; None: ranked in full)."""
        from spacefusion.api import build
        from spacefusion.frontend import families

        self._record_hardware()
        t0 = time.perf_counter()
        families.ORIGIN.pop(smg.key, None)
        with families.transferring(self.folder / FAMILIES, self.transfer):
            schedule = self.schedule_for(smg)
        t1 = time.perf_counter()
        sym = None
        if self.symbolic_rows:  # a specialisation of a symbolic graph: its rows a run-time size where they can be
            from spacefusion.frontend import symbolic_artefacts

            sym = symbolic_artefacts.symbolic_dim(schedule, smg)
        art = build(schedule, f"cuda:{self.arch}", symbolic=sym)
        t2 = time.perf_counter()
        where = self.artefact_dir(smg) if sym is None else symbolic_artefacts.artefact_dir(self.folder, schedule, sym)
        path = art.save(where, compile_cubin=cubin)
        if sym is not None:
            symbolic_artefacts.record(self.folder, smg, sym, path)
        t3 = time.perf_counter()
        (path / "timing.json").write_text(json.dumps({"name": smg.name, "schedule_s": round(t1 - t0, 3),
                                                      "lower_s": round(t2 - t1, 3), "save_s": round(t3 - t2, 3),
                                                      "ranked_for": self.hardware.to_dict(),
                                                      "picked_from_sizes": families.ORIGIN.get(smg.key)}))
        return path

    def _compile(self, smg: SMG) -> Kernel:
        from spacefusion.runtime.gpu import load_kernel, torch_dtype

        path = self.artefact_path(smg)
        if self.build_missing and (not (path / "kernel.json").is_file() or _stale(path)):
            path = self.export(smg)
        if not (path / "kernel.json").is_file():
            # an export under another split rule has the kernels of its own decision, not of this code's
            stale = self.stale_splits.get(smg.key)
            why = (f" (its exported split.json was not used: {stale}; export the model again with this code)"
                   if stale else "")
            raise FrontendError(f"no CUDA artefact for {smg.name} at {path}: run CudaBackend.export where TVM is{why}")
        if not self.load:
            def exported(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                raise FrontendError(f"{smg.name}: exported to {path} only (load=False); run it on the GPU")

            return exported
        kernel = load_kernel(path)
        # a symbolic kernel (``symbolic_artefacts``) runs at this SMG's rows: its launchers are made for them
        sym = kernel.artefact.symbolic
        size = smg.dim_sizes[sym.dim] if sym is not None else None
        sized = {"size": size} if size is not None else {}
        # a folded schedule's kernel (smg.fold) takes the same memory with merged dims: view, never copy
        shapes = {p.name: p.shape if sym is None else sym.shape_at(p, size)
                  for p in (*kernel.artefact.inputs, *kernel.artefact.outputs)}
        ins = [p.name for p in kernel.artefact.inputs]
        dtypes = [torch_dtype(p.dtype) for p in kernel.artefact.inputs]
        outs = [(p.name, smg.shape(p.name)) for p in kernel.artefact.outputs]
        fast: dict[int, Callable] = {}

        def positional(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            """The inputs in artefact order, as the kernel's shapes; the outputs in artefact order, as the
            SMG's.  The first call on a device checks every tensor (and a changed dtype is checked again,
            to raise); later ones launch unchecked: the views fix the element counts, the graph the rest."""
            xs = tuple(x.contiguous().view(shapes[k]) for k, x in zip(ins, xs))
            device = xs[0].device.index
            launch = fast.get(device)
            if launch is None or any(x.dtype != dt for x, dt in zip(xs, dtypes)):
                out = kernel(**dict(zip(ins, xs)))
                if device is not None and hasattr(kernel, "launcher"):
                    fast[device] = kernel.launcher(device, **sized)
                return tuple(out[k].view(shape) for k, shape in outs)
            return tuple(t.view(shape) for (_, shape), t in zip(outs, launch(*xs)))

        def run(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return dict(zip((k for k, _ in outs), positional(*(inputs[k] for k in ins))))

        def lean(device: int, out_shapes: list[tuple[int, ...] | None]) -> Callable[..., tuple[torch.Tensor, ...]]:
            """For a caller that has run ``positional`` once (checked): a call that reads only the inputs'
            addresses (any shapes of the kernel's sizes; non-contiguous ones are packed), with each output
            allocated in ``out_shapes`` (None: the SMG's shape), so nothing is viewed on the way in or out.
            Sizes and dtypes are still compared (a few attribute reads): another shape raises, never reads
            out of bounds."""
            launch = kernel.launcher(device, [s if s is not None else shape for s, (_, shape) in zip(out_shapes, outs)],
                                     **sized)
            # a tensor map is encoded from its tensor's sizes and strides: those inputs keep the kernel's shape
            mapped = {p.tensor_map[0] for p in kernel.artefact.params if p.tensor_map is not None}
            want = [(math.prod(shapes[k]), dt, shapes[k] if k in mapped else None) for k, dt in zip(ins, dtypes)]

            def call(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
                for x, (n, dt, _) in zip(xs, want):
                    if x.numel() != n or x.dtype != dt:
                        raise FrontendError(f"{smg.name}: an input of {x.numel()} {x.dtype} elements where the "
                                            f"kernel was built for {n} {dt}")
                return launch(*(x.contiguous().view(s) if s is not None else x if x.is_contiguous() else x.contiguous()
                                for x, (_, _, s) in zip(xs, want)))

            return call

        run.positional = positional  # type: ignore[attr-defined]
        run.lean = lean  # type: ignore[attr-defined]
        run.cuda_kernel = kernel  # type: ignore[attr-defined]
        run.input_shapes = tuple(shapes[k] for k in ins)  # type: ignore[attr-defined]
        run.inputs = tuple(ins)  # type: ignore[attr-defined]
        run.outputs = tuple(k for k, _ in outs)  # type: ignore[attr-defined]
        return run


BACKENDS: dict[str, Callable[[], _Cached]] = {"reference": ReferenceBackend, "llvm": LLVMBackend}


def get_backend(backend: str | _Cached) -> _Cached:
    if not isinstance(backend, str):
        return backend
    if backend not in BACKENDS:
        raise FrontendError(f"unknown backend {backend!r}; known: {sorted(BACKENDS)}, or a CudaBackend instance")
    return BACKENDS[backend]()
