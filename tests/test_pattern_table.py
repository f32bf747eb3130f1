"""The frontend's patterns as a declared table (``frontend.table``) over one spelling per op (``frontend.canon``),
with refusals as a code plus a sentence (``frontend.refusals``): the table is the only place patterns are
listed, every code a row or a classifier gives is declared, and the report counts the ops left by code."""

from __future__ import annotations

import ast
import operator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from spacefusion.frontend import canon, refusals, table
from spacefusion.frontend.capture import capture
from spacefusion.frontend.partition import partition

ROOT = Path(__file__).resolve().parents[1]
FRONTEND = ROOT / "spacefusion" / "frontend"
SOURCES = [p for part in ("spacefusion", "experiments") for p in sorted((ROOT / part).rglob("*.py"))]


def _refusal_codes(tree: ast.AST) -> list[tuple[str, int]]:
    """(code, line) of every ``*.refuse(node, "code", ...)`` and ``Refusal("code", ...)`` / ``refusal(...)``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        arg = node.args[1] if name == "refuse" and len(node.args) > 1 else \
            node.args[0] if name in ("Refusal", "refusal") and node.args else None
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.append((arg.value, node.lineno))
        elif name == "refuse" and arg is not None:
            found.append((f"<not a literal: {ast.unparse(arg)}>", node.lineno))
    return found


def test_every_refusal_code_given_is_declared() -> None:
    undeclared = [f"{p.relative_to(ROOT)}:{line} {code}" for p in SOURCES
                  for code, line in _refusal_codes(ast.parse(p.read_text())) if not refusals.known(code)]
    assert not undeclared, undeclared


def test_every_rows_codes_are_declared_and_each_builders_refusals_are_its_rows() -> None:
    for row in table.ROWS:
        assert all(refusals.known(c) for c in row.codes), (row.name, row.codes)
        assert row.anchors and row.anchors <= KNOWN_OPS, (row.name, row.anchors - KNOWN_OPS)
    # a builder's module refuses only with codes of the rows whose builders live there
    rows_of: dict[str, set[str]] = {}
    for row in table.ROWS:
        rows_of.setdefault(row.build.__module__, set()).update(row.codes, table.COMMON)
    for module, codes in rows_of.items():
        path = ROOT / (module.replace(".", "/") + ".py")
        given = {c for c, _ in _refusal_codes(ast.parse(path.read_text()))}
        assert given <= codes, (module, given - codes)
    declared_by_rows = {c for row in table.ROWS for c in row.codes}
    pattern_codes = {c for c in refusals.CODES if not c.startswith(("left.", "build.", "library.", "kept."))}
    assert pattern_codes <= declared_by_rows, pattern_codes - declared_by_rows


def test_the_table_is_the_only_place_patterns_are_listed() -> None:
    """No module but ``table`` names a builder it does not define, and every ``match_*`` function of the
    frontend is the builder of exactly one row (no pattern outside the table, none listed twice)."""
    builders = {row.build.__name__ for row in table.ROWS}
    assert len(builders) == len(table.ROWS)
    defined: dict[str, str] = {}
    for p in sorted(FRONTEND.glob("*.py")):
        tree = ast.parse(p.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("match_"):
                defined[node.name] = p.name
    assert set(defined) == builders, set(defined) ^ builders
    for p in SOURCES:
        if p.name == "table.py":
            continue
        names = _names(ast.parse(p.read_text()))
        assert "MATCHERS" not in names, p
        own = {n for n, f in defined.items() if p.parent == FRONTEND and f == p.name}
        assert not names & (builders - own), (str(p.relative_to(ROOT)), names & (builders - own))


def _names(tree: ast.AST) -> set[str]:
    """The names a module's code uses (not its prose): identifiers, attributes and imported names."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            out.update(a.name for a in node.names)
    return out


#: the ops ``canon`` names: every function's, every module's, the tensor methods the rows anchor on, and the
#: ATen ops it declares as anchors
KNOWN_OPS = frozenset(canon.FUNCTIONS.values()) | {"hardtanh", "gelu", "interpolate", "to", "float", "half",
                                                    "bfloat16", "type_as"} | canon.ATEN_ANCHORS | canon.CUSTOM_ANCHORS


def test_each_aten_anchor_is_the_name_canonical_gives_its_overload() -> None:
    for name in canon.ATEN_ANCHORS:
        g = fx.Graph()
        node = g.call_function(getattr(torch.ops.aten, name).default, ())
        assert canon.op_of(node) == name


def _graph(fn, shape: tuple[int, ...]) -> fx.GraphModule:
    class M(nn.Module):
        def forward(self, x):
            return fn(x)

    return capture(M(), torch.randn(shape)).module


def _calls(gm: fx.GraphModule) -> list[canon.Call]:
    return [c for n in gm.graph.nodes if (c := canon.canonical(n, gm)) is not None]


@pytest.mark.parametrize("fn", [lambda x: x.transpose(1, 2), lambda x: torch.transpose(x, 1, 2)])
def test_a_method_and_a_function_are_one_op(fn) -> None:
    (c,) = _calls(_graph(fn, (2, 3, 4)))
    assert (c.op, c.args[1:]) == ("transpose", (1, 2))


def test_a_module_is_its_function_with_its_parameters_as_refs() -> None:
    lin = nn.Linear(4, 6)
    gm = capture(nn.Sequential(lin, nn.ReLU6(), nn.GELU("tanh")).eval(), torch.randn(2, 4)).module
    got = _calls(gm)
    assert [c.op for c in got] == ["linear", "hardtanh", "gelu"]
    assert got[0].args[1:] == (canon.Param("0.weight"), canon.Param("0.bias"))
    assert got[1].args[1:] == (0.0, 6.0) and got[2].kwargs == {"approximate": "tanh"}
    functional = _calls(_graph(lambda x: F.relu6(x), (2, 3)))
    assert (functional[0].op, functional[0].args[1:]) == ("hardtanh", (0.0, 6.0))


def test_an_aten_overload_is_named_by_its_packet() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    node = g.call_function(torch.ops.aten.add.Tensor, (x, x))
    assert canon.op_of(node) == "add" and canon.op_of(g.call_function(operator.add, (x, x))) == "add"
    assert canon.canonical(x) is None


def test_an_undeclared_code_is_refused() -> None:
    with pytest.raises(KeyError, match="undeclared refusal code"):
        refusals.refusal("conv.nonsense", "no")


def test_the_report_counts_what_is_left_by_code() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1, dilation=1, groups=2)  # grouped: conv.form
            self.emb = nn.Embedding(10, 8)

        def forward(self, x, ids):
            return self.conv(x).flatten(2).transpose(1, 2) + self.emb(ids)[:, None]

    p = partition(capture(Block().eval(), torch.randn(1, 8, 4, 4), torch.randint(0, 10, (1,))).module)
    codes = p.left_codes()
    assert codes["conv.form"] == 1 and codes["left.gather"] == 1 and codes["left.layout"] >= 2
    conv = next(op for op in p.left if op.code == "conv.form")
    assert "block-diagonal GEMM" in conv.reason  # the sentence is the one it always was
    assert "by code: " in p.summary() and "[conv.form]" in p.summary()
