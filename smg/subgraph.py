"""The SMG of some of a graph's ops: what the partition cuts into kernels, and a split's combine into two."""

from __future__ import annotations

from smg.ir import SMG, Op


def sub_smg(smg: SMG, ops: list[Op], name: str) -> SMG:
    """The SMG of ``ops``: it reads what they don't produce and writes what the
    rest of the graph (or the user) needs."""
    produced = {op.out for op in ops}
    read_later = {a.space for op in smg.ops if op.out not in produced for a in op.inputs}
    used = {a.space for op in ops for a in op.inputs} | produced
    outs = tuple(op.out for op in ops if op.out in smg.outputs or op.out in read_later)
    dims = {d for sp in smg.spaces if sp.name in used for d in sp.dims} | {d for op in ops for d in op.iter_dims}
    return SMG(
        name=name,
        dims=tuple(d for d in smg.dims if d.name in dims),
        spaces=tuple(sp for sp in smg.spaces if sp.name in used),
        ops=tuple(ops),
        outputs=outs,
        attrs=smg.attrs,
    )


def joined(first: SMG, second: SMG, name: str) -> SMG:
    """``first``'s ops then ``second``'s as one graph: what ``second`` reads of ``first``'s outputs becomes an
    intermediate (kept on chip), and the graph writes ``second``'s outputs.  A dim both name must have one size."""
    sizes = first.dim_sizes
    for d in second.dims:
        if d.name in sizes and sizes[d.name] != d.size:
            raise ValueError(f"cannot join {first.name!r} and {second.name!r}: dim {d.name!r} is {sizes[d.name]} "
                             f"long in one and {d.size} in the other")
    spaces = {s.name: s for s in second.spaces} | {s.name: s for s in first.spaces}
    dims = {d.name: d for d in (*first.dims, *second.dims)}
    return SMG(name=name, dims=tuple(dims.values()), spaces=tuple(spaces.values()),
               ops=first.ops + second.ops, outputs=second.outputs, attrs=second.attrs)
