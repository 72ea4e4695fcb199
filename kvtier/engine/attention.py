"""Paged attention over a kvtier device pool.

Each sequence in a forward pass owns a *page table*: the device slot of
every token of its context, page-expanded (``slots[j]`` holds token ``j``).
A layer writes the K/V of the step's new tokens into their slots, waits for
that layer's host load to land (and only that layer's), then gathers each
sequence's keys and values through its slots and attends causally: query
``i`` of a sequence sees keys ``0 .. q_start + i``.

Two implementations compute the attention itself: :func:`reference_attention`
(explicit scores and softmax, portable, batch-invariant when given a float64
``acc``) and :func:`sdpa_attention` (torch's fused kernels; what the engine
uses on CUDA). Tests check that they agree.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F


@dataclass
class SeqSlice:
    """One sequence's share of a forward pass.

    ``q_start`` tokens of the sequence already have KV in the pool; this step
    adds ``n_new`` more, at rows ``offset .. offset + n_new`` of the batch.
    ``slots`` (on the pool's device) maps all ``q_start + n_new`` tokens to
    pool slots. ``layer_load`` is a :class:`kvtier.transfer.LayerLoad` (or
    ``None``) that some of those slots are being loaded by.
    """

    offset: int
    q_start: int
    n_new: int
    slots: torch.Tensor
    layer_load: object | None = None

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.n_new)


@dataclass
class AttentionBatch:
    """What every attention layer of one forward pass needs."""

    seqs: list[SeqSlice]
    new_slots: torch.Tensor  # (new tokens,) where this step's K/V go, on the pool's device

    def wait_layer(self, layer: int) -> None:
        """Order this layer's reads after the host loads of this layer (only)."""
        for s in self.seqs:
            if s.layer_load is not None:
                s.layer_load.wait_layer(layer)

    def __iter__(self) -> Iterator[SeqSlice]:
        return iter(self.seqs)


AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def causal_mask(n_q: int, q_start: int, device) -> torch.Tensor:
    """``(n_q, q_start + n_q)`` bool: query ``i`` may see key ``j`` iff ``j <= q_start + i``."""
    keys = torch.arange(q_start + n_q, device=device)
    queries = torch.arange(q_start, q_start + n_q, device=device)
    return keys[None, :] <= queries[:, None]


def _expand_heads(k: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Repeat each KV head for the query heads of its group (grouped-query attention)."""
    return k if k.shape[1] == n_heads else k.repeat_interleave(n_heads // k.shape[1], dim=1)


# Scores one reference-attention block may hold (query rows x keys x query heads): 2^25, 256 MiB
# in float64. Unblocked, a 16k-token prefill of 8 query heads would hold 17 GB of float64 scores,
# and the softmax as much again.
MAX_SCORES = 1 << 25


def reference_attention(acc: torch.dtype | None = None, max_scores: int = MAX_SCORES) -> AttendFn:
    """Explicit causal attention; ``q`` is ``(n, heads, d)``, ``k``/``v`` ``(ctx, kv_heads, d)``.

    The query heads of a group are stacked so that each KV head is read once
    (no copy of K/V per query head). Scores, softmax and the weighted sum are
    computed in ``acc`` (default float32) and rounded to ``q``'s dtype.
    Queries go in blocks of rows whose scores (rows x keys x heads) stay within
    ``max_scores`` elements; each block attends to the keys up to its last query
    only (the ones after are masked out anyway).
    """
    if max_scores < 1:
        raise ValueError(f"max_scores must be >= 1, got {max_scores}")

    def attend(q, k, v, q_start, scale):
        dt = acc or torch.float32
        n, n_heads, d = q.shape
        kv_heads = k.shape[1]
        group = n_heads // kv_heads
        kt, vt = k.to(dt).permute(1, 2, 0), v.to(dt).transpose(0, 1)  # (kv_heads, d, ctx), (kv_heads, ctx, dv)
        rows = max(1, max_scores // (n_heads * (q_start + n)))
        out = torch.empty(n, n_heads, vt.shape[-1], dtype=q.dtype, device=q.device)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            m, keys = r1 - r0, q_start + r1
            # (m, kv_heads * group, d) -> (kv_heads, group * m, d): rows of one KV head together.
            qg = q[r0:r1].to(dt).view(m, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * m, d)
            scores = torch.matmul(qg, kt[:, :, :keys]) * scale
            scores.masked_fill_(~causal_mask(m, q_start + r0, q.device).repeat(group, 1), float("-inf"))
            o = torch.matmul(torch.softmax(scores, dim=-1), vt[:, :keys])
            out[r0:r1] = o.view(kv_heads, group, m, -1).permute(2, 0, 1, 3).reshape(m, n_heads, -1)
        return out

    return attend


def _lower_right(n_q: int, n_k: int):
    """Causal mask aligned to the last key, as a bias the fused kernels understand (torch >= 2.2)."""
    try:
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:  # older torch: an explicit boolean mask
        return None
    return causal_lower_right(n_q, n_k)


@functools.cache
def _flash_takes_gqa(device_type: str, dtype: torch.dtype, n_heads: int, kv_heads: int, d: int, dv: int,
                     is_causal: bool) -> bool:
    """Whether the fused flash kernel runs grouped-query attention itself (``enable_gqa``) for
    inputs of this kind, so the KV heads need not be repeated. CUDA only (CPU keeps the
    repeat), asked of torch once per kind of input with a probe of one token; False where
    torch cannot tell."""
    if device_type != "cuda" or n_heads == kv_heads:
        return False
    try:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention
        probe = [torch.empty(1, h, 1, x, dtype=dtype, device="cuda")
                 for h, x in ((n_heads, d), (kv_heads, d), (kv_heads, dv))]
        return bool(can_use_flash_attention(SDPAParams(*probe, None, 0.0, is_causal, True)))
    except (ImportError, TypeError, RuntimeError):
        return False


def sdpa_attention(acc: torch.dtype | None = None) -> AttendFn:
    """Causal attention through ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels).

    ``acc``: inputs in that dtype, the output rounded back to the queries' (the engine's
    ``exact`` mode on the CPU: float64, as the reference attention accumulates; without it a
    prefix hit moves the logits by up to 5e-7 where the reference path leaves every bit).

    A whole-sequence prefill (``q_start == 0``) is plain causal attention; a
    prefill after a cached prefix uses a lower-right-aligned causal bias, so
    the fused kernels still run. Where the flash kernel takes grouped-query
    attention itself (``enable_gqa``; :func:`_flash_takes_gqa`), KV heads are
    read as they are; elsewhere they are repeated for the kernels, since not
    every kernel or torch version takes ``enable_gqa`` (one that does not
    leaves the call to the math path, which holds every score). The repeat is
    not cheap at long contexts: two elementwise kernels a layer, nearly 40% of a
    16k-token device-hit step's device work (measured on an H200;
    docs/performance.md).
    """

    def attend(q, k, v, q_start, scale):
        n_heads, out_dtype = q.shape[1], q.dtype
        if acc is not None and acc != q.dtype:
            q, k, v = q.to(acc), k.to(acc), v.to(acc)
        bias = None if q_start == 0 else _lower_right(q.shape[0], k.shape[0])
        # A boolean mask (torch without the causal bias) keeps the flash kernel out: repeat.
        gqa = (q_start == 0 or bias is not None) and _flash_takes_gqa(
            q.device.type, q.dtype, n_heads, k.shape[1], k.shape[2], v.shape[2], q_start == 0)
        if not gqa:
            k, v = _expand_heads(k, n_heads), _expand_heads(v, n_heads)
        # (1, heads, tokens, dim): the fused kernels take 4-D inputs only (3-D falls back to the math path).
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
        kw = {"enable_gqa": True} if gqa else {}
        if q_start == 0:
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, **kw)
        else:
            mask = bias if bias is not None else causal_mask(q.shape[0], q_start, q.device)
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, **kw)
        return out[0].transpose(0, 1).to(out_dtype)

    return attend


ATTENTION_IMPLS = {"reference": reference_attention, "sdpa": sdpa_attention}


def attention_impl(name: str, acc: torch.dtype | None) -> AttendFn:
    """The attention function called ``name`` (``reference`` or ``sdpa``)."""
    try:
        return ATTENTION_IMPLS[name](acc)
    except KeyError:
        raise ValueError(f"unknown attention implementation {name!r}; use one of {sorted(ATTENTION_IMPLS)}") from None
