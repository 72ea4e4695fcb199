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
"""

from __future__ import annotations

import heapq
import itertools
import time

import numpy as np
import torch

from ..allocator import PageAllocator, pages_to_tokens
from .advisor import BandwidthMeter
from .inflight import BACKUP, LOAD, InFlight, Op
from .radix import Node, RadixTree

FREE, REQUEST, TREE = 0, 1, 2


def tokens_of(pages: np.ndarray, page_size: int) -> torch.Tensor:
    """Page ids -> an int64 CPU tensor of their token slots."""
    return torch.from_numpy(pages_to_tokens(pages, page_size))


def concat(arrays: list[np.ndarray]) -> np.ndarray:
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)


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
        """The next node still eligible (earlier evictions may have changed some)."""
        while self.heap:
            node = heapq.heappop(self.heap)[2]
            if self.eligible(node):
                return node
        return None


class Tiers:
    def __init__(self, device_pool, host_pool, config, tree: RadixTree, eviction, writer, metrics,
                 engine, storage_hook=None):
        self.ps = config.page_size
        self.tree, self.eviction, self.writer, self.metrics = tree, eviction, writer, metrics
        self.device_alloc = PageAllocator(device_pool.size, self.ps)
        self.owner = np.zeros(self.device_alloc.num_pages, dtype=np.int8)
        self.host_alloc = host_pool.allocator if host_pool is not None else None
        self.engine = engine
        self.storage_hook = storage_hook
        self.inflight = InFlight(config.max_inflight_backups, config.max_inflight_loads)
        self.meters = {d: BandwidthMeter(config.bandwidth_ewma) for d in (BACKUP, LOAD)}
        if config.load_gbps_prior:
            self.meters[LOAD].bps = config.load_gbps_prior * 1e9
        self.token_bytes = device_pool.spec.bytes_per_token
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
            elif keep_device_copies:
                free = False
            total += len(n.host) if free else 0
        return total

    # -- device eviction -----------------------------------------------------

    @staticmethod
    def device_evictable(node: Node) -> bool:
        return (node.device is not None and node.device_ready and node.op is None
                and node.lock_ref == 0 and node.dev_children == 0)

    def evict_device(self, n_pages: int) -> int:
        """Free up to ``n_pages`` device pages now; returns how many were freed.

        Victims are unlocked device leaves, in policy order. One with a host
        copy just leaves the device; one the write policy wants kept gets a
        backup started (it is freed by a later call, once the copy landed, and
        counts toward ``n_pages`` here, so no more backups start than the
        pages asked for); anything else is dropped with its host-only subtree.
        """
        victims = Victims(self.eviction.key, self.tree.device_nodes, self.device_evictable)
        freed = pending = 0  # pending: pages of the demotions started here, freed once they land
        while freed + pending < n_pages and (node := victims.pop()) is not None:
            parent = node.parent
            if node.host is not None:
                freed += self._demoted(node)
            elif (self.engine is not None and self.writer.demote_on_evict(node)
                  and self.start_backup([node], demotion=True)):
                pending += len(node.device)  # (demoted_tokens counts it when it lands: poll)
                continue
            else:
                freed += self.drop_subtree(node)
            victims.offer(parent)
        return freed

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
        return (node.host is not None and node.host_ready and node.op is None and node.lock_ref == 0
                and (node.device is not None or not node.children))

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
        return freed

    def _free_host_of(self, node: Node) -> int:
        if self.storage_hook is not None:
            self.storage_hook.offer(list(node.hashes), tokens_of(node.host, self.ps))
            self.metrics.storage_offered_pages.inc(len(node.host))
        pages = self.tree.drop_host(node)
        self.host_alloc.free_pages(pages)
        self.metrics.evicted_tokens["host"].inc(len(pages) * self.ps)
        return len(pages)

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
        dev = concat([n.device for n in nodes])
        host = self.obtain_host(len(dev), keep_device_copies=demotion)
        if host is None:
            self.metrics.backups_skipped["host_full"].inc()
            return False
        op = self._issue(BACKUP, nodes, self.engine.backup, host, dev, self.host_alloc.free_pages, self.tree.set_host)
        op.demotion = demotion
        return True

    def start_load(self, nodes: list[Node]) -> Op | None:
        """Prepare and issue a load of host-only nodes (top-down, on one path); None if no device room."""
        while self.inflight.full(LOAD):
            self.wait_oldest(LOAD)
        host = concat([n.host for n in nodes])
        dev = self.obtain_device(len(host))
        if dev is None:
            return None
        self.owner[dev] = TREE
        return self._issue(LOAD, nodes, self.engine.load, host, dev, self.release_device, self.tree.set_device)

    def _issue(self, kind, nodes, transfer, host, dev, undo, place) -> Op:
        """Issue one transfer and record its destination pages on ``nodes`` as not ready.

        On failure the destination pages are given back with ``undo`` and
        nothing else has changed.
        """
        issued = time.perf_counter()
        try:
            handle = transfer(tokens_of(host, self.ps), tokens_of(dev, self.ps))
        except BaseException:
            undo(dev if kind == LOAD else host)
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
        """Complete every op whose transfer has finished; returns how many (failed ones too:
        :meth:`_failed`)."""
        done = self.inflight.take_done()
        failed_loads = [op for op in done if op.error is not None and op.kind == LOAD]
        for op in done:
            if op.error is not None:
                if op.kind == BACKUP:
                    self._failed(op)
                continue
            seconds = op.seconds()
            self.meters[op.kind].add(op.nbytes, seconds)
            self.metrics.transfer_bytes[op.kind].inc(op.nbytes)
            self.metrics.transfer_seconds[op.kind].inc(seconds)
            self.metrics.transfers[op.kind].inc()
            if op.demotion:  # counted once its copy landed: a failed one is retried, not done
                self.metrics.demoted_tokens.inc(sum(len(n) for n in op.nodes))
            for n in op.nodes:
                n.op = None
                if op.kind == BACKUP:
                    n.host_ready = True
                else:
                    n.device_ready = True
        if failed_loads:
            # Every other op is completed first; the failed loads stay in flight (their pages
            # may hold anything, and a request may be reading them): raised at every poll.
            self.inflight.queues[LOAD].extendleft(reversed(failed_loads))
            err = failed_loads[0].error
            raise RuntimeError(f"a load in flight failed: {err}") from err
        return len(done)

    def _failed(self, op: Op) -> None:
        """Retire a backup whose copies could not all be queued: once what was queued has run,
        its host pages are freed and its nodes are as before it (their device pages, which it
        read, are intact; a demotion is simply not done). kvtier's loads cannot fail this way:
        their copies are all queued before the engine's ``load()`` returns, and an error there
        raises from :meth:`_issue`, undone; a caller's engine whose load handle raises has it
        raised by :meth:`poll`."""
        settle = getattr(op.handle, "settle", None)  # an engine of the caller's may lack it
        try:
            settle() if settle is not None else op.handle.synchronize()
        except Exception:  # noqa: BLE001 - the error is op.error already
            pass
        for n in op.nodes:
            n.op = None
            self.host_alloc.free_pages(self.tree.drop_host(n))
        self.metrics.transfer_failures[op.kind].inc()

    def wait_oldest(self, kind: str | None = None) -> None:
        op = self.inflight.oldest(kind)
        if op is None:
            return
        t0 = time.perf_counter()
        try:
            op.handle.synchronize()
        except Exception:  # noqa: BLE001 - a failed backup: poll() retires it (_failed)
            if op.kind != BACKUP:
                raise
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
