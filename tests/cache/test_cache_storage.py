"""The storage tier inside the cache, on real directories: saves (write-back, write-through), lookups
and prefetches under each policy, shared prefetches, the split the advice picks, damaged and
missing stores, metrics, bad input. Every page a request reads is checked byte for byte (KV bytes
derive from the tokens they belong to)."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
from prometheus_client import generate_latest

from cache_testlib import kv_matches, kv_values, make_storage_cache, write_kv
from kvtier.cache import CacheConfig, HiCache, StorageHook
from kvtier.cache.policy import storage_split
from kvtier.storage.tier import TierConfig

SEQ = list(range(100, 140))   # 10 pages of 4


def put(cache, seq, ns_id=0):
    """Compute ``seq``'s KV into fresh device slots and insert it."""
    slots = cache.alloc_device(-(-len(seq) // cache.page_size) * cache.page_size)
    write_kv(cache.device_pool, slots[: len(seq)], kv_values(seq, ns_id))
    cache.insert(seq, slots[: len(seq)])
    cache.free_device(slots[len(seq) // cache.page_size * cache.page_size:])


def to_storage_only(cache, seq):
    """``seq`` cached, then saved and dropped from both tiers: only the store holds it."""
    put(cache, seq)
    cache.poll()
    cache.evict_device(10**6)
    cache.evict_host(10**6)
    assert cache.flush(30) and cache.tree.host_pages == 0 and cache.tree.device_pages == 0


def load(cache, m, **kw):
    """load_back, every layer waited for; returns the LoadResult."""
    r = cache.load_back(m, **kw)
    for layer in range(cache.device_pool.layer_num):
        r.layer_load.wait_layer(layer)
    return r


def assert_bytes(cache, r, seq):
    n = len(r.device_indices)
    assert kv_matches(cache.device_pool, r.device_indices, kv_values(seq, 0)[:n]), "loaded bytes are not the page's"


# -- the split ---------------------------------------------------------------------------------

PAGE = dict(page_tokens=16, page_bytes=16 * 1000)   # 1 MB/s makes a page 16 ms


@pytest.mark.parametrize("load_bps, storage_bps, spt, arrived, want", [
    (1e9, 1e9, 1e-3, 0, 8),      # both fast against a millisecond a token: load it all
    (1e9, 1e5, 1e-3, 3, 3),      # the store reads a page in 160 ms, recomputing takes 16: the 3 arrived pay
    (1e9, 1e5, 1e-3, 0, 0),      # ... and with none arrived, nothing pays
    (1e4, 1e9, 1e-3, 5, 0),      # the host link itself is slower than recomputing: nothing
    (0.0, 0.0, 1e-3, 0, 8),      # nothing measured yet: loading measures it
    (1e9, 1.6e6, 1e-3, 2, 8),    # 10 ms from the store + 16 us to the device <= 16 ms: all
    (1e9, 1.5e6, 1e-3, 2, 2),    # 10.7 ms + ... > 16 ms x margin 0.6: the arrived prefix
])
def test_the_split_loads_the_prefix_that_pays(load_bps, storage_bps, spt, arrived, want):
    margin = 0.6 if storage_bps == 1.5e6 else 1.0
    assert storage_split(8, arrived, PAGE["page_tokens"], PAGE["page_bytes"], load_bps, storage_bps, spt,
                         margin) == want


# -- saves and loads ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind, layout", [("mha", "page_first"), ("mha", "layer_first"), ("mla", "page_first"),
                                          ("dsa", "layer_first")])
@pytest.mark.parametrize("write", ["write_back", "write_through"])
def test_a_page_saved_by_either_policy_comes_back_whole(tmp_path, kind, layout, write):
    cache, *_, tier = make_storage_cache(tmp_path, kind, layout, storage_write=write, storage_prefetch="wait_complete")
    to_storage_only(cache, SEQ)
    m = cache.match_prefix(SEQ + [1], lock=True)
    assert (m.device_len, m.host_len, m.storage_len) == (0, 0, 40)
    cache.check()
    r = load(cache, m)
    assert (len(r.device_indices), r.loaded_tokens, r.storage_tokens) == (40, 40, 40)
    assert_bytes(cache, r, SEQ)
    assert r.node is not m.node and r.node.lock_ref == 1 and m.node.own_locks == 0  # the lock moved down
    cache.unlock(r.node)
    cache.check()
    snap = cache.metrics.snapshot()
    assert snap["hit_tokens_total.storage"] == 40 and snap["storage_prefetches_total.complete"] == 1
    assert snap["storage_written_pages_total"] == 10
    assert cache.match_prefix(SEQ).device_len == 40  # the pages from storage are cached in the tree now


def test_write_through_saves_a_page_once_its_backup_lands(tmp_path):
    cache, _, _, held, tier = make_storage_cache(tmp_path, held=True, storage_write="write_through")
    put(cache, SEQ)
    assert tier.flush(10) and tier.lookup(cache.page_hashes(SEQ)) == 0   # the backup is held
    held.release()
    cache.poll()
    assert tier.flush(10) and tier.lookup(cache.page_hashes(SEQ)) == 10
    cache.evict_device(10**6)
    cache.evict_host(10**6)
    assert tier.metrics.snapshot()["written_pages_total"] == 10   # eviction does not write them again


def test_write_through_saves_what_its_queue_cannot_take_yet_later(tmp_path):
    """A backup larger than the tier's queue is not dropped: what does not fit waits in the backlog,
    survives a split of its node, and is saved as the queue drains (at the latest by flush)."""
    from kvtier.storage.format import PageCodec
    blob = PageCodec(make_storage_cache(tmp_path / "probe")[-1].salt).blob_bytes
    cache, *_, tier = make_storage_cache(tmp_path / "s", storage_write="write_through",
                                         tier_config=TierConfig(max_pending_bytes=2 * blob, batch_pages=1))
    tier.backend.write_gate.clear()          # the disk stalls: the queue fills with 2 pages
    put(cache, SEQ)
    cache.poll()
    assert cache.storage.backlog and sum(cache.storage.backlog.values()) == 8
    put(cache, SEQ[:24] + [7] * 8)           # splits the node after 6 pages, inside the backlog's part
    tier.backend.write_gate.set()
    assert cache.flush(30)
    assert tier.lookup(cache.page_hashes(SEQ)) == 10 and not cache.storage.backlog
    snap = tier.metrics.snapshot()
    assert snap["save_dropped_pages_total.queue_full"] == 0 and snap["written_pages_total"] >= 10
    cache.check()


def test_write_back_saves_only_what_host_eviction_frees(tmp_path):
    cache, *_, tier = make_storage_cache(tmp_path)
    put(cache, SEQ[:32])
    put(cache, SEQ)           # two nodes: 8 pages, and a leaf of 2
    cache.poll()
    assert tier.flush(10) and tier.lookup(cache.page_hashes(SEQ)) == 0
    cache.evict_device(10**6)
    cache.evict_host(8)
    assert cache.flush(10)
    keys = cache.page_hashes(SEQ)
    assert tier.lookup(keys[8:]) == 2 and tier.lookup(keys) == 0   # the two leaf pages went first


SEQS = [list(range(1000 * s, 1000 * s + 16)) for s in range(1, 5)]   # four prompts of 4 pages


@pytest.mark.parametrize("ahead, dropped", [(0.25, 0), (0.0, 2)])
def test_write_back_saves_ahead_what_a_burst_of_eviction_frees(tmp_path, ahead, dropped):
    """A full host tier under write_back saves the pages next in line for eviction while its queue
    (2 pages here) has room, so evicting a quarter of the host in one burst loses none of them;
    with storage_save_ahead=0 the same burst drops what the queue cannot take."""
    from kvtier.storage.format import PageCodec
    blob = PageCodec(make_storage_cache(tmp_path / "probe")[-1].salt).blob_bytes
    cache, *_, tier = make_storage_cache(tmp_path / "s", storage_save_ahead=ahead,
                                         tier_config=TierConfig(max_pending_bytes=2 * blob, batch_pages=1))
    for seq in SEQS:
        put(cache, seq)
    deadline = time.monotonic() + 10
    while (cache.metrics.snapshot()["storage_saved_ahead_pages_total"] < 4 * (ahead > 0)
           and time.monotonic() < deadline):
        cache.poll()
        tier.flush(5)
        time.sleep(0.002)
    assert cache.host_pool.allocator.available_pages() == 0 and tier.flush(10)
    assert tier.metrics.snapshot()["written_pages_total"] == 4 * (ahead > 0)   # no more than needed
    assert tier.lookup(cache.page_hashes(SEQS[1])) == 0
    cache.evict_device(10**6)
    assert cache.evict_host(16) == 16   # the least recently used prompt's pages: SEQS[0]
    assert cache.flush(10)
    snap = tier.metrics.snapshot()
    assert snap["save_dropped_pages_total.queue_full"] == dropped
    assert tier.lookup(cache.page_hashes(SEQS[0])) == 4 - dropped
    assert snap["written_pages_total"] == 4 - dropped   # saved ahead, not written again at eviction
    assert not cache.storage.saved
    cache.check()


def test_pages_read_from_the_store_are_not_saved_again_when_evicted(tmp_path):
    cache, *_, tier = make_storage_cache(tmp_path, storage_prefetch="wait_complete")
    to_storage_only(cache, SEQ)
    before = tier.metrics.snapshot()
    m = cache.match_prefix(SEQ, lock=True)
    r = load(cache, m)
    assert_bytes(cache, r, SEQ)
    cache.unlock(r.node)
    cache.evict_device(10**6)
    assert cache.evict_host(10**6) == 40 and cache.flush(10)
    after = tier.metrics.snapshot()
    for key in ("written_pages_total", "save_skipped_pages_total", "save_dropped_pages_total.queue_full"):
        assert after[key] == before[key], key   # not even copied out to be found stored
    assert tier.lookup(cache.page_hashes(SEQ)) == 10 and not cache.storage.saved


def test_only_the_rank_0_writes_mla_pages_and_every_rank_reads_them(tmp_path):
    writer, *_ = make_storage_cache(tmp_path, "mla", tp=(0, 2))
    to_storage_only(writer, SEQ)
    other, *_, tier = make_storage_cache(tmp_path, "mla", tp=(1, 2), storage_prefetch="wait_complete")
    put(other, SEQ)
    other.poll()
    other.evict_device(10**6)
    other.evict_host(10**6)
    assert other.flush(10) and tier.metrics.snapshot()["written_pages_total"] == 0
    m = other.match_prefix(SEQ, lock=True)
    assert m.storage_len == 40
    r = load(other, m)
    assert_bytes(other, r, SEQ)
    other.unlock(r.node)


def test_a_second_cache_over_the_same_directory_loads_what_the_first_saved(tmp_path):
    first, *_, tier = make_storage_cache(tmp_path)
    to_storage_only(first, SEQ)
    tier.close()
    second, *_ = make_storage_cache(tmp_path, storage_prefetch="wait_complete")
    m = second.match_prefix(SEQ + [7, 7, 7, 7, 7], lock=True)
    assert m.storage_len == 40
    r = load(second, m)
    assert_bytes(second, r, SEQ)
    second.unlock(r.node)


# -- prefetch policies -------------------------------------------------------------------------

def test_best_effort_takes_what_arrived_and_the_rest_is_recomputed(tmp_path):
    cache, *_, tier = make_storage_cache(tmp_path, storage_prefetch="best_effort")
    to_storage_only(cache, SEQ)
    tier.backend.open_gate.clear()
    m = cache.match_prefix(SEQ, lock=True)
    assert m.storage_len == 40
    start = time.perf_counter()
    r = load(cache, m)
    assert time.perf_counter() - start < 1.0 and r.storage_tokens == 0 and len(r.device_indices) == 0
    tier.backend.open_gate.set()
    cache.unlock(r.node)
    cache.check()
    assert cache.tree.host_pages == 0 and not cache.storage.pending   # nothing arrived; its pages freed


def test_timeout_gives_up_at_the_deadline_with_what_arrived(tmp_path):
    cfg = TierConfig(prefetch_timeout_s=0.3, prefetch_timeout_per_page_s=0.0, batch_pages=4)
    cache, *_, tier = make_storage_cache(tmp_path, tier_config=cfg)
    to_storage_only(cache, SEQ)
    store = tier.backend
    real = store.get_into

    def second_batch_hangs(keys, buffers):   # the first batch of 4 pages arrives, then the disk stalls
        if store.reads >= 1:
            store.open_gate.clear()
        return real(keys, buffers)
    store.get_into = second_batch_hangs
    m = cache.match_prefix(SEQ, lock=True)
    start = time.perf_counter()
    r = load(cache, m)
    waited = time.perf_counter() - start
    store.open_gate.set()
    assert 0.25 < waited < 2.0 and r.storage_tokens == 16
    assert_bytes(cache, r, SEQ)
    cache.unlock(r.node)
    cache.check()


def test_two_matches_share_one_prefetch_and_one_that_gives_up_leaves_it_to_the_other(tmp_path):
    cache, *_, tier = make_storage_cache(tmp_path, storage_prefetch="wait_complete")
    to_storage_only(cache, SEQ)
    a = cache.match_prefix(SEQ, lock=True)
    b = cache.match_prefix(SEQ[:24], lock=True)
    assert a.prefetch is b.prefetch and (a.storage_len, b.storage_len) == (40, 24)
    assert tier.metrics.snapshot()["lookup_pages_total"] == 10   # b asked the store nothing
    cache.check()
    cache.unlock(a.node)                                         # a gives up: the prefetch goes on
    r = load(cache, b)
    assert r.storage_tokens == 24
    assert_bytes(cache, r, SEQ)
    cache.unlock(r.node)
    m = cache.match_prefix(SEQ)   # what arrived past b's part joined the host tier; the rest, a new prefetch
    assert m.total_len >= 24 and m.total_len + m.storage_len == 40 and m.stored_len == m.total_len - 24
    cache.check()


def test_a_prefetch_nobody_claims_joins_the_host_tier_at_a_poll(tmp_path):
    cache, *_ = make_storage_cache(tmp_path)
    to_storage_only(cache, SEQ)
    m = cache.match_prefix(SEQ)
    assert m.storage_len == 40 and not m.prefetch.handle.wait(10) < 10
    cache.poll()
    assert not cache.storage.pending and cache.tree.host_pages == 10
    cache.check()
    assert cache.match_prefix(SEQ).host_len == 40


def test_the_advice_splits_and_counts_a_storage_hit_it_skips(tmp_path):
    cache, *_, tier = make_storage_cache(tmp_path, load_gbps_prior=1.0, storage_prefetch="wait_complete")
    to_storage_only(cache, SEQ)
    m = cache.match_prefix(SEQ, lock=True)
    m.prefetch.handle.wait(10)
    assert tier.read_rate.bps > 0
    assert cache.advise(m, prefill_seconds_per_token=1.0).storage_tokens == 40   # recomputing is slow
    skip = cache.advise(m, prefill_seconds_per_token=1e-12)
    assert not skip.load and skip.storage_tokens == 0
    assert tier.metrics.snapshot()["prefetches_total.skipped"] == 1
    r = load(cache, m, storage_tokens=skip.storage_tokens)
    assert r.storage_tokens == 0 and r.node is m.node
    cache.unlock(r.node)
    cache.check()


# -- faults ------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_page_damaged_on_disk_is_a_miss_and_never_loaded(tmp_path, damage):
    cache, *_, tier = make_storage_cache(tmp_path, storage_prefetch="wait_complete")
    to_storage_only(cache, SEQ)
    victim = tier.backend.path_of(tier.keys(cache.page_hashes(SEQ))[5])
    data = bytearray(open(victim, "rb").read())
    if damage == "flip":
        data[-3] ^= 0x40
    data = data[: len(data) // 2] if damage == "truncate" else b"" if damage == "empty" else data
    open(victim, "wb").write(data)
    m = cache.match_prefix(SEQ, lock=True)
    r = load(cache, m)
    assert r.storage_tokens == 20 and len(r.device_indices) == 20   # pages 0-4; page 5 on is recomputed
    assert_bytes(cache, r, SEQ)
    cache.unlock(r.node)
    snap = cache.metrics.snapshot()
    assert snap["storage_corrupt"] == 1 and snap["storage_foreign"] == 0
    assert cache.match_prefix(SEQ).total_len == 20 and tier.lookup(cache.page_hashes(SEQ)) == 5  # deleted


def test_a_store_whose_directory_is_removed_is_skipped_and_the_cache_goes_on(tmp_path):
    cfg = TierConfig(health_interval_s=0.05)
    cache, *_, tier = make_storage_cache(tmp_path / "store", tier_config=cfg, storage_prefetch="wait_complete")
    to_storage_only(cache, SEQ)
    shutil.rmtree(tmp_path / "store")
    m = cache.match_prefix(SEQ, lock=True)
    assert m.storage_len == 0 and not tier.healthy()
    put(cache, SEQ)                     # computed again, cached again; evicting it offers it to a dead store
    cache.unlock(m.node)
    cache.poll()
    cache.evict_device(10**6)
    cache.evict_host(10**6)
    cache.check()
    os.makedirs(tmp_path / "store")
    deadline = time.monotonic() + 10
    while not tier.healthy() and time.monotonic() < deadline:
        tier.lookup(cache.page_hashes(SEQ))   # a lookup while down schedules the health probe
        time.sleep(0.02)
    assert tier.healthy()
    to_storage_only(cache, SEQ)
    m = cache.match_prefix(SEQ, lock=True)
    r = load(cache, m)
    assert r.storage_tokens == 40
    assert_bytes(cache, r, SEQ)
    cache.unlock(r.node)


def test_clear_stops_prefetches_in_flight_and_frees_their_pages(tmp_path):
    cache, _, host, _, tier = make_storage_cache(tmp_path)
    free = host.allocator.available_pages()
    to_storage_only(cache, SEQ)
    tier.backend.open_gate.clear()
    m = cache.match_prefix(SEQ)
    assert m.storage_len == 40 and cache.storage.pending
    cache.check()
    threading_gate_opens_later(tier.backend.open_gate)
    cache.clear()
    assert not cache.storage.pending and host.allocator.available_pages() == free
    cache.check()


def threading_gate_opens_later(gate, after: float = 0.2) -> None:
    import threading
    threading.Timer(after, gate.set).start()


# -- metrics and bad input ---------------------------------------------------------------------

def test_the_storage_tiers_metrics_are_in_the_caches_snapshot_and_registry(tmp_path):
    cache, *_ = make_storage_cache(tmp_path, storage_prefetch="wait_complete")
    to_storage_only(cache, SEQ)
    m = cache.match_prefix(SEQ, lock=True)
    cache.unlock(load(cache, m).node)
    snap = cache.metrics.snapshot()
    for key in ("storage_read_bytes_total", "storage_written_bytes_total", "storage_read_bytes_per_second",
                "storage_prefetches_total.complete", "storage_prefetches_total.partial",
                "storage_prefetches_total.timed_out", "storage_prefetches_total.skipped", "storage_capacity_bytes",
                "storage_used_bytes", "hit_tokens_total.storage", "queue_depth.prefetch",
                "storage_prefetch_refused_total.host_full"):
        assert key in snap, key
    assert snap["storage_read_bytes_total"] > 0 and snap["storage_read_bytes_per_second"] > 0
    text = generate_latest(cache.metrics.registry).decode()
    assert "kvtier_storage_read_bytes_total" in text and 'kvtier_cache_hit_tokens_total{tier="storage"} 40.0' in text


def test_bad_storage_settings_are_refused_before_anything_is_built(tmp_path):
    for field, value, words in (("storage_write", "sometimes", "storage_write"),
                                ("storage_prefetch", "never", "storage_prefetch"),
                                ("storage_min_pages", 0, "storage_min_pages"),
                                ("storage_save_ahead", -0.1, "storage_save_ahead"),
                                ("storage_save_ahead", 1.5, r"storage_save_ahead must be in \[0, 1\]"),
                                ("storage_save_ahead", float("nan"), "storage_save_ahead"),
                                ("storage_save_ahead", "all", "storage_save_ahead"),
                                ("max_inflight_prefetches", -1, "max_inflight_prefetches")):
        with pytest.raises(ValueError, match=words):
            CacheConfig(page_size=4, **{field: value})
    cache, dev, host, _, tier = make_storage_cache(tmp_path / "a")
    del cache
    with pytest.raises(ValueError, match="not both"):
        HiCache(dev, host, CacheConfig(page_size=4), storage=tier, storage_hook=StorageHook())
    with pytest.raises(ValueError, match="needs a host pool"):
        HiCache(dev, None, CacheConfig(page_size=4), storage=tier)
    with pytest.raises(TypeError, match="StorageTier"):
        HiCache(dev, host, CacheConfig(page_size=4), storage=tier.backend)
    _, other_dev, other_host, _, other_tier = make_storage_cache(tmp_path / "b", "mla")
    with pytest.raises(ValueError, match="does not hold this store's pages"):
        HiCache(dev, host, CacheConfig(page_size=4), storage=other_tier)
    cache = HiCache(dev, host, CacheConfig(page_size=4), storage=tier)
    m = cache.match_prefix(SEQ, lock=True)
    with pytest.raises(ValueError, match="storage_tokens"):
        cache.load_back(m, storage_tokens=-4)
    cache.unlock(m.node)
    cache.check()
    assert torch.equal(cache.match_prefix(SEQ).device_indices, torch.empty(0, dtype=torch.int64))
