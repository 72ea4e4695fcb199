"""A failed transfer or a failing storage hook never disables the cache: what fails is dropped
or kept by rule, counted, and the cache goes on (and ``check()`` finds it whole)."""

from __future__ import annotations

import pytest
import torch

from cache_regressions_testlib import _put
from cache_testlib import kv_matches, kv_values, make_cache, serve
from kvtier.cache import LoadFailedError, StorageHook


def _host_only(cache, dev, engine, *seqs):
    """Cache ``seqs`` on the device and the host, then evict their device copies."""
    for seq in seqs:
        _put(cache, dev, seq)
    engine.release()
    cache.poll()
    assert cache.evict_device(dev.size) == sum(len(s) for s in seqs)


# -- 1. a failed asynchronous load ---------------------------------------------------------

def _failing_load():
    """A cache whose prefix ``a`` is on the host only, matched, locked, and loading back by a
    load that will fail partway: (cache, device pool, engine, a, match, load result)."""
    cache, dev, host, engine = make_cache(page_size=4, dev_pages=8, host_pages=16)
    a = list(range(8))
    _host_only(cache, dev, engine, a)
    m = cache.match_prefix(a, lock=True)
    engine.fail_loads = 1
    return cache, dev, engine, a, m, cache.load_back(m)


def test_a_failed_load_is_dropped_and_the_cache_goes_on():
    """A load handle that fails partway (a host link fault): its requests are told, its device
    pages hold no valid KV and are never served, the host copy is kept, a metric counts it,
    and every call works after it (before, every poll, match and alloc raised from then on)."""
    cache, dev, host, engine = make_cache(page_size=4, dev_pages=8, host_pages=16)
    a, b = list(range(8)), list(range(100, 108))
    _host_only(cache, dev, engine, a, b)
    free = cache.device_free_tokens()
    m = cache.match_prefix(a, lock=True)
    engine.fail_loads = 1
    r = cache.load_back(m)
    engine.release()
    assert cache.poll() == 1
    assert cache.metrics.snapshot()["transfer_failures_total.load"] == 1
    with pytest.raises(LoadFailedError, match="match_prefix again"):
        r.layer_load.wait_layer(1)
    assert r.layer_load.failed
    cache.check()
    again = cache.match_prefix(a)                   # nothing of it is ready on the device
    assert (again.device_len, again.host_len, again.host_only_len) == (0, 8, 8)
    assert cache.alloc_device(4) is not None        # the cache goes on
    assert serve(cache, b) is not None
    cache.unlock(m.node)                            # its last holder lets go: the pages are freed
    cache.poll()
    assert cache.device_free_tokens() == free - 4
    cache.check()
    m2 = cache.match_prefix(a, lock=True)           # loaded again from the host copy, intact
    r2 = cache.load_back(m2)
    engine.release()
    for layer in range(dev.layer_num):
        r2.layer_load.wait_layer(layer)
    assert kv_matches(dev, r2.device_indices, kv_values(a, 0))
    cache.unlock(m2.node)
    cache.check()


def test_a_failed_load_still_held_is_loaded_again_into_its_own_pages():
    """A request that matches the failed pages while another still holds them loads them again
    into the same slots (nobody else may write them), and reads the right bytes."""
    cache, dev, engine, a, m1, r1 = _failing_load()
    engine.release()
    cache.poll()
    m2 = cache.match_prefix(a, lock=True)
    assert m2.host_only_len == 8
    r2 = cache.load_back(m2)
    assert torch.equal(r2.device_indices, r1.device_indices) and r2.loaded_tokens == 8
    r2.layer_load.synchronize()
    assert kv_matches(dev, r2.device_indices, kv_values(a, 0))
    assert cache.match_prefix(a).device_len == 8
    with pytest.raises(LoadFailedError):
        r1.layer_load.synchronize()                 # the first request was told all the same
    cache.unlock(m1.node)
    cache.unlock(m2.node)
    cache.check()


def test_clear_works_with_a_failed_load_in_flight():
    """clear() raised the load's raw error, and the cache could not be cleared at all."""
    cache, dev, engine, a, m, r = _failing_load()
    cache.unlock(m.node)
    cache.clear()
    cache.check()
    assert cache.tiers.device_alloc.available_pages() == cache.tiers.device_alloc.num_pages
    assert cache.host_pool.allocator.available_pages() == cache.host_pool.allocator.num_pages


