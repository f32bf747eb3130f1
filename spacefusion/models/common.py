"""What BERT, ViT and LLaMA share: seeded initialisation, head reshapes and the encoder blocks alike in both
encoders (HF repeats them per model; the parameter names are the same).

The reshapes read no sizes (``unflatten``/``flatten``), so ``torch.fx.symbolic_trace`` records them as
plain calls without shape arithmetic on proxies."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """HF's ``_init_weights``: normal(0, std) matrices, zero biases, unit norm weights, from one seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):  # LayerNorm / RMSNorm scale
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def split_heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """[b, s, heads * head_dim] -> [b, heads, s, head_dim] (the layout SDPA takes)."""
    return x.unflatten(-1, (heads, head_dim)).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[b, heads, s, head_dim] -> [b, s, heads * head_dim]."""
    return x.transpose(1, 2).flatten(2)


class SelfAttention(nn.Module):
    """BERT's and ViT's ``*SelfAttention``: query/key/value projections with bias, SDPA, heads merged."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(f(x), self.heads, self.head_dim) for f in (self.query, self.key, self.value))
        return merge_heads(F.scaled_dot_product_attention(q, k, v))


class GeluIntermediate(nn.Module):
    """``*Intermediate``: the FFN's first projection and the exact GELU."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class Encoder(nn.Module):
    """``*Encoder``: the layers in order under HF's ``layer`` name."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class Pooler(nn.Module):
    """``*Pooler``: ``tanh(dense(first token))``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[:, 0]))
