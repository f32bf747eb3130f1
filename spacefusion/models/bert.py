"""BERT encoder (``transformers.BertModel`` structure, sdpa attention, post-LN, exact GELU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spacefusion.models.common import Encoder, GeluIntermediate, Pooler, SelfAttention, init_weights


@dataclass(frozen=True)
class BertConfig:
    """BERT-base by default (``bert-base-uncased``'s config.json)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def tiny(cls, layers: int = 2, hidden: int = 64, heads: int = 4) -> BertConfig:
        return cls(vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   intermediate_size=4 * hidden, max_position_embeddings=64)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
        emb = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(emb + self.position_embeddings(positions))


class BertSelfOutput(nn.Module):
    """Projection, then the post-LN residual: ``LayerNorm(dense(h) + input)``."""

    def __init__(self, c: BertConfig, inner: int) -> None:
        super().__init__()
        self.dense = nn.Linear(inner, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + residual)


class BertAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.self = SelfAttention(c.hidden_size, c.num_attention_heads)
        self.output = BertSelfOutput(c, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = GeluIntermediate(c.hidden_size, c.intermediate_size)
        self.output = BertSelfOutput(c, c.intermediate_size)  # HF's BertOutput has the same shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attention(x)
        return self.output(self.intermediate(a), a)


class BertModel(nn.Module):
    """``forward(input_ids, token_type_ids) -> (last_hidden_state, pooler_output)``; no padding mask."""

    def __init__(self, config: BertConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = c = config or BertConfig()
        self.embeddings = BertEmbeddings(c)
        self.encoder = Encoder([BertLayer(c) for _ in range(c.num_hidden_layers)])
        self.pooler = Pooler(c.hidden_size)
        init_weights(self, seed)
        self.eval()

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(self.embeddings(input_ids, token_type_ids))
        return h, self.pooler(h)

    def example_inputs(self, batch: int = 1, seq: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.config.vocab_size, (batch, seq), generator=gen)
        return ids, torch.randint(0, self.config.type_vocab_size, (batch, seq), generator=gen)
