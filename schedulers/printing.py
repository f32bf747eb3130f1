"""Readable summaries of schedules."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schedulers.schedule import Schedule


def schedule_summary(s: Schedule) -> str:
    sizes = s.smg.dim_sizes
    lines = [f"Schedule for {s.smg.name}  key={s.key[:12]}", "  spatial slicer:"]
    for d in s.spatial:
        tile = s.tiles.get(d.dim)
        mark = f"cut, tile {tile} ({s.grid()[d.dim]} blocks)" if d.cut else "not cut"
        lines.append(f"    {d.dim}={sizes[d.dim]}: {mark} -- {d.reason}")
    lines.append(f"  blocks: {s.num_blocks}, threads/block: {s.threads} (over {s.thread_dim})")
    lines.append(f"  temporal slicer: serial dim {s.serial}, step {s.step} ({s.num_steps} steps)")
    lines.append(f"    streamed per step: {', '.join(s.plan.streamed) or '-'}; inlined: "
                 f"{', '.join(s.plan.inlined) or '-'}")
    names = tuple(u.state for u in s.plan.states)
    lines.append("  update functions (derived):")
    for u in s.plan.states:
        lines.append(f"    {u.describe(s.serial, names)}")
        if u.postponed != "1":
            lines.append(f"      broadcast postposition: factor {u.postponed} applied after the loop")
    for out, expr in s.plan.finalize:
        lines.append(f"  finalize: {out} = {expr}")
    lines.append("  memory levels: " + ", ".join(f"{n}:{lvl}" for n, lvl in s.memory))
    return "\n".join(lines)
