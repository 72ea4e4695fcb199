"""The mechanism under the tree: allocators, transfers and eviction for both tiers.

:class:`Tiers` owns the device page allocator, the host pool's allocator
and the transfer engine. It moves pages between tiers on the tree's
behalf: every transfer is prepared (pages allocated, recorded on the nodes
as not ready, an :class:`~.inflight.Op` queued) and completed when its
handle reports done (pages marked ready). A page is freed only when no op
touches it: nodes with an op are never evicted.

Device page ownership is tracked per page (free / held by a request /
held by the tree), so a request cannot free a page the tree owns, and the
tree never adopts a page nobody allocated. Not thread-safe on its own:
the cache calls it under its lock.

A transfer that fails is retired, never raised to the caller of a later
call (:meth:`Tiers._failed`), and eviction settles the tree before it
offers pages to the storage hook, which may therefore call back into the
cache (:meth:`Tiers.flush_offers`).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np
import torch

from ..allocator import PageAllocator, pages_to_tokens
from .policy import BandwidthMeter
from .inflight import BACKUP, LOAD, InFlight, Op, settle
from .policy import Victims
from .radix import Node, RadixTree

FREE, REQUEST, TREE = 0, 1, 2
# How deep offers to the storage hook nest (an offer that evicts, whose pages are offered from
# inside it, ...); deeper ones wait for the offer running below them to return.
MAX_OFFER_DEPTH = 4

logger = logging.getLogger("kvtier")


def tokens_of(pages: np.ndarray, page_size: int) -> torch.Tensor:
    """Page ids (device pages are int32) -> an int64 CPU tensor of their token slots."""
    return torch.from_numpy(pages_to_tokens(pages.astype(np.int64, copy=False), page_size))


def concat(arrays: list[np.ndarray]) -> np.ndarray:
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)


class Tiers:
    def __init__(self, device_pool, host_pool, config, tree: RadixTree, eviction, writer, metrics,
                 engine, storage_hook=None, keys=None):
        self.ps = config.page_size
        self.keys = keys  # a ChainKeys: a backed-up page gets its key (for storage) as its backup starts
        self.tree, self.eviction, self.writer, self.metrics = tree, eviction, writer, metrics
        self.device_alloc = PageAllocator(device_pool.size, self.ps)
        self.owner = np.zeros(self.device_alloc.num_pages, dtype=np.int8)
        assert self.device_alloc.num_pages < 2**31, "device page ids are kept as int32"
        self.host_alloc = host_pool.allocator if host_pool is not None else None
        self.engine = engine
        self.storage_hook = storage_hook
        self.storage = None  # a CacheStorage, told of backups that landed (the controller sets it)
        self.inflight = InFlight(config.max_inflight_backups, config.max_inflight_loads)
        self.meters = {d: BandwidthMeter(config.bandwidth_ewma) for d in (BACKUP, LOAD)}
        if config.load_gbps_prior:
            self.meters[LOAD].bps = config.load_gbps_prior * 1e9
        self.token_bytes = device_pool.spec.bytes_per_token
        self.stale: dict[Node, None] = {}  # nodes a failed load may have left stale (Node.stale)
        # Host pages taken from the tree, waiting to be offered to the storage hook, then freed.
        self.offers: deque[tuple[list[bytes], np.ndarray]] = deque()
        self.in_offer: list[np.ndarray] = []  # the pages of the offer calls running now
        # Safety net against a livelock of wait-and-evict rounds (never reached in tests).
        self.max_rounds = 4 * (config.max_inflight_backups + config.max_inflight_loads) + 16

    # -- device pages for requests ----------------------------------------

    def alloc_request(self, n_pages: int) -> np.ndarray | None:
        pages = self.obtain_device(n_pages)
        if pages is not None:
            self.owner[pages] = REQUEST
        return pages

    def free_request(self, pages: np.ndarray) -> None:
        held = self.owner[pages] == REQUEST
        if not held.all():
            bad = int(pages[int(np.argmin(held))])
            state = "cached in the tree" if self.owner[bad] == TREE else "not allocated"
            raise ValueError(
                f"device page {bad} is {state}; free_device takes only slots from alloc_device "
                "that were not handed to insert"
            )
        self.release_device(pages)

    def release_device(self, pages: np.ndarray) -> None:
        self.owner[pages] = FREE
        self.device_alloc.free_pages(pages)

    # -- getting room ------------------------------------------------------

    def obtain_device(self, n_pages: int) -> np.ndarray | None:
        """``n_pages`` free device pages, evicting (and waiting for demotions) as needed; None,
        with nothing evicted, where the unlocked cached pages would not make room either."""
        if self.device_room() < n_pages:
            return None
        for _ in range(self.max_rounds):
            pages = self.device_alloc.alloc_pages(n_pages)
            if pages is not None:
                return pages
            self.evict_device(n_pages - self.device_alloc.available_pages())
            if self.device_alloc.available_pages() >= n_pages:
                continue
            if not len(self.inflight):
                return None
            self.wait_oldest()
        return None

    def device_room(self) -> int:
        """Device pages free, or held by unlocked cached pages that eviction may free."""
        t = self.tree
        return self.device_alloc.available_pages() + t.device_pages - t.device_locked_pages

    def host_room(self) -> int:
        """Host pages free, or held by unlocked cached pages (0 without a host pool)."""
        t = self.tree
        return self.host_alloc.available_pages() + t.host_pages - t.host_locked_pages if self.host_alloc else 0

    def obtain_host(self, n_pages: int, keep_device_copies: bool = False) -> np.ndarray | None:
        """``n_pages`` free host pages, evicting host copies as needed.

        ``keep_device_copies``: evict only host-only pages, never the host copy
        of a page still on the device. A demotion needs this: taking another
        device page's host copy to make room would only make that page the
        next one to demote, and two such pages can take each other's room
        forever while the device never frees a page.
        """
        pages = self.host_alloc.alloc_pages(n_pages)
        if pages is None:
            short = n_pages - self.host_alloc.available_pages()
            if self.host_reclaimable(keep_device_copies) < short:
                return None  # evicting would lose cached pages and still not make room
            self.evict_host(short, keep_device_copies)
            pages = self.host_alloc.alloc_pages(n_pages)
        return pages

    def host_reclaimable(self, keep_device_copies: bool = False) -> int:
        """Host pages :meth:`evict_host` could free now, all of them: host copies of device
        nodes (unless ``keep_device_copies``), and host-only nodes whose whole subtree can go
        (their descendants are host-only too: device residency is closed under ancestors)."""
        gone: dict[Node, bool] = {}  # host-only node -> removable with its subtree
        total = 0
        for n in reversed(list(self.tree.nodes())):  # children before parents
            if n.host is None:
                continue
            free = n.host_ready and n.op is None and n.lock_ref == 0
            if n.device is None:
                free = gone[n] = free and all(gone.get(c, False) for c in n.children.values())
            elif keep_device_copies or not n.device_ready:
                free = False  # (a stale node's host copy is its only valid one)
            total += len(n.host) if free else 0
        return total

    # -- device eviction -----------------------------------------------------

    @staticmethod
    def device_evictable(node: Node) -> bool:
        """Unlocked device leaves with no op: ready, or stale (a stale node has a host copy)."""
        return (node.alive and node.device is not None and node.op is None
                and node.lock_ref == 0 and node.dev_children == 0)

    def evict_device(self, n_pages: int) -> int:
        """Free up to ``n_pages`` device pages now; returns how many were freed.

        Victims are unlocked device leaves, in policy order. One with a host
        copy just leaves the device; one the write policy wants kept gets a
        backup started (it is freed by a later call, once the copy landed, and
        counts toward ``n_pages`` here, so no more backups start than the
        pages asked for); anything else, and one whose backup could not start
        (no host room, or the engine raised: counted), is dropped with its
        host-only subtree.
        """
        victims = Victims(self.eviction.key, self.tree.device_nodes, self.device_evictable)
        freed = pending = 0  # pending: pages of the demotions started here, freed once they land
        while freed + pending < n_pages and (node := victims.pop()) is not None:
            parent = node.parent
            if node.host is not None:
                freed += self._demoted(node)
            elif self.engine is not None and self.writer.demote_on_evict(node) and self._demote(node):
                pending += len(node.device)  # (demoted_tokens counts it when it lands: poll)
                continue
            elif self.device_evictable(node):  # (a storage hook called back meanwhile may have locked it)
                freed += self.drop_subtree(node)
            victims.offer(parent)
            self.flush_offers()
        return freed

    def _demote(self, node: Node) -> bool:
        """Start a demotion's backup; False where it cannot start (no room, or the engine raised:
        counted and logged, the victim is then dropped instead)."""
        try:
            return self.start_backup([node], demotion=True)
        except Exception as e:  # noqa: BLE001 - one failed copy must not stop eviction
            self.metrics.backups_skipped["error"].inc()
            logger.warning("a demotion of %d cached tokens was not started (dropped instead): %s", len(node), e)
            return False

    def _demoted(self, node: Node) -> int:
        pages = self.tree.drop_device(node)
        self.release_device(pages)
        self.metrics.evicted_tokens["device"].inc(len(pages) * self.ps)
        return len(pages)

    def drop_subtree(self, node: Node) -> int:
        """Remove ``node`` (a device leaf) and its host-only descendants; returns device pages freed."""
        stack, order = [node], []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        freed = 0
        for n in reversed(order):  # children before parents
            assert n.lock_ref == 0 and n.op is None
            if n.host is not None:
                self._free_host_of(n)
            if n.device is not None:
                freed += self._demoted(n)
            self.metrics.dropped_tokens.inc(len(n))
            self.tree.remove(n)
        return freed

    # -- host eviction ---------------------------------------------------------

    @staticmethod
    def host_evictable(node: Node) -> bool:
        """Ready host copies with no op and no lock: of a ready device node, or of a host-only
        leaf (never a stale node's: its host copy is the only valid one)."""
        return (node.alive and node.host is not None and node.host_ready and node.op is None
                and node.lock_ref == 0
                and (node.device_ready if node.device is not None else not node.children))

    def evict_host(self, n_pages: int, keep_device_copies: bool = False) -> int:
        """Free up to ``n_pages`` host pages: host copies of device nodes (unless
        ``keep_device_copies``), host-only leaves."""
        evictable = self.host_evictable
        if keep_device_copies:
            evictable = lambda n: self.host_evictable(n) and n.device is None  # noqa: E731
        victims = Victims(self.eviction.key, self.tree.host_nodes, evictable)
        freed = 0
        while freed < n_pages and (node := victims.pop()) is not None:
            freed += self._free_host_of(node)
            if node.device is None:
                parent = node.parent
                self.metrics.dropped_tokens.inc(len(node))
                self.tree.remove(node)
                victims.offer(parent)
            self.flush_offers()  # the tree is settled: the hook may call back into the cache
        return freed

    def _free_host_of(self, node: Node) -> int:
        """Take ``node``'s host pages from it: freed now, or, with a storage hook, queued to be
        offered (:meth:`flush_offers`) and freed after that."""
        hashes, pages = list(self.keys.of_node(node)), self.tree.drop_host(node)
        self.metrics.evicted_tokens["host"].inc(len(pages) * self.ps)
        if self.storage_hook is None:
            self.host_alloc.free_pages(pages)
        else:
            self.offers.append((hashes, pages))
        return len(pages)

    def flush_offers(self) -> None:
        """Offer the queued host pages to the storage hook, each page once, then free them.

        Called once the tree is settled, so that ``offer`` may call back into the cache. A
        nested call offers what its own evictions queued, up to :data:`MAX_OFFER_DEPTH` deep;
        deeper, the offers wait for the loop below to come back to them (no recursion without
        end where every offer evicts). A failing hook is counted and the pages freed all the same.
        """
        while self.offers and len(self.in_offer) < MAX_OFFER_DEPTH:
            hashes, pages = self.offers.popleft()
            self.in_offer.append(pages)
            self.metrics.storage_offered_pages.inc(len(pages))
            try:
                self.storage_hook.offer(hashes, tokens_of(pages, self.ps))
            except Exception as e:  # noqa: BLE001 - a storage tier's failure must not stop eviction
                self.metrics.storage_offer_failures.inc()
                logger.warning("the storage hook failed on %d host pages (freed all the same): %s", len(pages), e)
            finally:
                self.in_offer.pop()
                self.host_alloc.free_pages(pages)

    def held_for_offers(self) -> list[np.ndarray]:
        """Host pages taken from the tree and not yet offered and freed (queued, or being offered)."""
        return [pages for _, pages in self.offers] + self.in_offer

    # -- transfers ---------------------------------------------------------------

    def start_backup(self, nodes: list[Node], demotion: bool = False) -> bool:
        """Prepare and issue a backup of device-ready nodes; False (nothing changed) if no room.

        A full backup queue is waited on for a ``demotion`` (which the device
        needs, and which makes room on the host only from host-only pages),
        else the backup is skipped (a write-through copy).
        """
        if self.inflight.full(BACKUP):
            self.poll()
            while demotion and self.inflight.full(BACKUP):
                self.wait_oldest(BACKUP)
            if self.inflight.full(BACKUP):
                self.metrics.backups_skipped["queue_full"].inc()
                return False
        for n in nodes:  # every host page has its key (pure, kept: nothing to undo if the backup does not start)
            self.keys.of_node(n)
        dev = concat([n.device for n in nodes])
        host = self.obtain_host(len(dev), keep_device_copies=demotion)
        if host is None:
            self.metrics.backups_skipped["host_full"].inc()
            return False
        if any(not n.alive or n.host is not None or n.op is not None or n.device is None for n in nodes):
            self.host_alloc.free_pages(host)  # a storage hook, called to make room, changed them
            return False
        op = self._issue(BACKUP, nodes, self.engine.backup, host, dev, lambda: self.host_alloc.free_pages(host),
                         self.tree.set_host)
        op.demotion = demotion
        return True

    def start_load(self, nodes: list[Node]) -> Op | None:
        """Prepare and issue a load of locked nodes that need one (top-down, on one path):
        host-only ones into new device pages, stale ones into their own. None if no device room."""
        while self.inflight.full(LOAD):
            self.wait_oldest(LOAD)
        fresh = [n for n in nodes if n.device is None]
        got = self.obtain_device(sum(len(n.host) for n in fresh))
        if got is None:
            return None
        self.owner[got] = TREE
        dest, start = [], 0
        for n in nodes:
            if n.device is None:
                dest.append(got[start:start + len(n.host)])
                start += len(n.host)
            else:
                dest.append(n.device)  # stale: loaded again where the failed load wrote
        host = concat([n.host for n in nodes])
        return self._issue(LOAD, nodes, self.engine.load, host, concat(dest),
                           lambda: self.release_device(got), self._place_load)

    def _place_load(self, node: Node, pages: np.ndarray, ready: bool) -> None:
        if node.device is None:
            self.tree.set_device(node, pages, ready)

    def _issue(self, kind, nodes, transfer, host, dev, undo, place) -> Op:
        """Issue one transfer and record its destination pages on ``nodes`` as not ready.

        On failure the pages taken for it are given back (``undo()``) and
        nothing else has changed.
        """
        issued = time.perf_counter()
        try:
            handle = transfer(tokens_of(host, self.ps), tokens_of(dev, self.ps))
        except BaseException:
            undo()
            raise
        op = Op(kind, list(nodes), handle, len(dev) * self.ps * self.token_bytes, issued)
        dest, start = (dev if kind == LOAD else host), 0
        for n in nodes:
            end = start + len(n) // self.ps
            place(n, dest[start:end], False)
            n.op = op
            start = end
        self.inflight.add(op)
        return op

    def poll(self) -> int:
        """Complete every op whose transfer has finished, and retire every one that failed
        (:meth:`_failed`); returns how many. Never raises for a transfer's failure."""
        done = self.inflight.take_done()
        for op in done:
            if op.error is not None:
                self._failed(op)
            else:
                self._completed(op)
        self.reap_stale()
        self.flush_offers()
        return len(done)

    def _completed(self, op: Op) -> None:
        seconds = op.seconds()
        self.meters[op.kind].add(op.nbytes, seconds)
        self.metrics.transfer_bytes[op.kind].inc(op.nbytes)
        self.metrics.transfer_seconds[op.kind].inc(seconds)
        self.metrics.transfers[op.kind].inc()
        if op.demotion:  # counted once its copy landed: a failed one is not done
            self.metrics.demoted_tokens.inc(sum(len(n) for n in op.nodes))
        for n in op.nodes:
            n.op = None
            if op.kind == BACKUP:
                n.host_ready = True
            else:
                n.device_ready = True
        if op.kind == BACKUP and self.storage is not None:
            self.storage.backed_up(op.nodes)

    def _failed(self, op: Op) -> None:
        """Retire a transfer that failed, once whatever it queued has run (nothing writes its
        pages after that), counted and logged.

        A backup: its host pages are freed and its nodes are as before it (their device pages,
        which it read, are intact); a demotion's victim that nothing holds now is dropped, as
        eviction drops a page it cannot demote, so the room asked for is freed all the same.
        A load: its nodes keep their host copies and become stale (their device pages hold no
        valid KV and are never served); a stale page is loaded again by the next ``load_back``
        that needs it, or freed once nothing holds it (:meth:`reap_stale`). The requests waiting
        on it are told by their :class:`~.inflight.CacheLoad`.
        """
        settle(op.handle)
        self.metrics.transfer_failures[op.kind].inc()
        logger.warning("a %s of %d cached tokens failed: %s", op.kind, sum(len(n) for n in op.nodes), op.error)
        for n in op.nodes:
            n.op = None
        if op.kind == LOAD:
            self.stale.update(dict.fromkeys(op.nodes))
            return
        for n in op.nodes:
            self.host_alloc.free_pages(self.tree.drop_host(n))
        if op.demotion:
            for n in op.nodes:
                if self.device_evictable(n) and n.host is None:
                    self.drop_subtree(n)

    def reap_stale(self) -> int:
        """Free the device pages of stale nodes that nothing holds (no lock, no device child);
        returns how many pages."""
        freed, changed = 0, True
        while self.stale and changed:
            changed = False
            for n in list(self.stale):
                if not (n.alive and n.stale):
                    del self.stale[n]  # loaded again, evicted or cleared since
                elif n.lock_ref == 0 and n.dev_children == 0:
                    pages = self.tree.drop_device(n)
                    self.release_device(pages)
                    freed += len(pages)
                    del self.stale[n]
                    if n.parent.stale:  # the upper part of a split stale node, a leaf now
                        self.stale[n.parent] = None
                    changed = True
        return freed

    def wait_oldest(self, kind: str | None = None) -> None:
        """Block until the oldest transfer (of ``kind``) has run, then poll; a transfer that
        raised is retired by that poll."""
        op = self.inflight.oldest(kind)
        if op is None:
            return
        t0 = time.perf_counter()
        try:
            op.handle.synchronize()
        except Exception as e:  # noqa: BLE001 - retired by the poll below (_failed)
            op.error = op.error or e
        self.metrics.stall_seconds.inc(time.perf_counter() - t0)
        self.poll()

    def wait_all(self) -> None:
        while len(self.inflight):
            self.wait_oldest()

    def free_everything(self) -> None:
        """Free every page the tree holds (the caller resets the tree), counted as evicted from
        its tier, and every node's tokens as dropped, as eviction counts them."""
        assert not len(self.inflight)
        dev = [n.device for n in self.tree.device_nodes]
        host = [n.host for n in self.tree.host_nodes]
        if dev:
            pages = concat(dev)
            self.release_device(pages)
            self.metrics.evicted_tokens["device"].inc(len(pages) * self.ps)
        if host:
            pages = concat(host)
            self.host_alloc.free_pages(pages)
            self.metrics.evicted_tokens["host"].inc(len(pages) * self.ps)
        self.metrics.dropped_tokens.inc(sum(len(n) for n in self.tree.nodes()))
        self.stale.clear()
