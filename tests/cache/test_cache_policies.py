"""Write policies, eviction policies, preemption through the host tier, backpressure."""

from __future__ import annotations

import pytest
import torch

from cache_testlib import kv_matches, kv_values, make_cache, serve

SEQ_A = list(range(100, 116))        # 4 pages of 4
SEQ_B = list(range(200, 216))
SEQ_C = list(range(300, 316))


def snap(cache):
    return cache.metrics.snapshot()


def node_of(cache, seq, ns="default"):
    return cache.match_prefix(torch.tensor(seq), namespace=ns).node


# -- write policies ----------------------------------------------------------------

def test_write_through_backs_up_on_insert_and_host_copy_counts_only_when_complete():
    cache, dev, host, engine = make_cache(write_policy="write_through")
    serve(cache, SEQ_A)
    assert engine.issued == 1 and len(engine.pending) == 1
    node = node_of(cache, SEQ_A)
    assert node.host is not None and not node.host_ready      # in flight: not host-resident yet
    assert not cache.tiers.host_evictable(node) and not cache.tiers.device_evictable(node)
    engine.release()
    cache.poll()
    assert node.host_ready
    assert cache.evict_device(16) == 16
    m = cache.match_prefix(SEQ_A)
    assert (m.device_len, m.host_len) == (0, 16)
    assert serve(cache, SEQ_A)[1] == 16                      # loaded back, bytes checked


def test_eviction_waits_for_a_backup_in_flight_instead_of_freeing_its_source():
    cache, dev, host, engine = make_cache(write_policy="write_through")
    serve(cache, SEQ_A)
    assert engine.pending
    assert cache.evict_device(16) == 16       # had to wait for the copy to land first
    assert not engine.pending and snap(cache)["stall_seconds_total"] > 0
    assert serve(cache, SEQ_A)[0].host_len == 16


def test_write_through_selective_backs_up_hot_nodes_only():
    cache, dev, host, engine = make_cache(write_policy="write_through_selective", selective_hits=2, held=False)
    serve(cache, SEQ_A)
    serve(cache, SEQ_B)
    assert node_of(cache, SEQ_A).host is None      # first hit: still cold
    assert node_of(cache, SEQ_A).host is not None  # second hit: backed up
    assert node_of(cache, SEQ_B).host is None      # one hit: cold
    cache.evict_device(10**6)
    assert cache.match_prefix(SEQ_A).host_len == 16        # hot: demoted to the host
    assert cache.match_prefix(SEQ_B).host_len == 0         # cold: dropped
    assert snap(cache)["dropped_tokens_total"] == 16


def test_write_back_copies_only_on_eviction():
    cache, dev, host, engine = make_cache(write_policy="write_back")
    serve(cache, SEQ_A)
    assert engine.issued == 0
    assert cache.evict_device(16) == 16
    assert engine.issued == 1 and snap(cache)["demoted_tokens_total"] == 16
    m, cached = serve(cache, SEQ_A)
    assert (m.host_len, cached) == (16, 16)


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "layer_first"), ("dsa", "layer_first")])
def test_preempted_request_resumes_from_the_host(write_policy, kind, layout):
    """The engine's preemption: insert the full pages, unlock, the device evicts, resume loads back."""
    cache, dev, host, engine = make_cache(kind=kind, layout=layout, write_policy=write_policy, held=False)
    seq = list(range(50, 64))                      # 3 full pages + 2 tokens
    serve(cache, seq)
    cache.evict_device(10**6)
    assert cache.device_free_tokens() == cache.tiers.device_alloc.size
    resumed = seq + [7, 8, 9]
    m, cached = serve(cache, resumed)
    assert (m.device_len, m.host_len, cached) == (0, 12, 12)
    m2 = cache.match_prefix(resumed)
    assert (m2.device_len, m2.host_len) == (16, 0)
    assert snap(cache)["hit_tokens_total.host"] == 12


def test_recomputed_host_part_is_adopted_by_the_device():
    cache, dev, host, engine = make_cache(held=False)
    serve(cache, SEQ_A)
    cache.evict_device(10**6)
    serve(cache, SEQ_A, load=False)                # the engine recomputed instead of loading
    m = cache.match_prefix(SEQ_A)
    assert (m.device_len, m.host_len) == (16, 0)
    node = m.node
    assert node.host is not None and node.device is not None  # both tiers now


