"""What torch runs of a fused graph, pruned (``frontend.constants``): dead values go, constants are evaluated
once, and nothing that writes in place or draws random numbers is touched."""

from __future__ import annotations

import torch
from torch import fx, nn

from spacefusion.frontend.constants import PREFIX, fold_constants, remove_dead


class _Buckets(nn.Module):
    """T5-like: a table computed from aranges alone (an in-place add among them), added to the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        buckets = (rel > 0).to(torch.int64) * 4
        buckets += torch.where(rel.abs() < 2, rel.abs(), torch.full_like(rel, 3))
        unused = torch.arange(n) * 2  # noqa: F841  (dead: nothing reads it)
        return x + buckets.to(x.dtype)


def _dynamo_graph(model: nn.Module, *args: torch.Tensor) -> fx.GraphModule:
    """The graph Dynamo hands a backend (aranges as nodes, shapes as numbers; fx's tracer folds them itself)."""
    got: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, _: list) -> fx.GraphModule:
        got.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=keep, dynamic=False)(*(a.clone() for a in args))
    torch._dynamo.reset()
    return got[0]


def _calls(gm: fx.GraphModule) -> int:
    return sum(n.op in ("call_function", "call_method") for n in gm.graph.nodes)


def test_constants_are_evaluated_once_and_the_rest_is_unchanged() -> None:
    model = _Buckets()
    x = torch.randn(2, 8, 8)
    gm = _dynamo_graph(model, x)
    before = _calls(gm)
    folded = fold_constants(gm)
    assert len(folded) >= 10 and _calls(gm) == 1, gm.code  # only x + table is left
    assert [b for b, _ in gm.named_buffers()] == [f"{PREFIX}_0"]
    torch.testing.assert_close(gm(x)[0], model(x))
    assert before > _calls(gm)


class _WritesItsInput(nn.Module):
    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, torch.tensor([1]), x[:1])  # result unread: still a write to the caller's tensor
        cache[0] = 5.0
        return x * 2


def test_writes_to_inputs_are_never_removed() -> None:
    x, cache = torch.randn(2, 4), torch.zeros(3, 4)
    gm = _dynamo_graph(_WritesItsInput(), x, cache)
    remove_dead(gm)
    fold_constants(gm)
    by_name = {"L_x_": x, "L_cache_": cache}  # Dynamo orders the inputs its own way
    gm(*(by_name[n.target] for n in gm.graph.nodes if n.op == "placeholder"))
    torch.testing.assert_close(cache[1], x[0])
    assert bool((cache[0] == 5.0).all())


class _ReadBeforeWrite(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.arange(4.0)
        y = x + t  # reads t before the write below
        t.add_(10.0)
        return y + t


def test_a_constant_read_before_an_in_place_write_keeps_its_order() -> None:
    model = _ReadBeforeWrite()
    x = torch.zeros(4)
    gm = _dynamo_graph(model, x)
    fold_constants(gm)
    torch.testing.assert_close(gm(x)[0], model(x))  # [10, 12, 14, 16], not [20, ...]


class _Random(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(4)


def test_random_values_are_drawn_every_call() -> None:
    x = torch.zeros(4)
    gm = _dynamo_graph(_Random(), x)
    fold_constants(gm)
    assert not torch.equal(gm(x)[0], gm(x)[0])


class _LazyCache(nn.Module):
    """HF's StaticCache made inside the graph: zeros, written at run time, read through a view, returned."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.zeros(4, 3)
        keys.index_copy_(0, pos, x)
        return keys[:2] * 1.0, keys


def test_a_constant_a_call_writes_stays_a_fresh_tensor_each_call() -> None:
    model = _LazyCache()
    x, pos = torch.ones(1, 3), torch.tensor([1])
    gm = _dynamo_graph(model, x, pos)
    assert fold_constants(gm) == []
    by_name = {"L_x_": x, "L_pos_": pos}
    first = gm(*(by_name[n.target] for n in gm.graph.nodes if n.op == "placeholder"))
    by_name["L_x_"] = x * 3
    second = gm(*(by_name[n.target] for n in gm.graph.nodes if n.op == "placeholder"))
    for got, want in ((first, model(x, pos)), (second, model(x * 3, pos))):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    assert first[1] is not second[1]


class _WeightTable(nn.Module):
    """A table computed from a weight and a constant index (T5's position bias), a view of a weight, and a
    buffer the call writes in place."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.register_buffer("idx", torch.tensor([[0, 1, 2, 3], [5, 4, 3, 2], [1, 1, 1, 1], [2, 3, 4, 5]]))
        self.register_buffer("calls", torch.zeros(1))
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        bias = self.emb(self.idx).sum(-1).permute(1, 0)  # [4, 4], strided
        return x @ self.w.t() + bias + self.calls


def _lifted(model: nn.Module, x: torch.Tensor) -> tuple[fx.GraphModule, list]:
    """Dynamo's graph with the weights as ``get_attr`` nodes, as the backend sees it."""
    from spacefusion.frontend.compiled import lift_parameters

    got: list = []

    def keep(gm: fx.GraphModule, inputs: list) -> fx.GraphModule:
        got.append((gm, list(inputs)))
        lift_parameters(gm, inputs)  # here: Dynamo drops the placeholders' sources after the backend returns
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=keep, dynamic=False)(x)
    torch._dynamo.reset()
    return got[0]


def test_values_of_baked_weights_are_folded_and_weights_are_never_written() -> None:
    model = _WeightTable()
    x = torch.randn(4, 4)
    gm, inputs = _lifted(model, x)
    model.calls.zero_()
    unfolded = fold_constants(gm)  # weights not baked: nothing reads only constants here
    assert unfolded == [] and not any(b.startswith(PREFIX) for b, _ in gm.named_buffers())
    folded = fold_constants(gm, weights=True)
    assert {"embedding", "sum_1", "bias"} <= set(folded), (folded, gm.code)
    buffers = [t for b, t in gm.named_buffers() if b.startswith(PREFIX)]
    assert len(buffers) == 1 and buffers[0].is_contiguous(), gm.code  # the bias; w.t() is a view: left to run
    assert "t()" in gm.code or ".t(" in gm.code, gm.code
    assert float(model.calls) == 0.0  # the in-place add was not evaluated at fold time
    with torch.no_grad():
        want = x @ model.w.t() + model.emb(model.idx).sum(-1).permute(1, 0) + 1.0
        torch.testing.assert_close(gm(*inputs)[0], want)
    assert float(model.calls) == 1.0  # ... and still runs each call


class _AndMasks(nn.Module):
    """HF's mask building: ``a & b`` (``operator.and_``, not in place) of constants, and one with an input
    that nothing reads once the attention took the mask."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(4)[:, None] >= 1
        both = torch.ones((), dtype=torch.bool) & rows
        unused = both & keep[None, :]  # noqa: F841
        return x + both.to(x.dtype)


def test_and_of_constants_is_folded_and_an_unread_and_is_removed() -> None:
    import operator

    model = _AndMasks()
    x, keep = torch.randn(4, 4), torch.tensor([True, True, False, True])
    gm = _dynamo_graph(model, x, keep)
    remove_dead(gm)
    folded = fold_constants(gm)
    assert folded and not [n for n in gm.graph.nodes if n.target is operator.and_], gm.code
    by_name = {"L_x_": x, "L_keep_": keep}
    got = gm(*(by_name[n.target] for n in gm.graph.nodes if n.op == "placeholder"))[0]
    torch.testing.assert_close(got, model(x, keep))
