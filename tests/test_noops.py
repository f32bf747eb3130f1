"""``drop_noops`` on Dynamo graphs: what is removed is an identity, what changes a value stays."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from spacefusion.frontend.compiled import lift_parameters
from spacefusion.frontend.noops import drop_noops


class _Scaled(nn.Module):
    """diffusers' patterns: ``/ output_scale_factor`` at 1.0, ``.to(its own dtype)``, and a channels-last image
    made NCHW-contiguous for a 1x1 conv; beside them ops that look alike but change the value."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = (x + 1.0) / 1.0
        y = 1 * y.to(torch.float32) * 1.0
        t = y.permute(0, 2, 3, 1).reshape(2, 4, 4, 8).permute(0, 3, 1, 2).contiguous()
        z = self.proj(t)
        kept = (ids / 1, x / 2.0, x.to(torch.float16), y.contiguous())  # (channels-last -> NCHW: a copy)
        return z, *kept


def _dropped(model: nn.Module, *x: torch.Tensor) -> tuple[list[str], tuple[torch.Tensor, ...]]:
    seen: list[str] = []

    def backend(gm: fx.GraphModule, example: list) -> object:
        before = {n.name: (n.op, str(n.target)) for n in gm.graph.nodes}
        lift_parameters(gm, example)  # as the backend does: the conv's weight a get_attr
        ShapeProp(gm).propagate(*example)
        drop_noops(gm)
        after = {n.name for n in gm.graph.nodes}
        seen.extend(sorted(t for name, (op, t) in before.items() if name not in after))
        return gm.forward

    with torch.no_grad():
        got = torch.compile(model, backend=backend, dynamic=False)(*x)
    return seen, got


def test_identities_go_and_value_changes_stay() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Scaled().eval()
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    ids = torch.arange(4)
    dropped, got = _dropped(model, x, ids)
    with torch.no_grad():
        want = model(x, ids)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
        assert g.dtype == w.dtype
    # x / 1.0, 1 * y, * 1.0, .to(float32), the reshape to the shape it has and the contiguous before the
    # conv; not ids / 1 (int -> float), x / 2, the cast to fp16 or the NCHW copy that no conv reads
    assert sorted(dropped) == sorted(["<built-in function truediv>", "<built-in function mul>",
                                      "<built-in function mul>", "to", "reshape", "contiguous"]), dropped
    torch._dynamo.reset()


def test_a_contiguous_read_by_a_conv_and_something_else_stays() -> None:
    torch._dynamo.reset()
    conv = nn.Conv2d(4, 4, 1).eval()

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.permute(0, 2, 3, 1).permute(0, 3, 1, 2).contiguous()
        return conv(t), F.relu(t).view(-1)  # the view needs the NCHW copy

    x = torch.randn(1, 4, 3, 3).to(memory_format=torch.channels_last)
    dropped, got = _dropped(f, x)
    assert "contiguous" not in dropped
    torch.testing.assert_close(got[1], F.relu(x).contiguous().view(-1))
    torch._dynamo.reset()


def test_repeated_activations_of_one_value_merge() -> None:
    """``silu(t)`` called twice on one value is one node; on another value, or another function, it stays."""
    from spacefusion.frontend.noops import merge_repeated_activations

    torch._dynamo.reset()
    counts: list[int] = []

    def backend(gm: fx.GraphModule, example: list) -> object:
        counts.append(merge_repeated_activations(gm))
        return gm.forward

    def f(t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(t) * 2 + F.silu(t) + F.silu(u) + F.gelu(t) + torch.relu(t) + torch.relu(t)

    t, u = torch.randn(4, 8), torch.randn(4, 8)
    got = torch.compile(f, backend=backend, dynamic=False)(t, u)
    torch.testing.assert_close(got, f(t, u))
    assert counts == [2], counts  # the second silu(t) and the second relu(t)
    torch._dynamo.reset()
