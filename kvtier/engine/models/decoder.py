"""The decoder-only transformer both models share; only the attention differs.

Parameter names follow Hugging Face's (``model.layers.3.self_attn.q_proj.weight``),
so a checkpoint's state dict loads as it is.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ..attention import AttendFn, AttentionBatch
from ..config import ModelConfig
from .layers import Linear, RMSNorm, SwiGLU

MakeAttention = Callable[[ModelConfig, int, AttendFn, "torch.dtype | None"], nn.Module]


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, layer_id: int, make_attention: MakeAttention,
                 attend: AttendFn, acc: torch.dtype | None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, acc)
        self.self_attn = make_attention(cfg, layer_id, attend, acc)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, acc)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, acc)

    def forward(self, x, positions, batch: AttentionBatch, pool) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, batch, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg, make_attention, attend, acc):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, make_attention, attend, acc) for i in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, acc)


class CausalLM(nn.Module):
    """Embeddings, ``n_layers`` decoder layers, final norm, LM head.

    ``forward`` runs the new tokens of a whole batch (all sequences'
    tokens concatenated) and returns logits only at ``logit_rows``, the
    rows whose next token is wanted.
    """

    def __init__(self, cfg: ModelConfig, make_attention: MakeAttention, attend: AttendFn,
                 acc: torch.dtype | None = None):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg, make_attention, attend, acc)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, acc)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                pool, logit_rows: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, batch, pool)
        return self.lm_head(self.model.norm(x[logit_rows]))

    @torch.no_grad()
    def init_random(self, seed: int) -> "CausalLM":
        """Fill every weight from ``seed``: norms 1, embeddings N(0, 1), linears N(0, 1/fan_in)."""
        device = next(self.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 2 and "embed_tokens" not in name:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
            else:
                p.normal_(0.0, 1.0, generator=gen)
        return self
