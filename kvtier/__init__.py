"""kvtier: a tiered KV cache for LLM inference (GPU -> host -> storage)."""

from .allocator import AllocatorError, PageAllocator
from .device_pool import DSATokenToKVPool, KVPool, MHATokenToKVPool, MLATokenToKVPool, pool_from_spec
from .host_pool import (
    DSATokenToKVPoolHost,
    HostKVCache,
    MHATokenToKVPoolHost,
    MLATokenToKVPoolHost,
    host_pool_for,
)
from .layouts import LAYOUTS, SUPPORTED as SUPPORTED_LAYOUTS, Placement
from .spec import DSA, MHA, MLA, PRESETS, KVSpec, preset

__version__ = "0.1.0"

__all__ = [
    "AllocatorError", "PageAllocator",
    "KVPool", "MHATokenToKVPool", "MLATokenToKVPool", "DSATokenToKVPool", "pool_from_spec",
    "HostKVCache", "MHATokenToKVPoolHost", "MLATokenToKVPoolHost", "DSATokenToKVPoolHost", "host_pool_for",
    "LAYOUTS", "SUPPORTED_LAYOUTS", "Placement",
    "KVSpec", "MHA", "MLA", "DSA", "PRESETS", "preset",
]
