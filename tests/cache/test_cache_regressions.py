"""Cache bugs the model-based test (tests/cache/test_cache_stateful.py) found, pinned as fixed cases.

- load_back over a path whose pages are partly still loading and partly being backed up:
  the handle of a backup in flight (write-through of a freshly inserted page) was combined
  with the per-layer load into one "layer load", which then failed on ``wait_layer``.
- demotions that took other device pages' host copies, so that two pages could swap host
  room forever while alloc_device refused with room counted free.

And those a review found (2026-12-04), below their marker; those found later (namespaces'
roots, metrics and error paths) and the steady state: test_cache_regressions_later.py.
"""

from __future__ import annotations

import pytest
import torch

from cache_regressions_testlib import _put
from cache_testlib import HeldTransferEngine, kv_matches, kv_values, make_cache, write_kv
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


# -- found by a review (2026-12-04): each failed before its fix -------------------------

def _tiers(cache) -> list[tuple[list[int], bool, bool]]:
    return [(list(map(int, n.tokens)), n.device is not None, n.host is not None) for n in cache.tree.nodes()]


def test_a_match_keeps_its_own_host_part_when_its_hot_pages_are_backed_up():
    """A hit makes a device page hot (write_through_selective) and backs it up; the room for
    that came from evicting host pages, once including the host-only tail of the very path
    being matched: the match reported it cached, lock=True locked a removed node, and
    load_back raised."""
    cache, dev, host, engine = make_cache(page_size=1, dev_pages=6, host_pages=2,
                                          write_policy="write_through_selective", selective_hits=2)

    def settle():
        engine.release()
        cache.poll()
    _put(cache, dev, [1])
    _put(cache, dev, [1, 2])                 # P=[1] -> X=[2], both on the device
    cache.match_prefix([1, 2])
    cache.match_prefix([1, 2])
    settle()                                 # both hot: both backed up
    assert cache.evict_device(1) == 1        # X: host only
    assert cache.evict_host(1) == 1          # P's host copy (P stays on the device)
    _put(cache, dev, [7])
    cache.match_prefix([7])
    cache.match_prefix([7])
    settle()                                 # Q=[7] takes the last host page
    held = cache.match_prefix([7], lock=True)
    assert _tiers(cache) == [([7], True, True), ([1], True, False), ([2], False, True)]

    m = cache.match_prefix([1, 2], lock=True)   # P is hot: its backup wants a host page
    assert (m.device_len, m.host_len) == (1, 1)
    assert m.node.alive and m.node.lock_ref == 1
    assert ([2], False, True) in _tiers(cache)  # X is still there, as reported
    assert cache.metrics.snapshot()["backups_skipped_total.host_full"] == 1
    r = cache.load_back(m)
    assert r is not None and r.loaded_tokens == 1
    r.layer_load.synchronize()
    assert kv_matches(dev, r.device_indices, kv_values([1, 2], 0))
    cache.unlock(m.node)
    cache.unlock(held.node)
    settle()
    cache.clear()


def test_a_transfer_engine_over_another_host_pool_is_refused():
    ps = 4
    dev = make_device_pool("mha", 8 * ps, ps, torch.float16, 2, heads=2, head_dim=4, lora=6, rope=2)
    host = make_host_pool(dev, "layer_first", 16 * ps)
    other_dev = make_device_pool("mha", 8 * ps, ps, torch.float16, 2, heads=2, head_dim=4, lora=6, rope=2)
    other = make_host_pool(other_dev, "layer_first", 16 * ps)
    with pytest.raises(ValueError, match="another host pool"):
        HiCache(dev, host, CacheConfig(page_size=ps), transfer_engine=HeldTransferEngine(other))