# -- eviction policies -----------------------------------------------------------------

@pytest.mark.parametrize("policy,survivor", [("lru", SEQ_B), ("lfu", SEQ_A)])
def test_eviction_order(policy, survivor):
    cache, dev, host, engine = make_cache(eviction=policy, host_pages=0, dev_pages=12)
    for seq in (SEQ_A, SEQ_B, SEQ_C):
        serve(cache, seq)
    for _ in range(3):
        cache.match_prefix(SEQ_A)      # A: most hits
    cache.match_prefix(SEQ_B)          # B: most recent
    assert cache.evict_device(32) == 32
    for seq in (SEQ_A, SEQ_B, SEQ_C):
        assert cache.match_prefix(seq).device_len == (16 if seq is survivor else 0)


def test_eviction_goes_leaf_first_and_keeps_locked_paths():
    cache, dev, host, engine = make_cache(host_pages=0, dev_pages=12)
    serve(cache, SEQ_A)
    serve(cache, SEQ_A[:8] + [1, 2, 3, 4, 5, 6, 7, 8])     # shares 2 pages with A
    m = cache.match_prefix(SEQ_A)
    cache.lock(m.node)
    assert cache.evict_device(10**6) == 8                    # only the unlocked branch could go
    assert cache.match_prefix(SEQ_A).device_len == 16
    cache.unlock(m.node)
    assert cache.evict_device(10**6) == 16
    assert cache.tiers.device_alloc.available_pages() == 12


# -- backpressure ------------------------------------------------------------------------

def test_alloc_device_refuses_when_only_locked_and_owned_pages_remain():
    cache, dev, host, engine = make_cache(host_pages=0, dev_pages=8)
    serve(cache, SEQ_A)
    m = cache.match_prefix(SEQ_A)
    cache.lock(m.node)
    held = cache.alloc_device(12)
    assert held is not None
    assert cache.device_free_tokens() == 4
    free_before = cache.tiers.device_alloc.available_pages()
    assert cache.alloc_device(8) is None
    assert cache.tiers.device_alloc.available_pages() == free_before
    assert snap(cache)["backpressure_total.alloc_device"] == 1
    cache.unlock(m.node)
    assert cache.alloc_device(8) is not None                  # the cached pages may go now


def test_load_back_refuses_without_device_room_and_changes_nothing():
    cache, dev, host, engine = make_cache(dev_pages=4, host_pages=8, held=False)
    serve(cache, SEQ_A)
    cache.evict_device(16)
    m = cache.match_prefix(SEQ_A)
    cache.lock(m.node)
    hog = cache.alloc_device(16)
    assert cache.load_back(m) is None
    assert m.node.device is None and m.node.host_ready
    assert snap(cache)["backpressure_total.load_back"] == 1
    cache.free_device(hog)
    r = cache.load_back(m)
    assert r is not None and r.loaded_tokens == 16
    assert kv_matches(dev, r.device_indices, kv_values(SEQ_A, 0))
    cache.unlock(m.node)


def test_full_backup_queue_skips_write_through_then_demotes_on_eviction():
    cache, dev, host, engine = make_cache(write_policy="write_through", max_inflight_backups=1)
    serve(cache, SEQ_A)
    serve(cache, SEQ_B)
    assert engine.issued == 1
    assert snap(cache)["backups_skipped_total.queue_full"] == 1
    assert snap(cache)["queue_depth.backup"] == 1
    cache.evict_device(10**6)
    assert cache.match_prefix(SEQ_B).host_len == 16          # demoted once the queue had room


def test_host_full_drops_what_it_cannot_keep():
    cache, dev, host, engine = make_cache(write_policy="write_back", dev_pages=8, host_pages=4, held=False)
    serve(cache, SEQ_A)
    serve(cache, SEQ_B)
    cache.evict_device(10**6)
    held = [cache.match_prefix(s).host_len for s in (SEQ_A, SEQ_B)]
    assert sorted(held) == [0, 16]
    assert cache.tiers.host_alloc.available_pages() == 0
