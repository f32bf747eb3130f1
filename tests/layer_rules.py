"""The layer rules, as data: ``tests/test_layers.py`` checks every import of the repository against them.

A module belongs to the part whose prefix matches it longest (``spacefusion.lower.mma`` is in
``spacefusion.lower``, ``spacefusion.api`` in the face ``spacefusion``). An import from part A of a module
of part B is allowed when B is A itself or in ``ALLOWED[A]``, and never when (A, B) is in ``NEVER`` (a
never-pair outranks an allowed arrow). Third-party heavy dependencies may be imported only by the modules
that ``HEAVY`` names (by prefix, the longest wins), at module level ("any") or inside functions only
("lazy"). ``EXCEPTIONS`` lists single imports allowed against the rules above, each with its reason.
``experiments/`` imports library code through ``PUBLIC_API`` only (a public module, or a name one of them offers
that is not a module of its own); ``EXPERIMENT_INTERNALS`` lists the internal studies' other imports, each with
its reason (an entry covers the module it names and the modules under it).
The GPU runtime's closure (its modules, every repo module they import, lazily or not, and everything
those import at module level) must not reach ``RUNTIME_FORBIDDEN``.
"""

from __future__ import annotations

#: part -> its module prefix (the part's name is its prefix)
PARTS = (
    "smg",
    "schedulers",
    "search",
    "spacefusion.lower",
    "spacefusion.runtime",
    "spacefusion.frontend",
    "spacefusion.runners",
    "spacefusion.models",
    "spacefusion",  # the face: api, cli, __init__
    "experiments",
    "tests",
)

_CORE = ("smg", "schedulers", "search")
_FACE_SIDE = ("spacefusion", "spacefusion.frontend", "spacefusion.runners", "spacefusion.models")

#: the arrows: part -> the other parts it may import
ALLOWED: dict[str, tuple[str, ...]] = {
    "smg": (),
    "schedulers": ("smg",),
    "search": ("smg", "schedulers"),
    "spacefusion.lower": ("smg", "schedulers"),
    # the runtime reads artefacts: the smg reference to check outputs (lazily) and the measuring wire format,
    # ``search.records`` (pure data: json, math, dataclasses; ``schedulers``/``smg`` only under TYPE_CHECKING)
    "spacefusion.runtime": ("smg", "search.records"),
    # the face and its implementations (builders, runners, the torch frontend) are one layer; they use each other
    "spacefusion.frontend": (*_CORE, *_FACE_SIDE, "spacefusion.lower", "spacefusion.runtime"),
    "spacefusion.runners": (*_CORE, *_FACE_SIDE, "spacefusion.lower", "spacefusion.runtime"),
    "spacefusion.models": (*_CORE, *_FACE_SIDE),
    "spacefusion": (*_CORE, *_FACE_SIDE, "spacefusion.lower", "spacefusion.runtime"),
    "experiments": (*_CORE, *_FACE_SIDE, "spacefusion.lower", "spacefusion.runtime"),
    "tests": tuple(p for p in PARTS if p != "tests"),
}

#: never, whatever ALLOWED says (part or module prefix on the right)
NEVER: tuple[tuple[str, str, str], ...] = (
    ("spacefusion.lower", "spacefusion", "lowering is a pure function of (SMG, Schedule, target); the face calls it"),
    ("spacefusion.lower", "search", "search never meets lowering but through the builder interface"),
    ("spacefusion.lower", "spacefusion.frontend", "lowering knows no torch graphs"),
    ("spacefusion.lower", "spacefusion.runners", "lowering builds, the runners measure"),
    ("spacefusion.runtime", "schedulers", "the GPU runtime imports nothing of the compiler"),
    ("spacefusion.runtime", "spacefusion.lower", "the GPU runtime imports nothing of the compiler"),
    ("search", "spacefusion", "search defines interfaces and takes implementations as arguments"),
    *((lib, "experiments", "library code never imports experiment scripts") for lib in (*_CORE, *_FACE_SIDE,
                                                                                       "spacefusion.lower",
                                                                                       "spacefusion.runtime")),
    *((lib, "tests", "nothing outside tests imports tests") for lib in (*_CORE, *_FACE_SIDE, "spacefusion.lower",
                                                                          "spacefusion.runtime", "experiments")),
)