def test_a_failed_backup_is_retired_and_its_host_pages_freed():
    """A backup whose copies the background thread could not queue: its handle raises. The
    cache kept the op in flight for good (its host pages held, the node never evictable) and
    every later poll, match, alloc and clear raised its error."""
    cache, dev, host, engine = make_cache(write_policy="write_through")
    free_host = host.allocator.available_pages()
    seq = list(range(8))
    engine.fail_backups = 1
    _put(cache, dev, seq)                    # its write-through backup fails
    assert cache.poll() == 1
    s = cache.metrics.snapshot()
    assert s["transfer_failures_total.backup"] == 1 and s["transfers_total.backup"] == 0
    assert len(cache.tiers.inflight) == 0 and host.allocator.available_pages() == free_host
    assert _tiers(cache) == [(seq, True, False)]   # still on the device, intact
    m = cache.match_prefix(seq, lock=True)
    assert m.device_len == 8 and kv_matches(dev, m.device_indices, kv_values(seq, 0))
    cache.unlock(m.node)
    assert cache.evict_device(8) == 8        # evictable again (a demotion: backed up this time)
    engine.release()
    cache.poll()
    assert _tiers(cache) == [(seq, False, True)]
    r = cache.load_back(m2 := cache.match_prefix(seq, lock=True))
    r.layer_load.synchronize()
    assert kv_matches(dev, r.device_indices, kv_values(seq, 0))
    cache.unlock(m2.node)
    engine.release()
    cache.clear()
    # Waited on rather than polled (clear, evict_device): the same.
    engine.fail_backups = 1
    _put(cache, dev, seq)
    cache.clear()
    assert cache.metrics.snapshot()["transfer_failures_total.backup"] == 2
    assert host.allocator.available_pages() == free_host


