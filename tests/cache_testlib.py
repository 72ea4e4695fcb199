"""Shared by the cache tests: a transfer engine whose completions the test controls,
and KV bytes derived from the tokens they belong to.

:class:`HeldTransferEngine` wraps the real :class:`~kvtier.transfer.TransferEngine`.
A transfer's bytes move when it completes (the test releases it, or someone
synchronizes on it), through the real engine and the real pools. So a cache
that reused a slot while a transfer was still reading or writing it would
copy the wrong bytes, and the byte checks below would see it.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import torch

from concurrent.futures import Future

from kvtier.transfer.engine import LayerLoad, TransferEngine, TransferHandle


class _Held:
    """Completion state shared by held backups and loads. ``error``: the transfer fails once
    released (its ``run`` moved only part of the bytes): ``done``, ``synchronize`` and
    ``wait_layer`` raise it then, ``settle`` returns it, as a caller's engine whose copy
    failed on the device would."""

    def _init_held(self, engine: "HeldTransferEngine", run, error: BaseException | None = None) -> None:
        self._engine, self._run, self._released, self._error = engine, run, False, error

    def _complete(self) -> None:
        with self._engine.lock:
            if not self._released:
                self._run()
                self._released = True
                self.finished_at = time.perf_counter()
                self._engine.pending.remove(self)
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        if self._released and self._error is not None:
            raise self._error
        return self._released

    def synchronize(self) -> None:
        self._complete()

    def settle(self) -> BaseException | None:
        try:
            self._complete()
        except Exception as e:  # noqa: BLE001 - returned, as settle() does
            return e
        return None


class HeldHandle(_Held, TransferHandle):
    def __init__(self, engine, run, nbytes, error=None):
        TransferHandle.__init__(self, nbytes)
        self.finished_at = None
        self._init_held(engine, run, error)


class HeldLayerLoad(_Held, LayerLoad):
    def __init__(self, engine, run, layer_num, nbytes, error=None):
        LayerLoad.__init__(self, layer_num, nbytes)
        self.finished_at = None
        self._init_held(engine, run, error)

    def wait_layer(self, layer: int, stream=None) -> None:
        self._complete()

    def layer_done(self, layer: int) -> bool:
        return self._released


class HeldTransferEngine:
    """The real engine with completion held back until :meth:`release` (or a synchronize)."""

    def __init__(self, host_pool, io_backend: str = "direct"):
        self.real = TransferEngine(host_pool, io_backend)
        self.host_pool, self.device_pool = host_pool, host_pool.device_pool
        self.pending: list[_Held] = []
        self.lock = threading.RLock()
        self.issued = 0
        # The next this many backups fail as the CUDA engine reports a background thread that
        # could not queue a backup's copies: a real handle whose queueing future holds the error.
        self.fail_backups = 0
        # The next this many loads fail partway: released, they load layer 0 only, then raise.
        self.fail_loads = 0
        # The next this many backups fail when released (held until then, as others are).
        self.fail_released_backups = 0

    @property
    def layer_num(self) -> int:
        return self.real.layer_num

    def backup(self, host_indices, device_indices):
        if self.fail_backups:
            self.fail_backups -= 1
            failed: Future = Future()
            failed.set_exception(RuntimeError("queueing the backup's copies failed"))
            self.issued += 1
            return TransferHandle(self.real._nbytes(len(host_indices)), queued=failed)
        h, d = host_indices.clone(), device_indices.clone()
        error = None
        if self.fail_released_backups:
            self.fail_released_backups -= 1
            error = RuntimeError("the backup's copy failed on the device")
        handle = HeldHandle(self, lambda: self.real.backup(h, d), self.real._nbytes(len(h)), error)
        return self._track(handle)

    def load(self, host_indices, device_indices):
        h, d = host_indices.clone(), device_indices.clone()
        run, error = (lambda: self.real.load(h, d)), None
        if self.fail_loads:
            self.fail_loads -= 1
            run = lambda: self.host_pool.load_to_device_per_layer(self.device_pool, h, d, 0)  # noqa: E731
            error = RuntimeError("the load failed partway: a host link fault after layer 0")
        handle = HeldLayerLoad(self, run, self.layer_num, self.real._nbytes(len(h)), error)
        return self._track(handle)

    def _track(self, handle):
        with self.lock:
            self.pending.append(handle)
            self.issued += 1
        return handle

    def release(self, count: int | None = None, rng: random.Random | None = None) -> int:
        """Complete ``count`` pending transfers (all if None), in random order when given ``rng``."""
        with self.lock:
            todo = list(self.pending)
            if rng is not None:
                rng.shuffle(todo)
            todo = todo if count is None else todo[:count]
            for h in todo:
                h.settle()  # a failing one fails here; its owner sees it at done()
            return len(todo)


# -- KV bytes that say which tokens they belong to --------------------------------

def kv_values(tokens, namespace_id: int) -> np.ndarray:
    """One int per position, a rolling hash of the namespace and the whole prefix up to it."""
    out = np.empty(len(tokens), dtype=np.int64)
    v = 7919 * (namespace_id + 1)
    for i, t in enumerate(tokens):
        v = (v * 1000003 + int(t) + 1) % 2147483647
        out[i] = v
    return out


def _pattern(values: np.ndarray, layer: int, item_bytes: int) -> torch.Tensor:
    v = torch.from_numpy(values)[:, None]
    return ((v + layer * 7 + torch.arange(item_bytes)[None, :] * 3) % 251).to(torch.uint8)


def write_kv(pool, slots: torch.Tensor, values: np.ndarray) -> None:
    """Fill every layer and component of ``slots`` with bytes derived from ``values``."""
    idx = slots.to(pool.device)
    for comp in pool.spec.components:
        for layer in range(pool.layer_num):
            rows = pool.layer_bytes(comp.name, layer)
            rows[idx] = _pattern(values, layer, rows.shape[1]).to(pool.device)


def kv_matches(pool, slots: torch.Tensor, values: np.ndarray) -> bool:
    idx = slots.to(pool.device)
    for comp in pool.spec.components:
        for layer in range(pool.layer_num):
            rows = pool.layer_bytes(comp.name, layer)
            if not torch.equal(rows[idx].cpu(), _pattern(values, layer, rows.shape[1])):
                return False
    return True


def common_pages(a, b, page_size: int) -> int:
    """Tokens of the longest common whole-page prefix of two sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n // page_size * page_size


