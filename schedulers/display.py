"""An HTML view of a Schedule for notebooks: every slicing decision next to the SMG it applies to.

The text summary (``schedulers.printing``) says the same things; this view puts the
per-dim decisions in one table (so cut, tile, grid, thread and serial dims can be read
across) and colours spaces by memory level, matching the levels drawn in the SMG SVG.
Optional schedule fields are read with ``getattr`` so the view survives the record growing.
"""

from __future__ import annotations

import html
import math
from typing import Any

from smg.display import level_colour, smg_svg

_CELL = "padding:2px 8px;border:1px solid #d0d7de;text-align:left;vertical-align:top"
_HEAD = _CELL + ";background:#f0f3f6"


def _t(text: Any) -> str:
    """Escape for element content (quotes stay readable: update functions use primes)."""
    return html.escape(str(text), quote=False)


def _a(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _call(obj: Any, name: str, default: Any) -> Any:
    """``obj.name`` (called if it is a method), or ``default`` where it is missing or fails."""
    try:
        v = getattr(obj, name)
        return v() if callable(v) else v
    except Exception:  # a derived property of a partial/odd schedule must not break the view
        return default


def _table(head: list[str], rows: list[list[str]]) -> str:
    """Rows are pre-escaped HTML cells."""
    th = "".join(f'<th style="{_HEAD}">{_t(h)}</th>' for h in head)
    body = "".join("<tr>" + "".join(f'<td style="{_CELL}">{c}</td>' for c in r) + "</tr>" for r in rows)
    return f'<table style="border-collapse:collapse;margin:4px 0 10px 0;font-size:12px">' \
           f"<thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _dims_table(s: Any) -> str:
    smg = s.smg
    sizes = dict(getattr(smg, "dim_sizes", {}) or {})
    tiles = dict(_call(s, "tiles", {}) or {})
    grid = dict(_call(s, "grid", {}) or {})
    decisions = {getattr(d, "dim", None): d for d in getattr(s, "spatial", ()) or ()}
    serial, step = getattr(s, "serial", None), getattr(s, "step", None)
    thread_dim = getattr(s, "thread_dim", None)
    rows = []
    for dim in list(sizes) + [d for d in decisions if d not in sizes and d is not None]:
        size = sizes.get(dim)
        dec = decisions.get(dim)
        cut = bool(getattr(dec, "cut", dim in tiles))
        tile = tiles.get(dim)
        blocks = grid.get(dim, math.ceil(size / tile) if tile and size else 1)
        if dim == serial and step and size:
            ser = f"<b>serial</b>, step {_t(step)} ({_t(math.ceil(size / step))} steps)"
        else:
            ser = ""
        thr = f"<b>threads</b> ({_t(tiles.get(dim, '?'))})" if dim == thread_dim else ""
        rows.append([
            f"<code>{_t(dim)}</code>", _t(size if size is not None else "?"),
            '<span style="color:#1a7f37">cut</span>' if cut else '<span style="color:#8c959f">not cut</span>',
            _t(tile) if tile is not None else f'<span style="color:#8c959f">whole ({_t(size)})</span>',
            _t(blocks) if cut else "1", thr, ser, _t(getattr(dec, "reason", "")),
        ])
    return _table(["dim", "size", "spatial", "tile", "blocks", "thread dim", "temporal", "slicer's reason"], rows)


def _memory(s: Any) -> str:
    smg = s.smg
    inputs, outputs = set(getattr(smg, "inputs", ())), set(getattr(smg, "outputs", ()))
    chips = []
    for name, lvl in getattr(s, "memory", ()) or ():
        role = "input" if name in inputs else "output" if name in outputs else "intermediate"
        border = "dashed" if lvl == "inlined" else "solid"
        chips.append(f'<span title="{_a(f"{name}: {lvl} ({role})")}" style="display:inline-block;margin:2px 4px 2px 0;'
                     f'padding:1px 6px;border:1px {border} #34495e;border-radius:3px;'
                     f'background:{level_colour(str(lvl))}"><code>{_t(name)}</code>: {_t(lvl)}</span>')
    return "".join(chips) or "<i>no memory levels recorded</i>"


def _updates(s: Any) -> str:
    plan = getattr(s, "plan", None)
    states = tuple(getattr(plan, "states", ()) or ())
    names = tuple(getattr(u, "state", "?") for u in states)
    serial = getattr(s, "serial", "?")
    lines = []
    for u in states:
        try:
            text = u.describe(serial, names)
        except Exception:  # an update function of a newer kind: show its fields rather than fail
            text = f"{getattr(u, 'state', '?')}: {getattr(u, 'combiner', '?')} of {getattr(u, 'body', '?')}"
        lines.append(_t(text))
        post = str(getattr(u, "postponed", "1"))
        if post != "1":
            lines.append(f"  <i>broadcast postposition: factor {_t(post)} applied after the loop</i>")
    for out, expr in getattr(plan, "finalize", ()) or ():
        lines.append(f"<b>finalize</b>: {_t(out)} = {_t(expr)}")
    streamed = ", ".join(getattr(plan, "streamed", ()) or ()) or "-"
    inlined = ", ".join(getattr(plan, "inlined", ()) or ()) or "-"
    pre = "\n".join(lines) or "<i>no carried state</i>"
    return (f"<div>streamed per step: <code>{_t(streamed)}</code>; inlined: <code>{_t(inlined)}</code></div>"
            f'<pre style="background:#f6f8fa;padding:6px 8px;margin:4px 0 10px 0;font-size:12px;'
            f'white-space:pre-wrap">{pre}</pre>')


def schedule_html(s: Any) -> str:
    """HTML for a Schedule: dims table, memory levels, derived update functions, totals and the SMG.

    The SMG drawing is inline SVG (no XML declaration) with data spaces filled by memory level.
    """
    smg = s.smg
    grid = dict(_call(s, "grid", {}) or {})
    blocks = _call(s, "num_blocks", math.prod(grid.values()) if grid else 1)
    threads = _call(s, "threads", "?")
    steps = _call(s, "num_steps", "?")
    key = str(_call(s, "key", ""))[:12]
    grid_txt = " × ".join(f"{d}:{n}" for d, n in grid.items()) or "1"
    totals = (f"<b>grid</b> {_t(blocks)} blocks ({_t(grid_txt)}) &nbsp;·&nbsp; <b>threads/block</b> {_t(threads)} "
              f"(over <code>{_t(getattr(s, 'thread_dim', '?'))}</code>) &nbsp;·&nbsp; <b>serial</b> "
              f"<code>{_t(getattr(s, 'serial', '?'))}</code>, step {_t(getattr(s, 'step', '?'))} "
              f"({_t(steps)} steps)")
    try:
        svg = smg_svg(smg, levels={str(k): str(v) for k, v in getattr(s, "memory", ()) or ()},
                      title=f"SMG {getattr(smg, 'name', '')} (data spaces by memory level)")
    except Exception as e:  # the drawing is an aid; never hide the decisions behind a drawing bug
        svg = f"<pre>SMG drawing failed: {_t(repr(e))}</pre>"
    h4 = 'style="margin:8px 0 2px 0"'
    return (
        '<div class="spacefusion-schedule" style="font-family:system-ui,sans-serif;font-size:13px;color:#1f2328;'
        'background:#ffffff;padding:8px">'
        f'<h3 style="margin:0 0 4px 0">Schedule for <code>{_t(getattr(smg, "name", ""))}</code> '
        f'<span style="font-weight:normal;color:#57606a;font-size:12px">key {_t(key)}</span></h3>'
        f"<div>{totals}</div>"
        f"<h4 {h4}>Dimensions (spatial and temporal slicers)</h4>{_dims_table(s)}"
        f"<h4 {h4}>Memory levels</h4><div>{_memory(s)}</div>"
        f"<h4 {h4}>Update functions (derived by the temporal slicer)</h4>{_updates(s)}"
        f'<h4 {h4}>SMG</h4><div style="overflow-x:auto">{svg}</div></div>'
    )
