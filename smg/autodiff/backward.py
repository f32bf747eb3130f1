"""``derive_backward``: the backward SMG of a forward SMG, and the forward that saves what it needs."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import sympy as sp

from smg.autodiff import rewrite as rw
from smg.autodiff.sweep import Node, reverse_sweep
from smg.errors import BackwardError
from smg.expr import PLUS_INF, parse, symbol
from smg.hashing import text_key
from smg.ir import SMG, Access, DataSpace, Dim, Op


@dataclass(frozen=True)
class Backward:
    """A derived backward.  ``forward`` is the forward SMG with the saved statistics as extra outputs;
    ``graph`` the whole backward as one SMG (inputs: the forward's inputs, what it saved, the outputs'
    adjoints ``seeds``); ``grads`` maps each differentiated input to its gradient space; ``derivation`` the
    steps in words (``schedulers.passes`` cuts ``graph`` into kernels and prints them with each)."""

    forward: SMG
    graph: SMG
    saved: tuple[str, ...]
    seeds: tuple[tuple[str, str], ...]
    grads: tuple[tuple[str, str], ...]
    derivation: tuple[str, ...]

    @property
    def key(self) -> str:
        return text_key("\n".join((self.forward.key, self.graph.key, *self.derivation)))


def _stat_dtype(dtype: str) -> str:
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def derive_backward(fwd: SMG, wrt: tuple[str, ...] | None = None) -> Backward:
    """Derive the backward of ``fwd`` with respect to ``wrt`` (default: every input)."""
    wrt = tuple(fwd.inputs) if wrt is None else tuple(wrt)
    for w in wrt:
        if w not in fwd.inputs:
            raise BackwardError(f"{w!r} is not an input of {fwd.name!r} (inputs: {list(fwd.inputs)})")
    taken = {s.name for s in fwd.spaces} | set(fwd.dim_sizes) | {f"d{w}" for w in wrt}
    sw = reverse_sweep(fwd, wrt, taken)
    notes = ["reverse sweep (adjoint contributions, the duals of the mappings):"]
    notes += [f"  {n}" for n in sw.notes]
    for m, steps in sw.stabilisers.items():
        notes.append(f"  {m}: a stabiliser, adjoint 0 (shift it by t: {'; '.join(steps)})")
    space_dims = {s.name: s.dims for s in fwd.spaces} | {sw.seeds[o]: fwd.space(o).dims for o in fwd.outputs}
    space_dims |= {n.name: n.dims for n in sw.nodes.values()}
    all_dims = set(fwd.dim_sizes)
    stats = rw.saved_statistics(fwd)
    keep = set(stats) | set(fwd.outputs)
    nodes = sw.nodes
    adj = {w: sw.adjoints[w] for w in wrt}
    for n in nodes.values():
        n.body = rw.inline(n.body, fwd, keep)
    adj = {w: rw.inline(e, fwd, keep) for w, e in adj.items()}

    # -- compress the statistics of one row into one (log-linear), where every other then cancels
    saved_ops: list[Op] = []
    anchor: tuple[str, sp.Expr] | None = None
    groups: dict[tuple[str, ...], list[str]] = {}
    for s, back in stats.items():
        groups.setdefault(back, []).append(s)
    for members in groups.values():
        if len(members) < 2:
            continue
        syms = [symbol(s) for s in members]
        for op in fwd.ops:
            if op.reduce or op.out in keep:
                continue
            value = rw.inline(symbol(op.out), fwd, keep)
            c = rw.log_linear(value, syms)
            if c is None:
                continue
            name = "LSE" if "LSE" not in taken else f"LSE_{op.out}"
            taken.add(name)
            lse = symbol(name)
            for s in syms:
                sol = sp.solve(sp.Eq(lse, c), s)
                if len(sol) != 1:
                    continue
                trial_nodes, trial_adj = copy.deepcopy(nodes), dict(adj)
                sub = {s: sol[0]}
                for n in trial_nodes.values():
                    n.body = rw.pull_logs(n.body.xreplace(sub))
                trial_adj = {w: rw.pull_logs(e.xreplace(sub)) for w, e in trial_adj.items()}
                post = rw.postpone(trial_nodes, trial_adj, space_dims, all_dims)
                for n in trial_nodes.values():
                    n.body = rw.tidy(n.body)
                left = set().union(*(n.body.free_symbols for n in trial_nodes.values()),
                                   *(e.free_symbols for e in trial_adj.values()))
                if left & set(syms):
                    continue
                nodes, adj = trial_nodes, trial_adj
                sdims = tuple(d for d in fwd.space(members[0]).dims)
                saved_ops.append(Op("saved", name, sdims, tuple(Access(m, fwd.space(m).dims) for m in members),
                                    str(c)))
                space_dims[name] = sdims
                for m in members:
                    keep.discard(m)
                keep.add(name)
                anchor = (op.out, rw.tidy(rw.pull_logs(value.xreplace(sub))))
                notes.append("saved statistics, compressed (log-linear in the row statistics):")
                notes.append(f"  log {op.out} = log({value}) = f - ({c})  =>  the forward saves {name} = {c}")
                notes.append(f"  {s} = {sol[0]} substituted; {', '.join(m for m in members if m != s)} cancel "
                             f"from every backward body")
                notes.append(f"  recomputed: {op.out} = {anchor[1]}")
                notes += [f"  postposition: {p}" for p in post]
                break
            if anchor is not None:
                break
    if anchor is None:
        post = rw.postpone(nodes, adj, space_dims, all_dims)
        for n in nodes.values():
            n.body = rw.tidy(n.body)
        if post:
            notes.append("postposition (row constants out of backward reductions):")
            notes += [f"  {p}" for p in post]
        plain = [s for s in stats if s in set().union(*(n.body.free_symbols for n in nodes.values()))]
        if plain:
            notes.append(f"saved statistics (read back along a reduced dim; not log-linear together): {plain}")

    # -- reassociate against the forward's saved outputs
    outs = {}
    for o in fwd.outputs:
        op = fwd.producer(o)
        if op is not None and op.reduce and op.combiner == "sum":
            body = rw.inline(op.expr, fwd, keep)
            if anchor is not None:
                body = rw.pull_logs(body.xreplace({symbol(k): v for k, v in _solved(saved_ops).items()}))
            outs[o] = Node(o, fwd.space(o).dims, op.reduce, rw.tidy(body), "forward output")
    re_notes = rw.reassociate(nodes, outs, space_dims, all_dims)
    if re_notes:
        notes.append("reassociated against the forward's saved outputs:")
        notes += [f"  {n}" for n in re_notes]

    for n in list(nodes.values()):  # FlashAttention's name for rowsum(dO * O)
        if n.origin == "reassociated" and "Delta" not in taken and "Delta" not in nodes:
            del nodes[n.name]
            old, n.name = n.name, "Delta"
            nodes["Delta"] = n
            space_dims["Delta"] = n.dims
            for m in nodes.values():
                m.body = m.body.xreplace({symbol(old): symbol("Delta")})
            for w in adj:
                adj[w] = adj[w].xreplace({symbol(old): symbol("Delta")})
            notes.append(f"  {old} is named Delta")
    # -- name the recomputed normalised value and the gradients
    extra_saved: tuple[str, ...] = ()
    if anchor is not None:
        pname, pexpr = anchor
        for n in nodes.values():
            n.body = n.body.xreplace({pexpr: symbol(pname)})
        nodes = {pname: Node(pname, fwd.space(pname).dims, (), pexpr, "recomputed"), **nodes}
        space_dims[pname] = fwd.space(pname).dims
        split = _split_statistics(fwd, nodes, pname, saved_ops[-1], keep, taken)
        if split is not None:
            nodes, split_ops, split_notes = split
            extra_saved = (saved_ops[-1].out,)  # still an output: torch's attention backward reads it
            saved_ops += split_ops
            for op in split_ops:
                space_dims[op.out] = op.out_index
                keep.add(op.out)
            notes += split_notes
    grads = []
    for w in wrt:
        e = adj[w]
        gname = f"d{w}"
        single = isinstance(e, sp.Symbol) and e.name in nodes and nodes[e.name].reduce
        if single and (gname not in nodes or e.name == gname):
            n = nodes.pop(e.name)
            n.name = gname
            nodes[gname] = n
            for m in nodes.values():
                m.body = m.body.xreplace({e: symbol(gname)})
        else:
            nodes[gname] = Node(gname, fwd.space(w).dims, (), rw.tidy(e), f"gradient of {w}")
        space_dims[gname] = fwd.space(w).dims
        grads.append((w, gname))
    graph = _emit(fwd, nodes, [g for _, g in grads], space_dims, sw.seeds, saved_ops, keep)
    notes.append("backward bodies:")
    for op in graph.ops:
        red = f"sum_{','.join(op.reduce)} " if op.reduce else ""
        notes.append(f"  {op.out}[{', '.join(op.out_index)}] = {red}{op.body}")
    used = set(graph.inputs)
    saved = tuple(s for s in dict.fromkeys([*(o.out for o in saved_ops), *sorted(keep)])
                  if (s in used or s in extra_saved) and s not in fwd.inputs)
    recomputed = [op.out for op in graph.ops if fwd.producer(op.out) is not None]
    notes.append(f"saved by the forward: {', '.join(saved) or '-'}; recomputed: {', '.join(recomputed) or '-'}")
    forward = _with_saved(fwd, saved_ops, saved)
    return Backward(forward, graph, saved, tuple(sw.seeds.items()), tuple(grads), tuple(notes))


def _split_statistics(fwd: SMG, nodes: dict[str, Node], pname: str, lse_op: Op, keep: set[str],
                      taken: set[str]) -> tuple[dict[str, Node], list[Op], list[str]] | None:
    """The recomputed ``P = exp(X - LSE)`` rewritten to read the row statistics in two parts, where its
    scores ``X`` add a forward input (a mask or bias the caller fills, HF's ``finfo.min`` included): the
    forward's own chain ``X`` (its max's operand), ``P_sub = X - LSE_max``, ``P = exp(P_sub - LSE_log)``
    with ``LSE_max`` the row max and ``LSE_log`` the log of the row sum, saved apart.  Why: for a row whose
    every score is about ``finfo.min``, ``LSE = max + log(sum)`` rounds to ``max`` (the log part is below
    its ulp), so ``exp(X - LSE)`` is 1 per key instead of ``1/L`` and dV is L times too big; the
    differences ``X - max`` are exact (0 for equal fills), as in the forward.  Each node is one two-term
    operation, so every target evaluates the differences before the log part (a sum of three terms would
    be evaluated in sympy's argument order).  None (today's single ``LSE``) where ``P``'s exponent reads
    no forward input (its scores are bounded by the data: plain and causal attention keep their graphs and
    keys), or where the statistic is not ``max + log(sum)`` or another body reads ``LSE``."""
    lse = symbol(lse_op.out)
    body = nodes[pname].body
    if not isinstance(body, sp.exp) or not (body.free_symbols & {symbol(i) for i in fwd.inputs}):
        return None
    if any(lse in n.body.free_symbols for k, n in nodes.items() if k != pname):
        return None
    terms = sp.Add.make_args(parse(lse_op.body))
    stat_max = [t for t in terms if isinstance(t, sp.Symbol)]
    stat_log = [t.args[0] for t in terms if isinstance(t, sp.log) and isinstance(t.args[0], sp.Symbol)]
    if len(terms) != 2 or len(stat_max) != 1 or len(stat_log) != 1:
        return None
    mx, total = fwd.producer(stat_max[0].name), fwd.producer(stat_log[0].name)
    if mx is None or mx.combiner != "max" or len(mx.inputs) != 1 or total is None:
        return None
    scores = mx.inputs[0].space
    x = rw.inline(symbol(scores), fwd, keep)
    rest = sp.expand(body.args[0] + lse)
    if sp.expand(rest - x) != 0:
        return None
    name_max, name_log, name_sub = f"{lse_op.out}_max", f"{lse_op.out}_log", f"{pname}_shift"
    if {name_max, name_log, name_sub} & (taken | set(nodes)):
        return None
    taken |= {name_max, name_log, name_sub}
    dims, m, total_s = lse_op.out_index, stat_max[0], stat_log[0]
    ops = [Op("saved", name_max, dims, (Access(m.name, fwd.space(m.name).dims),
                                        Access(total_s.name, fwd.space(total_s.name).dims)),
              f"Piecewise(({m}, {total_s} > 0), ({PLUS_INF}, True))"),
           Op("saved", name_log, dims, (Access(total_s.name, fwd.space(total_s.name).dims),), f"log({total_s})")]
    sub_dims = fwd.space(scores).dims
    new = {scores: Node(scores, sub_dims, (), rw.tidy(x), "recomputed"),
           name_sub: Node(name_sub, sub_dims, (), symbol(scores) - symbol(name_max), "recomputed"),
           pname: Node(pname, nodes[pname].dims, (), sp.exp(symbol(name_sub) - symbol(name_log)), "recomputed")}
    new |= {k: n for k, n in nodes.items() if k != pname}
    notes = [f"saved statistics, in two parts ({pname}'s scores read a forward input, a fill possibly "
             f"finfo.min, where max + log(sum) loses the log):",
             f"  {name_max} = {m}, {name_log} = log({total_s}) (+inf both for an empty row); "
             f"{lse_op.out} = {lse_op.body} still saved",
             f"  recomputed: {scores} = {rw.tidy(x)}; {name_sub} = {scores} - {name_max}; "
             f"{pname} = exp({name_sub} - {name_log})"]
    return new, ops, notes


def _solved(saved_ops: list[Op]) -> dict[str, sp.Expr]:
    out = {}
    for op in saved_ops:
        c = parse(op.body)
        for a in op.inputs:
            sol = sp.solve(sp.Eq(symbol(op.out), c), symbol(a.space))
            if len(sol) == 1:
                out[a.space] = sol[0]
                break
    return out


def _emit(fwd: SMG, nodes: dict[str, Node], grads: list[str], space_dims: dict[str, tuple[str, ...]],
          seeds: dict[str, str], saved_ops: list[Op], keep: set[str]) -> SMG:
    """The backward SMG: the nodes the gradients need, in dependency order, and the forward reductions they
    recompute."""
    all_dims = set(fwd.dim_sizes)
    recompute: dict[str, Node] = {}
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        node = nodes.get(name) or recompute.get(name)
        if node is None:
            op = fwd.producer(name)
            if op is None or name in keep or name in fwd.outputs:
                return
            if op.combiner != "sum":
                raise BackwardError(f"the backward needs {name!r} ({op.kind}), a {op.combiner} the forward does "
                                    f"not save and the backward cannot recompute")
            node = Node(name, fwd.space(name).dims, op.reduce, rw.inline(op.expr, fwd, keep), "recomputed")
            recompute[name] = node
        for s in sorted(node.body.free_symbols, key=str):
            if s.name not in all_dims:
                visit(s.name)
        order.append(name)

    for g in grads:
        visit(g)
    spaces: dict[str, DataSpace] = {}
    ops = []
    dtype = fwd.spaces[0].dtype
    for name in order:
        node = nodes.get(name) or recompute[name]
        reads = sorted({s.name for s in node.body.free_symbols if s.name not in all_dims})
        for r in reads:
            if r not in spaces:
                if r in {s.name for s in fwd.spaces}:
                    spaces[r] = fwd.space(r)
                elif r in seeds.values():
                    o = next(k for k, v in seeds.items() if v == r)
                    spaces[r] = DataSpace(r, fwd.space(o).dims, fwd.space(o).dtype)
                else:
                    spaces[r] = DataSpace(r, space_dims[r], _stat_dtype(dtype))
        extra = rw.dims_of(node.body, space_dims, all_dims) - set(node.dims) - set(node.reduce)
        if extra:  # pragma: no cover - the sweep reduces every dim a contribution lacks
            raise BackwardError(f"backward body of {name!r} reads dims {sorted(extra)} it neither keeps nor reduces")
        spaces[name] = DataSpace(name, node.dims, fwd.space(name).dtype if name in {s.name for s in fwd.spaces}
                                 else dtype)
        ops.append(Op("backward" if name not in recompute else "recompute", name, node.dims,
                      tuple(Access(r, space_dims.get(r) or spaces[r].dims) for r in reads),
                      _text(rw.bounded_logistic(node.body)),
                      node.reduce, "sum" if node.reduce else "none"))
    used = {d for s in spaces.values() for d in s.dims} | {d for op in ops for d in op.iter_dims}
    return SMG(name=f"{fwd.name}_backward", dims=tuple(Dim(d.name, d.size) for d in fwd.dims if d.name in used),
               spaces=tuple(spaces.values()), ops=tuple(ops), outputs=tuple(grads))


def _text(expr: sp.Expr) -> str:
    """A body's text: sympy's constants as numbers (the body parser reads ``pi`` as a name)."""
    return str(expr.xreplace({sp.pi: sp.Float(math.pi, 17), sp.E: sp.Float(math.e, 17)}))


def empty_row_guard(op: Op) -> Op:
    """A saved statistic ``c`` (``LSE = P_max + log(P_sum)``) as the forward stores it: +inf where a sum it
    takes the log of is 0, FlashAttention-2's rule.  That sum is 0 only for a row whose every score is -inf
    (each term ``exp(-inf)``; a row with a finite score has a term ``exp(0) = 1``), where ``c`` is
    ``-inf + log 0 = -inf`` and a backward's ``exp(s - LSE)`` would be ``exp(-inf + inf)``: NaN, spread by
    dK and dV's sums over the rows to every key.  With +inf it is ``exp(-inf) = 0``, so such a row (0 in the
    forward) has P = 0 and gradient 0, as torch's (whose CPU flash attention stores 0 there and FA2 +inf;
    its backward reads +inf alike).  Rows with a finite score keep ``c`` exactly; a statistic with no log
    is stored as it is."""
    logs = sorted({a.args[0] for a in parse(op.body).atoms(sp.log)}, key=str)
    if not logs:
        return op
    keep = f"{logs[0]} > 0" if len(logs) == 1 else f"And({', '.join(f'{x} > 0' for x in logs)})"
    return dataclasses.replace(op, body=f"Piecewise(({op.body}, {keep}), ({PLUS_INF}, True))")


def _with_saved(fwd: SMG, saved_ops: list[Op], saved: tuple[str, ...]) -> SMG:
    """``fwd`` with the saved statistics as extra outputs (the forward outputs themselves are saved anyway),
    each as ``empty_row_guard`` stores it."""
    extra_ops = tuple(empty_row_guard(op) for op in saved_ops if op.out in saved)
    extra_spaces = tuple(DataSpace(op.out, op.out_index, _stat_dtype(fwd.spaces[0].dtype)) for op in extra_ops)
    outs = tuple(dict.fromkeys((*fwd.outputs, *(s for s in saved if s not in fwd.inputs))))
    if not extra_ops and outs == fwd.outputs:
        return fwd
    return SMG(name=fwd.name, dims=fwd.dims, spaces=fwd.spaces + extra_spaces, ops=fwd.ops + extra_ops,
               outputs=outs, attrs=fwd.attrs + (("saves", ",".join(saved)),))
