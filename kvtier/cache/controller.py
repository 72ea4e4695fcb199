"""HiCache: the hierarchical prefix cache a serving engine talks to.

One lock guards the tree and the tiers, so a scheduler thread can match,
insert and lock while another thread polls for completed transfers.
Expected outcomes are return values (``None`` from :meth:`alloc_device`
and :meth:`load_back` when even eviction cannot make room); misuse raises
before anything changes.

A request's life::

    m = cache.match_prefix(tokens)          # device part + host extension
    cache.lock(m.node)                      # nothing on the path is evicted now
    r = cache.load_back(m)                  # host part -> device, layer by layer
    own = cache.alloc_device(n)             # slots for the tokens it computes
    ...                                     # attention waits on r.layer_load
    cache.insert(tokens, slots)             # the tree takes the full pages
    cache.free_device(partial_page_slots)
    cache.unlock(m.node)
"""

from __future__ import annotations

import logging
import math
import threading

import numpy as np
import torch

from ..transfer.engine import TransferEngine
from .advisor import Advice, advise
from .config import CacheConfig
from .hashing import ChainKeys
from .inflight import LOAD, CacheLoad
from .invariants import check_cache
from .metrics import CacheMetrics
from .policy import make_policies
from .radix import Node, RadixTree, load_tokens, ready_prefix, stored
from ..validate import check_namespace, is_int
from .checks import PageRuns, as_slots, as_tokens, check_insert_pages, check_pools, claim_device_pool
from .tiers import REQUEST, TREE, Tiers, concat, tokens_of
from .types import LoadResult, MatchResult, StorageHook

logger = logging.getLogger("kvtier")


