"""Layers import only along the arrows of ``tests/layer_rules.py``, read from the source (nothing is imported).

Every import is checked: module level, lazy ones inside functions, ``TYPE_CHECKING`` ones, and
``importlib.import_module("...")`` / ``__import__("...")`` with a constant name. The GPU runtime's import
closure (what running it may execute) must not reach the compiler's heavy dependencies; a failure names
the chain. The planted-violation tests at the bottom prove the checker catches what it should.
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import layer_rules as R

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("smg", "schedulers", "search", "spacefusion", "experiments", "tests")


@dataclass(frozen=True)
class Source:
    text: str
    is_package: bool = False  # an ``__init__.py``: relative imports resolve against the module itself
    path: str = "<memory>"


@dataclass(frozen=True)
class Imp:
    line: int
    module: str
    lazy: bool  # inside a function (runs only when it is called)
    type_only: bool  # under ``if TYPE_CHECKING:`` (never runs)


def repo_sources() -> dict[str, Source]:
    return dict(_repo_sources())


@functools.cache
def _repo_sources() -> tuple[tuple[str, Source], ...]:
    out = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO)
            if any(p.startswith((".", "_scratch")) or p == "__pycache__" for p in rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            pkg = parts[-1] == "__init__"
            mod = ".".join(parts[:-1] if pkg else parts)
            out.append((mod, Source(path.read_text(), pkg, rel.as_posix())))
    return tuple(out)


def _resolve(module: str, src: Source, name: str, level: int) -> str:
    package = module.split(".") if src.is_package else module.split(".")[:-1]
    base = package[: len(package) - level + 1] if level else []
    return ".".join(base + ([name] if name else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str, src: Source) -> tuple[Imp, ...]:
    return _imports(module, src)


@functools.cache  # Sources are frozen: each text is parsed once, planted copies only for what changed
def _imports(module: str, src: Source) -> tuple[Imp, ...]:
    """Every import in ``src`` (the text of ``module``), relative ones resolved; ``from a import b`` also
    yields ``a.b`` (b may be a module), dynamic imports with a constant name too."""
    out: list[Imp] = []

    def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend(Imp(node.lineno, a.name, lazy, type_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(module, src, node.module or "", node.level)
            out.append(Imp(node.lineno, mod, lazy, type_only))
            out.extend(Imp(node.lineno, f"{mod}.{a.name}", lazy, type_only) for a in node.names if a.name != "*")
        elif isinstance(node, ast.Call) and node.args:
            f, arg = node.func, node.args[0]
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                dots = len(arg.value) - len(arg.value.lstrip("."))
                target = _resolve(module, src, arg.value[dots:], dots) if dots else arg.value
                out.append(Imp(node.lineno, target, lazy, type_only))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, lazy, True)
            for child in node.orelse:
                visit(child, lazy, type_only)
            return
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, type_only)

    visit(ast.parse(src.text, src.path), False, False)
    return tuple(out)


def _match(module: str, prefixes) -> str | None:
    """The longest of ``prefixes`` that ``module`` is or lies under."""
    hits = [p for p in prefixes if module == p or module.startswith(p + ".")]
    return max(hits, key=len) if hits else None


def part_of(module: str) -> str | None:
    return _match(module, R.PARTS)


def _hits(module: str, targets) -> bool:
    """Whether ``module`` is in one of ``targets``: a part (by ``part_of``) or, if not a part, a module prefix."""
    return any(part_of(module) == t if t in R.PARTS else bool(_match(module, (t,))) for t in targets)


def violations(sources: dict[str, Source]) -> list[str]:
    """Each import against the arrows, the never-pairs and the heavy-dependency table."""
    bad: list[str] = []
    for mod, src in sorted(sources.items()):
        here = part_of(mod)
        if here is None:
            continue
        for imp in imports(mod, src):
            where = f"{src.path}:{imp.line} ({mod}) imports {imp.module}"
            if (mod, imp.module) in R.EXCEPTIONS or any(b.startswith(f"{src.path}:{imp.line} ") for b in bad[-3:]):
                continue  # excepted, or ``from a import b`` already reported as ``a``
                continue
            there = part_of(imp.module)
            if there is not None and there != here:
                never = [why for a, b, why in R.NEVER if a == here and _hits(imp.module, (b,))]
                if never:
                    bad.append(f"{where}: never {here} -> {there}: {never[0]}")
                elif not _hits(imp.module, R.ALLOWED[here]):
                    bad.append(f"{where}: no arrow {here} -> {there}")
            top = imp.module.split(".")[0]
            if top in R.HEAVY:
                may = R.HEAVY[top]
                key = _match(mod, may)
                if key is None:
                    bad.append(f"{where}: {top} only in {sorted(may)}")
                elif may[key] == "lazy" and not (imp.lazy or imp.type_only):
                    bad.append(f"{where}: {top} only inside functions in {key}")
    return bad


_LIBRARY = ("smg", "schedulers", "search", "spacefusion.lower", "spacefusion.runtime", "spacefusion.frontend",
            "spacefusion.runners", "spacefusion.models", "spacefusion")


def api_bypasses(sources: dict[str, Source]) -> list[str]:
    """Each import of library code by ``experiments/`` that is not through ``R.PUBLIC_API`` nor declared in
    ``R.EXPERIMENT_INTERNALS``. ``from a import b`` is judged by ``a.b``: public when ``a.b`` is a public module
    or ``a`` is one and ``b`` is a name it offers, not a module of its own (``from spacefusion.runtime import
    gpu`` reaches an internal module)."""
    bad: list[str] = []
    for mod, src in sorted(sources.items()):
        if part_of(mod) != "experiments":
            continue
        imps = imports(mod, src)
        for imp in imps:
            if part_of(imp.module) not in _LIBRARY:
                continue
            if any(o.line == imp.line and o.module.startswith(imp.module + ".") for o in imps):
                continue  # ``from a import b, c``: judged by a.b and a.c
            parent = imp.module.rpartition(".")[0]
            if imp.module in R.PUBLIC_API or (parent in R.PUBLIC_API and imp.module not in sources):
                continue
            if any(m == mod and _match(imp.module, (p,)) for m, p in R.EXPERIMENT_INTERNALS):
                continue
            bad.append(f"{src.path}:{imp.line} ({mod}) imports {imp.module}: not the public API "
                       f"({', '.join(R.PUBLIC_API)}) nor in EXPERIMENT_INTERNALS")
    return bad


def _known(module: str, sources: dict[str, Source]) -> list[str]:
    """The repo modules that importing ``module`` runs: its packages' ``__init__`` first, then itself."""
    parts = module.split(".")
    return [m for m in (".".join(parts[: i + 1]) for i in range(len(parts))) if m in sources]


