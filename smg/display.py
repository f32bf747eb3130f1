"""A self-contained SVG drawing of an SMG, for notebooks (no graphviz, no dependencies).

Data spaces are boxes (name, dims, shape), iteration spaces are rounded (``<out>.it``
and the op kind).  Nodes sit in topological layers from left to right; an input is
placed just before its first consumer so that, e.g., MHA's ``V`` does not cross the
whole graph.  Edges longer than one layer are routed through virtual points so they
never run through a node.  Every edge is labelled with its per-dimension dependency
kinds (``m:1:1 l:A:1``) and coloured by its most significant kind.  Kinds this module
does not know (a future ``Windowed``) get a fallback colour instead of an error.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any

#: Colours of the known dependency kinds, keyed by ``Kind.value``.
KIND_COLOURS: dict[str, str] = {
    "One-to-One": "#7a8796",
    "One-to-All": "#e07b00",
    "All-to-One": "#c0392b",
}
KIND_NOTES: dict[str, str] = {
    "One-to-One": "element-wise",
    "One-to-All": "broadcast",
    "All-to-One": "reduction",
}
FALLBACK_KIND_COLOURS = ("#8e44ad", "#16a085", "#2e5cb8", "#b8860b", "#d35490")

#: Fill colours of data spaces per memory level (shared with the schedule view).
LEVEL_COLOURS: dict[str, str] = {
    "global": "#d6e6f7",
    "shared": "#d3f0d3",
    "register": "#fff0bf",
    "inlined": "#ececec",
}
FALLBACK_LEVEL_COLOUR = "#f3dcef"

_FONT = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace"
_CHAR = 0.62  # monospace advance per em, slightly generous so boxes never clip text
_NAME_PT, _TEXT_PT, _LABEL_PT = 12.0, 10.5, 10.0
_MARGIN, _MIN_GAP, _VGAP, _DUMMY_H = 16.0, 44.0, 30.0, 14.0
_LABEL_CHARS = 12  # wrap edge labels after this many characters (at least one token per line)
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def esc(text: Any) -> str:
    """XML-escape ``text`` for element content and double-quoted attributes."""
    s = _INVALID_XML.sub("?", str(text))
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def kind_short(kind: Any) -> str:
    """``kind.short``, or its value where a (new) kind has no working ``short``."""
    try:
        short = kind.short
    except Exception:  # a new enum member missing from the short table raises KeyError
        short = None
    return str(short) if short else str(getattr(kind, "value", kind))


def kind_value(kind: Any) -> str:
    return str(getattr(kind, "value", kind))


def level_colour(level: str) -> str:
    return LEVEL_COLOURS.get(level, FALLBACK_LEVEL_COLOUR)


def _tw(text: str, pt: float) -> float:
    return len(text) * pt * _CHAR


@dataclass(eq=False)
class _Node:
    key: tuple[str, str]
    shape: str  # "data" | "iter" | "dummy"
    lines: list[tuple[str, float, str]] = field(default_factory=list)  # (text, size, extra attrs)
    title: str = ""
    w: float = 0.0
    h: float = _DUMMY_H
    layer: int = 0
    pos: float = 0.0
    x: float = 0.0  # centre
    y: float = 0.0
    fill: str = "#ffffff"
    stroke: str = "#34495e"
    stroke_width: float = 1.3
    dash: str = ""
    tag: str = ""  # small role tag drawn above a data box

    def port(self, dy: float, side: int) -> tuple[float, float]:
        """Point on the node's left (side=-1) or right (side=+1) outline at height ``y + dy``."""
        if self.shape == "iter":  # a stadium: straight top and bottom, round ends
            r = self.h / 2
            k = min(abs(dy), 0.9 * r)
            return self.x + side * (self.w / 2 - r + math.sqrt(r * r - k * k)), self.y + dy
        return self.x + side * self.w / 2, self.y + dy


