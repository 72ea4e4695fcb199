"""The cache under load: four threads of random requests, holds, allocations and evictions on
tiny pools, transfers that finish late or fail partway on threads of their own, and a storage
hook that fails at random. Every byte a request reads, every page offered to the hook and,
at the end, every cached page is checked against its prefix's pattern; ``check()`` runs
after the run and after clear()."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from cache_testlib import FlakyTransferEngine, kv_matches, kv_values, write_kv
from kvtier.cache import CacheConfig, HiCache, LoadFailedError, StorageHook
from kvtier_testlib import make_device_pool, make_host_pool

PS, NAMESPACES = 2, ("a", "b")


class FlakyHook(StorageHook):
    """Checks every offered page's bytes (loaded into a scratch pool), then fails at random."""

    def __init__(self, host, known: dict, rng: random.Random):
        self.host, self.known, self.rng = host, known, rng
        self.scratch = make_device_pool("mha", 4 * PS, PS, torch.float16, host.layer_num, heads=2, head_dim=4)
        self.pages = self.wrong = self.failures = 0

    def offer(self, page_hashes, host_indices):
        slots = torch.arange(PS)
        for j, h in enumerate(page_hashes):
            ns_id, prefix = self.known[h]
            for layer in range(self.host.layer_num):
                self.host.load_to_device_per_layer(self.scratch, host_indices[j * PS:(j + 1) * PS], slots, layer)
            self.wrong += not kv_matches(self.scratch, slots, kv_values(prefix, ns_id)[-PS:])
            self.pages += 1
        if self.rng.random() < 0.2:
            self.failures += 1
            raise ConnectionError("the storage server dropped the connection")


