"""The layer rules, as data: ``tests/test_layers.py`` checks every import of the repository against them.

A module belongs to the part whose prefix matches it longest (``spacefusion.lower.mma`` is in
``spacefusion.lower``, ``spacefusion.api`` in the face ``spacefusion``). An import from part A of a module
of part B is allowed when B is A itself or in ``ALLOWED[A]``, and never when (A, B) is in ``NEVER`` (a
never-pair outranks an allowed arrow). Third-party heavy dependencies may be imported only by the modules
that ``HEAVY`` names (by prefix, the longest wins), at module level ("any") or inside functions only
("lazy"). ``EXCEPTIONS`` lists single imports allowed against the rules above, each with its reason.
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
