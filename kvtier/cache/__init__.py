"""The hierarchical prefix cache: a radix tree over the device and host tiers."""

from .advisor import Advice
from .config import EVICTION_POLICIES, WRITE_POLICIES, CacheConfig
from .controller import HiCache, LoadResult, MatchResult, StorageHook

__all__ = [
    "HiCache", "CacheConfig", "MatchResult", "LoadResult", "Advice", "StorageHook",
    "WRITE_POLICIES", "EVICTION_POLICIES",
]