@dataclass(eq=False)
class _Seg:
    a: _Node
    b: _Node
    edge: int  # index into the edge list


def _kinds_of(edges: list[Any]) -> list[Any]:
    """All kinds in use, in first-seen order."""
    seen: dict[str, Any] = {}
    for e in edges:
        for _, k in getattr(e, "kinds", ()):
            seen.setdefault(kind_value(k), k)
    return list(seen.values())


def _kind_palette(kinds: list[Any]) -> dict[str, str]:
    colours, extra = {}, 0
    for k in kinds:
        v = kind_value(k)
        if v in KIND_COLOURS:
            colours[v] = KIND_COLOURS[v]
        elif v not in colours:
            colours[v] = FALLBACK_KIND_COLOURS[extra % len(FALLBACK_KIND_COLOURS)]
            extra += 1
    return colours


def _edge_kind(kinds: tuple[tuple[str, Any], ...]) -> str:
    """The kind an edge is coloured by: a reduction over a broadcast over anything new over 1:1."""
    values = [kind_value(k) for _, k in kinds]
    for v in ("All-to-One", "One-to-All"):
        if v in values:
            return v
    for v in values:
        if v not in KIND_COLOURS:
            return v
    return values[0] if values else "One-to-One"


def _wrap(tokens: list[tuple[str, str]], width: int) -> list[list[tuple[str, str]]]:
    lines: list[list[tuple[str, str]]] = []
    cur: list[tuple[str, str]] = []
    n = 0
    for tok in tokens:
        add = len(tok[0]) + (1 if cur else 0)
        if cur and n + add > width:
            lines.append(cur)
            cur, n = [], 0
            add = len(tok[0])
        cur.append(tok)
        n += add
    if cur:
        lines.append(cur)
    return lines


def _bezier(a: tuple[float, float], b: tuple[float, float], t: float) -> tuple[float, float]:
    (x1, y1), (x2, y2) = a, b
    dx = (x2 - x1) / 2
    pts = [(x1, y1), (x1 + dx, y1), (x2 - dx, y2), (x2, y2)]
    c = [(1 - t) ** 3, 3 * t * (1 - t) ** 2, 3 * t * t * (1 - t), t**3]
    return sum(ci * p[0] for ci, p in zip(c, pts)), sum(ci * p[1] for ci, p in zip(c, pts))


def _overlap(r: tuple[float, float, float, float], s: tuple[float, float, float, float]) -> float:
    w = min(r[2], s[2]) - max(r[0], s[0])
    h = min(r[3], s[3]) - max(r[1], s[1])
    return w * h if w > 0 and h > 0 else 0.0


