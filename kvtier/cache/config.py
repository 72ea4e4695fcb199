"""The prefix cache's knobs: one frozen, validated value."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..transfer.base import Backend
from ..transfer.factory import IO_BACKENDS
from ..validate import require_positive_int
from .hashing import KEY_HASHES

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
EVICTION_POLICIES = ("lru", "lfu")
STORAGE_WRITES = ("write_back", "write_through")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class CacheConfig:
    """How a :class:`~kvtier.cache.HiCache` behaves; checked once, never mutated.

    - ``page_size``: tokens per page; must equal the pools' page size.
    - ``write_policy``: when device pages get a host copy. ``write_through``
      backs up on insert; ``write_through_selective`` once a node has been
      hit ``selective_hits`` times; ``write_back`` when the device evicts it.
    - ``eviction``: ``lru`` or ``lfu`` (same policy for both tiers).
    - ``io_backend``: passed to :class:`~kvtier.transfer.TransferEngine`
      (None: the engine's default for the device): a name, or a configured
      backend such as ``DMABackend(DMAConfig(...))``.
    - ``max_inflight_backups`` / ``max_inflight_loads``: bounds of the
      transfer queues; a full backup queue skips write-through backups
      (counted in the metrics), a full load queue makes ``load_back`` wait
      for the oldest load.
    - ``model_id``: salts chain keys with the model's identity (weights),
      on top of the KV shape, dtype and page size.
    - ``key_hash``: the hash of chain keys (:mod:`.hashing`): ``xxh3_128``, or
      ``sha256`` for keys shared with other engines or untrusting tenants.
    - ``check_slots``: ``insert`` checks that each page's slots are that page's,
      in order; False reads one slot a page, for an engine whose slots come
      whole from ``alloc_device`` and matches (page ownership and repeats are
      checked either way; at page 1 it changes nothing).
    - ``load_gbps_prior``: host->device bandwidth the advisor assumes until it
      has measured one (0: no prior, loads are advised until measured).
    - ``bandwidth_ewma``: weight of the newest measurement in the bandwidth
      estimate (0 < w <= 1).
    - ``advisor_margin``: load when ``load_seconds <= margin * recompute_seconds``.
    - ``storage_write`` (with a storage tier): when host pages are saved to it, ``write_back``
      (as host eviction frees them) or ``write_through`` (as soon as their backup to the host
      has landed).
    - ``storage_save_ahead``: under ``write_back``, the fraction of the host pool kept free or
      saved: while fewer of its pages are free, the pages next in line for eviction are saved ahead
      of it, as the tier's queue has room, so an eviction burst that size loses none to a full
      queue (0: pages are saved only as eviction frees them).
    - ``storage_prefetch``: how long ``load_back`` waits for a match's prefetch from storage:
      ``best_effort`` (not at all: the pages arrived by then), ``wait_complete`` (until it is
      done) or ``timeout`` (until its deadline, from the page count and the measured read
      bandwidth: ``StorageTier.prefetch_timeout``).
    - ``storage_min_pages``: the fewest whole pages past a match worth a storage lookup.
    - ``max_inflight_prefetches``: bound of the prefetches in flight; a match past it starts none.
    """

    page_size: int
    write_policy: str = "write_through"
    selective_hits: int = 2
    eviction: str = "lru"
    io_backend: str | Backend | None = None
    max_inflight_backups: int = 256
    max_inflight_loads: int = 64
    model_id: str = ""
    key_hash: str = "xxh3_128"
    check_slots: bool = True
    load_gbps_prior: float = 0.0
    bandwidth_ewma: float = 0.25
    advisor_margin: float = 1.0
    storage_write: str = "write_back"
    storage_save_ahead: float = 0.25
    storage_prefetch: str = "timeout"
    storage_min_pages: int = 1
    max_inflight_prefetches: int = 16

    def __post_init__(self) -> None:
        require_positive_int("page_size", self.page_size)
        _choice("write_policy", self.write_policy, WRITE_POLICIES)
        _choice("eviction", self.eviction, EVICTION_POLICIES)
        require_positive_int("selective_hits", self.selective_hits)
        require_positive_int("max_inflight_backups", self.max_inflight_backups)
        require_positive_int("max_inflight_loads", self.max_inflight_loads)
        if self.io_backend is not None and not isinstance(self.io_backend, Backend):
            _choice("io_backend", self.io_backend, IO_BACKENDS)
        _choice("key_hash", self.key_hash, KEY_HASHES)
        if not isinstance(self.check_slots, bool):
            raise ValueError(f"check_slots must be True or False, got {self.check_slots!r}")
        if not isinstance(self.model_id, str):
            raise ValueError(f"model_id must be a string, got {self.model_id!r}")
        _finite("load_gbps_prior", self.load_gbps_prior, low=0.0)
        _finite("advisor_margin", self.advisor_margin, low=0.0, strict=True)
        _finite("bandwidth_ewma", self.bandwidth_ewma, low=0.0, strict=True)
        if self.bandwidth_ewma > 1:
            raise ValueError(f"bandwidth_ewma must be in (0, 1], got {self.bandwidth_ewma!r}")
        _choice("storage_write", self.storage_write, STORAGE_WRITES)
        _finite("storage_save_ahead", self.storage_save_ahead, low=0.0)
        if self.storage_save_ahead > 1:
            raise ValueError(f"storage_save_ahead must be in [0, 1] (a fraction of the host pool), "
                             f"got {self.storage_save_ahead!r}")
        _choice("storage_prefetch", self.storage_prefetch, PREFETCH_POLICIES)
        require_positive_int("storage_min_pages", self.storage_min_pages)
        require_positive_int("max_inflight_prefetches", self.max_inflight_prefetches)


def _choice(name: str, value, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"unknown {name} {value!r}; use one of {list(options)}")


def _finite(name: str, value, low: float, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low):
        bound = f"> {low}" if strict else f">= {low}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
