"""Argument checks of the cache's public calls: they raise before anything changes."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import torch

from ..validate import require_readable
from .config import CacheConfig


def as_slots(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ValueError(f"slot indices must be integers, got a tensor of {values.dtype}")
        require_readable("slot indices", values)
        arr = values.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(values)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"slot indices must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise ValueError(f"slot indices must be one-dimensional, got shape {tuple(arr.shape)}")
    return arr


def check_pools(device_pool, host_pool, config, engine) -> None:
    if not isinstance(config, CacheConfig):
        raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
    if device_pool.page_size != config.page_size:
        raise ValueError(
            f"config.page_size={config.page_size} but the device pool has page_size={device_pool.page_size}; "
            "they must match"
        )
    if host_pool is not None:
        if host_pool.device_pool is not device_pool:
            raise ValueError("host_pool mirrors a different device pool; build it from this device_pool")
        if host_pool.page_size != config.page_size:
            raise ValueError(f"host pool page_size={host_pool.page_size} differs from config.page_size={config.page_size}")
        if engine is not None and getattr(engine, "host_pool", None) is not host_pool:
            raise ValueError("transfer_engine moves another host pool than host_pool; build it as "
                             "TransferEngine(host_pool, ...) from this cache's host pool")
    elif engine is not None:
        raise ValueError("transfer_engine given without a host_pool; a device-only cache moves nothing")


def claim_device_pool(device_pool, cache) -> None:
    """Make ``cache`` the owner of ``device_pool``'s slots (a weak reference on the pool); raise
    if another live cache owns them (two allocators would hand out the same slots, and one
    cache's KV would overwrite the other's)."""
    prior = getattr(device_pool, "_kvtier_cache", None)
    if prior is not None and prior() is not None:
        gc.collect()  # a cache dropped by its caller may wait for the cycle collector
        if prior() is not None:
            raise ValueError("device_pool already has a HiCache that hands out its slots; use that cache, or drop it "
                             "(del it) before building another over the same pool, or build a new device pool")
    device_pool._kvtier_cache = weakref.ref(cache)
