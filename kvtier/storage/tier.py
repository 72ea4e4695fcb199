"""The storage tier the cache calls: saves of evicted host pages, lookups, prefetches.

:class:`StorageTier` puts one :class:`~kvtier.storage.StorageBackend` behind the calls a prefix
cache makes, on the cache's chained page hashes (``chain_keys``):

- ``save`` copies host pages out synchronously (the caller may free them on return) and writes
  them on a bounded background queue; a full queue drops the save and counts it (backpressure,
  never a stall).
- ``lookup`` asks the store how many leading pages of a chain it holds (one batched call).
- ``prefetch`` reads pages into host slots on a thread pool: each blob is verified (header,
  key, salt, checksum) before its bytes reach a host page, and one that fails is counted, deleted
  from the store and ends the prefetch; the handle says how many leading pages are ready, and
  ``cancel`` guarantees no later write into the slots.

A store that raises (unreachable) is marked down: lookups answer 0, saves are dropped and
prefetches load nothing until its ``healthy()`` passes, checked in the background at most once
every ``health_interval_s``. Counters and gauges: :class:`~.metrics.StorageMetrics`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from ..validate import is_finite_number, is_int
from . import StorageBackend, Usage
from .format import HEADER_BYTES, PageCodec, PageRejected, StorageSalt, store_key
from .metrics import Rate, StorageMetrics

logger = logging.getLogger("kvtier")
READ_AHEAD = 2  # batches a prefetch reads ahead (its buffers: 3 x batch_pages blobs); 1 left the file store's readers idle at each batch's end


class _Turns:
    """Lets its callers through one at a time, in the order of their numbers (0, 1, ...): the
    batches of one read from a backend with ``serial_reads``. Batches are submitted in order to
    a FIFO pool, so the holder of each number has started before the next one waits for it."""

    def __init__(self):
        self._cv, self._next = threading.Condition(), 0

    @contextlib.contextmanager
    def of(self, k: int):
        with self._cv:
            self._cv.wait_for(lambda: self._next == k)
        try:
            yield
        finally:
            with self._cv:
                self._next += 1
                self._cv.notify_all()


@dataclass(frozen=True)
class TierConfig:
    """How the storage tier behaves; checked once, never mutated.

    - ``io_threads``: threads for saves, as many again for prefetches (so reads never queue
      behind a backlog of writes), and as many for the store reads a prefetch runs a batch ahead;
      pages are verified, written into host pages, and copied out by a save, a core each.
    - ``max_pending_bytes``: blobs copied out by ``save`` and not yet written; a save that
      does not fit is dropped (counted), its pages recomputed if needed again.
    - ``batch_pages``: pages per backend read (a prefetch's batches, verified and written into
      host pages in order); a save's pages go to the backend in one call, which it windows.
    - ``skip_stored``: before writing a chain, ask the store which leading pages it holds and
      write only the rest.
    - ``prefetch_timeout_s`` + twice the pages' read time at the measured bandwidth (before one
      is measured, ``prefetch_timeout_per_page_s`` x pages), at most ``prefetch_timeout_max_s``:
      a prefetch's deadline (:meth:`StorageTier.prefetch_timeout`).
    - ``health_interval_s``: how often a store marked down is probed.
    """

    io_threads: int = 2
    max_pending_bytes: int = 256 << 20
    batch_pages: int = 8
    skip_stored: bool = True
    prefetch_timeout_s: float = 2.0
    prefetch_timeout_per_page_s: float = 0.01
    prefetch_timeout_max_s: float = 30.0
    health_interval_s: float = 5.0

    def __post_init__(self) -> None:
        for name, low, high in (("io_threads", 1, 64), ("max_pending_bytes", 1, None), ("batch_pages", 1, 4096)):
            v = getattr(self, name)
            if not is_int(v) or v < low or (high is not None and v > high):
                raise ValueError(f"{name} must be an integer in {low}..{high or 'inf'}, got {v!r}")
        if not isinstance(self.skip_stored, bool):
            raise ValueError(f"skip_stored must be True or False, got {self.skip_stored!r}")
        for name in ("prefetch_timeout_s", "prefetch_timeout_per_page_s", "prefetch_timeout_max_s",
                     "health_interval_s"):
            if not is_finite_number(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {getattr(self, name)!r}")


class PrefetchHandle:
    """A prefetch of ``n_pages`` pages into host slots. Pages become ready in order; ``ready_pages()``
    leading pages are verified and written, the rest are misses once ``done()``. After ``cancel()``
    returns, nothing more is written into the slots (free or reuse them)."""

    def __init__(self, n_pages: int, deadline: float):
        self.n_pages, self.deadline, self.started = n_pages, deadline, time.monotonic()
        self.outcome: str | None = None
        self._ready, self._cancelled = 0, False
        self._finished = threading.Event()
        self._write_lock = threading.Lock()  # held while pages are written into the host pool

    def ready_pages(self) -> int:
        return self._ready

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Wait until done, or ``timeout`` seconds (None: until the deadline); the pages ready."""
        if timeout is None:
            timeout = max(0.0, self.deadline - time.monotonic())
        self._finished.wait(timeout)
        return self._ready

    def cancel(self) -> int:
        """Stop the prefetch: no write into the slots after this returns; the pages ready."""
        with self._write_lock:
            self._cancelled = True
        return self._ready

    def _finish(self, outcome: str) -> None:
        self.outcome = "timed_out" if self._cancelled and self._ready < self.n_pages else outcome
        self._finished.set()