class HiCache:
    """A radix-tree prefix cache over a device pool and, optionally, a host pool.

    ``host_pool=None`` makes a device-only prefix cache. The cache owns the
    device pool's slot allocator (requests get slots from
    :meth:`alloc_device`; a second cache over the same pool is refused while
    this one lives), the host pool's allocator, and a transfer engine
    (``transfer_engine`` overrides the one built from ``config.io_backend``).
    """

    def __init__(self, device_pool, host_pool=None, config: CacheConfig | None = None, *,
                 storage_hook: StorageHook | None = None, transfer_engine=None):
        config = CacheConfig(page_size=device_pool.page_size) if config is None else config
        check_pools(device_pool, host_pool, config, transfer_engine)
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
        self.metrics = CacheMetrics(self._state, self._lock)
        self.tiers = Tiers(device_pool, host_pool, config, self.tree, self.eviction_policy,
                           self.write_policy, self.metrics, transfer_engine, storage_hook, self.keys)

    # -- device slots for requests -------------------------------------------

    def alloc_device(self, n_tokens: int) -> torch.Tensor | None:
        """``n_tokens`` device slots (whole pages), evicting unlocked cached pages if needed.

        None when even eviction cannot make room (backpressure: retry after
        requests finish, or preempt one).
        """
        n_pages = self._pages_of(n_tokens, "n_tokens")
        with self._lock:
            self.tiers.poll()
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
        it calls :meth:`count_match` once the request goes ahead.
        """
        tokens = as_tokens(token_ids)
        check_namespace(namespace)
        with self._lock:
            if len(self.tiers.inflight):
                self.tiers.poll()
            root = self._root(namespace)
            path, matched, partial = self.tree.walk(root, tokens)
            if partial is not None:
                path.append(self.tree.split(*partial))
                matched += partial[1]
            n_dev = ready_prefix(path)
            dev_pages = concat([n.device for n in path[:n_dev]])
            host_len = matched - len(dev_pages) * self.page_size
            load_len = load_tokens(path[n_dev:])
            node = path[-1] if path else root
            # Locked before the hot pages' backup, which may evict host pages for room: the
            # match's own host part must not be among them (it is reported cached).
            self.tree.lock(node)
            try:
                if count:
                    self._hit(path, n_dev, len(tokens), matched - load_len, load_len)
            except BaseException:
                self.tree.unlock(node)  # the caller gets no node to unlock
                raise
            if not lock:
                self.tree.unlock(node)  # (a root left empty is dropped)
            return MatchResult(tokens_of(dev_pages, self.page_size), host_len, node, namespace, load_len)

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
            self._check_node(match.node)
            path = self.tree.path_to(match.node)
            # As the match found them (a load_back since may have brought the host part over).
            host = match.host_only_len
            self._hit(path, ready_prefix(path), n_tokens, match.total_len - host, host)

    def _hit(self, path: list[Node], n_dev: int, n_tokens: int, on_device: int, host_only: int) -> None:
        """A query of ``n_tokens`` matched ``path`` (its first ``n_dev`` nodes ready on the
        device): ``on_device`` tokens found there (after a page still loading, a page on the
        device is a device hit), ``host_only`` on the host only."""
        self.tree.touch(path, hit=True)
        self._count_match(n_tokens, on_device, host_only)
        self._backup_hot(path[:n_dev])

    def lock(self, node: Node) -> None:
        """Hold every node from the root to ``node``: none of them is evicted until unlocked."""
        with self._lock:
            self._check_node(node)
            self.tree.lock(node)

    def unlock(self, node: Node) -> None:
        with self._lock:
            self._check_node(node)
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
        pages = self._slot_pages(slots[:n_full], "device_indices", self.config.check_slots)
        with self._lock:
            root = self._root(namespace)
            try:
                path, matched, partial = self.tree.walk(root, tokens, n_full)
                new = check_insert_pages(path, partial, pages, self.tiers.owner, self.page_size)
                if partial is not None:
                    path.append(self.tree.split(*partial))
                    matched += partial[1]
                self._absorb(path, pages.pages)
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

    def load_back(self, match: MatchResult) -> LoadResult | None:
        """Bring the match's host part onto the device; ``match.node`` must be locked.

        Returns the device slots of the whole matched prefix and the
        per-layer completion to wait on, or None when the device has no room
        even after eviction (nothing changed then). Where a load fails, its
        ``layer_load`` raises :class:`~.types.LoadFailedError` from every wait
        (``layer_load.failed``): the request unlocks its match and matches
        again; the cache keeps the host copy and goes on.
        """
        with self._lock:
            node = match.node
            self._check_node(node)
            if node.parent is not None and node.lock_ref == 0:
                raise ValueError("lock(match.node) before load_back: an unlocked match may be evicted meanwhile")
            self.tiers.poll()  # a load that failed since is retired here: its pages are loaded again below
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
            loaded = sum(len(n) for n in to_load)
            layer_load = CacheLoad(pending, self.device_pool.layer_num)
            dev = tokens_of(concat([n.device for n in path]), self.page_size)
            self.tiers.poll()  # what finished meanwhile (on the CPU: this load)
            return LoadResult(dev, layer_load, loaded)

    def advise(self, match: MatchResult, prefill_seconds_per_token: float) -> Advice:
        """Load the match's host part, or recompute it? From the measured load bandwidth."""
        v = prefill_seconds_per_token
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"prefill_seconds_per_token must be a finite number >= 0, got {v!r}")
        with self._lock:
            if match.host_len and not match.host_only_len:
                # Nothing to move: the host part is on the device behind a page another request is
                # loading; load_back waits for that load, which recomputing would not beat.
                return Advice(True, 0, 0, 0.0, match.host_len * float(v), self.tiers.meters[LOAD].bps)
            a = advise(match.host_only_len, self.tiers.token_bytes, self.tiers.meters[LOAD], float(v),
                       self.config.advisor_margin)
            if a.host_tokens:
                self.metrics.advice[a.decision].inc()
            return a

    # -- housekeeping ------------------------------------------------------------

    def poll(self) -> int:
        """Complete finished backups and loads; returns how many completed."""
        with self._lock:
            return self.tiers.poll()

    def evict_device(self, n_tokens: int) -> int:
        """Free at least ``n_tokens`` device slots of unlocked cached pages if possible; returns slots freed."""
        want = self._pages_of(n_tokens, "n_tokens", round_up=True)
        with self._lock:
            free = self.tiers.device_alloc.available_pages
            start = free()
            self.tiers.poll()  # transfers that finished: their pages may go now
            self.tiers.evict_device(want)
            while free() - start < want and len(self.tiers.inflight):
                self.tiers.wait_oldest()  # demotions landing (or failing: then dropped)
                self.tiers.evict_device(want - (free() - start))
            return max(free() - start, 0) * self.page_size

    def evict_host(self, n_tokens: int) -> int:
        """Free up to ``n_tokens`` host slots (rounded up to pages); returns slots freed."""
        want = self._pages_of(n_tokens, "n_tokens", round_up=True)
        with self._lock:
            if self.host_pool is None:
                return 0
            self.tiers.poll()
            return self.tiers.evict_host(want) * self.page_size

    def clear(self) -> None:
        """Wait for transfers in flight (retiring any that failed), then drop every cached page
        of both tiers.

        Slots requests hold (from alloc_device) stay theirs. Raises if a node
        is still locked, before changing anything.
        """
        with self._lock:
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
        if self.host_pool is None:
            return 0
        with self._lock:
            t = self.tree
            return (self.tiers.host_alloc.available_pages() + t.host_pages - t.host_locked_pages) * self.page_size

    # -- chain keys (the storage tier's page names: hashing.py) --------------------

    def page_hashes(self, token_ids, namespace: str = "default") -> list[bytes]:
        """The chain keys of every whole page of ``token_ids``; cached pages' are computed once
        and kept on their nodes."""
        tokens = as_tokens(token_ids)
        check_namespace(namespace)
        with self._lock:
            root = self.tree.root(namespace)
            if root is None:  # nothing cached in it: no root made for a read
                return self.keys.chain(self.keys.seed(namespace), tokens)
            path, matched, partial = self.tree.walk(root, tokens)
            known = [h for n in path for h in self.keys.of_node(n)]
            if partial is not None:
                known += self.keys.of_node(partial[0])[: partial[1] // self.page_size]
                matched += partial[1]
            prev = known[-1] if known else self.keys.of_node(root)[-1]
            return known + self.keys.chain(prev, tokens[matched:])

    def chain_keys(self, node: Node) -> list[bytes]:
        """The chain keys of ``node``'s pages (a ``MatchResult.node``; [] for a root): what the
        storage tier stores them under. Computed on first use, with any of its ancestors'
        that are missing, and kept."""
        with self._lock:
            self._check_node(node)
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
            self._check_node(match.node)
            prev = self.keys.of_node(match.node)[-1]
            return self.keys.chain(prev, tokens[match.total_len :])

    # -- internals -----------------------------------------------------------------

    def _root(self, namespace: str) -> Node:
        return self.tree.root(namespace, create=True)

    def _count_match(self, n_tokens: int, device: int, host: int) -> None:
        m = self.metrics
        m.query_tokens.inc(n_tokens - n_tokens % self.page_size)
        if device:
            m.hit_tokens["device"].inc(device)
        if host:
            m.hit_tokens["host"].inc(host)

    def _backup_hot(self, device_path: list[Node]) -> None:
        if self.engine is None:
            return
        hot = [n for n in device_path if n.host is None and n.op is None and self.write_policy.backup_on_hit(n)]
        if hot:
            self._optional_backup(hot)

    def _check_node(self, node) -> None:
        if not isinstance(node, Node):
            raise TypeError(f"expected a MatchResult.node, got {type(node).__name__}")
        if not node.alive:
            raise ValueError("this node was evicted from the cache; match_prefix again")
        top = node
        while top.parent is not None:
            top = top.parent
        if self.tree.roots.get(top.namespace) is top:
            return
        # An empty match's root, dropped while its namespace held nothing (RadixTree.drop_if_empty).
        if not (top is node and not node.children and node.owner is self.tree):
            raise ValueError("this node belongs to another cache (or one cleared since); match_prefix again")

    def _pages_of(self, n_tokens, name: str, round_up: bool = False) -> int:
        if not isinstance(n_tokens, (int, np.integer)) or isinstance(n_tokens, bool) or n_tokens < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {n_tokens!r}")
        if round_up:
            return -(-int(n_tokens) // self.page_size)
        if n_tokens % self.page_size:
            up = -(-int(n_tokens) // self.page_size) * self.page_size
            raise ValueError(f"{name}={n_tokens} is not a multiple of page_size={self.page_size}; ask for {up}")
        return int(n_tokens) // self.page_size

    def _slot_pages(self, slots, name: str, whole: bool = True) -> PageRuns:
        try:
            return PageRuns.of_slots(slots, self.page_size, self.tiers.device_alloc.size, whole)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    def _state(self) -> dict:
        with self._lock:
            t, ps, tiers = self.tree, self.page_size, self.tiers
            tokens = {
                ("device", "cached"): t.device_pages * ps, ("device", "locked"): t.device_locked_pages * ps,
                ("device", "free"): tiers.device_alloc.available_pages() * ps,
                ("device", "request"): int((tiers.owner == REQUEST).sum()) * ps,
                ("host", "cached"): t.host_pages * ps, ("host", "locked"): t.host_locked_pages * ps,
                ("host", "free"): tiers.host_alloc.available_pages() * ps if tiers.host_alloc else 0,
            }
            depth = {k: tiers.inflight.depth(k) for k in ("backup", "load")}
            bw = {k: m.bps for k, m in tiers.meters.items()}
            return {"tokens": tokens, "queue_depth": depth, "bandwidth": bw}

