"""The cache end to end with the real TransferEngine: CUDA device pools where present, CPU always.

On CUDA, backups run on the engine's backup stream and loads on its load
stream; these tests check that what attention would read after
``wait_layer`` is byte for byte what was written, through demotion,
load-back, preemption and eviction under pressure.
"""

from __future__ import annotations

import random

import pytest
import torch

from cache_testlib import kv_matches, kv_values, make_cache, serve
from conftest import devices
from kvtier.transfer import get_backend

BACKENDS = [None, "direct", "kernel", "dma"]


def cache_on(device, io_backend, **kw):
    if io_backend is not None:
        try:
            get_backend(io_backend, torch.device(device))
        except ValueError as e:
            pytest.skip(str(e))
    return make_cache(held=False, device=device, io_backend=io_backend, **kw)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("io_backend", BACKENDS)
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.parametrize("kind,layout", [("mha", "layer_first"), ("mha", "page_first"), ("mla", "page_first"),
                                         ("dsa", "layer_first")])
def test_demote_and_load_back_bytes(device, io_backend, write_policy, kind, layout):
    cache, dev, host, _ = cache_on(device, io_backend, kind=kind, layout=layout, page_size=16,
                                   dev_pages=16, host_pages=64, write_policy=write_policy)
    seqs = [[b] * 20 + list(range(b, b + 60)) for b in (1, 300, 700)]
    for s in seqs:
        serve(cache, s)
    cache.evict_device(10**6)
    for s in seqs:
        m = cache.match_prefix(torch.tensor(s), lock=True)
        assert (m.device_len, m.host_len) == (0, 80)
        r = cache.load_back(m)
        for layer in range(dev.layer_num):
            r.layer_load.wait_layer(layer)
        assert kv_matches(dev, r.device_indices, kv_values(s, 0)[:80])
        cache.unlock(m.node)
    r.layer_load.synchronize()
    cache.poll()
    assert cache.metrics.snapshot()["bandwidth_bytes_per_second.load"] > 0
    cache.clear()
    assert cache.tiers.device_alloc.available_pages() == cache.tiers.device_alloc.num_pages
    assert host.allocator.available_pages() == host.allocator.num_pages


@pytest.mark.parametrize("device", devices())
def test_many_requests_under_pressure(device):
    """A device pool far smaller than the working set: eviction, demotion and reuse all the time."""
    cache, dev, host, _ = cache_on(device, None, page_size=16, dev_pages=12, host_pages=48,
                                   write_policy="write_through", max_inflight_backups=4)
    rng = random.Random(0)
    bases = [[b] * 16 + list(range(b, b + 64)) for b in range(5)]
    served = 0
    for _ in range(120):
        base = rng.choice(bases)
        seq = base[: rng.randrange(16, len(base) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(0, 20))]
        served += serve(cache, seq, load=rng.random() < 0.9) is not None
    assert served == 120
    snap = cache.metrics.snapshot()
    assert snap["hit_tokens_total.host"] > 0 and snap["evicted_tokens_total.device"] > 0
    cache.clear()
    assert cache.tiers.device_alloc.available_pages() == cache.tiers.device_alloc.num_pages
    assert host.allocator.available_pages() == host.allocator.num_pages
