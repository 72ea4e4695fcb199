"""Argument checks of host pools (their size, page size, the slot indices of a transfer) and
the seed's module-level helpers.

Each check raises ``ValueError`` (``TypeError`` where the type is wrong), naming the
argument and what it holds, before anything is allocated or moved. Engines written against
the seed import ``synchronized``, ``get_cgroup_memory_limit_and_current`` and
``get_available_host_memory_bytes`` from its host-pool module; :mod:`kvtier.host_pool`
exports them from here, with :func:`spec_of`, the shape of the device pool a pool mirrors.
"""

from __future__ import annotations

import functools
import math
import numbers

import numpy as np
import torch

from .memory import GB, cgroup_limit_and_usage, host_memory
from .spec import DSA, MHA, KVSpec, dsa_index_row_bytes
from .validate import is_int_dtype, require_positive_int, require_readable


def _int_value(value):
    """A one-element integer tensor as its int (storage backends pass ``host_indices[i]``, a 0-d
    tensor, as SGLang's do); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and is_int_dtype(value.dtype):
        require_readable("index", value)
        return int(value.item())
    return value


def _pool_device(pool) -> torch.device:
    """The device a pool's buffers live on (a pool without ``device``: the CPU)."""
    return torch.device(getattr(pool, "device", "cpu"))


def _check_page_size(page_size, device_pool) -> None:
    """``page_size`` must be a positive integer, and the device pool's page size where it has one."""
    require_positive_int("page_size", page_size)
    dev_ps = getattr(device_pool, "page_size", page_size)
    if dev_ps != page_size:
        raise ValueError(
            f"page_size={page_size} differs from the device pool's page_size={dev_ps}; "
            "host and device pools must use the same page size"
        )


def _size_in_pages(tokens, gb, ratio, device_size, page_size, per_token) -> int:
    """Pages of a host pool: ``tokens`` tokens, else ``gb`` GB (1e9 bytes of ``per_token`` a
    token), else ``ratio`` x ``device_size`` tokens; rounded up to whole pages of ``page_size``.
    Raises for a negative, non-finite or fractional size, or for none at all."""
    for name, v in (("host_size_tokens", tokens), ("host_size", gb), ("host_to_device_ratio", ratio)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a non-negative finite number, got {v!r}")
    if tokens > 0:
        if int(tokens) != tokens:
            raise ValueError(f"host_size_tokens must be a whole number, got {tokens!r}")
        size = int(tokens)
    elif gb > 0:
        size = int(gb * GB // per_token)
    elif ratio > 0:
        size = int(device_size * ratio)
    else:
        raise ValueError(
            "the host pool has no size: set host_size_tokens (tokens), host_size (GB) "
            "or host_to_device_ratio (x the device pool) to a positive value"
        )
    pages = -(-size // page_size)
    if pages < 1:
        raise ValueError(
            f"the host pool would hold no page (size {size} tokens, page_size {page_size}); make it larger"
        )
    return pages


def _as_index_tensor(values, name: str) -> torch.Tensor:
    """``values`` as a contiguous 1-D int64 tensor: every backend reads an index tensor as
    packed (a strided view, read so, names other slots than its values)."""
    t = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(values))
    require_readable(name, t)
    if t.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}")
    if not is_int_dtype(t.dtype):
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if t.dtype == torch.uint64 and t.numel() and bool((t.view(torch.int64) < 0).any()):
        raise ValueError(f"{name} holds a slot of 2**63 or more (as uint64); slots are int64 positions in the pool")
    return (t if t.dtype == torch.int64 else t.to(torch.int64)).contiguous()


def _numpy(idx: torch.Tensor) -> np.ndarray:
    """An index tensor's values on the host (a CUDA one read back once)."""
    if idx.device.type == "cuda":  # read back by a kernel, not queued behind bulk copies
        from .transfer.cuda_common import host_numpy
        return host_numpy(idx)
    return idx.numpy()


def _check_range(idx: np.ndarray, size: int, name: str, what: str) -> None:
    """Every slot of ``idx`` (non-empty) lies in ``0..size-1`` and appears once."""
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= size:
        raise ValueError(f"{name} holds {lo if lo < 0 else hi}, outside the {what}'s slots 0..{size - 1}")
    # Strictly increasing (runs as the allocator hands them out) is unique at O(n); else sort.
    if idx.size > 1 and not (np.diff(idx) > 0).all():
        values, counts = np.unique(idx, return_counts=True)
        if values.size != idx.size:
            raise ValueError(f"{name} names slot {int(values[counts > 1][0])} twice; each slot may appear "
                             "once per transfer")


def spec_of(device_pool, kind: str) -> KVSpec:
    """The spec of a kvtier device pool, or one read off an SGLang-style pool's attributes.

    Raises ``TypeError`` for something that is not a device pool (a :class:`KVSpec` included)
    and for a pool of another kind than ``kind``."""
    spec = getattr(device_pool, "spec", None)
    if spec is None and not hasattr(device_pool, "layer_num"):
        raise TypeError(f"device_pool must be a device KV pool (a kvtier pool, or an engine's with layer_num, "
                        f"{'head_num' if kind == MHA else 'kv_lora_rank'} ... and its per-layer buffers), "
                        f"got {type(device_pool).__name__}")
    if isinstance(device_pool, KVSpec):
        raise TypeError("device_pool must be a device KV pool, got a KVSpec: make the pool first, "
                        "e.g. kvtier.device_pool.pool_from_spec(spec, size, page_size, device)")
    if isinstance(spec, KVSpec):
        if spec.kind != kind:
            raise TypeError(
                f"a {kind.upper()} host pool needs a {kind.upper()} device pool, got a {spec.kind.upper()} one"
            )
        return spec
    dtype = getattr(device_pool, "dtype", None) or device_pool.store_dtype
    if kind == MHA:
        return KVSpec(MHA, device_pool.layer_num, dtype, head_num=device_pool.head_num, head_dim=device_pool.head_dim)
    extra = {}
    if kind == DSA:
        extra["index_head_dim"] = device_pool.index_head_dim
        rows = getattr(device_pool, "index_k_row_bytes", None)  # the engine's index-K format
        if rows is not None and rows != dsa_index_row_bytes(device_pool.index_head_dim):
            extra["index_k_bytes"] = rows
    return KVSpec(
        kind, device_pool.layer_num, dtype, kv_lora_rank=device_pool.kv_lora_rank,
        qk_rope_head_dim=device_pool.qk_rope_head_dim, **extra,
    )


def synchronized(method):
    """Run ``method`` holding its pool's ``lock`` (the seed's decorator, for subclasses)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return locked


def get_cgroup_memory_limit_and_current() -> tuple[int, int] | None:
    """The seed's name: ``(limit, usage)`` bytes of this process's tightest cgroup memory limit
    (:func:`kvtier.memory.cgroup_limit_and_usage`), None where none applies."""
    room = cgroup_limit_and_usage()
    return None if room is None else (int(room[0]), int(room[1]))


def get_available_host_memory_bytes(reserve_bytes: int) -> tuple[int, int, int | None]:
    """The seed's name: ``(available, host available, cgroup available or None)`` bytes, each
    after ``reserve_bytes`` (:func:`kvtier.memory.host_memory`)."""
    mem = host_memory(reserve_bytes)
    return mem.available, mem.host_available, mem.cgroup_available
