"""ViT encoder (``transformers.ViTModel`` structure: patch conv, CLS token, pre-LN layers, exact GELU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spacefusion.models.common import Encoder, GeluIntermediate, Pooler, SelfAttention, init_weights


@dataclass(frozen=True)
class ViTConfig:
    """ViT-B/16 at 224 x 224 by default: 14 x 14 patches + CLS = 197 tokens."""

    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    layer_norm_eps: float = 1e-12

    @classmethod
    def tiny(cls, layers: int = 2, hidden: int = 64, heads: int = 4) -> ViTConfig:
        return cls(image_size=32, patch_size=8, hidden_size=hidden, num_hidden_layers=layers,
                   num_attention_heads=heads, intermediate_size=4 * hidden)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def seq_len(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1


class ViTEmbeddings(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.hidden_size))
        self.position_embeddings = nn.Parameter(torch.zeros(1, c.seq_len, c.hidden_size))
        self.patch_embeddings = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embeddings(pixel_values).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(pixel_values.size(0), -1, -1)
        return torch.cat((cls, patches), dim=1) + self.position_embeddings


class ViTSelfOutput(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)


class ViTAttention(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(c.hidden_size, c.num_attention_heads)
        self.output = ViTSelfOutput(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.attention(x))


class ViTOutput(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.intermediate_size, c.hidden_size)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.dense(h) + residual


class ViTLayer(nn.Module):
    """Pre-LN: ``h = x + attn(LN(x)); out = h + mlp(LN(h))``."""

    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.attention = ViTAttention(c)
        self.intermediate = GeluIntermediate(c.hidden_size, c.intermediate_size)
        self.output = ViTOutput(c)
        self.layernorm_before = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layernorm_after = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention(self.layernorm_before(x)) + x
        return self.output(self.intermediate(self.layernorm_after(h)), h)


class ViTModel(nn.Module):
    """``forward(pixel_values) -> (last_hidden_state, pooler_output)``."""

    def __init__(self, config: ViTConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = c = config or ViTConfig()
        self.embeddings = ViTEmbeddings(c)
        self.encoder = Encoder([ViTLayer(c) for _ in range(c.num_hidden_layers)])
        self.layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.pooler = Pooler(c.hidden_size)
        init_weights(self, seed)
        self.eval()

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.layernorm(self.encoder(self.embeddings(pixel_values)))
        return h, self.pooler(h)

    def example_inputs(self, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor]:
        c = self.config
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, c.num_channels, c.image_size, c.image_size, generator=gen),)
