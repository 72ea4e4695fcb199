"""A Llama-style decoder: grouped-query attention with RoPE, RMSNorm, SwiGLU.

The KV cache holds, per layer and token, K and V of ``n_kv_heads x head_dim``
(a kvtier ``MHATokenToKVPool``). K is stored after RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import AttendFn, AttentionBatch
from ..config import ModelConfig
from .decoder import CausalLM
from .layers import Linear, Rotary


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, attend: AttendFn, acc: torch.dtype | None):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv, self.d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.d, acc)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.d, acc)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.d, acc)
        self.o_proj = Linear(self.n_heads * self.d, cfg.hidden_size, acc)
        self.rotary = Rotary(self.d, cfg.rope_theta)
        self.attend = attend
        self.scale = self.d ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, pool) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.n_heads, self.d)
        k = self.k_proj(x).view(n, self.n_kv, self.d)
        v = self.v_proj(x).view(n, self.n_kv, self.d)
        cos, sin = self.rotary.cos_sin(positions, q.dtype)
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        pool.set_kv_buffer(self.layer_id, batch.new_slots, k, v)
        batch.wait_layer(self.layer_id)
        k_cache, v_cache = pool.k_buffer[self.layer_id], pool.v_buffer[self.layer_id]
        out = torch.empty_like(q)
        for s in batch:
            out[s.rows] = self.attend(q[s.rows], k_cache[s.slots], v_cache[s.slots], s.q_start, self.scale)
        return self.o_proj(out.view(n, self.n_heads * self.d))


def llama(cfg: ModelConfig, attend: AttendFn, acc: torch.dtype | None = None) -> CausalLM:
    """A Llama-style causal LM with uninitialised weights."""
    return CausalLM(cfg, LlamaAttention, attend, acc)
