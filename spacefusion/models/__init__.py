"""Transformer models written the HuggingFace way in plain PyTorch (no hub, random seeded weights).

Module structure and parameter names follow ``transformers`` (``encoder.layer.0.attention.self.query``,
``model.layers.0.self_attn.q_proj``) so that the frontend meets the same graphs a user's HF model gives;
attention goes through ``F.scaled_dot_product_attention`` as HF's sdpa path does.  Each ``*Config`` has the
real model's sizes as defaults and a ``tiny()`` for tests.
"""

from spacefusion.models.bert import BertConfig, BertModel
from spacefusion.models.llama import LlamaConfig, LlamaModel
from spacefusion.models.vit import ViTConfig, ViTModel

__all__ = ["BertConfig", "BertModel", "LlamaConfig", "LlamaModel", "ViTConfig", "ViTModel"]