def _build_nodes(smg: Any, levels: dict[str, str] | None) -> tuple[dict[tuple[str, str], _Node], list[Any]]:
    sizes = dict(getattr(smg, "dim_sizes", {}) or {})
    inputs, outputs = set(getattr(smg, "inputs", ())), set(getattr(smg, "outputs", ()))
    nodes: dict[tuple[str, str], _Node] = {}
    for sp in getattr(smg, "spaces", ()):
        dims = tuple(getattr(sp, "dims", ()))
        shape = "×".join(str(sizes.get(d, "?")) for d in dims) or "scalar"
        role = "input" if sp.name in inputs else "output" if sp.name in outputs else "intermediate"
        lines = [(str(sp.name), _NAME_PT, 'font-weight="bold"'),
                 ("[" + ",".join(map(str, dims)) + "]", _TEXT_PT, ""),
                 (shape, _TEXT_PT, 'fill="#555555"')]
        n = _Node(("d", str(sp.name)), "data", lines, tag=role if role != "intermediate" else "")
        n.title = f"{sp.name}[{', '.join(map(str, dims))}] {getattr(sp, 'dtype', '')} {role}; shape {shape}"
        n.fill = "#f7f9fc"
        if role != "intermediate":
            n.stroke_width = 2.2
        if levels is not None and sp.name in levels:
            lvl = str(levels[sp.name])
            n.lines.append((lvl, _TEXT_PT, 'font-style="italic" fill="#333333"'))
            n.fill = level_colour(lvl)
            n.title += f"; memory level {lvl}"
            if lvl == "inlined":
                n.dash = "4 3"
        nodes[n.key] = n
    for op in getattr(smg, "ops", ()):
        it = getattr(op, "iteration_space", f"{op.out}.it")
        lines = [(str(it), _NAME_PT, 'font-weight="bold"'), (str(getattr(op, "kind", "op")), _TEXT_PT, "")]
        red = tuple(getattr(op, "reduce", ()) or ())
        if red:
            lines.append((f"{getattr(op, 'combiner', 'reduce')} over {','.join(red)}", _TEXT_PT, 'fill="#c0392b"'))
        n = _Node(("i", str(it)), "iter", lines, fill="#ffffff", stroke="#5d6d7e")
        n.title = (f"{it}[{', '.join(map(str, getattr(op, 'iter_dims', ())))}] {getattr(op, 'kind', '')}: "
                   f"{getattr(op, 'body', '')}")
        nodes[n.key] = n
    for n in nodes.values():
        tw = max(_tw(t, pt) * (1.06 if "bold" in a else 1.0) for t, pt, a in n.lines)
        th = sum(pt * 1.3 for _, pt, _ in n.lines)
        if n.shape == "data":
            n.w, n.h = tw + 20, th + 10
        else:  # a stadium around the text block
            n.h = th + 10
            n.w = tw + n.h * 0.8
    return nodes, list(getattr(smg, "edges", ()))


def _endpoints(e: Any, nodes: dict[tuple[str, str], _Node]) -> tuple[_Node, _Node]:
    """Nodes of an edge; a name no space or op declares gets a plain node (never an error)."""
    iters = {k[1] for k in nodes if k[0] == "i"}
    src = ("i", str(e.src)) if str(e.src) in iters else ("d", str(e.src))
    dst = ("i", str(e.dst)) if str(e.dst) in iters and src[0] == "d" else ("d", str(e.dst))
    for key in (src, dst):
        if key not in nodes:
            nodes[key] = _Node(key, "data", [(key[1], _NAME_PT, 'font-weight="bold"')],
                               w=_tw(key[1], _NAME_PT) + 16, h=_NAME_PT * 1.3 + 10)
    return nodes[src], nodes[dst]


def _layers(nodes: list[_Node], pairs: list[tuple[_Node, _Node]]) -> None:
    """Longest-path layering; inputs then move right, to just before their first consumer."""
    succ: dict[int, list[_Node]] = {id(n): [] for n in nodes}
    indeg = {id(n): 0 for n in nodes}
    for a, b in pairs:
        succ[id(a)].append(b)
        indeg[id(b)] += 1
    ready = [n for n in nodes if indeg[id(n)] == 0]
    order: list[_Node] = []
    while ready:
        n = ready.pop(0)
        order.append(n)
        for m in succ[id(n)]:
            m.layer = max(m.layer, n.layer + 1)
            indeg[id(m)] -= 1
            if indeg[id(m)] == 0:
                ready.append(m)
    for n in nodes:  # a cycle cannot come from ops, but must not hang or crash the drawing
        if n not in order:
            order.append(n)
    has_pred = {id(b) for _, b in pairs}
    for n in order:
        if id(n) not in has_pred and succ[id(n)]:
            n.layer = max(0, min(m.layer for m in succ[id(n)]) - 1)
    for i, n in enumerate(order):
        n.pos = float(i)


