"""Readable summaries of schedules."""

from __future__ import annotations

import dataclasses
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
    derivation = dict(s.smg.attrs).get("derivation")
    if derivation:  # a pass of a derived backward (``smg.autodiff``, ``schedulers.passes``)
        lines.append("  backward derivation (smg.autodiff):")
        lines.extend(f"    {line}" for line in derivation.splitlines())
    lines.append("  memory levels: " + ", ".join(f"{n}:{lvl}" for n, lvl in s.memory))
    if s.warp_tile is not None:
        lines.append("  tensor cores: " + warp_tile_summary(s))
    return "\n".join(lines)


def warp_tile_summary(s: Schedule) -> str:
    """The warp-tile program's knobs in words (what the memory levels above do not say)."""
    p = s.warp_tile
    parts = [f"{p.warps} warps x {p.warp_mtiles} 16-row mma tile{'s' if p.warp_mtiles > 1 else ''}",
             f"{p.warp.stages}-stage {'TMA' if p.hopper.tma else 'cp.async'} ring"]
    if p.gemm is not None:
        held = "re-read from shared memory every step" if p.warp.reload_a else "held in registers"
        parts.append(f"{p.gemm.a} {held}")
    if p.warp.early_scores:
        parts.append("score operands waited for before the second GEMM's")
    if p.lazy:
        parts.append(", ".join(f"{m} kept within {tau:.2f}" for m, tau in p.lazy))
    if p.hopper.wgmma:
        parts.append("GEMMs on warpgroup MMA (wgmma.mma_async, 128 B-swizzled tiles)")
    if p.hopper.tma:
        parts.append("tiles loaded by TMA (tensor maps, an mbarrier per ring slot)")
    if p.hopper.producer:
        parts.append("loads issued by a producer warpgroup (slots handed back by mbarriers, no block barrier)")
        if p.gemm is not None:
            xs = ", ".join(dict.fromkeys(g.x for g in p.gemm_states))
            parts.append(f"{p.gemm.b} and {xs} loaded and freed apart; each step's row states overlap the previous "
                         f"step's {xs} GEMM" + ("; the two MMA warpgroups take turns" if p.warps == 8 else ""))
    if p.hopper.persistent:
        parts.append(f"persistent: {p.hopper.persistent} blocks looping over {s.num_tiles} tiles")
    if p.hopper.pingpong:
        parts.append("two MMA warpgroups taking turns on alternate tiles (pingpong)")
    if p.warp.fast_math:
        parts.append("tanh and logistics on tanh.approx.f32")
    if p.row_sums:
        parts.append(", ".join(f"{r} summed on tensor cores with {g}" for r, g in p.row_sums))
    if p.warp.split > 1:
        parts.append(f"{p.warp.split} warp groups splitting the steps")
    if p.warp.slices > 1:
        parts.append(f"{p.warp.slices} blocks per row tile splitting the steps")
    for group in (p.warp, p.hopper):  # the knobs whose declaration says what a set one does
        for f in dataclasses.fields(group):
            value = getattr(group, f.name)
            if f.metadata["says"] is not None and value != f.default:
                parts.append(f.metadata["says"].format(value=value))
    return ", ".join(parts)
