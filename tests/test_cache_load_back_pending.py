"""load_back over a path whose pages are partly still loading and partly being backed up.

Found by the model-based test (tests/test_cache_stateful.py) on a fresh CI clone: the
handle of a backup in flight (write-through of a freshly inserted page) was combined
with the per-layer load into one "layer load", which then failed on ``wait_layer``.
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
