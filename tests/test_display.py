"""Notebook views: the SMG SVG (``smg.display``) and the schedule HTML (``schedulers.display``)."""

from __future__ import annotations

import enum
import html
import re
import xml.etree.ElementTree as ET
from functools import cache

import pytest

from schedulers.display import schedule_html
from schedulers.schedule import LEVELS, Schedule, make_schedule
from smg import SMG, Access, Builder, DataSpace, Dim, Edge, Op
from smg.display import LEVEL_COLOURS, kind_short, smg_svg
from smg.workloads import gemm, mha, simplified_mha, softmax_gemm

SVG_NS = "{http://www.w3.org/2000/svg}"


@cache
def mha_graph() -> SMG:
    return mha(1, 2, 197, 197, 64)


@cache
def mha_sched() -> Schedule:
    return make_schedule(mha_graph(), tiles={"m": 64}, step=32)


def texts(root: ET.Element, cls: str | None = None) -> list[str]:
    """The full text of every <text> element (tspans joined), optionally under groups of class ``cls``."""
    scopes = [root] if cls is None else [g for g in root.iter(f"{SVG_NS}g") if g.get("class") == cls]
    return ["".join(t.itertext()) for scope in scopes for t in scope.iter(f"{SVG_NS}text")]


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG_NS}svg"
    return root


# -- smg_svg --------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: mha_graph(), lambda: softmax_gemm(64, 128, 32), lambda: gemm(32, 16, 8),
                                  lambda: simplified_mha(64, 32)])
def test_svg_is_xml_with_every_space_op_and_kind(make) -> None:
    g = make()
    root = parse(smg_svg(g))
    node_text = texts(root, "data-space") + texts(root, "iteration-space")
    for s in g.spaces:
        assert s.name in node_text, s.name
    for op in g.ops:
        assert op.iteration_space in node_text and op.kind in node_text
    legend = " ".join(texts(root, "legend"))
    labels = " ".join(texts(root, "label"))
    for e in g.edges:
        for d, k in e.kinds:
            assert f"{d}:{k.short}" in labels
            assert k.value in legend and k.short in legend


def test_mha_edges_show_their_kinds() -> None:
    root = parse(smg_svg(mha_graph()))
    labels = texts(root, "label")
    assert len(labels) >= 1
    joined = " ".join(labels)
    assert "d:A:1" in joined  # S = Q K^T reduces d
    assert "l:A:1" in joined  # max, sum and P V reduce l
    assert "l:1:A" in joined and "m:1:A" in joined and "n:1:A" in joined  # broadcasts
    paths = [p for p in root.iter(f"{SVG_NS}path") if p.get("marker-end")]
    assert len(paths) == len(mha_graph().edges)
    assert len({p.get("stroke") for p in paths}) == 3  # one colour per kind


def test_mha_svg_stays_notebook_wide() -> None:
    """17 layers would be ~3000 px in one row; they wrap into rows instead."""
    assert float(parse(smg_svg(mha_graph())).get("width")) <= 1200
    assert float(parse(smg_svg(mha_graph(), max_width=None)).get("width")) > 1200


def test_levels_colour_and_annotate_data_spaces() -> None:
    s = mha_sched()
    svg = smg_svg(s.smg, levels=dict(s.memory))
    root = parse(svg)
    node_text = texts(root, "data-space")
    for lvl in {lvl for _, lvl in s.memory}:
        assert lvl in node_text
        assert LEVEL_COLOURS[lvl] in svg
    assert "memory level:" in " ".join(texts(root, "legend"))
    assert "memory level:" not in " ".join(texts(parse(smg_svg(s.smg)), "legend"))


def test_text_is_escaped() -> None:
    """Names are identifiers via the Builder, but the SMG name, op kinds and levels are free text (dtypes are
    checked where a space is made)."""
    weird = 'a<b & "c">'
    g = SMG(name=weird, dims=(Dim("m", 4),),
            spaces=(DataSpace("x<&>", ("m",), dtype="float16"), DataSpace("y", ("m",))),
            ops=(Op(weird, "y", ("m",), (Access("x<&>", ("m",)),), "x"),), outputs=("y",))
    svg = smg_svg(g, levels={"x<&>": "<lvl&>", "y": "global"}, title=weird)
    root = parse(svg)
    all_text = texts(root)
    assert weird in all_text and "x<&>" in all_text and "<lvl&>" in all_text
    assert "<lvl&>" not in svg and "x<&>" not in svg

    b = Builder("n<&>")
    x = b.input("x", {"m": 8, "k": 4})
    g2 = b.build(b.map("exp(x)", x, name="z", kind="k<&>"))
    assert "k<&>" in texts(parse(smg_svg(g2)))


class Windowed(enum.StrEnum):
    """A kind added after this view was written, whose ``short`` table lacks it (raises KeyError)."""

    WINDOWED = "Windowed"

    @property
    def short(self) -> str:
        return {}[self.value]


def test_unknown_kind_gets_a_fallback_instead_of_an_error() -> None:
    g = softmax_gemm(16, 32, 8)
    edges = tuple(Edge(e.src, e.dst, tuple((d, Windowed.WINDOWED if d == "l" else k) for d, k in e.kinds))
                  for e in g.edges)
    g.__dict__["edges"] = edges  # the cached property, as a future IR would derive it
    assert kind_short(Windowed.WINDOWED) == "Windowed"
    root = parse(smg_svg(g))
    assert "l:Windowed" in " ".join(texts(root, "label"))
    assert "Windowed" in " ".join(texts(root, "legend"))


def test_edge_cases_render() -> None:
    b = Builder("single")
    x = b.input("x", {"m": 3})
    parse(smg_svg(b.build(b.unary("exp", x, name="y"))))
    parse(smg_svg(gemm(8, 8, 8), max_width=10))  # narrower than any column: one layer per row


# -- schedule_html --------------------------------------------------------------------------------


def test_schedule_html_has_decisions_levels_and_update_functions() -> None:
    s = mha_sched()
    out = schedule_html(s)
    assert "<td" in out and "<code>m</code>" in out
    assert ">64<" in out  # the tile of m
    assert f"<code>{s.serial}</code>" in out and f"step {s.step}" in out
    assert f"{s.num_blocks} blocks" in out and f"{s.num_steps} steps" in out
    for lvl in {lvl for _, lvl in s.memory}:
        assert lvl in LEVELS and f": {lvl}</span>" in out
    names = tuple(u.state for u in s.plan.states)
    for u in s.plan.states:
        assert html.escape(u.describe(s.serial, names), quote=False) in out
    for o, expr in s.plan.finalize:
        assert html.escape(f"{o} = {expr}", quote=False) in out
    for d in s.spatial:
        assert html.escape(d.reason, quote=False) in out


def test_schedule_html_embeds_valid_svg() -> None:
    out = schedule_html(mha_sched())
    svgs = re.findall(r"<svg\b.*?</svg>", out, flags=re.S)
    assert len(svgs) == 1
    root = parse(svgs[0])
    assert "register" in texts(root, "data-space")


def test_schedule_html_escapes_names() -> None:
    b = Builder("g<&>")
    x = b.input("x", {"m": 8, "l": 16})
    s = make_schedule(b.build(b.reduce(x, "l", "sum", name="y")), step=4)
    out = schedule_html(s)
    assert "g<&>" not in out and "g&lt;&amp;&gt;" in out
    parse(re.findall(r"<svg\b.*?</svg>", out, flags=re.S)[0])
