"""The storage tier over Valkey and over Mooncake Store, real servers on loopback: pages saved
from one host pool load into another, a value overwritten by another client is rejected and
counted, a dead store is marked down once and skipped until its health check passes (the
requests recompute), a paused store bounds the prefetch, and the tier uses the store again
once it is back."""

from __future__ import annotations

import time

import pytest

from storage_remote_testlib import MooncakeStore, ValkeyStore, needs_mooncake, storage_builders, until
from kvtier.storage.tier import StorageTier, TierConfig

lib = storage_builders()


@pytest.fixture(params=["valkey", "mooncake"])
def remote(request, tmp_path):
    if request.param == "mooncake":
        needs_mooncake()
    store = (ValkeyStore if request.param == "valkey" else MooncakeStore)(tmp_path)
    yield store
    store.stop()


def make_tier(remote, host, **tier_kw):
    config = TierConfig(**{"health_interval_s": 0.2, **tier_kw})
    return StorageTier(remote.backend(), lib.salt_of(host), config)


def pools():
    _, (src, dst) = lib.small_pools("mha", ("page_first", "layer_first"), page_size=4, pages=8)
    return src, dst


def saved(tier, src, n=4, tag=0):
    keys = lib.chain(n, tag)
    assert tier.save(keys, None, src, lib.slots_of(range(n), 4)) == n and tier.flush(30)
    assert tier.metrics.snapshot()["written_pages_total"] >= n
    return keys


def prefetch(tier, dst, keys, first_page=4):
    h = tier.prefetch(keys, dst, lib.slots_of(range(first_page, first_page + len(keys)), 4))
    h.wait(30)
    assert h.done()
    return h


def test_pages_saved_from_one_pool_load_into_another(remote):
    src, dst = pools()
    tier = make_tier(remote, src)
    keys = saved(tier, src)
    assert tier.lookup(keys) == 4
    h = prefetch(tier, dst, keys)
    assert h.ready_pages() == 4 and h.outcome == "complete"
    assert [lib.canonical_page(dst, 4 + i) for i in range(4)] == [lib.canonical_page(src, i) for i in range(4)]
    tier.close()


def test_a_value_overwritten_by_another_client_is_rejected_and_counted(remote):
    src, dst = pools()
    tier = make_tier(remote, src)
    keys = saved(tier, src)
    remote.overwrite(tier.keys([keys[2]])[0], b"\x00" * 200 + b"not a kvtier page" * 50)
    before = [lib.canonical_page(dst, 4 + i) for i in range(4)]
    h = prefetch(tier, dst, keys)
    assert h.ready_pages() == 2 and h.outcome == "partial"
    assert [lib.canonical_page(dst, 4 + i) for i in range(2)] == [lib.canonical_page(src, i) for i in range(2)]
    assert [lib.canonical_page(dst, 4 + i) for i in range(2, 4)] == before[2:]
    m = tier.metrics.snapshot()
    assert sum(v for k, v in m.items() if k.startswith(("corrupt_pages_total", "foreign_pages_total"))) == 1
    tier.close()


def test_a_dead_store_is_marked_down_once_skipped_and_used_again_when_back(remote):
    src, dst = pools()
    tier = make_tier(remote, src)
    keys = saved(tier, src)
    remote.kill()
    assert tier.lookup(keys) == 0  # this call finds it dead: marked down
    assert not tier.healthy() and tier.metrics.snapshot()["store_errors_total"] == 1
    t = time.monotonic()
    for _ in range(20):  # skipped: no call reaches the dead store, none waits for it
        assert tier.lookup(keys) == 0
        assert tier.save(keys, None, src, lib.slots_of(range(4), 4)) == 0
        assert prefetch(tier, dst, keys).ready_pages() == 0  # the request recomputes these pages
    assert time.monotonic() - t < 2.0
    m = tier.metrics.snapshot()
    assert m["store_errors_total"] == 1 and m["save_dropped_pages_total.down"] == 80
    assert m["prefetches_total.failed"] == 20
    remote.restart()  # empty
    until(lambda: tier.lookup(keys) == 0 and tier.healthy(), 60, "the tier did not take the store back")
    keys = saved(tier, src, tag=1)
    h = prefetch(tier, dst, keys)
    assert h.ready_pages() == 4
    assert [lib.canonical_page(dst, 4 + i) for i in range(4)] == [lib.canonical_page(src, i) for i in range(4)]
    tier.close()


def test_a_paused_store_bounds_the_prefetch_and_is_used_again_after(remote):
    src, dst = pools()
    tier = make_tier(remote, src, prefetch_timeout_s=1.0)
    keys = saved(tier, src)
    before = [lib.canonical_page(dst, 4 + i) for i in range(4)]
    remote.pause(True)
    try:
        t = time.monotonic()
        h = tier.prefetch(keys, dst, lib.slots_of(range(4, 8), 4))
        ready = h.wait()  # up to the prefetch's deadline
        waited = time.monotonic() - t
        h.cancel()  # nothing is written into the slots after this
        assert ready == 0 and waited < 1.0 + tier.config.prefetch_timeout_per_page_s * 4 + 0.5
        assert [lib.canonical_page(dst, 4 + i) for i in range(4)] == before
    finally:
        remote.pause(False)
    until(lambda: tier.lookup(keys) == 4 and tier.healthy(), 60, "the tier did not use the store again")
    h = prefetch(tier, dst, keys)
    assert h.ready_pages() == 4
    assert [lib.canonical_page(dst, 4 + i) for i in range(4)] == [lib.canonical_page(src, i) for i in range(4)]
    tier.close()
