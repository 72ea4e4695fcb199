"""kvtier inside other serving engines.

- :mod:`kvtier.integrations.vllm`: an offloading spec that stock vLLM's ``OffloadingConnector``
  loads by name (``spec_name: "KvtierOffloadingSpec"``, ``spec_module_path:
  "kvtier.integrations.vllm"``). Install with ``pip install 'kvtier[vllm]'``; kvtier imports and
  runs without vLLM.

What an engine integration shares, engine-independent, lives here:

- :class:`BlockPool`: an engine's per-layer KV views, ``(num_blocks, page_bytes)`` bytes each, as a
  device pool that kvtier's host pools mirror (a block is one slot of opaque rows);
- :class:`BlockMover`: a kvtier host pool in the ``page_first`` layout (a host page's blocks,
  every layer, one contiguous run) and a :class:`~kvtier.transfer.TransferEngine` moving whole
  blocks between it and the engine's views, as numbered jobs;
- :class:`StorageLink`: kvtier's storage tier (page format, integrity checks, write queue,
  prefetch) behind a :class:`BlockMover`'s host pool, one host page per engine key;
- :class:`HostDirectory`: the scheduler side, on keys (an engine's block hashes) and page ids:
  which key is in which host page, which page goes when the host is full (kvtier's
  :class:`~kvtier.allocator.PageAllocator` and eviction policies), and what storage holds;
- :class:`Counters`: counters and gauges in a private Prometheus registry, with their increase
  since the last report for an engine's own stats.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..allocator import PageAllocator
from ..cache.policy import EVICTION, LRU
from ..host_pool import MLATokenToKVPoolHost
from ..transfer import TransferEngine


class BlockPool:
    """An engine's per-layer KV views as a device pool of kvtier's MLA kind: ``layer_num`` layers
    of ``size`` slots (the engine's blocks), each slot one opaque row of ``kv_lora_rank`` bytes
    (a layer's page). ``page_size``: the slots a host page holds. Raises ``ValueError`` unless
    every view is a dense ``(num_blocks, page_bytes)`` tensor of one shape on one device."""

    def __init__(self, views: list[torch.Tensor], page_size: int):
        shapes = {(tuple(t.shape), t.stride(), t.element_size(), str(t.device)) for t in views}
        v = views[0] if views else None
        if len(shapes) != 1 or v.dim() != 2 or v.stride() != (v.shape[1], 1):
            raise ValueError("blocks move as equal, dense per-layer pages: every KV view must be one "
                             f"(num_blocks, page_bytes) tensor with stride (page_bytes, 1), got {sorted(shapes)}")
        self.layer_num, self.size, self.page_size, self.device = len(views), v.shape[0], page_size, v.device
        self.dtype = torch.uint8
        self.kv_lora_rank, self.qk_rope_head_dim = v.shape[1] * v.element_size(), 0
        self.kv_buffer = [t.view(torch.uint8).unsqueeze(1) for t in views]


def host_slots(pages, first_block: int, n: int, blocks_per_page: int) -> np.ndarray:
    """Host slots of ``n`` consecutive blocks of a request, from its block ``first_block`` on,
    laid over host ``pages`` of ``blocks_per_page`` slots each: the run starts
    ``first_block % blocks_per_page`` slots into the first page."""
    pos = np.arange(n, dtype=np.int64) + first_block % blocks_per_page
    return np.asarray(pages, dtype=np.int64)[pos // blocks_per_page] * blocks_per_page + pos % blocks_per_page


class BlockMover:
    """A host pool of ``num_pages`` pages of ``blocks_per_page`` blocks mirroring ``views``, and
    a transfer engine between them (``io_backend``: ``auto`` on CUDA, ``direct`` on the CPU).

    ``store`` copies device blocks to host slots, ``load`` the other way; both return at once
    (on CUDA, ordered after the work queued on the current stream; on the CPU, done). The
    caller keeps both sides of a job untouched until :meth:`finished` has reported it.
    """

    def __init__(self, views: list[torch.Tensor], blocks_per_page: int, num_pages: int,
                 io_backend: str | None = None):
        self.device_pool = BlockPool(views, blocks_per_page)
        self.host = MLATokenToKVPoolHost(self.device_pool, 0, 0, blocks_per_page, "page_first",
                                         host_size_tokens=num_pages * blocks_per_page)
        self.engine = TransferEngine(self.host, io_backend)
        self.block_bytes = self.device_pool.layer_num * self.device_pool.kv_lora_rank
        self._jobs: dict[int, tuple] = {}  # job id -> (handle, bytes, start), in submission order
        self.before_close: list[Callable[[], None]] = []  # run by close() while the host pool is alive

    def store(self, job_id: int, host: np.ndarray, dev: np.ndarray) -> None:
        handle = self.engine.backup(torch.from_numpy(host), torch.from_numpy(dev))
        self._jobs[job_id] = (handle, len(dev) * self.block_bytes, time.perf_counter())

    def load(self, job_id: int, host: np.ndarray, dev: np.ndarray) -> None:
        handle = self.engine.load(torch.from_numpy(host), torch.from_numpy(dev))
        self._jobs[job_id] = (handle, len(dev) * self.block_bytes, time.perf_counter())

    def finished(self) -> list[tuple[int, int, float]]:
        """``(job id, bytes, seconds from submission)`` of every job done since the last call."""
        out = []
        for job_id, (handle, nbytes, start) in list(self._jobs.items()):
            if handle.done():
                del self._jobs[job_id]
                out.append((job_id, nbytes, time.perf_counter() - start))
        return out

    def wait(self, job_ids) -> None:
        """Block until the named jobs (those still running) are done."""
        for job_id in job_ids:
            if job_id in self._jobs:
                self._jobs[job_id][0].synchronize()

    def close(self) -> None:
        """Wait for every job, run ``before_close``, then release the host pool's memory."""
        self.wait(list(self._jobs))
        for hook in self.before_close:
            hook()
        self._jobs.clear()
        self.host.close()


def open_store(backend: str, url: str, capacity_gb: float):
    """A storage backend by name (``file``, ``valkey``, ``mooncake``, ``module:Class``) at ``url``
    holding at most ``capacity_gb`` GB: :func:`kvtier.storage.open_backend` (for ``file``, ``url``
    is a directory). ``ValueError`` otherwise."""
    from ..storage import open_backend

    return open_backend(backend, url, int(capacity_gb * 1e9))


class StorageLink:
    """kvtier's :class:`~kvtier.storage.tier.StorageTier` behind ``mover``'s host pool: one host
    page per key (any bytes, e.g. an engine's block hash). Stored pages are sealed with the
    storage format's header (key, salt, checksum) and verified on every read, under a salt of
    the pool's shape, ``model_id`` and ``fingerprint`` (what else the bytes depend on).

    ``tier_config``: the :class:`~kvtier.storage.tier.TierConfig` (None: its defaults). ``save``
    copies pages out at once (they may be reused on return) and writes them in the background;
    ``prefetch`` reads one page into a host page, verified before a byte lands;
    a page that fails is deleted from the store, so it is recomputed and stored again."""

    def __init__(self, mover: BlockMover, backend, model_id: str, fingerprint: str, tier_config=None):
        from ..storage.format import StorageSalt
        from ..storage.tier import StorageTier

        self.host, self.page_size = mover.host, mover.host.page_size
        salt = StorageSalt(self.host.spec, self.page_size, model_id, fingerprint)
        self.tier = StorageTier(backend, salt, tier_config)

    def _slots(self, pages) -> np.ndarray:
        return host_slots(pages, 0, len(pages) * self.page_size, self.page_size)

    def save(self, keys: list[bytes], pages: list[int]) -> int:
        """Queue ``pages`` for writing under ``keys``; returns how many were queued."""
        return self.tier.save(keys, [None] * len(keys), self.host, self._slots(pages)) if keys else 0

    def holds(self, key: bytes) -> bool:
        return self.tier.lookup([key]) == 1

    def room(self) -> int:
        """Pages a ``save`` queues now without dropping any."""
        return self.tier.room_pages()

    def prefetch(self, key: bytes, page: int):
        """A :class:`~kvtier.storage.tier.PrefetchHandle` reading ``key`` into host ``page``."""
        return self.tier.prefetch([key], self.host, self._slots([page]))

    def forget(self, key: bytes) -> None:
        """Delete ``key`` from the store (a page that failed its checks, or went missing)."""
        try:
            self.tier.backend.delete(self.tier.keys([key]))
        except Exception:  # noqa: BLE001 - a store that cannot delete keeps a page that fails again: a miss
            pass

    def rejected(self) -> dict[str, float]:
        """Pages refused on read so far, by reason (``corrupt``, ``short``, ``wrong_key``, ``foreign``)."""
        snap = {k.replace("_total", "", 1): v for k, v in self.tier.metrics.snapshot().items()}
        out = {k.partition(".")[2]: v for k, v in snap.items() if k.startswith("corrupt_pages.")}
        return {**out, "foreign": snap.get("foreign_pages", 0.0)}

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued (for at most ``timeout`` s), then close the store."""
        self.tier.flush(timeout)
        self.tier.close()


COUNTERS = {
    "lookups": ("Key lookups answered", ()),
    "hit_chunks": ("Chunks loaded back into the engine's KV cache, by the tier that held them", ("tier",)),
    "stored_chunks": ("Chunks written to the host tier", ()),
    "evicted_chunks": ("Chunks evicted from the host tier", ()),
    "store_refused": ("Stores refused: every host page was in use", ()),
    "storage_saved_pages": ("Pages handed to the storage tier to write", ()),
    "storage_hit_pages": ("Pages read back from the storage tier into the host tier, verified", ()),
    "storage_missed_pages": ("Storage reads that loaded nothing: the page failed its checks or went missing", ()),
    "storage_rejected_pages": ("Stored pages refused by their integrity checks (never loaded)", ("reason",)),
}
GAUGES = {"host_used_chunks": "Host pages holding or receiving blocks", "host_chunks": "Host pages in all"}


@dataclass
class Chunk:
    """A key's blocks in the host tier: its page, readable yet, loads using it, from ``host``
    (the engine stored it) or ``disk`` (the storage tier), and whether storage holds it."""

    page: int
    last_access: int
    ready: bool = False
    refs: int = 0
    hits: int = 0
    source: str = "host"
    saved: bool = False


class HostDirectory:
    """The scheduler side of a host tier of ``num_pages`` pages, on keys and page ids only.

    A key is ``ready`` once its store completed (:meth:`commit`) or its storage read was
    verified; it is never evicted while pinned (:meth:`pin` to :meth:`unpin`), written or read.
    :meth:`reserve` takes free pages, then evicts the ``eviction`` policy's first evictable keys
    (never one it is offered); where too few can go it takes nothing. With ``store`` (a
    :class:`StorageLink`), :meth:`find` reads a host miss the store holds into a host page
    (``pending`` until verified; a page failing its checks is a miss, deleted and counted);
    keys reach storage when evicted (``write_back``), once stored (``write_through``), and at
    :meth:`flush`; what a full queue turned away is handed over again as it drains
    (``write_through``), and under ``write_back``, while fewer than ``save_ahead`` of the pages are
    free, the keys next in line for eviction are saved ahead of it (:meth:`poll`). :meth:`reset`
    forgets every key (storage keeps its pages). Counts in ``counters`` (:data:`COUNTERS`, under
    ``prefix``). One thread (the engine's scheduler) calls it.
    """

    def __init__(self, num_pages: int, eviction: str = "lru", write_policy: str = "write_back", store=None,
                 prefix: str = "kvtier_host_", save_ahead: float = 0.25):
        if isinstance(save_ahead, bool) or not isinstance(save_ahead, (int, float)) or not 0 <= save_ahead <= 1:
            raise ValueError(f"save_ahead must be a fraction of the host pages in [0, 1], got {save_ahead!r}")
        self.allocator = PageAllocator(num_pages, 1)
        self.save_ahead = save_ahead
        self._unsaved_due, self._unsaved_at = False, 0.0  # a pass over the keys storage lacks: wanted, and when
        self.policy = EVICTION[eviction]()
        self.write_back, self.store = write_policy == "write_back", store
        self.chunks: OrderedDict[bytes, Chunk] = OrderedDict()  # least recently used first
        self._fetching: dict[bytes, object] = {}  # key -> the storage read filling its page
        self._tick = itertools.count()
        self.counters = Counters(prefix, COUNTERS, self._gauges, GAUGES)

    def _gauges(self) -> dict[str, int]:
        n = self.allocator.num_pages
        return {"host_used_chunks": n - self.allocator.available_pages(), "host_chunks": n}

    def find(self, key: bytes) -> str:
        """``ready``, ``pending`` (being written, or read from storage) or ``miss``. A ready key is
        used last now: a storage read for the rest of its prefix does not evict it."""
        self.counters.inc("lookups")
        self.poll()
        c = self.chunks.get(key)
        if c is None:
            return self._fetch(key) if self.store is not None else "miss"
        if c.ready:
            self.touch([key])
        return "ready" if c.ready else "pending"

    def touch(self, keys) -> None:
        for key in keys:
            if (c := self.chunks.get(key)) is not None:
                c.last_access = next(self._tick)
                self.chunks.move_to_end(key)

    def pin(self, keys) -> list[int]:
        """The pages of ready ``keys``, kept from eviction until :meth:`unpin`."""
        pages = []
        for key in keys:
            c = self.chunks[key]
            assert c.ready, "only keys found ready are loaded"
            c.refs += 1
            c.hits += 1
            pages.append(c.page)
            self.counters.inc("hit_chunks", 1, c.source)
        self.touch(keys)
        return pages

    def unpin(self, keys) -> None:
        for key in keys:
            if (c := self.chunks.get(key)) is not None and c.refs:
                c.refs -= 1

    def reserve(self, keys) -> tuple[list[bytes], list[int], list[bytes]] | None:
        """Pages for the ``keys`` not held yet (being written until :meth:`commit`): ``(new keys,
        their pages, keys evicted for them)``, or None where too few pages can be had."""
        keys = list(keys)
        new = [k for k in dict.fromkeys(keys) if k not in self.chunks]
        self.touch([k for k in keys if k in self.chunks])
        taken = self._take(len(new), protect=set(keys))
        if taken is None:
            self.counters.inc("store_refused")
            return None
        for key, page in zip(new, taken[0]):
            self.chunks[key] = Chunk(page, next(self._tick))
        return new, *taken

    def _take(self, n: int, protect: set) -> tuple[list[int], list[bytes]] | None:
        """``n`` free pages and the keys evicted for them, or None where too few can go."""
        short = n - self.allocator.available_pages()
        victims = self._victims(short, protect) if short > 0 else []
        if victims is None:
            return None
        self._save([k for k in victims if not self.chunks[k].saved] if self.write_back else [])
        self._unsaved_due |= self.write_back
        self.allocator.free_pages([self.chunks.pop(k).page for k in victims])
        self.counters.inc("evicted_chunks", len(victims))
        pages = self.allocator.alloc_pages(n)
        assert pages is not None, "eviction freed enough pages"
        return pages.tolist(), victims

    def _victims(self, n: int, protect: set) -> list[bytes] | None:
        free = ((k, c) for k, c in self.chunks.items() if c.ready and not c.refs and k not in protect)
        if isinstance(self.policy, LRU):  # ``chunks`` is kept in access order: the first n found
            found = list(itertools.islice(free, n))
        else:
            found = heapq.nsmallest(n, free, key=lambda kc: self.policy.key(kc[1]))
        return [k for k, _ in found] if len(found) == n else None

    def commit(self, keys, success: bool = True) -> list[bytes]:
        """End the writes of ``keys`` (from :meth:`reserve`): ready, or dropped where they failed.
        Returns the keys made ready."""
        done = []
        for key in keys:
            c = self.chunks.get(key)
            if c is None or c.ready:
                continue
            if success:
                c.ready = True
                done.append(key)
            else:
                self.allocator.free_pages([self.chunks.pop(key).page])
        self.counters.inc("stored_chunks", len(done))
        if self.write_back:
            self._unsaved_due = True
        else:
            self._save(done)
        return done

    def _save(self, keys: list[bytes]) -> None:
        if self.store is None or not keys:
            return
        queued = self.store.save(keys, [self.chunks[k].page for k in keys])  # the rest dropped: queue full
        self.counters.inc("storage_saved_pages", queued)
        self._unsaved_due |= queued < len(keys)
        for k in keys[:queued]:
            self.chunks[k].saved = True

    def _fetch(self, key: bytes) -> str:
        if not self.store.holds(key):
            return "miss"
        taken = self._take(1, protect={key})
        if taken is None:
            return "miss"
        self.chunks[key] = Chunk(taken[0][0], next(self._tick), source="disk", saved=True)
        self._fetching[key] = self.store.prefetch(key, taken[0][0])
        return "pending"

    def poll(self) -> None:
        """Finish the storage reads that are done (or past their deadline: cancelled); hand keys
        storage lacks to it as its queue has room (:meth:`_save_unsaved`)."""
        if self._unsaved_due and self.store is not None:
            self._save_unsaved()
        for key, handle in list(self._fetching.items()):
            late = not handle.done() and time.monotonic() > handle.deadline
            if not (handle.done() or late):
                continue
            ready = handle.cancel() if late else handle.ready_pages()
            del self._fetching[key]
            if ready:
                self.chunks[key].ready = True
                self.counters.inc("storage_hit_pages")
            else:
                self.allocator.free_pages([self.chunks.pop(key).page])
                self.store.forget(key)
                self.counters.inc("storage_missed_pages")
                for reason, n in self.store.rejected().items():
                    self.counters.set_total("storage_rejected_pages", n, reason)

    def _save_unsaved(self) -> None:
        """Save ready keys storage lacks, least recently used first, while its queue has room:
        under ``write_through`` all of them (a full queue turned them away as they were stored);
        under ``write_back`` until ``save_ahead`` x the pages are free or saved. A pass walks the
        keys: the next waits 20 times as long as the walk took (at most 1/20 of the thread)."""
        start = time.monotonic()
        if start < self._unsaved_at:
            return
        want = len(self.chunks)
        if self.write_back:
            want = math.ceil(self.save_ahead * self.allocator.num_pages) - self.allocator.available_pages()
        room = self.store.room() if want > 0 else 0
        if room <= 0:
            return
        todo = []
        for key, c in self.chunks.items():
            if want <= 0 or len(todo) >= room:
                break
            if c.ready:
                want -= 1
                if not c.saved:
                    todo.append(key)
        walked = time.monotonic()
        self._save(todo)
        self._unsaved_due = len(todo) >= room > 0 and want > 0  # the queue's room ran out first
        self._unsaved_at = time.monotonic() + 20 * (walked - start)

    @property
    def reading(self) -> bool:
        """Storage reads in flight (the engine should keep polling)."""
        return bool(self._fetching)

    def flush(self) -> None:
        """Hand every ready key storage lacks to it (before the host pool goes)."""
        self._save([k for k, c in self.chunks.items() if c.ready and not c.saved])

    def reset(self) -> None:
        for handle in self._fetching.values():
            handle.cancel()
        self._fetching.clear()
        self.chunks.clear()
        self.allocator.clear()

    def close(self) -> None:
        """Stop reads, write what storage has queued, close it."""
        self.reset()
        if self.store is not None:
            self.store.close()
            self.store = None


class Counters:
    """Counters (``counters``: name -> (help, label names)) and gauges (``gauges()`` -> {name:
    value}, read when collected) under ``prefix`` in a private Prometheus registry
    (``registry``; ``prometheus_client.generate_latest(registry)`` renders it). :meth:`snapshot`
    gives them as a dict, :meth:`take` the counters' increase since its last call. Thread-safe."""

    def __init__(self, prefix: str, counters: dict, gauges: Callable[[], dict], gauge_help: dict):
        self.prefix, self.defs, self._gauges, self._gauge_help = prefix, counters, gauges, gauge_help
        self._lock = threading.Lock()
        self.counts: Counter = Counter()  # (name, label values) -> value
        self._taken: Counter = Counter()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)

    def inc(self, name: str, n: int = 1, *labels: str) -> None:
        assert name in self.defs and len(labels) == len(self.defs[name][1]), (name, labels)
        with self._lock:
            self.counts[(name, labels)] += n

    def collect(self):
        with self._lock:
            counts = dict(self.counts)
        for name, (doc, labels) in self.defs.items():
            fam = CounterMetricFamily(self.prefix + name, doc, labels=list(labels))
            for (n, values), v in counts.items():
                if n == name:
                    fam.add_metric(list(values), v)
            yield fam
        for name, v in self._gauges().items():
            fam = GaugeMetricFamily(self.prefix + name, self._gauge_help[name])
            fam.add_metric([], v)
            yield fam

    def snapshot(self) -> dict[str, float]:
        """``{"name.label": value}`` of every counter that has one, and every gauge."""
        with self._lock:
            out = {".".join((n, *values)): v for (n, values), v in self.counts.items()}
        return {**out, **self._gauges()}

    def set_total(self, name: str, value: float, *labels: str) -> None:
        """Set a counter kept elsewhere (never lowered)."""
        with self._lock:
            self.counts[(name, labels)] = max(self.counts[(name, labels)], value)

    def take(self) -> dict[tuple[str, tuple], float]:
        """Each counter's increase since the previous call (those that rose)."""
        with self._lock:
            delta = {k: v - self._taken[k] for k, v in self.counts.items() if v != self._taken[k]}
            self._taken.update(delta)
        return delta

    def gauges(self) -> dict:
        return self._gauges()