#: heavy third-party dependency -> {module prefix that may import it: "any" (module level too) | "lazy"}
HEAVY: dict[str, dict[str, str]] = {
    "tvm": {"spacefusion.lower": "any", "tests": "any"},
    "tvm_ffi": {"spacefusion.lower": "any", "tests": "any"},
    # exact footprints; the core installs with numpy and sympy only, so smg's use waits inside the function
    "islpy": {"schedulers.traffic": "any", "smg.footprint": "lazy"},
    # the learned cost model (the first-round prior loads through it)
    "xgboost": {"search.learned": "any"},
    "torch": {
        "smg.reference_torch": "lazy",  # the torch reference of an SMG, imported where torch is
        "schedulers.hardware": "lazy",  # device properties when cupy is missing (HardwareModel.from_device)
        "spacefusion.runtime": "any",
        "spacefusion.frontend": "any",
        "spacefusion.runners": "any",
        "spacefusion.models": "any",
        "experiments": "any",
        "tests": "any",
    },
}

#: what the GPU runtime's import closure must never reach
RUNTIME = "spacefusion.runtime"
RUNTIME_FORBIDDEN = ("tvm", "tvm_ffi", "islpy", "xgboost")

#: (importing module, imported module) -> why it stands against the rules
EXCEPTIONS: dict[tuple[str, str], str] = {}

#: the public API: what ``experiments/`` (and a user's script) imports of the library; each is import-light
#: (names resolve on first use) and documented in docs/architecture.md, "The public API"
PUBLIC_API = (
    "spacefusion",  # the package: build, schedule, compile, report, workloads, ...
    "spacefusion.api",  # hardware, graphs, schedules, candidates, estimate, first picks, build/export/load, frontend
    "spacefusion.tuning",  # tune, tune_with and its parts, the database and records, runners, prior, metrics
    "spacefusion.runtime",  # the GPU runtime's face: artefacts, load_kernel, CudaKernel, time_cuda (no TVM)
    "spacefusion.models",  # the model zoo (BERT, LLaMA, ViT in plain PyTorch)
)

#: (experiment module, internal library module or prefix) -> why that study may import it
EXPERIMENT_INTERNALS: dict[tuple[str, str], str] = {
    ("experiments.training_step", "spacefusion.frontend"):
        "times a training step's parts: the weight refresh (compiled.CompiledGraph._refresh) and the kernel calls "
        "(fused.FusedKernel, training.DerivedAttentionBackward, derived_norms.DerivedNormBackward, "
        "derived_epilogues.DerivedActGemmBackward) apart from the step they are part of",
    ("experiments.mma_cases", "smg.fold"):
        "the lowering's MMA cases fold dims by hand (fold_dims) to build the exact graphs the MMA tests probe",
    ("experiments.cluster_groupnorm", "schedulers.split"):
        "studies the GroupNorm split rule itself: decide_split and ONE_KERNEL_MAX_ROW against measurements",
    ("experiments.tuning.unet_groupnorms", "schedulers.split"):
        "measures both sides of the split rule's decision (decide_split) for the UNet's GroupNorms",
    ("experiments.conv_chains", "smg.ops"):
        "checks the upsample-fold matrix (upsample_fold) a fused upsample+conv chain merges its weights with",
    ("experiments.conv_chains", "spacefusion.frontend.convs"):
        "compares its chain rule with the frontend's convolution builder's own (by_parity)",
    ("experiments.conv_layouts", "spacefusion.frontend.layouts"):
        "studies the frontend's layout rule (choose_layout, NCHW_MARGIN) against measured NHWC/NCHW kernels",
    ("experiments.family_picks", "spacefusion.frontend.families"):
        "studies the family transfer of first picks (transferring, ORIGIN, NEAR) against ranking in full",
    ("experiments.dynamo_gpu", "spacefusion.frontend.partition"):
        "an in-run A/B of one pattern: swaps the partitioner's ROWS for the run (_without_matcher)",
    ("experiments.dynamo_gpu", "spacefusion.frontend.table"):
        "an in-run A/B of one pattern: looks the row up in the pattern table's ROWS (_without_matcher)",
    ("experiments.tuning.register_corpus", "schedulers.warp_tile"):
        "measures register caps up to the warp-specialised consumer's CONSUMER_REGS (setmaxnreg)",
    ("experiments.tuning.simt_pick_eval", "search.cost"):
        "re-ranks with one constant of the cost model patched (STEP_LATENCY_S): a study of that constant",
    ("experiments.harness", "schedulers.hardware"):
        "the GPU-side harness reads the hardware model (from_device, the presets) by a stdlib-only import that "
        "loads nothing else of the library (test_harness checks sys.modules)",
    ("experiments.gpu_runtime", "smg.tolerance"):
        "GPU-side helper that must load nothing of spacefusion but the runtime (test_mask_attention_script checks "
        "sys.modules; spacefusion.api would be loaded); smg.tolerance is numpy-only",
}
