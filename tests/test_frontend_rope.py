"""The rope matcher on fx graphs: HF's rotate-half RoPE is fused (LLaMA's Q and K, prefill and decode), its
output goes back with the strides torch gives it, so the bshd attention after it still reads it without a
copy; near-RoPEs stay with torch, with the difference as the reason."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from spacefusion.frontend import capture, fuse, partition
from spacefusion.frontend.backends import ReferenceBackend
from spacefusion.models import LlamaConfig, LlamaModel
from spacefusion.models.common import split_heads
from spacefusion.models.llama import rotate_half


class _Recording(ReferenceBackend):
    """The reference backend, remembering the tensors each kernel was given and returned (kept alive, so
    their addresses are not reused)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def _compile(self, smg):
        run = super()._compile(smg)

        def record(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = run(inputs)
            self.calls.append((smg.name, dict(inputs), out))
            return out

        return record


def _llama(kv_heads: int = 2):
    m = LlamaModel(LlamaConfig.tiny(layers=2, kv_heads=kv_heads), seed=1)
    return m, m.example_inputs(1, 16, seed=2)


def test_fused_rope_feeds_the_bshd_attention_without_a_copy() -> None:
    """Q and K leave the RoPE kernel as [b, s, h, d] memory viewed as [b, h, s, d]; the attention binds
    them through its permuted view: the very tensors RoPE wrote (same address, packed), no copy."""
    m, x = _llama()
    be = _Recording()
    fused = fuse(m, *x, backend=be)
    att = [s for s in fused.partition.subgraphs if s.kind == "attention"]
    assert att and all(dict(s.smg.attrs)["layout"] == "bshd" for s in att)
    assert all(o.permute == (0, 2, 1, 3) for s in att for o in s.operands)
    with torch.no_grad():
        for got, want in zip(fused(*x), m(*x)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    written = {out["Y"].data_ptr() for name, _, out in be.calls if name == "rope"}
    assert len(written) == 4  # Q and K of two layers
    read = [(ins["Q"], ins["K"]) for name, ins, _ in be.calls if name == "attention"]
    assert len(read) == 2
    for q, k in read:
        assert q.data_ptr() in written and k.data_ptr() in written
        assert q.is_contiguous() and k.is_contiguous()


def _strides(meta) -> tuple[int | None, ...]:
    """Strides where they matter: a dim of size 1 may have any."""
    return tuple(st if n > 1 else None for n, st in zip(meta.shape, meta.stride))


@pytest.mark.parametrize("past", [0, 8])
def test_rope_outputs_have_the_strides_shape_prop_recorded(past: int) -> None:
    """What the partition decided from the captured strides holds at run time: every fused kernel's output
    (RoPE's interleaved [b, h, s, d] views included) has the strides eager torch gave that node."""
    m = LlamaModel(LlamaConfig.tiny(layers=1, kv_heads=2), seed=1)
    x = m.example_inputs(1, 16, seed=2) if not past else m.example_inputs(2, 1, past=past, seed=2)
    want = {n.name: n.meta["tensor_meta"] for n in capture(m, *x).module.graph.nodes if "tensor_meta" in n.meta}
    fused = fuse(m, *x, backend="reference")
    gm = fused.graph_module
    ShapeProp(gm).propagate(*x)
    checked = set()
    for n in gm.graph.nodes:
        if n.op != "call_module" or not n.target.startswith("fused_"):
            continue
        sub = gm.get_submodule(n.target).sub
        for u in n.users:
            assert u.target is operator.getitem
            r = sub.results[u.args[1]]
            assert tuple(u.meta["tensor_meta"].shape) == tuple(want[r.node].shape)
            assert _strides(u.meta["tensor_meta"]) == _strides(want[r.node]), (sub.label, r.node)
            checked.add(sub.kind)
    assert "rope" in checked and "attention" in checked


class _Rope(nn.Module):
    """Rotary embedding of a projection's split_heads view, HF's way or almost; ``tables`` per sequence."""

    def __init__(self, variant: str = "hf", heads: int = 2, head_dim: int = 8) -> None:
        super().__init__()
        self.variant, self.heads, self.head_dim = variant, heads, head_dim
        self.proj = nn.Linear(heads * head_dim, heads * head_dim, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        x = split_heads(self.proj(h), self.heads, self.head_dim)
        v = self.variant
        if v == "scaled":  # an element-wise op first: not a view, but it keeps split_heads' strides
            x = x * 0.5
        if v == "packed":  # laid out [b, h, s, d]
            x = x.contiguous()
        if v == "catted":  # a concatenation's output, packed [b, h, s, d]: x * cos is a product with a cat too
            x = torch.cat((x[:, :, :2], x[:, :, 2:]), dim=2)
        cu, su = cos.unsqueeze(1), sin.unsqueeze(1)
        if v == "indexed":  # the tables broadcast by indexing, not unsqueeze(1)
            cu, su = cos[:, None], sin[:, None]
        if v == "swapped":
            x1, x2 = x.chunk(2, dim=-1)
            rot = torch.cat((x1, -x2), dim=-1)
        else:
            rot = rotate_half(x)
        out = x * cu + rot * su
        if v == "leaky":  # rotate_half(x) is read again outside the RoPE
            return out, rot
        return out


def _tables(b: int, s: int, d: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(b, s, d, generator=gen, dtype=dtype), torch.randn(b, s, d, generator=gen, dtype=dtype)


def _run(variant: str, batch: int = 2, table_batch: int = 1, dtype=torch.float32):
    torch.manual_seed(0)
    model = _Rope(variant).eval()
    h = torch.randn(batch, 5, 16)
    cos, sin = _tables(table_batch, 5, 8, dtype)
    fused = fuse(model, h, cos, sin, backend="llvm")
    with torch.no_grad():
        want, got = model(h, cos, sin), fused(h, cos, sin)
    for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert g.stride() == w.stride()
    return fused.partition


@pytest.mark.parametrize("variant,table_batch,layout,permute", [
    ("hf", 1, "bshd", None),  # split_heads' transpose taken in: X is the projection's unflatten view
    ("hf", 2, "bshd", None),  # one table per sequence ([b, s, d], HF's position_ids of a batch)
    ("scaled", 1, "bshd", (0, 2, 1, 3)),  # a value lying as [b, s, h, d]: read through a permuted view
    ("packed", 1, "bhsd", None),
    ("catted", 1, "bhsd", None),
])
def test_rope_binds_its_input_where_it_lies(variant, table_batch, layout, permute) -> None:
    p = _run(variant, table_batch=table_batch)
    (sub,) = [s for s in p.subgraphs if s.kind == "rope"]
    assert sub.label.endswith(" bshd") == (layout == "bshd")
    ops = {o.space: o for o in sub.operands}
    assert ops["X"].permute == permute and ops["X"].shape == sub.smg.shape("X")
    assert ops["Cos"].shape == ((2, 5, 8) if table_batch == 2 else (5, 8))
    assert sub.results[0].permute == ((0, 2, 1, 3) if layout == "bshd" else None)
    if variant == "hf":
        assert ops["X"].ref == "unflatten" and any(n.startswith("transpose") for n in sub.nodes)


@pytest.mark.parametrize("variant,dtype,why", [
    ("swapped", torch.float32, "concatenates (x1, -x2)"),
    ("indexed", torch.float32, "not unsqueeze(1)"),
    ("leaky", torch.float32, "read outside it"),
    ("hf", torch.float64, "dtypes"),
])
def test_near_ropes_stay_with_torch_with_a_reason(variant, dtype, why) -> None:
    """Not HF's form in a detail: nothing fused, the final add says why, the model still matches eager."""
    p = _run(variant, dtype=dtype)
    assert not [s for s in p.subgraphs if s.kind == "rope"]
    (add,) = [op for op in p.left if op.op == "operator.add"]
    assert why in add.reason


def test_a_sum_of_products_that_is_not_rope_is_not_refused() -> None:
    """``a * b + c * d`` with no rotate-half is not RoPE at all: no reason from the rope matcher."""

    class _Fma(nn.Module):
        def forward(self, a, b, c, d):
            return b * d + torch.cat((a, c), dim=-1) * d  # a concatenation, but of no chunk's halves

    a, c, b, d = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 8), torch.randn(2, 8)
    p = partition(capture(_Fma(), a, b, c, d).module)
    assert [op.op for op in p.left].count("operator.add") == 1
    assert not any("RoPE" in op.reason or "rotate" in op.reason for op in p.left)


def test_rope_matcher_takes_the_exact_nodes() -> None:
    """The subgraph is split_heads' transpose, the two products, chunk, its halves, the negation, the
    concatenation and the sum; the shared unsqueezes stay with torch (each feeds Q's and K's RoPE)."""
    m, x = _llama(kv_heads=4)
    gm = capture(m, *x).module
    p = partition(gm)
    sub = next(s for s in p.subgraphs if s.kind == "rope")
    by_name = {n.name: n for n in gm.graph.nodes}
    kinds = sorted(by_name[n].target if by_name[n].op == "call_method" else by_name[n].target.__name__
                   for n in sub.nodes)
    assert kinds == sorted(["transpose", "mul", "chunk", "getitem", "getitem", "neg", "cat", "mul", "add"])
    unsq = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "unsqueeze"
            and any(u.name in sub.nodes for u in n.users)]
    assert len(unsq) == 2 and all(len(n.users) == 2 for n in unsq)
    assert isinstance(by_name[sub.operands[0].ref], fx.Node) and sub.operands[0].ref.startswith("unflatten")


def test_cuda_backend_gives_rope_back_as_the_interleaved_view(tmp_path, monkeypatch) -> None:
    """Through ``CudaBackend`` (its kernel stood in for by the numpy reference on the artefact's params):
    X is bound as the projection's [b, s, h, d] memory, packed, and Y returns as [b, h, s, d] with the
    strides eager RoPE has; the model matches eager."""
    import numpy as np

    import spacefusion.runtime.gpu as gpu
    from smg.reference import evaluate
    from spacefusion.frontend import CudaBackend
    from spacefusion.runtime.artefact import KernelArtefact

    torch.manual_seed(0)
    model, h = _Rope("hf").eval(), torch.randn(2, 5, 16)
    cos, sin = _tables(1, 5, 8)
    (sub,) = [s for s in partition(capture(model, h, cos, sin).module).subgraphs if s.kind == "rope"]
    be = CudaBackend(tmp_path)
    be.export(sub.smg, cubin=False)
    seen: list[dict[str, torch.Tensor]] = []

    class _Reference:
        def __init__(self, folder) -> None:
            self.artefact = KernelArtefact.load(folder)

        def __call__(self, **t: torch.Tensor) -> dict[str, torch.Tensor]:
            seen.append(t)
            out = evaluate(sub.smg, {k: v.numpy() for k, v in t.items()})
            return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in out.items()}

    monkeypatch.setattr(gpu, "load_kernel", _Reference)
    fused = fuse(model, h, cos, sin, backend=be)  # the projection has no artefact: left to torch
    assert [s.kind for s in fused.partition.subgraphs] == ["rope"]
    with torch.no_grad():
        got, want = fused(h, cos, sin), model(h, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.stride() == want.stride() == (80, 8, 16, 1)  # [b, h, s, d] lying as [b, s, h, d]
    assert seen[0]["X"].shape == (2, 5, 2, 8) and seen[0]["X"].is_contiguous()