def test_a_load_waited_on_before_the_cache_polls_tells_its_request():
    """The request sees the failure in wait_layer even where its engine raises only there."""
    cache, dev, engine, a, m, r = _failing_load()
    with pytest.raises(LoadFailedError, match="host link fault"):
        r.layer_load.wait_layer(0)
    assert cache.poll() == 1 and cache.match_prefix(a).device_len == 0
    cache.unlock(m.node)
    cache.check()


# -- 2. failed demotions --------------------------------------------------------------------

def _boom(*args, **kwargs):
    raise RuntimeError("the copy engine refused the backup")


@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
@pytest.mark.parametrize("how", ["raises", "fails later"])
def test_backups_that_keep_failing_still_free_the_room_asked_for(policy, how):
    """Every victim's demotion fails: the victim is dropped, counted, and alloc_device gets its
    room (write_back raised from every alloc_device when the backup raised)."""
    cache, dev, host, engine = make_cache(page_size=4, dev_pages=8, host_pages=16, write_policy=policy,
                                          selective_hits=1)
    if how == "raises":
        engine.backup = _boom
    else:
        engine.fail_backups = 10**6
    seqs = [list(range(10 * i, 10 * i + 8)) for i in range(4)]
    for seq in seqs:
        _put(cache, dev, seq)                      # the device full of unlocked leaves
        cache.match_prefix(seq)                    # hot, for the selective policy
    engine.release()
    cache.poll()
    slots = cache.alloc_device(16)
    assert slots is not None and len(slots) == 16
    s = cache.metrics.snapshot()
    assert s["dropped_tokens_total"] >= 16
    assert s["backups_skipped_total.error"] + s["transfer_failures_total.backup"] >= 1
    cache.check()
    cache.free_device(slots)
    assert cache.evict_device(16) == 16
    cache.check()


def test_a_failed_demotion_of_a_page_matched_meanwhile_keeps_it():
    """A victim locked by a request while its demotion was in flight is kept (a locked page is
    never dropped); only the demotion is undone and counted."""
    cache, dev, host, engine = make_cache(page_size=4, dev_pages=8, host_pages=16, write_policy="write_back")
    a = list(range(8))
    _put(cache, dev, a)
    engine.fail_released_backups = 1
    assert cache.tiers.evict_device(2) == 0        # the demotion started, in flight
    m = cache.match_prefix(a, lock=True)
    cache.tiers.wait_all()
    assert m.node.device is not None and m.node.host is None and m.device_len == 8
    assert cache.metrics.snapshot()["transfer_failures_total.backup"] == 1
    cache.unlock(m.node)
    cache.check()


# -- 3. a storage hook that calls back into the cache --------------------------------------

class Reentrant(StorageHook):
    """Offered pages: checked against their tokens' bytes, and then it calls back into the cache."""

    def __init__(self, cache, seqs, every=True, evict=1, fail=False):
        self.cache, self.every, self.evict, self.fail = cache, every, evict, fail
        self.by_hash = {h: (seq, i) for seq in seqs for i, h in enumerate(cache.page_hashes(seq))}
        self.seen: list[bytes] = []
        self.calls = 0

    def offer(self, page_hashes, host_indices):
        self.calls += 1
        ps = self.cache.page_size
        for j, h in enumerate(page_hashes):
            seq, i = self.by_hash[h]
            self.seen.append(h)
            assert _host_page_matches(self.cache, int(host_indices[j * ps]), seq, i), "offered bytes changed"
        if self.every or self.calls == 1:
            self.cache.evict_host(self.evict * ps)     # as a storage tier making room would
            self.cache.match_prefix(list(range(50)))
        if self.fail:
            raise OSError("the storage server is gone")


def _host_page_matches(cache, slot, seq, page):
    """Whether host page at ``slot`` holds the bytes of page ``page`` of ``seq`` (device pattern)."""
    ps, host, dev = cache.page_size, cache.host_pool, cache.device_pool
    probe = cache.tiers.device_alloc.alloc_pages(1)
    if probe is None:
        return True  # no device page to load it into: nothing to compare against here
    slots = torch.arange(int(probe[0]) * ps, int(probe[0]) * ps + ps)
    try:
        for layer in range(dev.layer_num):
            host.load_to_device_per_layer(dev, torch.arange(slot, slot + ps), slots, layer)
        return kv_matches(dev, slots, kv_values(seq, 0)[page * ps:(page + 1) * ps])
    finally:
        cache.tiers.device_alloc.free_pages(probe)


