"""Cache bugs the model-based test (tests/test_cache_stateful.py) found, pinned as fixed cases.

- load_back over a path whose pages are partly still loading and partly being backed up:
  the handle of a backup in flight (write-through of a freshly inserted page) was combined
  with the per-layer load into one "layer load", which then failed on ``wait_layer``.
- demotions that took other device pages' host copies, so that two pages could swap host
  room forever while alloc_device refused with room counted free.
"""

from __future__ import annotations

import torch

from cache_testlib import HeldTransferEngine, kv_matches, kv_values, write_kv
from kvtier_testlib import make_device_pool, make_host_pool
from kvtier.cache import CacheConfig, HiCache


def test_load_back_waits_for_loading_pages_not_for_backups_of_ready_ones():
    ps = 2
    dev = make_device_pool("mha", 16 * ps, ps, torch.float16, 2, heads=2, head_dim=4, lora=6, rope=2)
    host = make_host_pool(dev, "layer_first", 32 * ps)
    engine = HeldTransferEngine(host)
    cache = HiCache(dev, host, CacheConfig(page_size=ps, write_policy="write_through"), transfer_engine=engine)
    a = list(range(1, 1 + 2 * ps))           # two pages
    ab = a + list(range(50, 50 + 2 * ps))    # and two more
    vals = kv_values(ab, 0)

    # a: computed, cached, backed up to the host, then dropped from the device.
    slots = cache.alloc_device(len(a))
    write_kv(dev, slots, vals[: len(a)])
    cache.insert(a, slots)
    engine.release()
    cache.poll()
    assert cache.evict_device(len(a)) == len(a)

    # A request for a starts loading it back (the load is held: pages not ready yet) ...
    m = cache.match_prefix(a, lock=True)
    assert (m.device_len, m.host_len) == (0, len(a))
    first = cache.load_back(m)
    assert first is not None and not first.layer_load.done()

    # ... and, reading it, computes b and caches a+b: b's write-through backup is in flight.
    tail = cache.alloc_device(len(ab) - len(a))
    write_kv(dev, tail, vals[len(a):])
    cache.insert(ab, torch.cat([first.device_indices, tail]))
    assert len(engine.pending) == 2          # a's load, b's backup

    # A second request matches a+b: a is still loading, b is ready (its backup reads it).
    m2 = cache.match_prefix(ab, lock=True)
    second = cache.load_back(m2)
    assert second is not None and second.loaded_tokens == 0
    for layer in range(dev.layer_num):
        second.layer_load.wait_layer(layer)   # completes the held load, not the backup
    assert kv_matches(dev, second.device_indices, vals)
    engine.release()
    cache.poll()
    cache.unlock(m.node)
    cache.unlock(m2.node)
    cache.clear()


def test_a_demotion_never_takes_the_host_copy_of_a_page_still_on_the_device():
    """Host smaller than the device's cached pages. To demote X, taking Z's host copy would
    only make Z the next page to demote; two pages can swap host room forever while the
    device frees nothing (the model-based test found alloc_device refusing with room
    counted free). A demotion takes host room only from host-only pages, else drops."""
    dev = make_device_pool("mha", 6, 1, torch.float16, 2, heads=2, head_dim=4, lora=6, rope=2)
    host = make_host_pool(dev, "layer_first", 2)
    engine = HeldTransferEngine(host)
    cache = HiCache(dev, host, CacheConfig(page_size=1, write_policy="write_through", eviction="lru"),
                    transfer_engine=engine)
    for t in (1, 2, 3, 4):                   # X, Y, Z, W in LRU order; write-through backups
        slots = cache.alloc_device(1)
        write_kv(dev, slots, kv_values([t], 0))
        cache.insert([t], slots)
        engine.release()
        cache.poll()
    on_host = sorted(int(n.tokens[0]) for n in cache.tree.host_nodes)
    assert on_host == [3, 4]                 # Z and W took X's and Y's host room
    hog = cache.alloc_device(2)              # the device's last free pages
    assert hog is not None and cache.device_free_tokens() == 4
    got = cache.alloc_device(2)              # must evict: X and Y have no host copy
    assert got is not None
    assert sorted(int(n.tokens[0]) for n in cache.tree.host_nodes) == [3, 4]  # kept
    assert sorted(int(n.tokens[0]) for n in cache.tree.device_nodes) == [3, 4]
    assert cache.metrics.snapshot()["dropped_tokens_total"] == 2            # X, Y dropped
    cache.free_device(got)
    cache.free_device(hog)
    engine.release()
    cache.clear()
