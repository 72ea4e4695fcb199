"""HiCache: the hierarchical prefix cache a serving engine talks to.

One lock guards the tree and the tiers, so a scheduler thread can match,
insert and lock while another thread polls for completed transfers.
Expected outcomes are return values (``None`` from :meth:`alloc_device`
and :meth:`load_back` when even eviction cannot make room); misuse raises
before anything changes.

A request's life::

    m = cache.match_prefix(tokens)          # device part + host extension (+ a storage prefetch)
    cache.lock(m.node)                      # nothing on the path is evicted now
    r = cache.load_back(m)                  # host (and storage) part -> device, layer by layer
    own = cache.alloc_device(n)             # slots for the tokens it computes
    ...                                     # attention waits on r.layer_load
    cache.insert(tokens, slots)             # the tree takes the full pages
    cache.free_device(partial_page_slots)
    cache.unlock(r.node)                    # m.node, unless storage pages moved the lock down
"""

from __future__ import annotations

import logging
import math
import threading

import numpy as np
import torch

from ..transfer.engine import TransferEngine
from .config import CacheConfig
from .hashing import ChainKeys
from .inflight import LOAD, CacheLoad
from .invariants import check_cache
from .metrics import CacheMetrics, cache_state
from .policy import make_policies
from .radix import Node, RadixTree, load_tokens, ready_prefix, stored
from ..validate import check_namespace, is_int
from .checks import (PageRuns, as_slots, as_tokens, check_node, check_pools, check_storage, claim_device_pool,
                     insert_pages, pages_of)
from .policy import Advice, advise_match
from .storage import CacheStorage
from .tiers import TREE, Tiers, concat, tokens_of
from .types import LoadResult, MatchResult, StorageHook

logger = logging.getLogger("kvtier")


