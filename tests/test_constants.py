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