class StorageTier:
    """Host pages <-> one store, for one :class:`StorageSalt` (see the module's contract)."""

    def __init__(self, backend: StorageBackend, salt: StorageSalt, config: TierConfig | None = None):
        if not isinstance(backend, StorageBackend):
            raise TypeError(f"backend must be a kvtier.storage.StorageBackend, got {type(backend).__name__}")
        config = TierConfig() if config is None else config
        if not isinstance(config, TierConfig):
            raise TypeError(f"config must be a TierConfig or None, got {type(config).__name__}")
        self.backend, self.config = backend, config
        self.codec, self.salt = PageCodec(salt), salt
        self.read_rate, self.write_rate = Rate(), Rate()
        self.metrics = StorageMetrics(self._state)
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._spare: list[np.ndarray] = []  # blob buffers to reuse (touched already: no page faults)
        self._down_since: float | None = None
        self._next_probe, self._probing = 0.0, False
        self._saves = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvtier-save")
        self._loads = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvtier-load")
        self._fetches = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvtier-fetch")
        self._workers = ThreadPoolExecutor(max(config.io_threads, min(config.batch_pages, os.cpu_count() or 1)),
                                           thread_name_prefix="kvtier-verify")
        self._reads_checked = _defined_together(type(backend), "get_into_checked", "get_into")
        self._idle = threading.Condition(self._lock)
        self._usage = Usage(0, None, 0)
        self._refresh_usage()

    # -- the calls the cache makes ---------------------------------------------------------------

    def keys(self, chain_keys: Sequence[bytes]) -> list[bytes]:
        """The store keys of ``chain_keys`` under this tier's salt."""
        fp = self.salt.fingerprint
        return [store_key(fp, k) for k in chain_keys]

    def lookup(self, chain_keys: Sequence[bytes]) -> int:
        """How many leading pages of ``chain_keys`` the store holds (0 while it is down)."""
        keys = self.keys(chain_keys)
        if not keys or not self._usable():
            return 0
        try:
            n = self.backend.exists(keys)
        except Exception as e:  # noqa: BLE001 - any failure of the store is the store's, not the cache's
            self._mark_down("exists", e)
            return 0
        self.metrics.lookup_pages.inc(len(keys))
        self.metrics.hit_pages.inc(n)
        return n

    def save(self, chain_keys: Sequence[bytes], parent_keys: Sequence[bytes | None] | None, host_pool,
             host_slots) -> int:
        """Copy the pages at ``host_slots`` (whole pages, one per chain key) out of ``host_pool`` and
        queue their write; the slots may be freed on return. ``parent_keys``: each page's parent
        chain key (None where unknown; None for all: the previous chain key, the first unknown).
        Returns the pages queued; the rest were dropped (queue full, store down) and counted."""
        keys = self.keys(chain_keys)
        parents = self._parents(chain_keys, parent_keys)
        pages = self.codec.pages_of(host_pool, host_slots, len(keys))
        n = self._admit(len(keys))
        if n == 0:
            return 0
        blobs = self._take_buffers(n)
        try:
            sums = self.codec.gather(host_pool, pages[:n], [b[HEADER_BYTES:] for b in blobs], threads=self._workers)
        except BaseException:
            self._give_buffers(blobs, queued=True)
            raise
        self._saves.submit(self._write, keys[:n], parents[:n], blobs, sums)
        return n

    def prefetch(self, chain_keys: Sequence[bytes], host_pool, host_slots,
                 parent_key: bytes | None = None) -> PrefetchHandle:
        """Read the pages of ``chain_keys`` into ``host_slots`` (whole pages, one per key) in the
        background; ``parent_key``: the chain key before the first (checked where the page names
        one). The slots must stay allocated and unread until the handle is done or cancelled."""
        keys = self.keys(chain_keys)
        first = None if parent_key is None else store_key(self.salt.fingerprint, parent_key)
        parents = [first, *keys[:-1]] if keys else []
        pages = self.codec.pages_of(host_pool, host_slots, len(keys))
        handle = PrefetchHandle(len(keys), time.monotonic() + self.prefetch_timeout(len(keys)))
        if not keys or not self._usable():
            self._finish_prefetch(handle, "failed" if keys else "complete")
            return handle
        self._loads.submit(self._read, handle, keys, parents, host_pool, pages)
        return handle

    def skip_prefetch(self) -> None:
        """Count a prefetch the load-or-recompute advice decided against."""
        self.metrics.prefetches["skipped"].inc()

    def prefetch_timeout(self, n_pages: int) -> float:
        """Seconds a prefetch of ``n_pages`` has: see ``TierConfig``."""
        c, est = self.config, self.load_seconds(n_pages)
        per = 2 * est if est is not None else c.prefetch_timeout_per_page_s * n_pages
        return min(c.prefetch_timeout_max_s, c.prefetch_timeout_s + per)

    def load_seconds(self, n_pages: int) -> float | None:
        """Estimated seconds to read and verify ``n_pages`` at the measured bandwidth (None: not measured)."""
        bps = self.read_rate.bps
        return n_pages * self.codec.blob_bytes / bps if bps else None

    def healthy(self) -> bool:
        """Whether the store is in use (not marked down)."""
        return self._down_since is None

    def room_pages(self) -> int:
        """Pages a ``save`` queues now without dropping any (0 while the store is down)."""
        if not self._usable():
            return 0
        with self._lock:
            return max(0, self.config.max_pending_bytes - self._pending_bytes) // self.codec.blob_bytes

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written (or dropped); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending_bytes == 0, timeout)

    def close(self) -> None:
        """Finish queued work, then close the store."""
        for pool in (self._saves, self._loads, self._fetches, self._workers):
            pool.shutdown(wait=True)
        self.backend.close()

    # -- saves -----------------------------------------------------------------------------------

    def _admit(self, n: int) -> int:
        """How many of ``n`` pages the queue takes (reserved); the rest are counted as dropped."""
        if not self._usable():
            self.metrics.dropped_pages["down"].inc(n)
            return 0
        blob = self.codec.blob_bytes
        with self._lock:
            fits = min(n, max(0, self.config.max_pending_bytes - self._pending_bytes) // blob)
            self._pending_bytes += fits * blob
        if fits < n:
            self.metrics.dropped_pages["queue_full"].inc(n - fits)
        return fits

    def _write(self, keys: list[bytes], parents: list[bytes | None], blobs: list[np.ndarray], sums: list[int]) -> None:
        done = 0
        try:
            done = self.backend.exists(keys) if self.config.skip_stored else 0
            self.metrics.skipped_pages.inc(done)
            if done < len(keys):  # one call: the backend spreads it over its threads or windows it
                self._write_batch(keys[done:], parents[done:], blobs[done:], sums[done:])
                done = len(keys)
        except Exception as e:  # noqa: BLE001 - the store failed whole: drop the rest, mark it down
            self.metrics.dropped_pages["error"].inc(len(keys) - done)
            self._mark_down("put", e)
        finally:
            self._refresh_usage()
            self._give_buffers(blobs, queued=True)

    def _write_batch(self, keys, parents, blobs, sums) -> None:
        for key, parent, blob, checksum in zip(keys, parents, blobs, sums):
            self.codec.seal(blob, key, parent, checksum)
        t0 = time.perf_counter()
        stored = self.backend.put(keys, blobs)
        seconds = time.perf_counter() - t0
        ok = sum(map(bool, stored))
        nbytes = ok * self.codec.blob_bytes
        self.write_rate.add(nbytes, seconds)
        self.metrics.written_pages.inc(ok)
        self.metrics.written_bytes.inc(nbytes)
        self.metrics.write_seconds.inc(seconds)
        self.metrics.dropped_pages["failed"].inc(len(keys) - ok)

    def _take_buffers(self, n: int) -> list[np.ndarray]:
        with self._lock:
            taken, self._spare = self._spare[:n], self._spare[n:]
        return taken + [np.empty(self.codec.blob_bytes, np.uint8) for _ in range(n - len(taken))]

    def _give_buffers(self, blobs: list[np.ndarray], queued: bool) -> None:
        """Keep ``blobs`` for reuse (as many as the queue could hold); ``queued``: they were a save's."""
        with self._idle:
            if queued:
                self._pending_bytes -= len(blobs) * self.codec.blob_bytes
            room = self.config.max_pending_bytes // self.codec.blob_bytes - len(self._spare)
            self._spare.extend(blobs[: max(room, 0)])
            self._idle.notify_all()

    # -- prefetches ------------------------------------------------------------------------------

    def read_blobs(self, keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None
                   ) -> Iterator[tuple[int, list[np.ndarray], list[int], list]]:
        """The blobs of ``keys`` (store keys, :meth:`keys`; ``parents``: each one's parent store key
        to check, None where unknown), read and verified: ``(start, blobs, lengths, checks)`` per
        batch of ``batch_pages``, in order, where ``checks[i]`` is None for a blob that is its key's
        page, else why not (``"missing"`` or the :class:`PageRejected`). The next :data:`READ_AHEAD`
        batches are read and verified while the caller handles this one; the blobs are valid until
        the next step. Closing it early waits for the batches in flight. A store error raises from
        the step."""
        parents = [None] * len(keys) if parents is None else parents
        b = max(1, min(len(keys), self.config.batch_pages))
        slots = READ_AHEAD + 1   # batches in flight, and the one the caller holds
        buffers = self._take_buffers(slots * b if keys else 0)
        spans = [(i, min(i + b, len(keys))) for i in range(0, len(keys), b)]

        turns = _Turns() if self.backend.serial_reads else None

        def fetch(k: int):
            i, j = spans[k]
            blobs = buffers[(k % slots) * b : (k % slots) * b + j - i]
            turn = turns.of(k) if turns is not None else contextlib.nullcontext()
            return self._fetches.submit(self._fetch_checked, keys[i:j], parents[i:j], blobs, turn), blobs
        pending = collections.deque(fetch(k) for k in range(min(READ_AHEAD, len(spans))))
        try:
            for k, (i, _) in enumerate(spans):
                future, blobs = pending.popleft()
                lengths, checks = future.result()
                if k + READ_AHEAD < len(spans):
                    pending.append(fetch(k + READ_AHEAD))
                yield i, blobs, lengths, checks
        finally:
            wait([f for f, _ in pending])
            self._give_buffers(buffers, queued=False)

    def _fetch_checked(self, keys, parents, blobs, turn) -> tuple[list[int], list]:
        """Read and verify one batch: on the backend's reading threads where it offers
        ``get_into_checked`` (each blob verified while still in cache), else a page per worker
        once ``turn`` (a context) lets the read through."""
        with turn:  # entered first: a batch that fails still lets the next one through
            views = [memoryview(x) for x in blobs]
            if self._reads_checked:
                pairs = self.backend.get_into_checked(
                    keys, views, lambda i, n, checksum: self._check(keys[i], parents[i], blobs[i], n, checksum))
                return [n for n, _ in pairs], [why for _, why in pairs]
            lengths = self.backend.get_into(keys, views)
        return lengths, list(self._workers.map(self._check, keys, parents, blobs, lengths))

    def _read(self, handle: PrefetchHandle, keys, parents, host_pool, pages) -> None:
        """One prefetch: its batches read and verified a batch ahead, each written into host pages
        in order, until one falls short or the handle is cancelled."""
        outcome = "failed"
        try:
            with contextlib.closing(self.read_blobs(keys, parents)) as batches:
                t0 = time.perf_counter()
                for i, blobs, lengths, checks in batches:
                    good = self._accept(handle, keys[i:], host_pool, pages[i:], blobs, lengths, checks, t0)
                    t0 = time.perf_counter()
                    if good < len(lengths) or handle._cancelled:
                        break
            outcome = "complete" if handle.ready_pages() == len(keys) else "partial" if handle.ready_pages() else "miss"
        except Exception as e:  # noqa: BLE001 - the store failed whole: what is ready stays ready
            self._mark_down("get", e)
        finally:
            self._finish_prefetch(handle, outcome)

    def _accept(self, handle, keys, host_pool, pages, blobs, lengths, checks, t0: float) -> int:
        """Write one verified batch's good leading pages into host pages, a page per worker thread;
        how many. The read rate counts the batch's bytes over the time since the previous batch was
        written (``t0``): what the pipeline delivers."""
        good = next((k for k, why in enumerate(checks) if why is not None), len(checks))
        if good < len(checks):
            self._count_miss(keys[good], checks[good])
        with handle._write_lock:
            if handle._cancelled:
                return 0
            list(self._workers.map(lambda page, blob: self.codec.scatter(host_pool, [page], [blob[HEADER_BYTES:]]),
                                   pages[:good], blobs[:good]))
            handle._ready += good
        seconds, nbytes = time.perf_counter() - t0, sum(max(n, 0) for n in lengths)
        self.read_rate.add(nbytes, seconds)
        self.metrics.read_bytes.inc(nbytes)
        self.metrics.read_seconds.inc(seconds)
        self.metrics.read_pages.inc(good)
        return good

    def _check(self, key: bytes, parent: bytes | None, blob: np.ndarray, n: int,
               checksum: int | None = None) -> PageRejected | str | None:
        """None for a blob that is the page of ``key`` (``checksum``: its payload's, where the read
        computed it); else why not ("missing", or the rejection)."""
        if n < 0:
            return "missing"
        try:
            self.codec.verify(blob, n, key, parent, checksum)
        except PageRejected as e:
            return e
        return None

    def _count_miss(self, key: bytes, why: PageRejected | str) -> None:
        if isinstance(why, str):
            self.metrics.missing_pages.inc()
            return
        self.metrics.rejected(why.reason)
        logger.debug("storage page %s rejected: %s", key.hex(), why)
        self.backend.delete([key])   # else lookups keep finding it and saves skip rewriting it

    def _finish_prefetch(self, handle: PrefetchHandle, outcome: str) -> None:
        handle._finish(outcome)
        self.metrics.prefetches[handle.outcome].inc()

    # -- arguments ---------------------------------------------------------------------------------

    def _parents(self, chain_keys, parent_keys) -> list[bytes | None]:
        if parent_keys is None:
            return [None, *self.keys(chain_keys[:-1])] if len(chain_keys) else []
        if len(parent_keys) != len(chain_keys):
            raise ValueError(f"{len(chain_keys)} chain keys but {len(parent_keys)} parent keys; give one per page "
                             "(None where unknown), or None for the chain's own order")
        fp = self.salt.fingerprint
        return [None if p is None else store_key(fp, p) for p in parent_keys]

    # -- health ------------------------------------------------------------------------------------

    def _usable(self) -> bool:
        """True while the store is up; while down, probes it in the background when due."""
        if self._down_since is None:
            return True
        with self._lock:
            due = not self._probing and time.monotonic() >= self._next_probe
            self._probing = self._probing or due
        if due:
            self._loads.submit(self._probe)
        return False

    def _probe(self) -> None:
        try:
            ok = bool(self.backend.healthy())
        except Exception:  # noqa: BLE001 - a probe that raises is a store still down
            ok = False
        with self._lock:
            self._probing = False
            if ok:
                self._down_since = None
            else:
                self._next_probe = time.monotonic() + self.config.health_interval_s
        if ok:
            logger.warning("storage %s is back: in use again", self.backend.name)

    def _mark_down(self, call: str, e: Exception) -> None:
        self.metrics.store_errors.inc()
        with self._lock:
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
                self._next_probe = self._down_since + self.config.health_interval_s
        if first:
            logger.warning("storage %s failed in %s (%s): skipped until its health check passes, every %.0f s",
                           self.backend.name, call, e, self.config.health_interval_s)

    def _state(self) -> dict[str, float]:
        u = self._usage
        return {"used_bytes": u.used_bytes, "capacity_bytes": u.capacity_bytes or 0, "stored_pages": u.pages,
                "pending_bytes": self._pending_bytes, "read_bytes_per_second": self.read_rate.bps,
                "write_bytes_per_second": self.write_rate.bps, "up": float(self._down_since is None)}

    def _refresh_usage(self) -> None:
        """Read the store's usage for the gauges (here, after writes: a scrape never calls the store)."""
        try:
            self._usage = self.backend.usage()
        except Exception:  # noqa: BLE001 - gauges keep their last values while the store does not answer
            pass


def _defined_together(cls: type, name: str, other: str) -> bool:
    """Whether ``cls`` has ``name`` from the same class as its ``other`` (a subclass that overrides
    ``get_into`` alone keeps being called through it)."""
    owner = lambda n: next((c for c in cls.__mro__ if n in c.__dict__), None)  # noqa: E731
    return owner(name) is not None and owner(name) is owner(other)
