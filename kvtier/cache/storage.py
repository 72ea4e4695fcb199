"""The storage (L3) tier composed with the tree.

:class:`CacheStorage` puts a :class:`~kvtier.storage.tier.StorageTier` behind the host tier, as
:class:`~.tiers.Tiers` puts the host pool behind the device (the tree is never subclassed):

- **writes.** Under ``storage_write="write_back"`` the host pages that eviction frees are saved
  (it is the cache's :class:`~.types.StorageHook`), and, while fewer than ``storage_save_ahead``
  x the host pool's pages are free, the pages next in line for eviction are saved ahead of it as
  the tier's queue has room (:meth:`CacheStorage.save_ahead`); under ``write_through`` a page is saved as
  soon as its backup to the host has landed. A save copies the pages out at once and the tier
  writes them in the background (a full queue drops the save and counts it). MLA and DSA pages,
  the same on every tensor-parallel rank, are written by rank 0 only; every rank reads them.
- **prefetch, prepared** when a match is made: the query's whole pages past the match are looked
  up in the store (one batched ``exists``, outside the cache's lock) and read into fresh host
  pages in the background. The :class:`Prefetch` in flight holds those host pages and a lock on
  the node it continues (its *anchor*), so the path it extends stays put; a match that finds a
  prefetch of the same pages in flight shares it.
- **prefetch, completed** when the request is scheduled (``HiCache.load_back``): the policy says
  how long to wait (``best_effort``: not at all; ``wait_complete``: until it is done;
  ``timeout``: until its deadline), the rest is cancelled (nothing writes its pages after that),
  and the ready leading pages join the tree as host-resident nodes with their chain keys (pages
  the tree holds already are freed, as are pages that did not arrive). A prefetch nobody claims
  joins at the first poll after it is done or past its deadline. A page evicted from the store
  between the lookup and the read, or one that fails its checks, ends the prefetch there: a
  miss, never garbage.

The storage part of the load-or-recompute advice (:meth:`CacheStorage.advise`) is the prefix
that pays by :func:`.policy.storage_split`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np

from ..allocator import pages_to_tokens
from ..spec import MHA
from ..storage.tier import StorageTier
from ..validate import is_int
from .policy import Advice, Victims, storage_split
from .radix import Node, stored
from .types import MatchResult, StorageHook

logger = logging.getLogger("kvtier")

# A save-ahead pass walks every host node (O(nodes)): the next waits this many times as long as
# the last one's walk took (its saves not counted: eviction would copy the same pages out), so
# walks take at most 1/20 of the thread that polls.
AHEAD_SPACING = 20


# -- prefetches in flight ----------------------------------------------------------------------

class Prefetch:
    """One prefetch in flight: the pages of ``keys`` (the chain of ``tokens``, whole pages past
    ``anchor``) being read into host ``pages``; ``anchor`` is locked until it completes."""

    __slots__ = ("anchor", "tokens", "keys", "pages", "handle", "done")

    def __init__(self, anchor: Node, tokens, keys: list[bytes], pages: np.ndarray, handle):
        self.anchor, self.tokens, self.keys, self.pages, self.handle = anchor, tokens, keys, pages, handle
        self.done = False

    def arrived(self) -> int:
        """Leading pages on the host now (all of them once it has joined the tree)."""
        return len(self.keys) if self.done else self.handle.ready_pages()


class CacheStorage(StorageHook):
    """The storage tier of one cache (see the module's contract). Called under the cache's lock,
    except :meth:`lookup` and :meth:`wait`, which must not hold it (they wait for the store)."""

    def __init__(self, tier: StorageTier, config, host_pool, tree, tiers, keys, metrics):
        self.tier, self.config, self.host_pool = tier, config, host_pool
        self.tree, self.tiers, self.keys, self.metrics = tree, tiers, keys, metrics
        self.ps = config.page_size
        salt = tier.salt
        self.writes = salt.spec.kind == MHA or salt.tp_rank == 0
        self.pending: dict[tuple[Node, bytes], Prefetch] = {}
        self.backlog: dict[Node, int] = {}  # write_through: node -> its trailing pages not saved yet
        self.ahead = self.writes and config.storage_write == "write_back" and config.storage_save_ahead > 0
        self.saved: set[bytes] = set()  # write_back: chain keys of host pages saved ahead of eviction
        self._ahead_at = 0.0  # write_back: no save-ahead pass before this time.monotonic()
        self._ahead_due = True  # write_back: the host tier changed since a pass found nothing to do

    # -- writes --------------------------------------------------------------------------------

    def offer(self, page_hashes: list[bytes], host_indices) -> None:
        """Host eviction's pages (one node's, in chain order): saved under ``write_back``, but for
        those saved ahead."""
        if not (self.writes and self.config.storage_write == "write_back"):
            return
        parents = None  # each page's parent is the chain key before it; the first one's is unknown
        self._ahead_due = True
        if self.saved:
            fresh = [i for i, k in enumerate(page_hashes) if k not in self.saved]
            self.saved.difference_update(page_hashes)
            if len(fresh) < len(page_hashes):
                parents = [page_hashes[i - 1] if i else None for i in fresh]
                host_indices = np.asarray(host_indices).reshape(-1, self.ps)[fresh].reshape(-1)
                page_hashes = [page_hashes[i] for i in fresh]
        if page_hashes:
            self.tier.save(page_hashes, parents, self.host_pool, host_indices)

    def save_ahead(self) -> None:
        """Under ``write_back``, while fewer than ``storage_save_ahead`` x the host pool's pages are
        free: save the host pages next in line for eviction (in the eviction policy's order) that
        are not saved yet, as far as the tier's queue has room, until that many pages are free or
        saved. A burst of host eviction of that size then finds its pages saved instead of dropping
        what the queue cannot take. A page counts as saved once queued (a write that fails later is
        counted by the tier, not redone); eviction forgets it. A page read from the store counts as
        saved. Passes are spaced (AHEAD_SPACING); after one that left nothing to do, the next waits
        for a backup to land or an eviction."""
        start = time.monotonic()
        if not self._ahead_due or start < self._ahead_at:
            return
        alloc = self.host_pool.allocator
        need = math.ceil(self.config.storage_save_ahead * alloc.num_pages) - alloc.available_pages()
        room = self.tier.room_pages() if need > 0 else 0
        if room <= 0:
            return
        if len(self.saved) > alloc.num_pages:  # keys of pages gone other than by eviction
            self.saved.intersection_update(k for n in self.tree.host_nodes for k in self.keys.of_node(n))
        victims = Victims(self.tiers.eviction.key, self.tree.host_nodes, self.tiers.host_evictable)
        saving = 0.0
        while need > 0 and room > 0 and (node := victims.pop()) is not None:
            keys, parents = self._chain(node)
            todo = [i for i, k in enumerate(keys) if k not in self.saved]
            need -= len(keys) - len(todo)
            todo = todo[: max(0, min(room, need))]
            if not todo:
                continue
            t0 = time.monotonic()
            queued = self.tier.save([keys[i] for i in todo], [parents[i] for i in todo], self.host_pool,
                                    _slots(node.host[todo], self.ps))
            saving += time.monotonic() - t0
            self.saved.update(keys[i] for i in todo[:queued])
            self.metrics.storage_saved_ahead_pages.inc(queued)
            need, room = need - queued, room - queued if queued == len(todo) else 0
        self._ahead_due = need > 0 and room <= 0  # the queue's room ran out first: go on when it frees
        now = time.monotonic()
        self._ahead_at = now + AHEAD_SPACING * (now - start - saving)

    def backed_up(self, nodes: list[Node]) -> None:
        """Nodes whose backup to the host has landed: saved under ``write_through``, as much as the
        tier's queue takes now; the rest wait in the backlog (see :meth:`drain`)."""
        self._ahead_due = True
        if not (self.writes and self.config.storage_write == "write_through"):
            return
        for n in nodes:
            self.backlog[n] = len(n) // self.ps  # its whole host copy has just landed
        self.drain()

    def drain(self, wait: bool = False) -> None:
        """Save the backlog's pages, oldest first, while the tier's queue has room (``wait``: wait
        for room until all are queued). An entry is a node and its trailing pages not yet saved; a
        node split since holds fewer pages, the rest are its new parent's tail; a node gone from the
        host tier is dropped (its pages went with it). A save that raises is counted and logged
        (the pages stay cached on the host)."""
        while self.backlog:
            node, unsaved = next(iter(self.backlog.items()))
            if node.host is None or not node.host_ready or not node.alive:
                del self.backlog[node]
                continue
            have = len(node) // self.ps
            if unsaved > have:  # split: the upper part's tail is unsaved too
                self.backlog[node.parent] = self.backlog.get(node.parent, 0) + unsaved - have
                unsaved = self.backlog[node] = have
            n = min(unsaved, self.tier.room_pages())
            if n == 0 and wait and self.tier.healthy():
                self.tier.flush()
                n = min(unsaved, self.tier.room_pages())
            if n == 0:
                return
            self._save_tail(node, unsaved, n)

    def _save_tail(self, node: Node, unsaved: int, n: int) -> None:
        """Save ``n`` pages of ``node``'s ``unsaved`` trailing ones (the first of them)."""
        keys, parents = self._chain(node)
        first = len(keys) - unsaved
        if n == unsaved:
            del self.backlog[node]
        else:
            self.backlog[node] = unsaved - n
        try:
            self.tier.save(keys[first:first + n], parents[first:first + n], self.host_pool,
                           _slots(node.host[first:first + n], self.ps))
        except Exception as e:  # noqa: BLE001 - a failed save loses a copy, never the cache
            self.metrics.storage_offer_failures.inc()
            logger.warning("saving %d backed-up pages to storage failed: %s", n, e)

    def save_host(self) -> int:
        """Save every page the host tier holds (not being written by a backup) that this rank
        writes: write-back at shutdown. Waits for room in the tier's queue between nodes; returns
        the pages queued."""
        if not self.writes:
            return 0
        queued = 0
        for n in [n for n in self.tree.host_nodes if n.host_ready and n.op is None]:
            keys, parents = self._chain(n)
            done = self.tier.save(keys, parents, self.host_pool, _slots(n.host, self.ps))
            if done < len(keys):  # the queue was full: let it drain, then the rest once more
                self.tier.flush()
                done += self.tier.save(keys[done:], parents[done:], self.host_pool, _slots(n.host[done:], self.ps))
            queued += done
        return queued

    def _chain(self, node: Node) -> tuple[list[bytes], list[bytes]]:
        """``node``'s chain keys, and each one's parent key."""
        keys = self.keys.of_node(node)
        return keys, [self.keys.of_node(node.parent)[-1], *keys[:-1]]

    # -- prefetch: prepare ---------------------------------------------------------------------

    def wanted(self, match: MatchResult, tokens) -> list[bytes]:
        """The chain keys of the query's whole pages past ``match``, where there are at least
        ``storage_min_pages`` of them ([] otherwise)."""
        start = match.total_len
        n = (len(tokens) - start) // self.ps
        if n < self.config.storage_min_pages:
            return []
        return self.keys.chain(self.keys.of_node(match.node)[-1], tokens[start : start + n * self.ps])

    def lookup(self, anchor: Node, keys: list[bytes]) -> int:
        """How many leading pages of ``keys`` the store holds (outside the cache's lock: the store
        is asked); -1 where a prefetch of them is in flight already (to share)."""
        if not keys:
            return 0
        if (anchor, keys[0]) in self.pending:
            return -1
        return self.tier.lookup(keys)

    def start(self, match: MatchResult, tokens, keys: list[bytes], found: int) -> MatchResult:
        """``match`` with its storage part: a prefetch in flight of these pages shared, or one of
        the ``found`` leading pages started into host pages (as many as the host can take)."""
        shared = self.pending.get((match.node, keys[0])) if keys else None
        if shared is not None:
            n = 0
            while n < min(len(keys), len(shared.keys)) and keys[n] == shared.keys[n]:
                n += 1
            return dataclasses.replace(match, storage_len=n * self.ps, prefetch=shared)
        if found < self.config.storage_min_pages:
            return match
        if len(self.pending) >= self.config.max_inflight_prefetches:
            self.metrics.prefetch_refused["queue_full"].inc()
            return match
        anchor = match.node
        self.tree.lock(anchor)  # first: making host room evicts, and must not take the path it extends
        pages = self._host_pages(found)
        if pages is None:
            self.tree.unlock(anchor)
            self.metrics.prefetch_refused["host_full"].inc()
            return match
        n, start = len(pages), match.total_len
        try:
            handle = self.tier.prefetch(keys[:n], self.host_pool, _slots(pages, self.ps),
                                        parent_key=self.keys.of_node(anchor)[-1])
        except BaseException:
            self.tiers.host_alloc.free_pages(pages)
            self.tree.unlock(anchor)
            raise
        pf = Prefetch(anchor, stored(tokens, start, start + n * self.ps), keys[:n], pages, handle)
        self.pending[(anchor, keys[0])] = pf
        return dataclasses.replace(match, storage_len=n * self.ps, prefetch=pf)

    def _host_pages(self, n: int) -> np.ndarray | None:
        """``n`` host pages (evicting host copies as needed), else as many as are free; None: none."""
        pages = self.tiers.obtain_host(n)
        if pages is None:
            free = min(n, self.tiers.host_alloc.available_pages())
            pages = self.tiers.host_alloc.alloc_pages(free) if free else None
        return pages

    # -- prefetch: complete --------------------------------------------------------------------

    def pages_wanted(self, match: MatchResult, storage_tokens: int | None) -> int:
        """Pages of ``match``'s storage part a load brings: all, or ``storage_tokens`` of them."""
        if storage_tokens is not None and (not is_int(storage_tokens) or storage_tokens < 0):
            raise ValueError(f"storage_tokens must be a non-negative integer (Advice.storage_tokens), "
                             f"got {storage_tokens!r}")
        if not isinstance(match.prefetch, Prefetch) or not match.storage_len:
            return 0
        n = match.storage_len if storage_tokens is None else min(int(storage_tokens), match.storage_len)
        return n // self.ps

    def wait(self, pf: Prefetch, pages: int) -> None:
        """Wait, as the policy says, until the first ``pages`` pages of ``pf`` are on the host
        (outside the cache's lock; the prefetch runs on the tier's threads)."""
        policy, h = self.config.storage_prefetch, pf.handle
        if pf.done or policy == "best_effort" or h.done():
            return
        end = h.deadline if policy == "timeout" else time.monotonic() + self.tier.config.prefetch_timeout_max_s
        if pages >= len(pf.keys):
            h.wait(max(0.0, end - time.monotonic()))
            return
        while h.ready_pages() < pages and not h.done() and time.monotonic() < end:
            h.wait(0.001)

    def settle(self, pf: Prefetch) -> None:
        """Complete ``pf`` now, if it has not joined yet: stop it where it is still reading, put
        its ready pages in the tree, free the rest, release its anchor."""
        if pf.done:
            return
        h = pf.handle
        ready = h.ready_pages() if h.done() else h.cancel()
        del self.pending[(pf.anchor, pf.keys[0])]
        pf.done, used = True, slice(0, 0)
        try:
            used = self._join(pf, ready)
        finally:
            keep = np.zeros(len(pf.pages), dtype=bool)
            keep[used] = True
            if not keep.all():
                self.tiers.host_alloc.free_pages(pf.pages[~keep])
            self.tree.unlock(pf.anchor)

    def _join(self, pf: Prefetch, ready: int) -> slice:
        """Insert the first ``ready`` pages of ``pf`` below its anchor as host-resident nodes;
        returns which of its pages the tree took (those it held already are not taken)."""
        tokens = pf.tokens[: ready * self.ps]
        if not ready:
            return slice(0, 0)
        path, matched = self.tree.walk_split(pf.anchor, tokens)
        if matched == len(tokens):
            return slice(0, 0)
        parent = path[-1] if path else pf.anchor
        self.keys.of_node(parent)  # a node with keys has a parent with keys
        leaf = self.tree.add_leaf(parent, stored(tokens, matched, len(tokens)))
        first = matched // self.ps
        leaf.hashes = list(pf.keys[first:ready])
        leaf.from_storage = True
        if self.ahead:
            self.saved.update(leaf.hashes)
        self.tree.set_host(leaf, pf.pages[first:ready], ready=True)
        self.tree.touch(self.tree.path_to(leaf), hit=False)
        return slice(first, ready)

    def claim(self, match: MatchResult, pages: int) -> list[Node]:
        """The nodes below ``match.node`` that hold the first ``pages`` pages of its storage part
        now (its prefetch settled first): the path a load extends the match by."""
        pf = match.prefetch
        self.settle(pf)
        tokens = pf.tokens[: min(pages * self.ps, match.storage_len)]
        return self.tree.walk_split(match.node, tokens)[0]

    def loaded(self, to_load: list[Node], ext: list[Node]) -> int:
        """A load of ``to_load`` started (``ext``: its nodes past the match): the tokens of those
        read from storage, counted as storage hits where the match did not count them."""
        extended = {id(n) for n in ext}
        tokens = counted = 0
        for n in to_load:
            if n.from_storage:
                tokens += len(n)
                counted += len(n) if id(n) in extended else 0
                n.from_storage = False
        self.metrics.hit_tokens["storage"].inc(counted)
        return tokens

    def poll(self) -> None:
        """Save what the backlog's queue room allows; settle the prefetches that are done or past
        their deadline."""
        if self.backlog:
            self.drain()
        if self.ahead:
            self.save_ahead()
        if not self.pending:
            return
        now = time.monotonic()
        for pf in list(self.pending.values()):
            if pf.handle.done() or now >= pf.handle.deadline:
                self.settle(pf)

    def drop_all(self) -> None:
        """Stop every prefetch in flight and free its pages (none joins the tree); forget the backlog
        and the pages saved ahead."""
        self.backlog.clear()
        self.saved.clear()
        for pf in list(self.pending.values()):
            pf.handle.cancel()
            pf.handle = _Stopped()
            self.settle(pf)

    def held_pages(self) -> list[np.ndarray]:
        """Host pages of the prefetches in flight (no node's)."""
        return [pf.pages for pf in self.pending.values()]

    # -- advice ----------------------------------------------------------------------------------

    def advise(self, advice: Advice, match: MatchResult, prefill_seconds_per_token: float,
               load_bps: float, margin: float) -> Advice:
        """``advice`` (the host part's) with the storage part's split; a split of nothing is
        counted as a prefetch skipped."""
        pf = match.prefetch
        if not match.storage_len or (match.host_only_len and not advice.load):
            return advice
        pages = match.storage_len // self.ps
        bps = self.tier.read_rate.bps
        k = storage_split(pages, pf.arrived(), self.ps, self.tier.codec.blob_bytes, load_bps, bps,
                          prefill_seconds_per_token, margin)
        if k == 0:
            self.tier.skip_prefetch()
        return dataclasses.replace(advice, load=advice.load or k > 0, storage_tokens=k * self.ps,
                                   storage_bytes_per_second=bps)


def _slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    return pages_to_tokens(pages.astype(np.int64, copy=False), page_size)


class _Stopped:
    """The handle of a prefetch stopped whole: nothing ready, nothing more written."""

    deadline = 0.0

    def done(self) -> bool:
        return True

    def ready_pages(self) -> int:
        return 0
