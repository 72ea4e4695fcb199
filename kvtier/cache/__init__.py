"""The hierarchical prefix cache: a radix tree over the device and host tiers, and a storage tier behind them."""

from .config import EVICTION_POLICIES, PREFETCH_POLICIES, STORAGE_WRITES, WRITE_POLICIES, CacheConfig
from .controller import HiCache, LoadResult, MatchResult, StorageHook
from .policy import Advice
from .types import LoadFailedError

__all__ = [
    "HiCache", "CacheConfig", "MatchResult", "LoadResult", "LoadFailedError", "Advice", "StorageHook",
    "WRITE_POLICIES", "EVICTION_POLICIES", "STORAGE_WRITES", "PREFETCH_POLICIES",
]
