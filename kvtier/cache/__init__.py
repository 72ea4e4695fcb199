"""The hierarchical prefix cache: a radix tree over the device and host tiers."""

from .advisor import Advice
from .config import EVICTION_POLICIES, WRITE_POLICIES, CacheConfig
from .controller import HiCache, LoadResult, MatchResult, StorageHook
from .types import LoadFailedError

__all__ = [
    "HiCache", "CacheConfig", "MatchResult", "LoadResult", "LoadFailedError", "Advice", "StorageHook",
    "WRITE_POLICIES", "EVICTION_POLICIES",
]
