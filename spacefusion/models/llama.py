"""LLaMA decoder stack (``transformers.LlamaModel`` structure: RMSNorm, RoPE, SiLU-gated MLP, GQA).

Prefill (``past_keys is None``: causal attention over the prompt) and decode (a KV cache passed in:
the new keys and values are appended and the query attends to all of them, not causal, as HF does
for one query).  Caches are stacked over layers, ``[layers, batch, kv_heads, seq, head_dim]``, and the
extended ones are returned, so a decode step's inputs are the previous step's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spacefusion.models.common import init_weights, merge_heads, split_heads


@dataclass(frozen=True)
class LlamaConfig:
    """LLaMA-2-7B by default; ``gqa()`` gives the grouped-query variant with 8 kv heads."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def tiny(cls, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int | None = None) -> LlamaConfig:
        return cls(vocab_size=128, hidden_size=hidden, intermediate_size=172 * hidden // 64, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads or heads)

    def gqa(self, kv_heads: int = 8) -> LlamaConfig:
        from dataclasses import replace

        return replace(self, num_key_value_heads=kv_heads)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class LlamaRMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, through torch's fused ``F.rms_norm``."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.hidden_size, self.variance_epsilon = hidden, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.variance_epsilon)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        d = c.head_dim
        self.register_buffer("inv_freq", 1.0 / c.rope_theta ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin in float32, returned in ``x``'s dtype (HF's order)."""
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaAttention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: torch.Tensor | None,
                past_v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = split_heads(self.q_proj(x), self.heads, self.head_dim)
        k = split_heads(self.k_proj(x), self.kv_heads, self.head_dim)
        v = split_heads(self.v_proj(x), self.kv_heads, self.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_k is not None:
            k, v = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=past_k is None,
                                           enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(merge_heads(o)), k, v


class LlamaMLP(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(c)
        self.mlp = LlamaMLP(c)
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: torch.Tensor | None,
                past_v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, past_k, past_v)
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h)), k, v


class LlamaModel(nn.Module):
    """``forward(input_ids, past_keys=None, past_values=None) -> (last_hidden_state, keys, values)``."""

    def __init__(self, config: LlamaConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = c = config or LlamaConfig()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = LlamaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(c)
        init_weights(self, seed)
        self.eval()

    def forward(self, input_ids: torch.Tensor, past_keys: torch.Tensor | None = None,
                past_values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        start = 0 if past_keys is None else past_keys.size(3)
        positions = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0) + start
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(h, positions)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            pk = None if past_keys is None else past_keys[i]
            pv = None if past_values is None else past_values[i]
            h, k, v = layer(h, cos, sin, pk, pv)
            keys.append(k)
            values.append(v)
        return self.norm(h), torch.stack(keys), torch.stack(values)

    def example_inputs(self, batch: int = 1, seq: int = 2048, past: int = 0,
                       seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Prefill ``(input_ids,)`` when ``past`` is 0, else decode ``(input_ids, past_keys, past_values)``."""
        c = self.config
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, c.vocab_size, (batch, seq), generator=gen)
        if not past:
            return (ids,)
        shape = (c.num_hidden_layers, batch, c.num_key_value_heads, past, c.head_dim)
        return ids, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