def _order(layers: list[list[_Node]], segs: list[_Seg], sweeps: int = 6) -> None:
    """Barycentre sweeps to reduce crossings, then index positions per layer."""
    preds: dict[int, list[_Node]] = {}
    succs: dict[int, list[_Node]] = {}
    for s in segs:
        preds.setdefault(id(s.b), []).append(s.a)
        succs.setdefault(id(s.a), []).append(s.b)

    def settle(layer: list[_Node], nbrs: dict[int, list[_Node]]) -> None:
        def key(n: _Node) -> tuple[float, float]:
            ns = nbrs.get(id(n))
            return (sum(m.pos for m in ns) / len(ns) if ns else n.pos, n.pos)

        layer.sort(key=key)
        for i, n in enumerate(layer):
            n.pos = float(i)

    for layer in layers:
        layer.sort(key=lambda n: n.pos)
        for i, n in enumerate(layer):
            n.pos = float(i)
    for _ in range(sweeps):
        for layer in layers[1:]:
            settle(layer, preds)
        for layer in reversed(layers[:-1]):
            settle(layer, succs)


def _pack(col_w: list[float], gap: list[float], limit: float) -> list[list[int]]:
    rows: list[list[int]] = [[]]
    used = 0.0
    for i, w in enumerate(col_w):
        need = w + (gap[i - 1] if rows[-1] else 0)
        if rows[-1] and used + need > limit:
            rows.append([])
            need, used = w, 0.0
        rows[-1].append(i)
        used += need
    return rows


def _rows(col_w: list[float], gap: list[float], limit: float | None) -> list[list[int]]:
    """Split the layers into as few rows as fit ``limit``, then even out the row widths."""
    if not col_w:
        return [[]]
    if limit is None:
        return [list(range(len(col_w)))]
    rows = _pack(col_w, gap, limit)
    lo = max(col_w)
    hi = max(limit, lo)
    for _ in range(30):  # the narrowest width that still needs no more rows
        mid = (lo + hi) / 2
        if len(_pack(col_w, gap, mid)) <= len(rows):
            hi = mid
        else:
            lo = mid
    return _pack(col_w, gap, hi)