@pytest.mark.parametrize("every", [False, True])
def test_a_storage_hook_may_evict_from_inside_offer(every):
    """evict_host from offer(): a TypeError escaped (the node's host pages already gone), and a
    hook re-entering every time recursed without end. Eviction is re-entrant: the tree is
    settled before offer is called, and the offered pages stay untouched until it returns."""
    seqs = [list(range(10 * i, 10 * i + 8)) for i in range(6)]
    cache, dev, host, engine = make_cache(page_size=4, dev_pages=16, host_pages=12, held=False)
    hook = Reentrant(cache, seqs, every=every)
    cache.tiers.storage_hook = hook
    for seq in seqs[:3]:
        _put(cache, dev, seq)
    cache.evict_device(64)
    for seq in seqs[3:]:
        _put(cache, dev, seq)                      # write-through needs host room: host eviction
    assert cache.evict_host(8) >= 8
    assert cache.alloc_device(16) is not None
    assert len(hook.seen) == len(set(hook.seen)) > 0
    cache.check()
    assert host.allocator.available_pages() + cache.tree.host_pages == host.allocator.num_pages


def test_a_hook_re_entering_every_time_over_a_large_tree_does_not_recurse_without_end():
    cache, dev, host, engine = make_cache(page_size=1, dev_pages=8, host_pages=1200, held=False)
    seqs = [[i] for i in range(1200)]
    for seq in seqs:
        cache.insert(seq, cache.alloc_device(1))
        cache.evict_device(1)
    hook = Reentrant(cache, seqs, every=True)
    hook.offer = lambda hashes, idx: (hook.seen.extend(hashes), cache.evict_host(1))
    cache.tiers.storage_hook = hook
    cache.evict_host(1)
    assert len(hook.seen) == 1200 and cache.tree.host_pages == 0
    cache.check()


def test_a_storage_hook_that_fails_never_stops_eviction():
    cache, dev, host, engine = make_cache(page_size=4, dev_pages=8, host_pages=8, held=False)
    seqs = [list(range(10 * i, 10 * i + 8)) for i in range(4)]
    hook = Reentrant(cache, seqs, every=False, evict=0, fail=True)
    cache.tiers.storage_hook = hook
    for seq in seqs:
        _put(cache, dev, seq)
    assert cache.evict_host(32) == 32 or cache.tree.host_pages == 0
    s = cache.metrics.snapshot()
    assert s["storage_offer_failures_total"] >= 1 and s["storage_offered_pages_total"] >= 2
    cache.check()
    assert host.allocator.available_pages() + cache.tree.host_pages == host.allocator.num_pages


# -- check() -----------------------------------------------------------------------------------

@pytest.mark.parametrize("corrupt, match", [
    (lambda c, n: c.tiers.owner.__setitem__(int(n.device[0]), 1), "marked the tree's"),
    (lambda c, n: setattr(n, "lock_ref", 3), "lock_ref 3 is not its own"),
    (lambda c, n: setattr(c.tree, "host_pages", 99), "host_pages=99"),
    (lambda c, n: setattr(n, "host_ready", False), "host pages not ready and no backup"),
    (lambda c, n: c.tiers.device_alloc.free_pages(n.device[:1]), "free in the allocator but the tree's"),
    (lambda c, n: c.host_pool.allocator.free_pages(n.host[:1]), "is held but free in the allocator"),
    (lambda c, n: setattr(n, "dev_children", 2), "counts 2 children on the device"),
])
def test_check_names_the_first_invariant_broken(corrupt, match):
    from kvtier.validate import InvariantError
    cache, dev, host, engine = make_cache(page_size=4, dev_pages=8, host_pages=16)
    serve(cache, list(range(8)))
    engine.release()
    cache.poll()
    cache.check()
    dev.check()
    host.check()
    node = cache.match_prefix(list(range(8))).node
    corrupt(cache, node)
    with pytest.raises(InvariantError, match=match):
        cache.check()


def test_pool_checks_name_a_replaced_buffer():
    from kvtier.validate import InvariantError
    cache, dev, host, engine = make_cache(page_size=4)
    dev.k_buffer[1] = dev.k_buffer[0]
    with pytest.raises(InvariantError, match=r"k_buffer\[1\] is not layer 1 of the k stack"):
        dev.check()
    host.allocator._free_pages -= 1
    with pytest.raises(InvariantError, match="counts"):
        host.check()
