"""What the cache hands back: match and load results, and the storage hook it calls."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..transfer.engine import LayerLoad
from .radix import Node


@dataclass(frozen=True)
class MatchResult:
    """What the cache holds of a prompt.

    ``device_indices``: device slots of the device-resident prefix (whole
    pages). ``host_len``: further tokens :meth:`HiCache.load_back` can bring
    from the host right after it. ``node``: opaque handle of the deepest
    matched node (covering the host part too), for lock/unlock/load_back.
    ``load_len``: how many of ``host_len`` are on the host only, which a load
    moves (the others are on the device already, behind a page another
    request is loading); None: all of them. ``stored_len``: of those, tokens
    whose host copy was read from the storage tier. ``storage_len``: further tokens
    past the host part being prefetched from the storage tier into host pages
    (``prefetch``, the cache's in-flight record), which :meth:`HiCache.load_back`
    brings too, as far as they have arrived by the prefetch policy; not part of
    ``total_len``, which the cache holds now.
    """

    device_indices: torch.Tensor
    host_len: int
    node: Node
    namespace: str
    load_len: int | None = None
    stored_len: int = 0
    storage_len: int = 0
    prefetch: object | None = None

    @property
    def host_only_len(self) -> int:
        """Tokens of the host part a load would move (``load_len``, else ``host_len``)."""
        return self.host_len if self.load_len is None else self.load_len

    @property
    def device_len(self) -> int:
        return len(self.device_indices)

    @property
    def total_len(self) -> int:
        return len(self.device_indices) + self.host_len


@dataclass(frozen=True)
class LoadResult:
    """Device slots of the whole matched prefix; attention for layer ``i`` calls ``layer_load.wait_layer(i)``
    (a :class:`~.inflight.CacheLoad`: it raises :class:`LoadFailedError` once a load it waits on has failed).

    ``loaded_tokens``: tokens this load moves host -> device, of which ``storage_tokens`` came from the
    storage tier (the match's ``storage_len``, as far as it arrived). ``node``: the node the request now
    holds locked, to unlock once done: the match's node, or, where storage pages joined the match,
    the deepest of them (the request's lock moved down to it)."""

    device_indices: torch.Tensor
    layer_load: LayerLoad
    loaded_tokens: int
    node: Node | None = None
    storage_tokens: int = 0


class LoadFailedError(RuntimeError):
    """A load a request waits on failed: the request's device slots for the matched host part
    hold no valid KV. The cache keeps the host copy and never serves those slots; the request
    unlocks its match, then matches again (and loads the host part again, or recomputes it)."""


class StorageHook:
    """Where host eviction offers pages before freeing them (the L3 tier implements this).

    ``offer`` is called under the cache's lock, in the thread that evicts. The cache is
    settled first: the pages offered belong to no node and to no allocator while it runs (no
    transfer writes them), so ``offer`` may call back into the cache (``evict_host`` to make
    room, ``match_prefix``, ``page_hashes`` ...). Pages that a nested eviction takes are
    offered from inside that call, up to a few calls deep, and after the current ``offer``
    returns beyond that: either way each page is offered once, and freed only after its
    ``offer`` returns. An exception from ``offer`` is counted
    (``storage_offer_failures_total``) and logged; the pages are freed all the same.
    ``offer`` must not wait for another thread that calls the cache (that thread waits for
    the lock ``offer`` runs under).
    """

    def offer(self, page_hashes: list[bytes], host_indices: torch.Tensor) -> None:
        """Called with the node's chained page hashes and host slots; the slots are freed on return."""
        raise NotImplementedError