def test_unlock_refuses_a_node_held_only_by_a_longer_match():
    """A second unlock of a node locked once, while a longer match still held it, was taken:
    its lock count went to -1 when the longer match was unlocked, and it was never evicted."""
    cache, dev, host, engine = make_cache(page_size=4, dev_pages=8, host_pages=0)
    seq = list(range(8))
    cache.insert(seq, cache.alloc_device(8))
    long = cache.match_prefix(seq, lock=True)
    short = cache.match_prefix(seq[:4], lock=True)   # splits the node
    cache.unlock(short.node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(short.node)
    cache.unlock(long.node)
    t = cache.tree
    assert short.node.lock_ref == 0 and (t.locked_nodes, t.device_locked_pages) == (0, 0)
    assert cache.evict_device(32) == 8


def test_a_backup_that_cannot_get_room_evicts_nothing():
    """Host room for a backup: the only evictable host page was evicted and the backup then
    skipped anyway (host_full), the page lost for nothing."""
    cache, dev, host, engine = make_cache(page_size=1, dev_pages=8, host_pages=3, write_policy="write_through")

    def settle():
        engine.release()
        cache.poll()
    _put(cache, dev, [9])
    settle()
    assert cache.evict_device(1) == 1        # X=[9]: host only, one page
    _put(cache, dev, [1, 2])
    settle()                                 # L=[1, 2]: device and host, two pages
    held = cache.match_prefix([1, 2], lock=True)
    _put(cache, dev, [5, 6])                 # its backup needs two host pages: only X could go
    assert cache.metrics.snapshot()["backups_skipped_total.host_full"] == 1
    assert cache.match_prefix([9]).host_len == 1
    cache.unlock(held.node)


def test_device_room_that_eviction_cannot_make_evicts_nothing():
    """alloc_device beyond free plus unlocked cached pages: None, and the cached pages stay."""
    cache, dev, host, engine = make_cache(page_size=4, dev_pages=4, host_pages=0)
    _put(cache, dev, list(range(8)))         # two cached pages, unlocked
    held = cache.alloc_device(8)             # a request holds the other two
    assert cache.alloc_device(12) is None
    assert cache.tree.device_pages == 2 and cache.metrics.snapshot()["dropped_tokens_total"] == 0
    cache.free_device(held)


def test_admit_refused_for_room_loads_nothing():
    """The engine's admit counted the match's own unlocked pages as room, then locked them:
    it loaded the host part back and only then found no room for the rest."""
    from kvtier.engine.kv_manager import PrefixCache
    from kvtier.engine.sequence import Sequence

    cache, dev, host, engine = make_cache(page_size=4, dev_pages=4, host_pages=8, write_policy="write_through")

    def settle():
        engine.release()
        cache.poll()
    p, x = list(range(4)), list(range(4, 8))
    _put(cache, dev, p)
    _put(cache, dev, p + x)
    settle()
    assert cache.evict_device(4) == 4        # X: host only; P: device and host
    other = cache.alloc_device(8)            # another request holds two pages: one free
    loads = cache.metrics.snapshot()["transfers_total.load"]
    issued = engine.issued
    seq = Sequence(p + x + [100, 101, 102, 103], max_new_tokens=1)
    assert not PrefixCache(cache).admit(seq)  # P's page and X's load + one page: 2 > 1 free
    assert engine.issued == issued and cache.metrics.snapshot()["transfers_total.load"] == loads
    assert cache.tree.locked_nodes == 0
    cache.free_device(other)
    assert PrefixCache(cache).admit(seq)


@pytest.mark.parametrize("bad", [True, float("inf"), float("nan"), -1.0, "0.1"])
def test_advise_refuses_a_prefill_time_that_is_no_time(bad):
    cache, dev, host, engine = make_cache()
    m = cache.match_prefix(list(range(8)))
    with pytest.raises(ValueError, match="prefill_seconds_per_token must be a finite number >= 0"):
        cache.advise(m, bad)


def test_a_load_that_raises_in_poll_leaves_the_others_completed():
    """A load handle that raises (a caller's engine; kvtier's loads raise from load() itself, and
    are undone) is retired by poll; the transfers that finished beside it are completed all the
    same. They were taken out of the queues and never completed: their pages stayed not ready,
    unevictable, for good (a review of the fix above). The failed load no longer stays in flight
    to be raised by every poll: its node is stale, its host copy kept (test_cache_resilience.py)."""
    cache, dev, host, engine = make_cache(page_size=4, dev_pages=8, host_pages=16, write_policy="write_through")
    a, b = list(range(8)), list(range(100, 108))
    _put(cache, dev, a)
    _put(cache, dev, b)
    engine.release()
    cache.poll()
    assert cache.evict_device(16) == 16
    ma = cache.match_prefix(a, lock=True)
    ra = cache.load_back(ma)
    mb = cache.match_prefix(b, lock=True)
    cache.load_back(mb)
    engine.release()

    def fails():
        raise RuntimeError("the load failed on the device")
    ra.layer_load.ops[0].handle.done = fails
    assert cache.poll() == 2
    assert mb.node.op is None and mb.node.device_ready            # b's load: completed
    assert ma.node.stale and ma.node.host is not None and not len(cache.tiers.inflight)  # a's: retired
    assert cache.metrics.snapshot()["transfer_failures_total.load"] == 1
    cache.unlock(ma.node)
    cache.unlock(mb.node)
    cache.check()


def test_unlock_costs_the_same_whatever_the_children():
    """unlock checked a node's own locks by summing its children's: the shared system prompt's
    node, which every conversation's node hangs under, took 1.2 ms a lock and unlock at 50k."""
    cache, dev, host, engine = make_cache(page_size=1, dev_pages=2048, host_pages=0)
    cache.insert([0], cache.alloc_device(1))
    for t in range(1, 1500):
        cache.insert([0, t], torch.cat([cache.match_prefix([0]).device_indices, cache.alloc_device(1)]))
    root_child = cache.match_prefix([0], lock=True).node
    assert len(root_child.children) == 1499 and root_child.own_locks == 1
    cache.unlock(root_child)
    assert root_child.own_locks == 0 and root_child.lock_ref == 0
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(root_child)


def test_a_match_made_without_counting_touches_and_backs_up_nothing_until_counted():
    """count=False left the metrics alone but still counted a hit on the path's nodes (eviction
    and write_through_selective go by them) and started hot pages' backups at every refused
    retry (a review of the fix above)."""
    cache, dev, host, engine = make_cache(page_size=4, write_policy="write_through_selective", selective_hits=2)
    seq = list(range(8))
    _put(cache, dev, seq)
    node = cache.match_prefix(seq, lock=True, count=False).node
    hits, issued = node.hits, engine.issued
    for _ in range(4):
        m = cache.match_prefix(seq, lock=True, count=False)
        cache.unlock(m.node)
    assert node.hits == hits and engine.issued == issued
    assert cache.metrics.snapshot()["hit_tokens_total.device"] == 0
    cache.count_match(m, len(seq))   # admitted: one hit
    assert node.hits == hits + 1 and cache.metrics.snapshot()["hit_tokens_total.device"] == 8
    cache.unlock(node)


def test_asking_for_one_device_page_backs_up_one_leaf_not_the_whole_device():
    """A demotion started for room counts toward the pages asked for: one page asked, one
    backup started (before, every unlocked device leaf was backed up, and the host room for
    those copies was taken by evicting host-only prefixes)."""
    cache, dev, host, _ = make_cache(page_size=1, dev_pages=8, host_pages=8, held=False, write_policy="write_back")

    def put(seq):
        cache.insert(seq, cache.alloc_device(len(seq)))
    for t in range(100, 104):
        put([t])
    cache.evict_device(4)                       # 100..103 now host-only
    backups = cache.engine.stats.backups
    for t in range(8):
        put([t])                                # the device full of unlocked leaves, no host copies
    assert cache.alloc_device(1) is not None
    assert cache.engine.stats.backups - backups == 1
    assert cache.metrics.snapshot()["demoted_tokens_total"] == 4 + 1
    assert [cache.match_prefix([t]).total_len for t in range(100, 104)] == [1, 1, 1, 1]


@pytest.mark.parametrize("bad", [-8, 2.5, True, 7, "8"])
def test_count_match_refuses_a_query_shorter_than_its_match_before_touching_anything(bad):
    """count_match's n_tokens is the query's length: a negative, fractional, bool or shorter
    one is refused before the path is touched (a negative one touched it, then raised in the
    counter; 2.5 counted 0 query tokens against 8 hit tokens)."""
    cache, dev, host, _ = make_cache(page_size=4, held=False)
    seq = list(range(8))
    cache.insert(seq, cache.alloc_device(8))
    m = cache.match_prefix(seq, lock=True, count=False)
    hits, before = m.node.hits, cache.metrics.snapshot()
    with pytest.raises(ValueError, match="n_tokens must be the query's length"):
        cache.count_match(m, bad)
    assert m.node.hits == hits and cache.metrics.snapshot() == before
    cache.count_match(m, 8)
    assert cache.metrics.snapshot()["query_tokens_total"] == before["query_tokens_total"] + 8


def test_a_second_cache_over_a_device_pool_in_use_is_refused():
    """Each cache hands out its pool's slots from an allocator of its own: a second one over the
    same pool gave out the slots the first held, and a match of the first then read another
    prompt's KV. Refused while the first lives; accepted once it is dropped."""
    cache, dev, host, _ = make_cache(page_size=4, dev_pages=8, host_pages=16, held=False)
    with pytest.raises(ValueError, match="device_pool already has a HiCache"):
        HiCache(dev, None, CacheConfig(page_size=4))
    other = make_device_pool("mha", 32, 4, torch.float32, 2)
    assert HiCache(other, None, CacheConfig(page_size=4)).alloc_device(4) is not None  # another pool: fine
    del cache
    again = HiCache(dev, None, CacheConfig(page_size=4))
    assert again.alloc_device(4) is not None
