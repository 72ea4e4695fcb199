"""Builders shared by the foundation tests: pools of every kind, random bytes, byte views."""

from __future__ import annotations

import torch

from kvtier import DSATokenToKVPool, MHATokenToKVPool, MLATokenToKVPool
from kvtier.host_pool import HOST_POOL_CLASSES
from kvtier.spec import KVSpec

# Real models' shapes, for the planning tests (tests/transfer_cpu/test_dma_*.py, tests/kernels/test_triton_launch.py).
MHA = KVSpec("mha", 32, torch.bfloat16, head_num=8, head_dim=128)    # llama-3-8b: 2 KiB K or V rows
MLA = KVSpec("mla", 61, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64)  # deepseek-v3: 1152 B


def make_device_pool(kind, size, page_size, dtype, layers, device="cpu", heads=3, head_dim=40,
                     lora=96, rope=16, index_head_dim=128):
    if kind == "mha":
        return MHATokenToKVPool(size, page_size, dtype, heads, head_dim, layers, device)
    if kind == "mla":
        return MLATokenToKVPool(size, page_size, dtype, lora, rope, layers, device)
    return DSATokenToKVPool(size, page_size, dtype, lora, rope, layers, device, index_head_dim=index_head_dim)


def make_host_pool(device_pool, layout, tokens, **kw):
    cls = HOST_POOL_CLASSES[device_pool.spec.kind]
    return cls(device_pool, 0, 0, device_pool.page_size, layout, host_size_tokens=tokens, **kw)


def fill_random(pool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for stack in pool.stacks.values():
        raw = stack.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen).to(raw.device))


def fill_host_random(host, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for c in host.spec.components:
        raw = host.raw_bytes(c.name)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def device_bytes(pool, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every component's bytes at ``slots`` (all layers), on the CPU."""
    idx = slots.to(pool.device)
    return {name: as_bytes(stack[:, idx]).reshape(stack.shape[0], len(slots), -1) for name, stack in pool.stacks.items()}


def host_snapshot(host) -> dict[str, torch.Tensor]:
    return {c.name: host.raw_bytes(c.name).clone() for c in host.spec.components}


def pages_to_slots(pages, page_size: int) -> torch.Tensor:
    p = torch.as_tensor(list(pages), dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def clear_bounded_caches() -> None:
    """Empty kvtier.transfer's bounded caches (``functools.lru_cache`` with a size over one:
    DMA planning keeps up to 1,024 transfers' run lengths), so that a steady-state count of
    live objects sees leaks, not those caches filling. Unbounded ones and cudart's handle stay."""
    import importlib
    import pkgutil

    import kvtier.transfer
    for info in pkgutil.walk_packages(kvtier.transfer.__path__, "kvtier.transfer."):
        for v in vars(importlib.import_module(info.name)).values():
            if hasattr(v, "cache_parameters") and (v.cache_parameters()["maxsize"] or 0) > 1:
                v.cache_clear()