def runtime_reaches(sources: dict[str, Source], forbidden=R.RUNTIME_FORBIDDEN) -> list[str]:
    """Chains from the GPU runtime to a forbidden dependency: roots are the runtime's modules and every repo
    module they import (lazily too: it runs when the function does); from there module-level imports."""
    parent: dict[str, str | None] = {}
    queue: deque[str] = deque()

    def reach(mod: str, via: str | None) -> None:
        for m in _known(mod, sources):
            if m not in parent:
                parent[m] = via
                queue.append(m)

    for mod in sorted(sources):
        if _match(mod, (R.RUNTIME,)):
            reach(mod, None)
    bad = []
    while queue:
        mod = queue.popleft()
        for imp in imports(mod, sources[mod]):
            if imp.type_only or (imp.lazy and not _match(mod, (R.RUNTIME,))):
                continue
            top = imp.module.split(".")[0]
            if top in forbidden:
                chain, m = [imp.module], mod
                while m is not None:
                    chain.append(m)
                    m = parent[m]
                bad.append(" -> ".join(reversed(chain)) + f"  ({sources[mod].path}:{imp.line})")
            reach(imp.module, mod)
    return bad


# --------------------------------------------------------------------------------------------- the repository


def test_the_rules_table_is_consistent() -> None:
    assert set(R.ALLOWED) == set(R.PARTS)
    for a, b, _ in R.NEVER:
        assert a in R.PARTS and part_of(b) is not None
        assert not _hits(b, R.ALLOWED[a]), f"{a} -> {b} is both allowed and never"
    for mod, _ in R.EXCEPTIONS:
        assert mod in repo_sources(), f"stale exception for {mod}"


def test_every_import_follows_the_layer_rules() -> None:
    assert violations(repo_sources()) == []


def test_experiments_use_the_public_api() -> None:
    assert api_bypasses(repo_sources()) == []


