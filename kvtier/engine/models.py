"""The models the reference engine runs: the building blocks, the decoder both models share, and
the two attentions (Llama's grouped-query attention, DeepSeek's multi-head latent attention).

Every block takes ``acc``, the dtype to accumulate in (``None``: the input's own dtype, as a GPU
engine runs). With ``acc=torch.float64`` on fp32 inputs a row's result is rounded from a float64
sum and so does not depend on how many other rows share the matmul: prefilling a prompt, or
decoding it a token at a time, writes the same KV bits. That is what lets the engine promise
identical greedy outputs with and without a prefix cache.

Parameter names follow Hugging Face's (``model.layers.3.self_attn.q_proj.weight``), so a
checkpoint's state dict loads as it is.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttendFn, AttentionBatch, attention_impl
from .config import DEEPSEEK, LLAMA, ModelConfig


# -- building blocks: linear, RMSNorm, RoPE, SwiGLU ---------------------------------------------

class Linear(nn.Module):
    """``y = x W^T`` with no bias (the weight is ``(out_features, in_features)``, as in HF)."""

    def __init__(self, in_features: int, out_features: int, acc: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.acc = acc
        self._acc_weight: tuple[int, int, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.acc is None:
            return F.linear(x, self.weight)
        return F.linear(x.to(self.acc), self._weight_in_acc()).to(x.dtype)

    def _weight_in_acc(self) -> torch.Tensor:
        # Converted once and kept until the weight changes (loading bumps its version).
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._acc_weight is None or self._acc_weight[:2] != key:
            self._acc_weight = (*key, w.detach().to(self.acc))
        return self._acc_weight[2]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the mean of squares taken in float32 (or ``acc``)."""

    def __init__(self, dim: int, eps: float, acc: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.acc = acc or torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.acc)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.to(self.acc)).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding, rotate-half convention, on the last ``dim`` values."""

    def __init__(self, dim: int, theta: float):
        super().__init__()
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        # inv_freq on each device it was asked for, copied once: a blocking .to(device) per layer
        # and step would make the host wait for the stream each time (torch synchronizes the stream
        # after a blocking host-to-device copy), so it could not queue layers ahead of the device.
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, dim)`` cosines and sines for integer ``positions``."""
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[positions.device] = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``(tokens, heads, dim)``."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]


class SwiGLU(nn.Module):
    """The gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, acc: torch.dtype | None = None):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, acc)
        self.up_proj = Linear(hidden, intermediate, acc)
        self.down_proj = Linear(intermediate, hidden, acc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# -- the decoder both models share; only the attention differs -------------------------------

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


# -- Llama: grouped-query attention with RoPE, RMSNorm, SwiGLU -----------------------------------
#
# The KV cache holds, per layer and token, K and V of ``n_kv_heads x head_dim``
# (a kvtier ``MHATokenToKVPool``). K is stored after RoPE.

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


# -- DeepSeek: multi-head latent attention (MLA) -------------------------------------------------
#
# Instead of per-head K and V, each token caches one *latent* row: a
# ``kv_lora_rank`` compression of the hidden state (normalised) followed by a
# ``qk_rope_head_dim`` key part that carries the position (decoupled RoPE,
# shared by all heads). That row is what a kvtier ``MLATokenToKVPool`` stores.
# Attention decompresses the latents of the context into per-head keys
# (``qk_nope_head_dim``, concatenated with the shared rope part) and values
# (``v_head_dim``). The MLP is dense SwiGLU (no mixture of experts).

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


# -- a model of a config -----------------------------------------------------------------------

BUILDERS = {LLAMA: llama, DEEPSEEK: deepseek}


def build_model(cfg: ModelConfig, device="cpu", attention: str = "reference",
                acc: torch.dtype | None = None) -> CausalLM:
    """An uninitialised model of ``cfg``'s kind, its parameters in ``cfg.dtype`` on ``device``."""
    attend = attention_impl(attention, acc)
    with torch.device(device):
        model = BUILDERS[cfg.kind](cfg, attend, acc)
    return model.to(dtype=cfg.dtype).eval().requires_grad_(False)


__all__ = ["BUILDERS", "CausalLM", "build_model", "llama", "deepseek"]