class Client:
    """One scheduler thread's requests and holds."""

    def __init__(self, cache, known, seed, stats):
        self.cache, self.known, self.rng, self.stats = cache, known, random.Random(seed), stats
        self.held, self.hogs = [], []
        self.bases = [[b] * 4 + list(range(b, b + 8)) for b in (1, 40, 80)]

    def seq(self):
        base = self.rng.choice(self.bases)
        s = base[: self.rng.randrange(2, len(base) + 1)] + [self.rng.randrange(4) for _ in range(self.rng.randrange(6))]
        ns_id = self.rng.randrange(len(NAMESPACES))
        return s, ns_id

    def serve(self):
        """A request: match, load back, check what it reads, compute the rest, insert."""
        cache, (seq, ns_id) = self.cache, self.seq()
        ns, vals = NAMESPACES[ns_id], kv_values(seq, ns_id)
        for i, h in enumerate(cache.page_hashes(seq, ns)):
            self.known[h] = (ns_id, seq[: (i + 1) * PS])
        m = cache.match_prefix(torch.tensor(seq), namespace=ns, lock=True)
        prefix = m.device_indices
        try:
            if m.host_len and self.rng.random() < 0.8 and (r := cache.load_back(m)) is not None:
                for layer in range(cache.device_pool.layer_num):
                    r.layer_load.wait_layer(layer)
                prefix = r.device_indices
        except LoadFailedError:
            self.stats["told"] += 1  # the request would match again, or recompute
            cache.unlock(m.node)
            return
        self.stats["wrong"] += not kv_matches(cache.device_pool, prefix, vals[: len(prefix)])
        p, n = len(prefix), len(seq)
        own = cache.alloc_device(-(-(n - p) // PS) * PS)
        if own is not None:
            write_kv(cache.device_pool, own[: n - p], vals[p:])
            cache.insert(torch.tensor(seq), torch.cat([prefix, own[: n - p]]), namespace=ns)
            cache.free_device(own[n // PS * PS - p:])
        cache.unlock(m.node)
        self.stats["served"] += 1

    def step(self):
        cache, r = self.cache, self.rng.random()
        if r < 0.5:
            self.serve()
        elif r < 0.6 and len(self.held) < 2:
            seq, ns_id = self.seq()
            self.held.append(cache.match_prefix(seq, namespace=NAMESPACES[ns_id], lock=True).node)
        elif r < 0.7 and self.held:
            cache.unlock(self.held.pop(self.rng.randrange(len(self.held))))
        elif r < 0.78 and len(self.hogs) < 2:
            if (slots := cache.alloc_device(PS * self.rng.randrange(1, 4))) is not None:
                self.hogs.append(slots)
        elif r < 0.85 and self.hogs:
            cache.free_device(self.hogs.pop())
        elif r < 0.93:
            cache.evict_device(self.rng.randrange(1, 12))
        elif r < 0.97:
            cache.evict_host(self.rng.randrange(1, 12))
        else:
            cache.poll()

    def release(self):
        for node in self.held:
            self.cache.unlock(node)
        for slots in self.hogs:
            self.cache.free_device(slots)
        self.held, self.hogs = [], []


def _cached_pages_intact(cache) -> bool:
    """Every ready page of every cached node, on the device and on the host, holds its prefix's bytes."""
    hook, dev = cache.tiers.storage_hook, cache.device_pool
    for node in cache.tree.nodes():
        path = cache.tree.path_to(node)
        toks = [t for n in path for t in map(int, n.tokens)]
        vals = kv_values(toks, NAMESPACES.index(node.namespace))[len(toks) - len(node):]
        if node.device is not None and node.device_ready:
            slots = (torch.from_numpy(node.device)[:, None] * PS + torch.arange(PS)).reshape(-1)
            if not kv_matches(dev, slots, vals):
                return False
        if node.host is not None and node.host_ready:
            for i, page in enumerate(node.host.tolist()):
                for layer in range(dev.layer_num):
                    cache.host_pool.load_to_device_per_layer(hook.scratch, torch.arange(page * PS, page * PS + PS),
                                                             torch.arange(PS), layer)
                if not kv_matches(hook.scratch, torch.arange(PS), vals[i * PS:(i + 1) * PS]):
                    return False
    return True


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_four_schedulers_flaky_transfers_and_a_flaky_storage_hook(write_policy):
    steps, seed = 600, 11 if write_policy == "write_back" else 7
    dev = make_device_pool("mha", 20 * PS, PS, torch.float16, 2, heads=2, head_dim=4)
    host = make_host_pool(dev, "page_first", 28 * PS)
    engine = FlakyTransferEngine(host, fail_rate=0.1, max_delay=0.002, seed=seed)
    known: dict = {}
    cfg = CacheConfig(page_size=PS, write_policy=write_policy, max_inflight_backups=4, max_inflight_loads=2)
    cache = HiCache(dev, host, cfg, transfer_engine=engine,
                    storage_hook=FlakyHook(host, known, random.Random(seed)))
    stats = {"served": 0, "told": 0, "wrong": 0}
    clients = [Client(cache, known, seed * 10 + i, stats) for i in range(4)]
    errors: list[BaseException] = []

    def run(client):
        try:
            for _ in range(steps):
                client.step()
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a scheduler thread hung"
    if errors:
        raise errors[0]
    for c in clients:
        c.release()
    engine.close()
    cache.poll()
    cache.check()
    hook, snap = cache.tiers.storage_hook, cache.metrics.snapshot()
    assert stats["wrong"] == 0 and hook.wrong == 0 and _cached_pages_intact(cache)
    assert stats["served"] > 4 * steps * 0.3 and engine.failed > 0 and hook.pages > 0 and hook.failures > 0
    assert snap["transfer_failures_total.backup"] + snap["transfer_failures_total.load"] == engine.failed
    assert snap["storage_offer_failures_total"] == hook.failures
    cache.clear()
    cache.check()
    assert cache.tiers.device_alloc.available_pages() == cache.tiers.device_alloc.num_pages
    assert host.allocator.available_pages() == host.allocator.num_pages
