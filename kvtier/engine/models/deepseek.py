"""A DeepSeek-style decoder with multi-head latent attention (MLA).

Instead of per-head K and V, each token caches one *latent* row: a
``kv_lora_rank`` compression of the hidden state (normalised) followed by a
``qk_rope_head_dim`` key part that carries the position (decoupled RoPE,
shared by all heads). That row is what a kvtier ``MLATokenToKVPool`` stores.
Attention decompresses the latents of the context into per-head keys
(``qk_nope_head_dim``, concatenated with the shared rope part) and values
(``v_head_dim``). The MLP is dense SwiGLU (no mixture of experts).
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import AttendFn, AttentionBatch
from ..config import ModelConfig
from .decoder import CausalLM
from .layers import Linear, RMSNorm, Rotary


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, attend: AttendFn, acc: torch.dtype | None):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = cfg.n_heads
        self.rank, self.nope, self.rope, self.dv = (
            cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
        qk = self.nope + self.rope
        self.q_lora = cfg.q_lora_rank > 0
        if self.q_lora:  # queries through a low-rank bottleneck, as DeepSeek-V2/V3
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, acc)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_eps, acc)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.n_heads * qk, acc)
        else:
            self.q_proj = Linear(cfg.hidden_size, self.n_heads * qk, acc)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.rank + self.rope, acc)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_eps, acc)
        self.kv_b_proj = Linear(self.rank, self.n_heads * (self.nope + self.dv), acc)
        self.o_proj = Linear(self.n_heads * self.dv, cfg.hidden_size, acc)
        self.rotary = Rotary(self.rope, cfg.rope_theta)
        self.attend = attend
        self.scale = qk ** -0.5

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, pool) -> torch.Tensor:
        n, h = x.shape[0], self.n_heads
        q = self.queries(x).view(n, h, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q = torch.cat((q_nope, Rotary.apply(q_pe, cos, sin)), dim=-1)
        k_pe = Rotary.apply(k_pe[:, None, :], cos, sin)
        row = torch.cat((self.kv_a_layernorm(latent)[:, None, :], k_pe), dim=-1)
        pool.set_kv_buffer(self.layer_id, batch.new_slots, row)
        batch.wait_layer(self.layer_id)
        cache = pool.kv_buffer[self.layer_id]
        out = q.new_empty(n, h, self.dv)
        for s in batch:
            k, v = self.decompress(cache[s.slots])
            out[s.rows] = self.attend(q[s.rows], k, v, s.q_start, self.scale)
        return self.o_proj(out.view(n, h * self.dv))

    def decompress(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latent rows ``(ctx, 1, rank + rope)`` -> per-head keys and values."""
        ctx = rows.shape[0]
        latent, k_pe = rows[:, 0].split([self.rank, self.rope], dim=-1)
        kv = self.kv_b_proj(latent).view(ctx, self.n_heads, self.nope + self.dv)
        k_nope, v = kv.split([self.nope, self.dv], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None, :].expand(ctx, self.n_heads, self.rope)), dim=-1)
        return k, v


def deepseek(cfg: ModelConfig, attend: AttendFn, acc: torch.dtype | None = None) -> CausalLM:
    """A DeepSeek-style (MLA) causal LM with uninitialised weights."""
    return CausalLM(cfg, MLAttention, attend, acc)