def test_the_public_api_and_allow_list_are_consistent() -> None:
    """Every public module and allow-listed one exists, every allow-list entry is used (none stale) and names
    an internal module (a public one needs no entry), and each has its reason."""
    sources = repo_sources()
    assert all(m in sources for m in R.PUBLIC_API)
    used = {(mod, i.module) for mod, src in sources.items() if part_of(mod) == "experiments"
            for i in imports(mod, src)}
    for (mod, prefix), why in R.EXPERIMENT_INTERNALS.items():
        assert mod in sources and any(m in sources for m in (prefix, prefix.rpartition(".")[0])), (mod, prefix)
        assert prefix not in R.PUBLIC_API and why.strip(), (mod, prefix)
        assert any(m == mod and _match(i, (prefix,)) for m, i in used), f"stale allow-list entry {mod} -> {prefix}"


def test_the_public_api_resolves_every_name() -> None:
    """What the public modules offer resolves (no stale entry in their lazy tables), and importing them loads
    nothing heavy: the names resolve on first use."""
    import subprocess
    import sys

    code = ("import sys, spacefusion, spacefusion.api, spacefusion.runtime\n"
            "heavy = sorted(m for m in ('tvm', 'islpy', 'xgboost', 'torch', 'schedulers', 'search')\n"
            "               if m in sys.modules)\n"
            "assert not heavy, heavy\n"
            "import spacefusion.api as a, spacefusion.tuning as t\n"
            "for m in (a, t):\n"
            "    for n in m.__all__: getattr(m, n)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_gpu_runtime_never_reaches_the_compilers_dependencies() -> None:
    assert runtime_reaches(repo_sources()) == []


def test_the_reader_sees_real_imports() -> None:
    """Lazy imports inside functions, relative ones resolved, TYPE_CHECKING ones marked, dynamic ones found."""
    src = repo_sources()
    found = {i.module: i for i in imports("spacefusion.runtime.batch", src["spacefusion.runtime.batch"])}
    assert not found["search.records"].lazy and found["smg.reference"].lazy and "spacefusion.runtime.gpu" in found
    rec = {i.module: i for i in imports("search.records", src["search.records"])}
    assert rec["schedulers.schedule"].type_only
    dyn = {i.module for i in imports("experiments.gpu_runtime", src["experiments.gpu_runtime"])}
    assert {"spacefusion.runtime", "smg.tolerance"} <= dyn  # importlib.import_module("...")
    assert any(m.startswith("spacefusion.api") for m in (
        i.module for i in imports("spacefusion.runners.builder", src["spacefusion.runners.builder"])))


# ---------------------------------------------------------------------------- planted violations are caught

PLANTS = {
    "lower imports the face": ("spacefusion.lower.tir", "from spacefusion.api import build\n",
                               "never spacefusion.lower -> spacefusion"),
    "lower imports search (lazily)": ("spacefusion.lower.build", "def f():\n    from search.records import x\n",
                                      "never spacefusion.lower -> search"),
    "dynamic tvm outside lower": ("schedulers.spatial", "import importlib\ntvm = importlib.import_module('tvm')\n",
                                  "tvm only in"),
    "__import__ of tvm in the face": ("spacefusion.api", "def f():\n    return __import__('tvm_ffi')\n",
                                      "tvm_ffi only in"),
    "xgboost in schedulers": ("schedulers.options", "import xgboost\n", "xgboost only in"),
    "torch in search": ("search.space", "def f():\n    import torch\n", "torch only in"),
    "library imports experiments": ("smg.ops", "from experiments.harness import main\n",
                                    "never smg -> experiments"),
    "frontend imports experiments": ("spacefusion.frontend.graph", "import experiments.gpu_runtime\n",
                                     "never spacefusion.frontend -> experiments"),
    "experiments import tests": ("experiments.harness", "def f():\n    from tests.test_mma import CASES\n",
                                 "never experiments -> tests"),
    "islpy at module level in smg": ("smg.ir", "import islpy\n", "islpy only in"),
    "runtime imports schedulers": ("spacefusion.runtime.timing", "def f():\n    from schedulers import hardware\n",
                                   "never spacefusion.runtime -> schedulers"),
}


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_planted_violation_is_caught(name: str) -> None:
    mod, line, expect = PLANTS[name]
    sources = repo_sources()
    src = sources[mod]
    sources[mod] = Source(src.text + "\n" + line, src.is_package, src.path)
    bad = violations(sources)
    assert any(expect in b and src.path in b for b in bad), bad


API_PLANTS = {
    "an internal module, module level": ("experiments.e2e_partition", "from schedulers.hardware import H100\n",
                                         "schedulers.hardware"),
    "an internal module, lazily": ("experiments.norm_sweep", "def f():\n    from search.cost import estimate_us\n",
                                   "search.cost"),
    "a plain import of an internal module": ("experiments.e2e_gpu", "import search.records\n", "search.records"),
    "a submodule through a public package": ("experiments.sanitize", "from spacefusion.runtime import gpu\n",
                                             "spacefusion.runtime.gpu"),
    "the frontend package (not public)": ("experiments.e2e_tune", "from spacefusion.frontend import capture\n",
                                          "spacefusion.frontend.capture"),
    "a dynamic import": ("experiments.tuning.records_db",
                         "import importlib\nimportlib.import_module('schedulers.schedule')\n", "schedulers.schedule"),
    "an allow-listed module from another script": ("experiments.norm_gemm",
                                                   "from schedulers.split import decide_split\n", "schedulers.split"),
    "the lowering": ("experiments.tuning.register_corpus", "from spacefusion.lower.build import build_cuda\n",
                     "spacefusion.lower.build"),
}


@pytest.mark.parametrize("name", sorted(API_PLANTS))
def test_a_planted_api_bypass_is_caught(name: str) -> None:
    mod, line, expect = API_PLANTS[name]
    sources = repo_sources()
    src = sources[mod]
    sources[mod] = Source(src.text + "\n" + line, src.is_package, src.path)
    bad = api_bypasses(sources)
    assert any(f"imports {expect}" in b and src.path in b for b in bad), bad


def test_public_imports_pass() -> None:
    """The checker is not merely noisy: public imports planted the same way raise nothing."""
    sources = repo_sources()
    for mod, line in (("experiments.harness", "from spacefusion.api import candidates, estimate, hardware\n"),
                      ("experiments.sanitize", "from spacefusion.runtime import load_kernel\nimport spacefusion\n"),
                      ("experiments.e2e_tune", "def f():\n    from spacefusion.tuning import TuningDatabase\n"),
                      ("experiments.e2e_gpu", "from spacefusion.models import BertConfig\n"),
                      ("experiments.mma_cases", "from smg.fold import fold_dims\n")):  # allow-listed there
        src = sources[mod]
        sources[mod] = Source(src.text + "\n" + line, src.is_package, src.path)
    assert api_bypasses(sources) == []


def test_the_runtime_reaching_islpy_through_smg_is_caught() -> None:
    """The runtime imports an smg module (lazily, as batch.py imports smg.reference), which imports
    ``smg.footprint`` at module level, which imports islpy at module level: the chain is reported."""
    sources = repo_sources()
    ref, fp = sources["smg.reference"], sources["smg.footprint"]
    sources["smg.reference"] = Source(ref.text + "\nfrom smg import footprint\n", ref.is_package, ref.path)
    sources["smg.footprint"] = Source(fp.text + "\nimport islpy as isl\n", fp.is_package, fp.path)
    (chain,) = runtime_reaches(sources)
    assert "spacefusion.runtime.batch -> smg.reference -> smg.footprint -> islpy" in chain
    # and a dynamic import of a compiler module by the runtime itself
    sources = repo_sources()
    t = sources["spacefusion.runtime.timing"]
    sources["spacefusion.runtime.timing"] = Source(t.text + "\nimport importlib\nimportlib.import_module("
                                                   "'schedulers.traffic')\n", t.is_package, t.path)
    assert any("spacefusion.runtime.timing -> schedulers.traffic -> islpy" in c for c in runtime_reaches(sources))


def test_a_clean_plant_passes() -> None:
    """The checker is not merely noisy: allowed imports added in the same way raise nothing."""
    sources = repo_sources()
    for mod, line in (("spacefusion.lower.tir", "from schedulers.schedule import Schedule\n"),
                      ("spacefusion.runtime.timing", "from search.records import MeasureResult\n"),
                      ("smg.footprint", "def f():\n    import islpy\n")):
        src = sources[mod]
        sources[mod] = Source(src.text + "\n" + line, src.is_package, src.path)
    assert violations(sources) == []
