"""Real threads: schedulers match, load, insert and lock while completions arrive from another thread."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from cache_testlib import kv_matches, kv_values, make_cache, serve


def all_device_bytes_intact(cache) -> bool:
    ps, dev = cache.page_size, cache.device_pool
    for node in cache.tree.nodes():
        if node.device is None or not node.device_ready:
            continue
        toks = [t for n in cache.tree.path_to(node) for t in map(int, n.tokens)]
        slots = (torch.from_numpy(node.device)[:, None] * ps + torch.arange(ps)).reshape(-1)
        if not kv_matches(dev, slots, kv_values(toks, 0)[len(toks) - len(node):]):
            return False
    return True


@pytest.mark.parametrize("write_policy", ["write_through", "write_back", "write_through_selective"])
def test_schedulers_and_completer_threads(write_policy):
    cache, dev, host, engine = make_cache(write_policy=write_policy, dev_pages=24, host_pages=32,
                                          max_inflight_backups=4, max_inflight_loads=2)
    stop = threading.Event()
    errors: list[BaseException] = []
    bases = [[b] * 6 + list(range(b, b + 10)) for b in (1, 50, 90)]

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # reported by the main thread
                errors.append(e)
                stop.set()
        return run

    def scheduler(seed):
        rng = random.Random(seed)
        for _ in range(150):
            if stop.is_set():
                return
            base = rng.choice(bases)
            seq = base[: rng.randrange(4, len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 6))]
            serve(cache, seq, load=rng.random() < 0.8)
            if rng.random() < 0.2:
                cache.evict_device(rng.randrange(1, 40))
            if rng.random() < 0.1:
                cache.evict_host(rng.randrange(1, 20))

    def completer():
        rng = random.Random(7)
        while not stop.is_set():
            engine.release(rng.randrange(0, 3), rng)
            cache.poll()
            time.sleep(0.0002)

    def reader():
        while not stop.is_set():
            snap = cache.metrics.snapshot()
            assert snap["tokens.device.cached"] <= dev.size
            time.sleep(0.001)

    workers = [threading.Thread(target=guarded(lambda s=s: scheduler(s))) for s in (1, 2)]
    helpers = [threading.Thread(target=guarded(completer)), threading.Thread(target=guarded(reader))]
    for t in workers + helpers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    stop.set()
    for t in helpers:
        t.join(timeout=30)
    if errors:
        raise errors[0]
    engine.release()
    cache.poll()
    cache.check()
    t = cache.tiers
    assert t.device_alloc.available_pages() + cache.tree.device_pages == t.device_alloc.num_pages
    assert host.allocator.available_pages() + cache.tree.host_pages == host.allocator.num_pages
    assert all_device_bytes_intact(cache)
    assert cache.metrics.snapshot()["hit_tokens_total.device"] > 0
    cache.clear()
    assert t.device_alloc.available_pages() == t.device_alloc.num_pages
    assert host.allocator.available_pages() == host.allocator.num_pages
