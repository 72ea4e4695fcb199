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
    """Completion state shared by held backups and loads."""

    def _init_held(self, engine: "HeldTransferEngine", run) -> None:
        self._engine, self._run, self._released = engine, run, False

    def _complete(self) -> None:
        with self._engine.lock:
            if not self._released:
                self._run()
                self._released = True
                self.finished_at = time.perf_counter()
                self._engine.pending.remove(self)

    def done(self) -> bool:
        return self._released

    def synchronize(self) -> None:
        self._complete()


class HeldHandle(_Held, TransferHandle):
    def __init__(self, engine, run, nbytes):
        TransferHandle.__init__(self, nbytes)
        self.finished_at = None
        self._init_held(engine, run)


class HeldLayerLoad(_Held, LayerLoad):
    def __init__(self, engine, run, layer_num, nbytes):
        LayerLoad.__init__(self, layer_num, nbytes)
        self.finished_at = None
        self._init_held(engine, run)

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
        handle = HeldHandle(self, lambda: self.real.backup(h, d), self.real._nbytes(len(h)))
        return self._track(handle)

    def load(self, host_indices, device_indices):
        h, d = host_indices.clone(), device_indices.clone()
        handle = HeldLayerLoad(self, lambda: self.real.load(h, d), self.layer_num, self.real._nbytes(len(h)))
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
                h._complete()
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
