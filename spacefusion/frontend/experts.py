"""MoE experts' grouped GEMMs as GEMMs whose weight is an indexed load along the expert dim (CPU targets).

transformers runs a Mixtral layer's experts under ``torch.compile`` as ``grouped_mm_fallback(x, w, offs)``: the
rows of ``x`` [M, k] sorted by expert, ``offs`` [E] the cumulative row counts (expert e's rows are
``[offs[e - 1], offs[e])``), ``w`` [E, k, n] (the experts' stored [E, n, k] weight, transposed), rows past the last
end zero.  Which expert's weight a row multiplies is data, so no index expression states it; as an indexed load
(``smg.loads``) it is ``Y[m, n] = sum_k X[m, k] * W[m, n, k]``, ``W[m, n, k] = Experts[Expert[m], n, k]``, the
``Expert`` ids each row's group (``records.Operand.ends``: ``searchsorted(offs, arange(M), right=True)``, which
torch computes at bind time; a row past the last end gets E, outside the table, and reads zeros as the fallback
writes them, though the CPU backends' id check raises there: transformers' ``offs`` always end at M).

Why CPU targets only: the kernel reads each row's weight from global through its id (``lower.loads``), a GEMV a
row with no reuse of a weight tile across rows, where the library's grouped GEMM runs each expert's rows as one
tensor-core GEMM; a warp-tile schedule of it is refused (``lower.loads.check``).  The GPU backend keeps it with
torch (``CudaBackend.library_first["expert_gemm"]``).
"""

from __future__ import annotations

import torch
from torch import fx

from smg.loads import IndexedLoad, with_loads
from smg.ops import Builder
from spacefusion.frontend.canon import canonical
from spacefusion.frontend.graph import dtype, param_ref, param_tensor, permutation, shape
from spacefusion.frontend.matchers import Context, _build, _param, _subgraph, _value
from spacefusion.frontend.records import Operand, Subgraph

#: ``CudaBackend.library_first``'s key of the experts' GEMMs
LIBRARY_KEY = "expert_gemm"
#: the canonical op of the grouped GEMM taken (``canon.CUSTOM_ANCHORS``): transformers' fallback, which it runs
#: under ``torch.compile`` where torch's own grouped GEMM is unavailable or refuses the dtype (that spelling: torch)
GROUPED = ("grouped_mm_fallback",)


def expert_gemm(m: int, n: int, k: int, experts: int, dtype: str) -> object:
    """``Y[m, n] = sum_k X[m, k] * W[m, n, k]`` with ``W`` read as ``Experts[Expert[m], n, k]`` (``smg.loads``)."""
    g = Builder("expert_gemm", dtype)
    y = g.matmul(g.input("X", {"m": m, "k": k}), g.input("W", {"m": m, "n": n, "k": k}), reduce="k", name="Y")
    return with_loads(g.build(y), (IndexedLoad("W", "Experts", "Expert", ("m",), experts),))


def match_expert_gemm(node: fx.Node, ctx: Context) -> Subgraph | None:
    """``grouped_mm(x, w.transpose(-2, -1), offs=offs)`` of a parameter ``w`` [E, n, k] -> ``expert_gemm``;
    None where it is not that form (left to torch as ``left.grouped_mm``)."""
    call = canonical(node, ctx.gm)
    if call is None or call.op not in GROUPED or not ctx.free(node):
        return None
    a = call.bind(("input", "weight", "offs"))
    x, w, offs = a.get("input"), a.get("weight"), a.get("offs")
    perm = permutation(w, rank=3) if isinstance(w, fx.Node) else None
    ref = param_ref(perm[0]) if perm is not None and perm[1] == (0, 2, 1) else None
    xs, os_, dt = shape(x), shape(offs), dtype(node)
    if ref is None or xs is None or os_ is None or len(xs) != 2 or dt is None or dtype(x) != dt:
        return None
    stored = tuple(param_tensor(ctx.gm, ref).shape)  # [E, n, k]
    meta = offs.meta.get("tensor_meta") if isinstance(offs, fx.Node) else None
    if (len(stored) != 3 or stored[2] != xs[1] or os_ != (stored[0],)
            or getattr(meta, "dtype", None) not in (torch.int32, torch.int64)):
        return None
    if ctx.library.get(LIBRARY_KEY):
        ctx.refuse(node, "library.first", ctx.library[LIBRARY_KEY])
        return None
    (m, k), (e, n, _) = xs, stored
    smg = _build(ctx, node, lambda: expert_gemm(m, n, k, e, dt))
    if smg is None:
        return None
    ops = [_value("X", x, xs), _param("Experts", ref, stored), Operand("Expert", "value", offs.name, (m,), ends=True)]
    return _subgraph("expert_gemm", f"expert gemm {m}x{n}x{k} of {e} experts {dt}", (node,), smg, ops, {"Y": node})
