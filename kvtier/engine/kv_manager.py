"""Where a sequence's KV slots come from: a plain page allocator, or kvtier's prefix cache.

The scheduler talks to one of these objects, chosen once by the engine, in
ints and lists; this module is the seam where kvtier's tensors of slot ids
turn into lists. Both managers keep the same contract:

- ``admit(seq)``: give a waiting sequence slots for all its tokens, reusing
  a cached prefix where there is one; ``False`` (and nothing changed) when
  the device pool has no room now.
- ``append(seq)``: make sure the token the next decode step feeds has a slot;
  ``False`` when there is no room (the scheduler then preempts someone).
- ``release(seq)``: the sequence finished or was preempted; its computed
  full pages go into the prefix cache (if any), everything else is freed.
"""

from __future__ import annotations

import torch

from ..allocator import PageAllocator
from .sequence import Sequence


def _round_up(n: int, page: int) -> int:
    return -(-n // page) * page


class _Pages:
    """What both managers share: growing a running sequence by whole pages."""

    page_size: int

    def _alloc(self, n_tokens: int) -> torch.Tensor | None:
        raise NotImplementedError

    def append(self, seq: Sequence) -> bool:
        if len(seq.slots) >= seq.num_tokens:
            return True
        page = self._alloc(self.page_size)
        if page is None:
            return False
        seq.slots += page.tolist()
        return True


class NoPrefixCache(_Pages):
    """Every prompt is recomputed; slots come straight from a :class:`kvtier.PageAllocator`."""

    def __init__(self, size: int, page_size: int):
        self.allocator = PageAllocator(size, page_size)
        self.page_size = page_size
        self.capacity = self.allocator.size

    def admit(self, seq: Sequence) -> bool:
        slots = self._alloc(_round_up(seq.num_tokens, self.page_size))
        if slots is None:
            return False
        seq.slots, seq.prefix_len, seq.num_computed = slots.tolist(), 0, 0
        return True

    def _alloc(self, n_tokens: int) -> torch.Tensor | None:
        return self.allocator.alloc(n_tokens)

    def release(self, seq: Sequence) -> None:
        self.allocator.free(torch.tensor(seq.slots, dtype=torch.int64))
        _forget(seq)

    def poll(self) -> None:
        pass

    def close(self) -> None:
        pass

    def metrics(self) -> dict:
        return {}


class PrefixCache(_Pages):
    """Slots through a :class:`kvtier.cache.HiCache` (device only, or device + host).

    ``advise``: ask the cache whether loading a host hit beats recomputing it,
    given the engine's measured prefill seconds per token (a callable).
    """

    def __init__(self, cache, advise=None):
        self.cache = cache
        self.page_size = cache.config.page_size
        self.capacity = cache.device_pool.size // self.page_size * self.page_size
        self.advise = advise

    def admit(self, seq: Sequence) -> bool:
        # At least one token must be computed, to get the logits of the last one.
        # Locked as it is matched: the room counted next must not include the match's own pages.
        # Counted only if admitted: a request refused for room asks again, and would count its
        # hits each time.
        query = seq.token_ids[: seq.num_tokens - 1]
        match = self.cache.match_prefix(query, namespace=seq.namespace, lock=True, count=False)
        # What is on the device already, ready or behind another request's load still in flight
        # (locked now, so not in the room below either: counted on both sides, a request that
        # fits would be held back until another finishes).
        need = _round_up(seq.num_tokens - (match.total_len - match.host_only_len), self.page_size)
        if need > self.cache.device_free_tokens():
            self.cache.unlock(match.node)
            return False  # would fail after loading; skip the transfer
        prefix, layer_load, node, host, storage = match.device_indices, None, match.node, 0, 0
        load, storage_tokens = self._plan(seq, match)
        if load:
            loaded = self.cache.load_back(match, storage_tokens=storage_tokens)
            if loaded is not None:  # None: no room to load; recompute those tokens instead
                prefix, layer_load, node = loaded.device_indices, loaded.layer_load, loaded.node
                storage = loaded.storage_tokens
                host = loaded.loaded_tokens - storage
        own = self._alloc(_round_up(seq.num_tokens - len(prefix), self.page_size))
        if own is None:
            self.cache.unlock(node)
            return False
        self.cache.count_match(match, len(query))
        seq.slots = prefix.tolist() + own.tolist()
        seq.prefix_len = seq.num_computed = len(prefix)
        seq.node, seq.layer_load = node, layer_load
        seq.count_reuse(len(prefix) - host - storage, host, storage)
        return True

    def _plan(self, seq: Sequence, match) -> tuple[bool, int | None]:
        """Whether to load the match's host and storage parts, and how much of the latter (None:
        all of it): everything, or as the cache advises from the measured prefill rate; nothing
        for a request whose earlier load failed (it is computed in full)."""
        if seq.load_failed or not (match.host_len or match.storage_len):
            return False, None
        if self.advise is None:
            return True, None
        advice = self.cache.advise(match, self.advise())
        return advice.load, advice.storage_tokens

    def _alloc(self, n_tokens: int) -> torch.Tensor | None:
        return self.cache.alloc_device(n_tokens)

    def release(self, seq: Sequence) -> None:
        """Insert the computed full pages (the cache owns them now), free the rest, unlock."""
        full = seq.num_computed // self.page_size * self.page_size
        if full > seq.prefix_len:
            self.cache.insert(seq.token_ids[:full], torch.tensor(seq.slots[:full], dtype=torch.int64),
                              namespace=seq.namespace)
        if len(seq.slots) > full:
            self.cache.free_device(torch.tensor(seq.slots[full:], dtype=torch.int64))
        self.cache.unlock(seq.node)
        _forget(seq)

    def poll(self) -> None:
        self.cache.poll()

    def close(self) -> None:
        """Finish the cache's transfers and prefetches, save the host tier's pages to its storage
        tier (write-back at shutdown; under write-through they are there already), close the tier."""
        self.cache.flush(save_host=self.cache.config.storage_write == "write_back")
        if self.cache.storage is not None:
            self.cache.storage.tier.close()

    def metrics(self) -> dict:
        return self.cache.metrics.snapshot()


def _forget(seq: Sequence) -> None:
    seq.slots, seq.prefix_len, seq.num_computed, seq.node, seq.layer_load = [], 0, 0, None, None