class HiCache:
    """A radix-tree prefix cache over a device pool and, optionally, a host pool.

    ``host_pool=None`` makes a device-only prefix cache. The cache owns the
    device pool's slot allocator (requests get slots from
    :meth:`alloc_device`; a second cache over the same pool is refused while
    this one lives), the host pool's allocator, and a transfer engine
    (``transfer_engine`` overrides the one built from ``config.io_backend``).
    ``storage``: a :class:`~kvtier.storage.tier.StorageTier` behind the host tier
    (:mod:`.storage`), whose owner closes it; or ``storage_hook``, where evicted host
    pages are offered instead (not both).
    """

    def __init__(self, device_pool, host_pool=None, config: CacheConfig | None = None, *,
                 storage_hook: StorageHook | None = None, transfer_engine=None, storage=None):
        config = CacheConfig(page_size=device_pool.page_size) if config is None else config
        check_pools(device_pool, host_pool, config, transfer_engine)
        check_storage(storage, host_pool, storage_hook)
        self.device_pool, self.host_pool = device_pool, host_pool
        claim_device_pool(device_pool, self)
        self.config = config
        self.page_size = ps = config.page_size
        if host_pool is not None and transfer_engine is None:
            transfer_engine = TransferEngine(host_pool, config.io_backend)
        self.engine = transfer_engine
        # Keys name a page's bytes in the storage tier's one canonical order: no host layout in them.
        self.salt = device_pool.spec.salt("canonical", ps) + b"|model=" + config.model_id.encode()
        self.keys = ChainKeys(self.salt, config.key_hash, ps)
        self._lock = threading.RLock()
        self.tree = RadixTree(ps)
        self.eviction_policy, self.write_policy = make_policies(config)
        self.metrics = CacheMetrics(lambda: cache_state(self), self._lock)
        self.tiers = Tiers(device_pool, host_pool, config, self.tree, self.eviction_policy,
                           self.write_policy, self.metrics, transfer_engine, storage_hook, self.keys)
        self.storage = None
        if storage is not None:
            self.storage = CacheStorage(storage, config, host_pool, self.tree, self.tiers, self.keys, self.metrics)
            self.tiers.storage_hook = self.tiers.storage = self.storage
            self.metrics.attach(storage.metrics.registry)

    # -- device slots for requests -------------------------------------------

    def alloc_device(self, n_tokens: int) -> torch.Tensor | None:
        """``n_tokens`` device slots (whole pages), evicting unlocked cached pages if needed.

        None when even eviction cannot make room (backpressure: retry after
        requests finish, or preempt one).
        """
        n_pages = pages_of(n_tokens, "n_tokens", self.page_size)
        with self._lock:
            self._poll()
            pages = self.tiers.alloc_request(n_pages)
            if pages is None:
                self.metrics.backpressure["alloc_device"].inc()
                return None
            return tokens_of(pages, self.page_size)

    def free_device(self, slots) -> None:
        """Give back slots from :meth:`alloc_device` that were not handed to :meth:`insert`."""
        pages = self._slot_pages(as_slots(slots), "slots")
        if pages.repeated() is not None:
            raise ValueError(f"slots names page {pages.repeated()} twice; give each page once")
        with self._lock:
            if len(pages.pages):
                self.tiers.free_request(pages.pages)

    # -- matching and locking -------------------------------------------------

    def match_prefix(self, token_ids, namespace: str = "default", lock: bool = False,
                     count: bool = True) -> MatchResult:
        """The longest cached whole-page prefix of ``token_ids`` in ``namespace``.

        ``lock=True`` also locks ``node`` under the same lock hold; with more
        than one thread matching and evicting, a separate :meth:`lock` call
        could come after another thread evicted the match. ``count=False``
        leaves the query and its hits out of the metrics, for a caller that
        may give the match up and ask again (a scheduler that finds no room):
        it calls :meth:`count_match` once the request goes ahead. With a
        storage tier, the query's whole pages past the match are looked up in
        the store (the store is asked outside the cache's lock) and a prefetch
        of those it holds into host pages starts: ``storage_len`` tokens.
        """
        tokens = as_tokens(token_ids)
        check_namespace(namespace)
        storage = self.storage
        with self._lock:
            match = self._match(tokens, namespace, count)
            keys = storage.wanted(match, tokens) if storage is not None else []
            if not keys:
                if not lock:
                    self.tree.unlock(match.node)  # (a root left empty is dropped)
                return match
        found = storage.lookup(match.node, keys)
        with self._lock:
            try:
                return storage.start(match, tokens, keys, found)
            finally:
                if not lock:
                    self.tree.unlock(match.node)

    def _match(self, tokens, namespace: str, count: bool) -> MatchResult:
        """:meth:`match_prefix` in the tree, its node locked."""
        self._poll()
        root = self._root(namespace)
        path, matched = self.tree.walk_split(root, tokens)
        n_dev = ready_prefix(path)
        dev_pages = concat([n.device for n in path[:n_dev]])
        host_len = matched - len(dev_pages) * self.page_size
        load_len = load_tokens(path[n_dev:])
        stored = sum(len(n) for n in path[n_dev:] if n.device is None and n.from_storage)
        node = path[-1] if path else root
        # Locked before the hot pages' backup, which may evict host pages for room: the
        # match's own host part must not be among them (it is reported cached).
        self.tree.lock(node)
        try:
            if count:
                self._hit(path, n_dev, len(tokens), matched - load_len, load_len, stored)
        except BaseException:
            self.tree.unlock(node)  # the caller gets no node to unlock
            raise
        return MatchResult(tokens_of(dev_pages, self.page_size), host_len, node, namespace, load_len, stored)

    def count_match(self, match: MatchResult, n_tokens: int) -> None:
        """What :meth:`match_prefix` does for a hit, for a match made with ``count=False`` (and
        still locked): the query and its hits counted, the path touched (recency, and the hits
        that eviction and ``write_through_selective`` go by), its hot device pages backed up.
        ``n_tokens``: the query's length, at least what it matched."""
        found = match.total_len
        if not is_int(n_tokens) or n_tokens < found:
            raise ValueError(f"n_tokens must be the query's length, an integer >= the {found} tokens it matched, "
                             f"got {n_tokens!r}")
        with self._lock:
            check_node(self.tree, match.node)
            path = self.tree.path_to(match.node)
            # As the match found them (a load_back since may have brought the host part over).
            host = match.host_only_len
            self._hit(path, ready_prefix(path), n_tokens, match.total_len - host, host, match.stored_len)

    def _hit(self, path: list[Node], n_dev: int, n_tokens: int, on_device: int, host_only: int,
             stored: int = 0) -> None:
        """A query of ``n_tokens`` matched ``path`` (its first ``n_dev`` nodes ready on the
        device): ``on_device`` tokens found there (after a page still loading, a page on the
        device is a device hit), ``host_only`` on the host only, ``stored`` of them read from storage."""
        self.tree.touch(path, hit=True)
        self._count_match(n_tokens, on_device, host_only, stored)
        self._backup_hot(path[:n_dev])

    def lock(self, node: Node) -> None:
        """Hold every node from the root to ``node``: none of them is evicted until unlocked."""
        with self._lock:
            check_node(self.tree, node)
            self.tree.lock(node)

    def unlock(self, node: Node) -> None:
        with self._lock:
            check_node(self.tree, node)
            # A node's own locks (a lock on a longer match holds this node too, but is that
            # match's to release).
            if node.parent is None and node.own_locks <= 0:
                return  # an empty match's root, not locked: nothing to release (locks there hold nothing)
            if node.own_locks <= 0:
                raise ValueError("unlock without a matching lock: this node is not locked by its own lock "
                                 "(unlock the node lock() or match_prefix(lock=True) gave you, once)")
            self.tree.unlock(node)
            if self.tiers.stale:
                self.tiers.reap_stale()  # a failed load's pages this lock held

    # -- insert ----------------------------------------------------------------

    def insert(self, token_ids, device_indices, namespace: str = "default") -> int:
        """Cache the full pages of ``token_ids`` whose KV sits in ``device_indices``.

        ``device_indices[i]`` holds the KV of ``token_ids[i]``; only whole
        pages are inserted, the partial last page stays the caller's. Slots
        of new pages pass to the tree; slots of pages the tree already holds
        on the device are freed unless they are the tree's own; pages the
        tree holds only on the host adopt the caller's slots. Returns how
        many tokens were cached before. Raises before changing anything if a
        slot is not the caller's (from alloc_device, or the tree's slot for
        that very page) or names a page twice.

        ``token_ids``: a list (kept as list slices; compared without
        converting it), a numpy array or a CPU tensor (kept as int64 copies).
        Costs O(tokens) at C speed, and no hashing (:mod:`.hashing`).
        """
        tokens = as_tokens(token_ids)
        check_namespace(namespace)
        slots = as_slots(device_indices)
        if len(slots) > len(tokens):
            raise ValueError(f"{len(slots)} device_indices for only {len(tokens)} token_ids")
        n_full = len(slots) // self.page_size * self.page_size
        with self._lock:
            root = self._root(namespace)
            try:
                path, matched, partial = self.tree.walk(root, tokens, n_full)
                held = matched + (partial[1] if partial is not None else 0)
                head, new = insert_pages(path, partial, slots[:n_full], held, self.tiers.owner, self.page_size,
                                         self.tiers.device_alloc.size, self.config.check_slots)
                if partial is not None:
                    path.append(self.tree.split(*partial))
                    matched += partial[1]
                if head is not None:
                    self._absorb(path, head.pages)
                if matched < n_full:
                    self._add_leaf(path[-1] if path else root, stored(tokens, matched, n_full), new)
                else:
                    self.tree.touch(path, hit=False)
                return matched
            finally:
                self.tree.drop_if_empty(root)  # nothing inserted (no whole page, or refused)

    def _absorb(self, path: list[Node], pages: np.ndarray) -> None:
        """Matched nodes: free the caller's duplicate pages, or adopt them where the device lacks the node."""
        start = 0
        for node in path:
            mine = pages[start : start + len(node) // self.page_size]
            start += len(mine)
            if node.device is None:
                self.tiers.owner[mine] = TREE
                self.tree.set_device(node, mine, ready=True)
                continue
            dup = mine[mine != node.device]
            if len(dup):
                self.tiers.release_device(dup)

    def _add_leaf(self, parent: Node, tokens, pages: PageRuns) -> None:
        leaf = self.tree.add_leaf(parent, tokens)
        pages.mark(self.tiers.owner, TREE)
        self.tree.set_device(leaf, pages.pages, ready=True)
        self.tree.touch(self.tree.path_to(leaf), hit=False)
        if self.engine is not None and self.write_policy.backup_on_insert(leaf):
            self._optional_backup([leaf])

    def _optional_backup(self, nodes: list[Node]) -> None:
        """A backup the cache may go without (write-through, a hot page's): one that fails to
        start (its engine raised) is skipped and counted, not raised from an insert or a match
        that has already changed the tree."""
        try:
            self.tiers.start_backup(nodes)
        except Exception as e:  # noqa: BLE001 - counted and logged; the data stays on the device
            self.metrics.backups_skipped["error"].inc()
            logger.warning("a backup of %d cached tokens was not started: %s", sum(len(n) for n in nodes), e)

    # -- host -> device --------------------------------------------------------

    def load_back(self, match: MatchResult, storage_tokens: int | None = None) -> LoadResult | None:
        """Bring the match's host part and storage part onto the device; ``match.node`` must be locked.

        The storage part (``match.storage_len``, at most ``storage_tokens`` of it: the advice's
        split) is waited for as ``storage_prefetch`` says, outside the cache's lock; what arrived
        joins the tree and is loaded with the host part, and the request's lock moves down to its
        deepest node (``LoadResult.node``: unlock that one). Returns the whole prefix's device slots
        and the per-layer completion, or None when the device has no room even after eviction (the
        lock stays on ``match.node``; what arrived stays on the host). A load that fails raises
        :class:`~.types.LoadFailedError` from every wait of its ``layer_load``: the request
        unlocks, then matches again; the cache keeps the host copy and goes on.
        """
        want = self.storage.pages_wanted(match, storage_tokens) if self.storage is not None else 0
        if want:
            self.storage.wait(match.prefetch, want)
        with self._lock:
            node = match.node
            check_node(self.tree, node)
            self._poll()  # a load that failed since is retired here: its pages are loaded again below
            ext = self.storage.claim(match, want) if want else []
            if node.parent is not None and node.lock_ref == 0:
                raise ValueError("lock(match.node) before load_back: an unlocked match may be evicted meanwhile")
            if not ext or node.own_locks <= 0:  # (no lock of the caller's own at node to move down)
                return self._load(node, [])
            self.tree.lock(ext[-1])
            self.tree.unlock(node)
            result = self._load(ext[-1], ext)
            if result is None:
                self.tree.lock(node)
                self.tree.unlock(ext[-1])
            return result

    def _load(self, node: Node, ext: list[Node]) -> LoadResult | None:
        """Load the path to ``node`` (locked) onto the device; ``ext``: its nodes from storage."""
        path = self.tree.path_to(node)
        rest = path[ready_prefix(path):]
        to_load = [n for n in rest if n.device is None or n.stale]
        # Pages still being loaded are waited for; a ready page's op, if any, is a backup
        # reading it (it has no layers to wait on, and the load does not need it).
        pending = list({id(n.op): n.op for n in rest
                        if n.device is not None and not n.device_ready and n.op is not None}.values())
        if to_load:
            op = self.tiers.start_load(to_load)
            if op is None:
                self.metrics.backpressure["load_back"].inc()
                return None
            pending.append(op)
        from_storage = self.storage.loaded(to_load, ext) if self.storage is not None else 0
        layer_load = CacheLoad(pending, self.device_pool.layer_num)
        dev = tokens_of(concat([n.device for n in path]), self.page_size)
        self.tiers.poll()  # what finished meanwhile (on the CPU: this load)
        return LoadResult(dev, layer_load, sum(len(n) for n in to_load), node, from_storage)

    def advise(self, match: MatchResult, prefill_seconds_per_token: float) -> Advice:
        """Load the match's host part, or recompute it? And how much of its storage part? From the
        measured bandwidths and the caller's prefill estimate (:func:`.storage.advise_match`)."""
        v = prefill_seconds_per_token
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"prefill_seconds_per_token must be a finite number >= 0, got {v!r}")
        with self._lock:
            return advise_match(match, float(v), self.tiers.meters[LOAD], self.tiers.token_bytes, self.config,
                                self.metrics, self.storage)

    # -- housekeeping ------------------------------------------------------------

    def poll(self) -> int:
        """Complete finished backups and loads, and storage prefetches done or past their deadline
        (their pages join the host tier); returns how many transfers completed."""
        with self._lock:
            return self._poll()

    def _poll(self) -> int:
        """:meth:`poll` under the lock, where no call holds nodes it is working on (a prefetch
        joining the tree may split one)."""
        done = self.tiers.poll() if len(self.tiers.inflight) else 0
        if self.storage is not None:
            self.storage.poll()
        return done

    def evict_device(self, n_tokens: int) -> int:
        """Free at least ``n_tokens`` device slots of unlocked cached pages if possible; returns slots freed."""
        want = pages_of(n_tokens, "n_tokens", self.page_size, round_up=True)
        with self._lock:
            free = self.tiers.device_alloc.available_pages
            start = free()
            self._poll()  # transfers that finished: their pages may go now
            self.tiers.evict_device(want)
            while free() - start < want and len(self.tiers.inflight):
                self.tiers.wait_oldest()  # demotions landing (or failing: then dropped)
                self.tiers.evict_device(want - (free() - start))
            return max(free() - start, 0) * self.page_size

    def evict_host(self, n_tokens: int) -> int:
        """Free up to ``n_tokens`` host slots (rounded up to pages); returns slots freed."""
        want = pages_of(n_tokens, "n_tokens", self.page_size, round_up=True)
        with self._lock:
            if self.host_pool is None:
                return 0
            self._poll()
            return self.tiers.evict_host(want) * self.page_size

    def flush(self, timeout: float | None = None, save_host: bool = False) -> bool:
        """Complete what is in flight: every transfer, and every storage prefetch (those still
        reading stop; what arrived joins the host tier); the write-through backlog saved (waiting
        for room in the storage tier's queue); with ``save_host``, save every page the
        host tier holds to storage (write-back at shutdown); then wait until the storage tier has
        written every save queued. True once all is written (False: ``timeout`` s passed first)."""
        with self._lock:
            self.tiers.wait_all()
            if self.storage is not None:
                for pf in list(self.storage.pending.values()):
                    self.storage.settle(pf)
                self.storage.drain(wait=True)
                if save_host:
                    self.storage.save_host()
        return self.storage is None or self.storage.tier.flush(timeout)

    def clear(self) -> None:
        """Stop storage prefetches in flight (their pages freed), wait for transfers in flight
        (retiring any that failed), then drop every cached page of both tiers.

        Slots requests hold (from alloc_device) stay theirs. Raises if a node
        is still locked, before changing anything else.
        """
        with self._lock:
            if self.storage is not None:
                self.storage.drop_all()  # (their locks on the nodes they continue go with them)
            if self.tree.locked_nodes:
                raise RuntimeError(
                    f"{self.tree.locked_nodes} cached nodes are locked; unlock every matched node before clear()"
                )
            self.tiers.wait_all()
            self.tiers.free_everything()
            self.tree.reset()

    def check(self) -> None:
        """Verify the cache's invariants; raise :class:`~kvtier.validate.InvariantError` naming the
        first one broken. For tests and debugging: O(cached pages), under the cache's lock."""
        with self._lock:
            check_cache(self)

    def device_free_tokens(self) -> int:
        """Slots alloc_device can hand out: free ones plus unlocked cached ones it may evict."""
        with self._lock:  # one consistent reading of counters another thread may be changing
            return self.tiers.device_room() * self.page_size

    def host_free_tokens(self) -> int:
        """Host slots free or held by unlocked cached pages (0 without a host pool)."""
        with self._lock:
            return self.tiers.host_room() * self.page_size

    # -- chain keys (the storage tier's page names: hashing.py) --------------------

    def page_hashes(self, token_ids, namespace: str = "default") -> list[bytes]:
        """The chain keys of every whole page of ``token_ids``; cached pages' are computed once
        and kept on their nodes."""
        tokens = as_tokens(token_ids)
        check_namespace(namespace)
        with self._lock:
            return self.keys.of_query(self.tree, namespace, tokens)

    def chain_keys(self, node: Node) -> list[bytes]:
        """The chain keys of ``node``'s pages (a ``MatchResult.node``; [] for a root): what the
        storage tier stores them under. Computed on first use, with any of its ancestors'
        that are missing, and kept."""
        with self._lock:
            check_node(self.tree, node)
            return [] if node.parent is None else list(self.keys.of_node(node))

    def chain_keys_after(self, match: MatchResult, token_ids) -> list[bytes]:
        """The chain keys of the whole pages of ``token_ids`` (the query ``match`` was made of)
        past the match: what a storage lookup asks for. Chained from the key of the match's
        last page, which is computed and kept if it is missing."""
        tokens = as_tokens(token_ids)
        if len(tokens) < match.total_len:
            raise ValueError(f"token_ids holds {len(tokens)} tokens, fewer than the {match.total_len} the match "
                             "covers; pass the query the match was made of")
        with self._lock:
            check_node(self.tree, match.node)
            prev = self.keys.of_node(match.node)[-1]
            return self.keys.chain(prev, tokens[match.total_len :])

    # -- internals -----------------------------------------------------------------

    def _root(self, namespace: str) -> Node:
        return self.tree.root(namespace, create=True)

    def _count_match(self, n_tokens: int, device: int, host: int, stored: int = 0) -> None:
        m = self.metrics
        m.query_tokens.inc(n_tokens - n_tokens % self.page_size)
        for tier, n in (("device", device), ("host", host - stored), ("storage", stored)):
            if n:
                m.hit_tokens[tier].inc(n)

    def _backup_hot(self, device_path: list[Node]) -> None:
        if self.engine is None:
            return
        hot = [n for n in device_path if n.host is None and n.op is None and self.write_policy.backup_on_hit(n)]
        if hot:
            self._optional_backup(hot)

    def _slot_pages(self, slots, name: str) -> PageRuns:
        try:
            return PageRuns.of_slots(slots, self.page_size, self.tiers.device_alloc.size)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
