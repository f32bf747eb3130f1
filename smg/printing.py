"""Readable text summaries of an SMG (``print(smg)``)."""

from __future__ import annotations

from smg.ir import SMG


def summary(smg: SMG) -> str:
    dims = " ".join(f"{d.name}={d.size}" for d in smg.dims)
    lines = [f"SMG {smg.name}  key={smg.key[:12]}", f"  dims: {dims}", "  data spaces:"]
    role = {n: "input" for n in smg.inputs} | {n: "output" for n in smg.outputs}
    for s in smg.spaces:
        lines.append(f"    {s.name}[{', '.join(s.dims)}] {s.dtype} {role.get(s.name, 'intermediate')}")
    lines.append("  iteration spaces (op: body):")
    for op in smg.ops:
        red = f" {op.combiner} over {','.join(op.reduce)}" if op.reduce else ""
        lines.append(f"    {op.iteration_space}[{', '.join(op.iter_dims)}] {op.kind}{red}: {op.body}")
    lines.append("  mappings (non One-to-One dims):")
    for e in smg.edges:
        marks = [f"{d}:{k.short}" for d, k in e.kinds if k.short != "1:1"]
        lines.append(f"    {e.src} -> {e.dst}  {' '.join(marks) or 'all 1:1'}")
    counts = smg.count_kinds()
    lines.append("  kinds: " + ", ".join(f"{k.value}={v}" for k, v in counts.items()))
    return "\n".join(lines)
