"""Eviction and write policies, chosen once at construction; the load-or-recompute advice.

An eviction policy is only a priority: among the nodes the mechanism says
may go, the one with the smallest key goes first. Everything else (which
nodes are eligible, demoting, freeing, accounting) lives once, in the
controller, so a policy cannot leave an eviction half done.

A write policy answers two questions: back a node up now (on insert, on a
hit), and give a device-only node a host copy when the device evicts it
(demote) rather than drop it.

The advice (:func:`advise_match`, :func:`storage_split`) weighs bandwidths measured online
against the caller's prefill estimate, for the host part of a match and for its storage part; of
the latter, the prefix that pays is loaded and the rest recomputed.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from .config import CacheConfig
from .radix import Node
from .types import MatchResult


class EvictionPolicy:
    name = ""

    def key(self, node: Node):
        """Sort key; smaller is evicted first."""
        raise NotImplementedError


class LRU(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def key(self, node: Node):
        return node.last_access


class LFU(EvictionPolicy):
    """Fewest hits first; ties broken by least recent use."""

    name = "lfu"

    def key(self, node: Node):
        return (node.hits, node.last_access)


EVICTION = {p.name: p for p in (LRU, LFU)}


class WritePolicy:
    name = ""

    def backup_on_insert(self, node: Node) -> bool:
        return False

    def backup_on_hit(self, node: Node) -> bool:
        return False

    def demote_on_evict(self, node: Node) -> bool:
        """Give the node a host copy before the device lets it go."""
        return True


class WriteThrough(WritePolicy):
    """Every inserted page is backed up at once (a skipped one is demoted on eviction)."""

    name = "write_through"

    def backup_on_insert(self, node: Node) -> bool:
        return True


class WriteThroughSelective(WritePolicy):
    """Back up a node once it has been hit ``hits`` times; cold nodes are dropped."""

    name = "write_through_selective"

    def __init__(self, hits: int):
        self.hits = hits

    def backup_on_hit(self, node: Node) -> bool:
        return node.hits >= self.hits

    def demote_on_evict(self, node: Node) -> bool:
        return node.hits >= self.hits


class WriteBack(WritePolicy):
    """Nothing is copied until the device evicts it; then it is demoted to the host."""

    name = "write_back"


def make_policies(config: CacheConfig) -> tuple[EvictionPolicy, WritePolicy]:
    eviction = EVICTION[config.eviction]()
    if config.write_policy == "write_through":
        return eviction, WriteThrough()
    if config.write_policy == "write_through_selective":
        return eviction, WriteThroughSelective(config.selective_hits)
    return eviction, WriteBack()


class Victims:
    """Eligible nodes in policy order; parents are offered as their children go."""

    def __init__(self, key, nodes, eligible):
        self.key, self.eligible, self.tie = key, eligible, itertools.count()
        self.heap = [(key(n), next(self.tie), n) for n in nodes if eligible(n)]
        heapq.heapify(self.heap)

    def offer(self, node: Node) -> None:
        if node.parent is not None and self.eligible(node):
            heapq.heappush(self.heap, (self.key(node), next(self.tie), node))

    def pop(self) -> Node | None:
        """The next node still eligible (earlier evictions, or calls a storage hook made
        back into the cache, may have changed some)."""
        while self.heap:
            node = heapq.heappop(self.heap)[2]
            if self.eligible(node):
                return node
        return None


# -- load or recompute ------------------------------------------------------------------------

class BandwidthMeter:
    """EWMA of bytes per second for one direction; 0 until the first sample."""

    def __init__(self, weight: float, prior_bps: float = 0.0):
        self.weight = weight
        self.bps = prior_bps
        self.samples = 0

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        self.bps = rate if self.samples == 0 else self.weight * rate + (1 - self.weight) * self.bps
        self.samples += 1


@dataclass(frozen=True)
class Advice:
    """Whether to call ``load_back`` (``load``), and for how much of the match.

    The host part: ``host_tokens``, ``host_bytes``, ``load_seconds`` (None when no bandwidth has
    been measured or assumed yet: then loading is advised, which measures it), against
    ``recompute_seconds``. The storage part: ``storage_tokens`` of it to load (pass them to
    ``load_back``; the rest is recomputed), at ``storage_bytes_per_second`` (0: not measured).
    """

    load: bool
    host_tokens: int
    host_bytes: int
    load_seconds: float | None
    recompute_seconds: float
    load_bytes_per_second: float
    storage_tokens: int = 0
    storage_bytes_per_second: float = 0.0

    @property
    def decision(self) -> str:
        return "load" if self.load else "recompute"


def advise(host_tokens: int, bytes_per_token: int, meter: BandwidthMeter,
           prefill_seconds_per_token: float, margin: float) -> Advice:
    """Load ``host_tokens`` from the host, or recompute them (the host part of a match)."""
    nbytes = host_tokens * bytes_per_token
    recompute = host_tokens * prefill_seconds_per_token
    if host_tokens == 0:
        return Advice(False, 0, 0, 0.0, 0.0, meter.bps)
    if meter.bps <= 0:
        return Advice(True, host_tokens, nbytes, None, recompute, 0.0)
    load = nbytes / meter.bps
    return Advice(load <= margin * recompute, host_tokens, nbytes, load, recompute, meter.bps)


def advise_match(match: MatchResult, prefill_seconds_per_token: float, meter: BandwidthMeter, token_bytes: int,
                 config, metrics, storage=None) -> Advice:
    """The advice for ``match``: its host part's (counted), then its storage part's split (by
    ``storage``, the cache's :class:`~.storage.CacheStorage`, where it has one)."""
    v = prefill_seconds_per_token
    if match.host_len and not match.host_only_len:
        # Nothing to move: the host part is on the device behind a page another request is
        # loading; load_back waits for that load, which recomputing would not beat.
        a = Advice(True, 0, 0, 0.0, match.host_len * v, meter.bps)
    else:
        a = advise(match.host_only_len, token_bytes, meter, v, config.advisor_margin)
        if a.host_tokens:
            metrics.advice[a.decision].inc()
    if storage is not None:
        a = storage.advise(a, match, v, meter.bps, config.advisor_margin)
    return a


def storage_split(pages: int, arrived: int, page_tokens: int, page_bytes: int, load_bps: float,
                  storage_bps: float, prefill_seconds_per_token: float, margin: float = 1.0) -> int:
    """How many leading pages of a storage hit of ``pages`` to load; the rest are recomputed.

    A page that has ``arrived`` on the host costs one host -> device load (``page_bytes`` at
    ``load_bps``); one still in the store costs a read at ``storage_bps`` too. A page pays when
    its cost is at most ``margin`` x recomputing its ``page_tokens``. Pages arrive in order, so
    the answer is all of them (the rest pays), the ``arrived`` prefix (only that pays), or none.
    An unmeasured bandwidth (0) counts as paying: loading measures it.
    """
    recompute = margin * page_tokens * prefill_seconds_per_token
    to_device = page_bytes / load_bps if load_bps > 0 else 0.0
    from_store = page_bytes / storage_bps if storage_bps > 0 else 0.0
    if to_device > recompute:
        return 0
    if to_device + from_store <= recompute:
        return pages
    return min(arrived, pages)
