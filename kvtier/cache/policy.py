"""Eviction and write policies: small objects chosen once, at construction.

An eviction policy is only a priority: among the nodes the mechanism says
may go, the one with the smallest key goes first. Everything else (which
nodes are eligible, demoting, freeing, accounting) lives once, in the
controller, so a policy cannot leave an eviction half done.

A write policy answers two questions: back a node up now (on insert, on a
hit), and give a device-only node a host copy when the device evicts it
(demote) rather than drop it.
"""

from __future__ import annotations

import heapq
import itertools

from .config import CacheConfig
from .radix import Node


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