# -- a cache on small real pools, and one request served the way an engine does it ----

def make_cache(kind="mha", layout="layer_first", page_size=4, dev_pages=8, host_pages=16, held=True,
               layers=2, device="cpu", **config):
    """(cache, device pool, host pool or None, held engine or None); host_pages=0 for device-only."""
    from kvtier.cache import CacheConfig, HiCache
    from kvtier_testlib import make_device_pool, make_host_pool

    dev = make_device_pool(kind, dev_pages * page_size, page_size, torch.float16, layers,
                           device=device, heads=2, head_dim=4, lora=6, rope=2)
    host = make_host_pool(dev, layout, host_pages * page_size) if host_pages else None
    engine = HeldTransferEngine(host) if (host is not None and held) else None
    cache = HiCache(dev, host, CacheConfig(page_size=page_size, **config), transfer_engine=engine)
    return cache, dev, host, engine


def serve(cache, seq, namespace="default", ns_id=0, load=True):
    """Match, lock, load back, compute the rest, insert, unlock; checks every byte it reads.

    Returns (match, tokens already cached at insert) or None when the device refused room.
    """
    dev, ps = cache.device_pool, cache.page_size
    vals = kv_values(seq, ns_id)
    m = cache.match_prefix(torch.tensor(seq), namespace=namespace, lock=True)
    prefix = m.device_indices
    if load and m.host_len:
        r = cache.load_back(m)
        if r is not None:
            for layer in range(dev.layer_num):
                r.layer_load.wait_layer(layer)
            prefix = r.device_indices
    assert kv_matches(dev, prefix, vals[: len(prefix)]), "prefix bytes differ from what was written"
    p, L = len(prefix), len(seq)
    own = cache.alloc_device(-(-(L - p) // ps) * ps)
    if own is None:
        cache.unlock(m.node)
        return None
    write_kv(dev, own[: L - p], vals[p:])
    cached = cache.insert(torch.tensor(seq), torch.cat([prefix, own[: L - p]]), namespace=namespace)
    cache.free_device(own[L // ps * ps - p :])
    cache.unlock(m.node)
    return m, cached


# -- a transfer engine with delays and failures on threads of its own -------------------------

class _FlakyHandle(LayerLoad):
    """Completion of one :class:`FlakyTransferEngine` transfer: every wait blocks until its
    worker has run it; a failed one then raises (``settle`` returns the error)."""

    def __init__(self, layer_num: int, nbytes: int):
        LayerLoad.__init__(self, layer_num, nbytes)
        self.finished_at = None
        self.error: BaseException | None = None
        self._event = threading.Event()

    def _finish(self, error: BaseException | None) -> None:
        self.error, self.finished_at = error, time.perf_counter()
        self._event.set()

    def done(self) -> bool:
        if self._event.is_set() and self.error is not None:
            raise self.error
        return self._event.is_set()

    def synchronize(self) -> None:
        self._event.wait()
        self.done()

    def settle(self) -> BaseException | None:
        self._event.wait()
        return self.error

    def wait_layer(self, layer: int, stream=None) -> None:
        self._check_layer(layer)
        self.synchronize()

    def layer_done(self, layer: int) -> bool:
        self._check_layer(layer)
        return self.done()

    def wait(self, stream=None, raise_error: bool = True) -> None:
        self._event.wait()
        if raise_error:
            self.done()


class FlakyTransferEngine:
    """Backups and loads run by ``workers`` threads after a random delay of up to ``max_delay``
    seconds; a ``fail_rate`` share fails partway, leaving wrong bytes where it wrote (a backup
    copies other device slots; a load writes layer 0 from other host slots), so a cache that
    served a failed transfer's pages would be caught by a byte check. Copies go through the
    host pool's own (seed-API) transfers, one at a time."""

    def __init__(self, host_pool, fail_rate: float, max_delay: float, seed: int, workers: int = 2):
        import heapq
        self.host_pool, self.device_pool = host_pool, host_pool.device_pool
        self.layer_num = host_pool.layer_num
        self.fail_rate, self.max_delay, self.rng = fail_rate, max_delay, random.Random(seed)
        self._heap: list = []
        self._push, self._pop = heapq.heappush, heapq.heappop
        self._cv, self._copy = threading.Condition(), threading.Lock()
        self._stop, self._count = False, 0
        self.failed = self.issued = 0
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(workers)]
        for t in self._threads:
            t.start()

    def backup(self, host_indices, device_indices):
        return self._submit("backup", host_indices.clone(), device_indices.clone())

    def load(self, host_indices, device_indices):
        return self._submit("load", host_indices.clone(), device_indices.clone())

    def _submit(self, kind, h, d):
        nbytes = len(h) * self.host_pool.size_per_token
        handle = _FlakyHandle(self.layer_num, nbytes)
        with self._cv:
            fail = self.rng.random() < self.fail_rate
            due = time.perf_counter() + self.rng.random() * self.max_delay
            self._count += 1
            self.issued += 1
            self._push(self._heap, (due, self._count, kind, h, d, fail, handle))
            self._cv.notify()
        return handle

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._heap or self._heap[0][0] > time.perf_counter()):
                    self._cv.wait(timeout=None if not self._heap else max(self._heap[0][0] - time.perf_counter(), 0))
                if self._stop and not self._heap:
                    return
                _, _, kind, h, d, fail, handle = self._pop(self._heap)
            handle._finish(self._run(kind, h, d, fail))

    def _run(self, kind, h, d, fail) -> BaseException | None:
        host, dev = self.host_pool, self.device_pool
        with self._copy:
            if kind == "backup":
                host.backup_from_device_all_layer(dev, h, d.flip(0) if fail else d, "direct")
            else:
                for layer in range(1 if fail else self.layer_num):
                    host.load_to_device_per_layer(dev, h.flip(0) if fail else h, d, layer, "direct")
        if fail:
            self.failed += 1
            return RuntimeError(f"the {kind} failed partway (an injected fault)")
        return None

    def close(self) -> None:
        """Run what is queued, then stop the workers."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=30)


# -- a cache with a storage tier over a real directory ----------------------------------------

class GatedStore:
    """Mixed into a real :class:`~kvtier.storage.file.FileBackend`: reads wait while ``open_gate``
    is clear, writes while ``write_gate`` is (a slow disk the test controls); ``reads`` counts them."""

    def __init__(self, config):
        super().__init__(config)
        self.open_gate, self.write_gate = threading.Event(), threading.Event()
        self.open_gate.set()
        self.write_gate.set()
        self.reads = 0

    def put(self, keys, blobs):
        self.write_gate.wait(30)
        return super().put(keys, blobs)

    def get_into(self, keys, buffers):
        self.reads += 1
        self.open_gate.wait(30)
        return super().get_into(keys, buffers)


def make_storage_cache(path, kind="mha", layout="page_first", page_size=4, dev_pages=16, host_pages=16,
                       capacity_pages=64, held=False, tier_config=None, model_id="test/model", tp=(0, 1), **config):
    """(cache, device pool, host pool, held engine or None, tier): a cache whose storage tier keeps
    its pages in the directory ``path`` (a file store gated by the test: ``tier.backend.open_gate``)."""
    from kvtier.cache import CacheConfig, HiCache
    from kvtier.storage.file import FileBackend, FileConfig
    from kvtier.storage.format import PageCodec, StorageSalt
    from kvtier.storage.tier import StorageTier, TierConfig
    from kvtier_testlib import make_device_pool, make_host_pool

    dev = make_device_pool(kind, dev_pages * page_size, page_size, torch.float16, 2, heads=2, head_dim=4, lora=6,
                           rope=2)
    host = make_host_pool(dev, layout, host_pages * page_size)
    salt = StorageSalt(host.spec, page_size, model_id, tp_rank=tp[0], tp_size=tp[1])
    store = type("GatedFileStore", (GatedStore, FileBackend), {})(
        FileConfig(str(path), capacity_pages * PageCodec(salt).blob_bytes))
    tier = StorageTier(store, salt, tier_config or TierConfig(prefetch_timeout_s=2.0))
    engine = HeldTransferEngine(host) if held else None
    cache = HiCache(dev, host, CacheConfig(page_size=page_size, model_id=model_id, **config), transfer_engine=engine,
                    storage=tier)
    return cache, dev, host, engine, tier