def smg_svg(smg: Any, levels: dict[str, str] | None = None, title: str | None = None,
            max_width: float | None = 1100) -> str:
    """Render ``smg`` as a standalone SVG string (valid XML, no XML declaration, so it embeds in HTML).

    ``levels`` maps space name -> memory level ("global", "shared", "register", "inlined");
    it fills the data-space boxes by level and adds a level legend (the schedule view).
    Layers that do not fit in ``max_width`` pixels continue on a new row below (read like
    text), so a long chain such as MHA stays legible at notebook width; ``None``: one row.
    """
    nodes, edges = _build_nodes(smg, levels)
    ends = [_endpoints(e, nodes) for e in edges]
    real = list(nodes.values())
    _layers(real, ends)
    nlayers = max((n.layer for n in real), default=0) + 1
    layers: list[list[_Node]] = [[] for _ in range(nlayers)]
    for n in real:
        layers[n.layer].append(n)

    # split long edges into one segment per layer through virtual (dummy) nodes
    chains: list[list[_Node]] = []
    segs: list[_Seg] = []
    for i, (a, b) in enumerate(ends):
        chain = [a]
        for lay in range(a.layer + 1, b.layer):
            d = _Node(("v", f"{i}:{lay}"), "dummy", layer=lay, pos=(a.pos + b.pos) / 2)
            layers[lay].append(d)
            chain.append(d)
        chain.append(b)
        chains.append(chain)
        segs.extend(_Seg(p, q, i) for p, q in zip(chain, chain[1:]))
    _order(layers, segs)

    # edge labels: per-dimension kinds, wrapped, each token coloured by its kind
    palette = _kind_palette(_kinds_of(edges))
    labels = []
    for e in edges:
        toks = [(f"{d}:{kind_short(k)}", kind_value(k)) for d, k in getattr(e, "kinds", ())]
        lines = _wrap(toks, max(_LABEL_CHARS, *(len(t) for t, _ in toks))) if toks else [[("-", "")]]
        w = max(_tw(" ".join(t for t, _ in ln), _LABEL_PT) for ln in lines) + 6
        labels.append((lines, w, len(lines) * _LABEL_PT * 1.2 + 4))

    # x: columns sized by their widest node, gaps by the widest label that may sit in them
    col_w = [max((n.w for n in lay if n.shape != "dummy"), default=20.0) for lay in layers]
    gap = [_MIN_GAP] * nlayers
    for s in segs:
        if s.a.layer < s.b.layer:
            gap[s.a.layer] = max(gap[s.a.layer], labels[s.edge][1] + 24)
    rows = _rows(col_w, gap, max_width - 2 * _MARGIN - 40 if max_width else None)
    row_of = {i: r for r, row in enumerate(rows) for i in row}
    wraps = [s for s in segs if s.a.layer < s.b.layer and row_of[s.a.layer] != row_of[s.b.layer]]
    tracks: dict[int, list[_Seg]] = {}
    for s in wraps:
        tracks.setdefault(row_of[s.a.layer], []).append(s)
    max_tracks = max((len(t) for t in tracks.values()), default=0)
    left = _MARGIN + (14 + 6 * max_tracks if max_tracks else 0)
    col_x: dict[int, float] = {}
    row_right: list[float] = []
    for row in rows:
        x = left
        for j, i in enumerate(row):
            x += gap[i - 1] if j else 0
            col_x[i] = x
            x += col_w[i]
        row_right.append(x)

    # label of each edge: on its middle segment that stays within one row, else in the channel below
    label_seg: list[_Seg | None] = []
    for i in range(len(chains)):
        mine = [s for s in segs if s.edge == i]
        inrow = [s for s in mine if s not in wraps]
        label_seg.append(inrow[(len(inrow) - 1) // 2] if inrow else (mine[0] if mine else None))

    # y: each layer stacked and centred in its row; rows separated by channels for wrapped edges
    def stack_h(lay: list[_Node]) -> float:
        return sum(n.h + (12 if n.tag else 0) for n in lay) + _VGAP * max(len(lay) - 1, 0)

    title_text = title if title is not None else f"SMG {getattr(smg, 'name', '')}"
    subtitle = "  ".join(f"{d}={s}" for d, s in dict(getattr(smg, "dim_sizes", {}) or {}).items())
    y = _MARGIN + 2 * _NAME_PT * 1.4 + 8
    channel_y: dict[int, float] = {}
    for r, row in enumerate(rows):
        row_h = max((stack_h(layers[i]) for i in row), default=0.0)
        for i in row:
            yy = y + (row_h - stack_h(layers[i])) / 2
            for n in layers[i]:
                yy += 12 if n.tag else 0
                n.x, n.y = col_x[i] + col_w[i] / 2, yy + n.h / 2
                if n.shape == "dummy":
                    n.w = col_w[i]
                yy += n.h + _VGAP
        y += row_h
        if r < len(rows) - 1:
            crossing = tracks.get(r, [])
            tall = max((labels[s.edge][2] for s in crossing if label_seg[s.edge] is s), default=0.0)
            channel_y[r] = y + 16 + tall / 2
            y += 32 + tall + 7 * len(crossing)
    graph_bottom = y

    # ports: spread the edges entering / leaving a node along its side, ordered by the other end's y
    out_p: dict[int, list[_Seg]] = {}
    in_p: dict[int, list[_Seg]] = {}
    for s in segs:
        out_p.setdefault(id(s.a), []).append(s)
        in_p.setdefault(id(s.b), []).append(s)
    start_pt: dict[int, tuple[float, float]] = {}
    end_pt: dict[int, tuple[float, float]] = {}
    for table, side, store, other in ((out_p, 1, start_pt, "b"), (in_p, -1, end_pt, "a")):
        for lst in table.values():
            lst.sort(key=lambda s, o=other, sd=side: (getattr(s, o).y + (1e6 if s in wraps else 0) * sd))
            node = lst[0].a if side == 1 else lst[0].b
            span = 0.0 if node.shape == "dummy" else max(node.h / 2 - 7, 0.0)
            step = min(9.0, 2 * span / max(len(lst) - 1, 1))
            for j, s in enumerate(lst):
                store[id(s)] = node.port((j - (len(lst) - 1) / 2) * step, side)

    # wrapped segments: right past the row, down to the channel, left past the next row, into the target
    wrap_pts: dict[int, list[tuple[float, float]]] = {}
    for r, lst in tracks.items():
        lst.sort(key=lambda s: -start_pt[id(s)][1])
        for k, s in enumerate(lst):
            (sx, sy), (tx, ty) = start_pt[id(s)], end_pt[id(s)]
            xr, xl = row_right[r] + 12 + 6 * k, left - 10 - 6 * (len(lst) - 1 - k)  # mirrored: fewer crossings
            yc = channel_y[r] + 7 * k - 7 * (len(lst) - 1) / 2
            wrap_pts[id(s)] = [(sx, sy), (xr, sy), (xr, yc), (xl, yc), (xl, ty), (tx, ty)]

    uid = "sf" + hashlib.sha256((str(getattr(smg, "key", "")) + title_text + repr(levels)).encode()).hexdigest()[:8]
    marker_ids = {v: f"{uid}-a{i}" for i, v in enumerate(palette)}
    paths: list[str] = []
    for i, e in enumerate(edges):
        v = _edge_kind(tuple(getattr(e, "kinds", ())))
        colour = palette.get(v, KIND_COLOURS["One-to-One"])
        d = ""
        for s in (x for x in segs if x.edge == i):
            a, b = start_pt[id(s)], end_pt[id(s)]
            d += f"M{a[0]:.1f},{a[1]:.1f}" if not d else f" L{a[0]:.1f},{a[1]:.1f}"
            if id(s) in wrap_pts:
                d += "".join(f" L{px:.1f},{py:.1f}" for px, py in wrap_pts[id(s)][1:])
            else:
                dx = (b[0] - a[0]) / 2
                d += f" C{a[0] + dx:.1f},{a[1]:.1f} {b[0] - dx:.1f},{b[1]:.1f} {b[0]:.1f},{b[1]:.1f}"
        if not d:
            continue
        marker = f' marker-end="url(#{marker_ids[v]})"' if v in marker_ids else ""
        width = 1.2 if v == "One-to-One" else 1.8
        tip = "; ".join(f"{dim}: {kind_value(k)}" for dim, k in getattr(e, "kinds", ()))
        paths.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="{width}" '
                     f'stroke-linejoin="round"{marker}><title>{esc(f"{e.src} -> {e.dst}: {tip}")}</title></path>')

    # labels, slid along their segment until they do not cover another label
    placed: list[tuple[float, float, float, float]] = []
    label_svg: list[str] = []
    for i, (lines, w, h) in enumerate(labels):
        seg = label_seg[i]
        if seg is None:
            continue
        if id(seg) in wrap_pts:
            pts = wrap_pts[id(seg)]
            (x1, yc), (x2, _) = pts[2], pts[3]
            cands = [(x1 - w / 2 - 8 - f * (x1 - x2 - w - 16), yc) for f in (0, 0.2, 0.4, 0.6, 0.8, 1)]
        else:
            a, b = start_pt[id(seg)], end_pt[id(seg)]
            lo, hi = a[0] + w / 2 + 3, b[0] - w / 2 - 3
            cands = []
            for t in (0.5, 0.38, 0.62, 0.28, 0.72, 0.18, 0.82):
                px, py = _bezier(a, b, t)
                cands.append((min(max(px, lo), hi) if lo <= hi else (a[0] + b[0]) / 2, py))
        best, best_cost = None, math.inf
        for px, py in cands:
            rect = (px - w / 2, py - h / 2, px + w / 2, py + h / 2)
            cost = sum(_overlap(rect, r) for r in placed)
            if cost < best_cost:
                best, best_cost = rect, cost
            if cost == 0:
                break
        assert best is not None
        placed.append(best)
        label_svg.append(_label_svg(lines, best, palette))

    node_svg = [_node_svg(n) for n in nodes.values() if n.shape != "dummy"]
    legend, legend_w, legend_h = _legend(edges, palette, levels, graph_bottom + 18)
    width = max(max(row_right, default=0.0) + 14 + 6 * max_tracks + _MARGIN, legend_w + 2 * _MARGIN)
    height = graph_bottom + 18 + legend_h + _MARGIN
    defs = "".join(
        f'<marker id="{mid}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{palette[v]}"/></marker>'
        for v, mid in marker_ids.items())
    head = (f'<text x="{_MARGIN}" y="{_MARGIN + _NAME_PT:.1f}" font-size="{_NAME_PT + 2}" font-weight="bold">'
            f'{esc(title_text)}</text>'
            f'<text x="{_MARGIN}" y="{_MARGIN + 2 * _NAME_PT * 1.3 + 2:.1f}" font-size="{_TEXT_PT}" fill="#555555">'
            f'{esc(subtitle)}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="{esc(_FONT)}" role="img">'
            f"<title>{esc(title_text)}</title><defs>{defs}</defs>"
            f'<rect width="100%" height="100%" fill="#ffffff"/>{head}'
            f'<g class="edges">{"".join(paths)}</g><g class="nodes">{"".join(node_svg)}</g>'
            f'<g class="labels">{"".join(label_svg)}</g>{legend}</svg>')


def _label_svg(lines: list[list[tuple[str, str]]], rect: tuple[float, float, float, float],
               palette: dict[str, str]) -> str:
    """An edge label: one coloured ``dim:kind`` token per dimension, on a light backing."""
    x0, y0, x1, y1 = rect
    rows = []
    for j, ln in enumerate(lines):
        spans = []
        for k, (tok, v) in enumerate(ln):
            attrs = f'fill="{palette.get(v, "#333333")}"' + ("" if v == "One-to-One" else ' font-weight="bold"')
            spans.append(("" if k == 0 else " ") + f"<tspan {attrs}>{esc(tok)}</tspan>")
        ty = y0 + 2 + (j + 1) * _LABEL_PT * 1.2 - 2.5
        rows.append(f'<text x="{x0 + 3:.1f}" y="{ty:.1f}" font-size="{_LABEL_PT}" xml:space="preserve">'
                    f'{"".join(spans)}</text>')
    return (f'<g class="label"><rect x="{x0:.1f}" y="{y0:.1f}" width="{x1 - x0:.1f}" height="{y1 - y0:.1f}" '
            f'rx="3" fill="#ffffff" fill-opacity="0.88"/>{"".join(rows)}</g>')


def _text_block(n: _Node) -> str:
    total = sum(pt * 1.3 for _, pt, _ in n.lines)
    y = n.y - total / 2
    parts = []
    for text, pt, attrs in n.lines:
        y += pt * 1.3
        parts.append(f'<text x="{n.x:.1f}" y="{y - pt * 0.3:.1f}" font-size="{pt}" text-anchor="middle" '
                     f'{attrs}>{esc(text)}</text>')
    return "".join(parts)


def _node_svg(n: _Node) -> str:
    dash = f' stroke-dasharray="{n.dash}"' if n.dash else ""
    style = f'fill="{n.fill}" stroke="{n.stroke}" stroke-width="{n.stroke_width}"{dash}'
    if n.shape == "iter":
        shape = (f'<rect x="{n.x - n.w / 2:.1f}" y="{n.y - n.h / 2:.1f}" width="{n.w:.1f}" height="{n.h:.1f}" '
                 f'rx="{n.h / 2:.1f}" {style}/>')
        cls = "iteration-space"
    else:
        shape = (f'<rect x="{n.x - n.w / 2:.1f}" y="{n.y - n.h / 2:.1f}" width="{n.w:.1f}" height="{n.h:.1f}" '
                 f'rx="3" {style}/>')
        cls = "data-space"
    tag = ""
    if n.tag:
        tag = (f'<text x="{n.x - n.w / 2:.1f}" y="{n.y - n.h / 2 - 3:.1f}" font-size="9" fill="#34495e">'
               f"{esc(n.tag)}</text>")
    return f'<g class="{cls}"><title>{esc(n.title)}</title>{shape}{_text_block(n)}{tag}</g>'


def _legend(edges: list[Any], palette: dict[str, str], levels: dict[str, str] | None,
            y0: float) -> tuple[str, float, float]:
    """Kinds (with their counts in this graph), node shapes and, with ``levels``, memory levels."""
    counts: dict[str, int] = {}
    shorts: dict[str, str] = {}
    for e in edges:
        for _, k in getattr(e, "kinds", ()):
            counts[kind_value(k)] = counts.get(kind_value(k), 0) + 1
            shorts[kind_value(k)] = kind_short(k)
    default_short = {"One-to-One": "1:1", "One-to-All": "1:A", "All-to-One": "A:1"}
    y1 = y0 + 24

    def label(x: float, y: float, text: str, fill: str = "#222222", bold: bool = False) -> str:
        weight = ' font-weight="bold"' if bold else ""
        return f'<text x="{x:.1f}" y="{y + 11:.1f}" font-size="{_TEXT_PT}" fill="{fill}"{weight}>{esc(text)}</text>'

    def kind_item(v: str) -> tuple[Any, float]:
        colour = palette.get(v, KIND_COLOURS.get(v, FALLBACK_KIND_COLOURS[0]))
        note = KIND_NOTES.get(v, "")
        text = f"{v} ({shorts.get(v) or default_short.get(v, v)}{', ' + note if note else ''}) ×{counts.get(v, 0)}"
        return (lambda x: f'<line x1="{x:.1f}" y1="{y0 + 7:.1f}" x2="{x + 28:.1f}" y2="{y0 + 7:.1f}" '
                          f'stroke="{colour}" stroke-width="2"/>' + label(x + 32, y0, text, colour),
                32 + _tw(text, _TEXT_PT) + 16)

    def box_item(text: str, fill: str, dash: bool = False, rounded: bool = False) -> tuple[Any, float]:
        dashed = ' stroke-dasharray="4 3"' if dash else ""

        def draw(x: float) -> str:
            if rounded:
                shape = f'<rect x="{x:.1f}" y="{y1:.1f}" width="26" height="14" rx="7" fill="{fill}" stroke="#5d6d7e"/>'
            else:
                shape = (f'<rect x="{x:.1f}" y="{y1:.1f}" width="26" height="14" rx="3" fill="{fill}" '
                         f'stroke="#34495e"{dashed}/>')
            return shape + label(x + 32, y1, text)

        return draw, 32 + _tw(text, _TEXT_PT) + 16

    row0 = [(lambda x: label(x, y0, "legend", bold=True), _tw("legend", _TEXT_PT) + 14)]
    row0 += [kind_item(v) for v in list(KIND_COLOURS) + [v for v in counts if v not in KIND_COLOURS]]
    row1 = [box_item("data space: name, [dims], shape", "#f7f9fc"),
            box_item("iteration space: <out>.it, op", "#ffffff", rounded=True)]
    if levels is not None:
        row1.append((lambda x: label(x, y1, "memory level:", bold=True), _tw("memory level:", _TEXT_PT) + 10))
        for lvl in dict.fromkeys([*LEVEL_COLOURS, *(str(v) for v in levels.values())]):
            row1.append(box_item(lvl, level_colour(lvl), dash=lvl == "inlined"))
    parts, width = [], 0.0
    for row in (row0, row1):
        x = _MARGIN
        for draw, w in row:
            parts.append(draw(x))
            x += w
        width = max(width, x - _MARGIN)
    return f'<g class="legend">{"".join(parts)}</g>', width, 44.0
