"""The storage tier over a real file store: save, lookup and prefetch across host layouts,
backpressure, cancelled prefetches, metrics, and its argument checks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier.storage.file import FileBackend
from kvtier.storage.tier import READ_AHEAD, StorageTier, TierConfig
from storage_testlib import GatedFileBackend, canonical_page, chain, file_tier, salt_of, slots_of, small_pools


@pytest.mark.parametrize("kind", ["mha", "mla", "dsa"])
def test_pages_saved_from_one_layout_prefetch_into_another(tmp_path, kind):
    layouts = {"mha": ("page_head", "page_first"), "mla": ("page_first", "layer_first"),
               "dsa": ("layer_first", "layer_first")}[kind]
    _, (src, dst) = small_pools(kind, layouts, page_size=4, pages=8)
    tier = file_tier(tmp_path, src)
    keys = chain(5)
    assert tier.save(keys, None, src, slots_of([7, 1, 3, 0, 5], 4)) == 5 and tier.flush(10)
    assert tier.lookup(keys) == 5 and tier.lookup(keys[:2] + chain(1, tag=9)) == 2
    h = tier.prefetch(keys, dst, slots_of([0, 2, 4, 6, 1], 4), parent_key=None)
    assert h.wait(10) == 5 and h.outcome == "complete"
    for s, d in zip([7, 1, 3, 0, 5], [0, 2, 4, 6, 1]):
        assert canonical_page(dst, d) == canonical_page(src, s)
    snap = tier.metrics.snapshot()
    assert snap["written_pages_total"] == 5 and snap["read_pages_total"] == 5 and snap["hit_pages_total"] == 7
    assert snap["stored_pages"] == 5 and snap["read_bytes_per_second"] > 0 and tier.load_seconds(5) > 0
    tier.close()


def test_a_missing_page_ends_the_prefetch_and_leaves_later_slots_alone(tmp_path):
    _, (src, dst) = small_pools("mla", ("page_first", "page_first"), page_size=2, pages=8)
    tier = file_tier(tmp_path, src)
    keys = chain(4)
    tier.save(keys, None, src, slots_of(range(4), 2))
    tier.flush(10)
    tier.backend.delete(tier.keys(keys[1:2]))
    before = [canonical_page(dst, p) for p in range(4, 8)]
    h = tier.prefetch(keys, dst, slots_of(range(4, 8), 2))
    assert h.wait(10) == 1 and h.outcome == "partial"
    assert canonical_page(dst, 4) == canonical_page(src, 0)
    assert [canonical_page(dst, p) for p in range(5, 8)] == before[1:]
    assert tier.metrics.snapshot()["missing_pages_total"] == 1


def test_a_page_saved_with_another_parent_is_refused(tmp_path):
    _, (src, dst) = small_pools("mha", ("layer_first", "layer_first"), page_size=2, pages=4)
    tier = file_tier(tmp_path, src)
    keys = chain(2)
    tier.save(keys, [b"parent-a", keys[0]], src, slots_of([0, 1], 2))
    tier.flush(10)
    h = tier.prefetch(keys, dst, slots_of([2, 3], 2), parent_key=b"parent-b")
    assert h.wait(10) == 0 and h.outcome == "miss"
    assert tier.metrics.snapshot()["corrupt_pages_total.wrong_key"] == 1
    assert tier.lookup(keys) == 0     # a rejected page leaves the store; it is recomputed and saved again
    tier.save(keys, [b"parent-a", keys[0]], src, slots_of([0, 1], 2))
    tier.flush(10)
    assert tier.prefetch(keys, dst, slots_of([2, 3], 2), parent_key=b"parent-a").wait(10) == 2


def test_a_full_queue_drops_saves_and_counts_them_without_waiting(tmp_path):
    _, (src,) = small_pools("mha", ("page_first",), page_size=4, pages=8)
    blob = tier_blob(src)
    tier = file_tier(tmp_path, src, tier=TierConfig(max_pending_bytes=3 * blob, io_threads=1),
                     backend=GatedFileBackend)
    tier.backend.put_gate.clear()     # a store that answers late
    assert tier.save(chain(2), None, src, slots_of([0, 1], 4)) == 2
    assert tier.save(chain(3, tag=1), None, src, slots_of([2, 3, 4], 4)) == 1   # the queue holds 3 pages
    assert tier.save(chain(1, tag=2), None, src, slots_of([5], 4)) == 0
    snap = tier.metrics.snapshot()
    assert snap["save_dropped_pages_total.queue_full"] == 3 and snap["pending_bytes"] == 3 * blob
    tier.backend.put_gate.set()
    assert tier.flush(10) and tier.metrics.snapshot()["written_pages_total"] == 3
    assert tier.lookup(chain(2)) == 2 and tier.lookup(chain(3, tag=1)) == 1


def tier_blob(pool) -> int:
    from kvtier.storage.format import PageCodec
    return PageCodec(salt_of(pool)).blob_bytes


def test_pages_the_store_holds_are_not_written_again(tmp_path):
    _, (src,) = small_pools("mla", ("layer_first",), page_size=4, pages=8)
    tier = file_tier(tmp_path, src)
    keys = chain(4)
    tier.save(keys[:2], None, src, slots_of([0, 1], 4))
    tier.flush(10)
    tier.save(keys, None, src, slots_of([0, 1, 2, 3], 4))
    tier.flush(10)
    snap = tier.metrics.snapshot()
    assert snap["save_skipped_pages_total"] == 2 and snap["written_pages_total"] == 4


def test_after_cancel_nothing_more_is_written_into_the_slots(tmp_path):
    _, (src, dst) = small_pools("mha", ("page_first", "page_first"), page_size=4, pages=16)
    tier = file_tier(tmp_path, src, tier=TierConfig(batch_pages=1), backend=GatedFileBackend)
    keys = chain(6)
    tier.save(keys, None, src, slots_of(range(6), 4))
    tier.flush(10)
    store = tier.backend
    store.read_gate.clear()     # the second batch's read stalls until the test says so
    before = [canonical_page(dst, p) for p in range(8, 14)]
    h = tier.prefetch(keys, dst, slots_of(range(8, 14), 4))
    assert store.reading.wait(10)
    ready = h.cancel()
    store.read_gate.set()
    h.wait(10)
    assert h.done() and h.outcome == "timed_out" and h.ready_pages() == ready <= 1
    assert [canonical_page(dst, p) for p in range(8 + ready, 14)] == before[ready:]
    assert tier.metrics.snapshot()["prefetches_total.timed_out"] == 1


def test_the_prefetch_deadline_follows_the_config(tmp_path):
    cfg = TierConfig(prefetch_timeout_s=1.0, prefetch_timeout_per_page_s=0.5, prefetch_timeout_max_s=3.0)
    _, (host,) = small_pools("mla", ("layer_first",))
    tier = file_tier(tmp_path, host, tier=cfg)
    assert tier.prefetch_timeout(2) == 2.0 and tier.prefetch_timeout(100) == 3.0
    tier.skip_prefetch()
    assert tier.metrics.snapshot()["prefetches_total.skipped"] == 1


@pytest.mark.parametrize("kwargs, words", [
    (dict(io_threads=0), "io_threads"), (dict(max_pending_bytes=0), "max_pending_bytes"),
    (dict(batch_pages=0), "batch_pages"), (dict(skip_stored=1), "skip_stored"),
    (dict(prefetch_timeout_s=float("nan")), "prefetch_timeout_s"), (dict(health_interval_s=-1), "health_interval_s"),
])
def test_a_bad_tier_config_is_refused_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        TierConfig(**kwargs)


def test_bad_calls_are_refused_before_anything_is_queued(tmp_path):
    _, (host, other) = small_pools("mha", ("layer_first", "layer_first"), page_size=4, pages=4)
    _, (mla,) = small_pools("mla", ("layer_first",), page_size=4, pages=4)
    tier = file_tier(tmp_path, host)
    with pytest.raises(ValueError, match="host_slots holds 4 slots for 2 chain keys"):
        tier.save(chain(2), None, host, slots_of([0], 4))
    with pytest.raises(ValueError, match="whole pages"):
        tier.save(chain(1), None, host, torch.arange(1, 5))
    with pytest.raises(ValueError, match="does not hold this store's pages"):
        tier.prefetch(chain(1), mla, slots_of([0], 4))
    with pytest.raises(ValueError, match="parent keys"):
        tier.save(chain(2), [None], host, slots_of([0, 1], 4))
    with pytest.raises(ValueError, match="chain_key"):
        tier.lookup([b""])
    with pytest.raises(TypeError, match="backend must be a kvtier.storage.StorageBackend, got object"):
        StorageTier(object(), salt_of(host))
    assert tier.metrics.snapshot()["pending_bytes"] == 0 and tier.backend.usage().pages == 0


class CountingFileBackend(FileBackend):
    """A file store read through plain ``get_into`` (no ``get_into_checked``), each read held a
    moment; it records the order of the reads and the most that overlapped."""

    def __init__(self, config):
        super().__init__(config)
        self.lock, self.active, self.most, self.firsts = threading.Lock(), 0, 0, []

    def get_into(self, keys, buffers):
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
            self.firsts.append(keys[0])
        try:
            time.sleep(0.02)  # a second read in flight would overlap this one
            return super().get_into(keys, buffers)
        finally:
            with self.lock:
                self.active -= 1


class SerialFileBackend(CountingFileBackend):
    serial_reads = True


@pytest.mark.parametrize("backend, most", [(SerialFileBackend, 1), (CountingFileBackend, READ_AHEAD)])
def test_a_serial_reads_backend_gets_one_batch_at_a_time_in_order(tmp_path, backend, most):
    _, (src, dst) = small_pools("mla", ("page_first", "page_first"), page_size=2, pages=16)
    tier = file_tier(tmp_path, src, tier=TierConfig(batch_pages=2, io_threads=4), backend=backend)
    keys = chain(8)
    assert tier.save(keys, None, src, slots_of(range(8), 2)) == 8 and tier.flush(10)
    h = tier.prefetch(keys, dst, slots_of(range(8, 16), 2))
    assert h.wait(10) == 8 and h.outcome == "complete"
    assert [canonical_page(dst, 8 + p) for p in range(8)] == [canonical_page(src, p) for p in range(8)]
    assert tier.backend.most == most
    if backend.serial_reads:
        assert tier.backend.firsts == tier.keys(keys)[::2]
    tier.close()


class FailingSerialFileBackend(SerialFileBackend):
    def get_into(self, keys, buffers):
        if not self.firsts:
            self.firsts.append(keys[0])
            raise OSError("the store went away mid-read")
        return super().get_into(keys, buffers)


def test_a_failed_serial_read_lets_the_batches_behind_it_through(tmp_path):
    _, (src, dst) = small_pools("mla", ("page_first", "page_first"), page_size=2, pages=16)
    tier = file_tier(tmp_path, src, tier=TierConfig(batch_pages=2, io_threads=4), backend=FailingSerialFileBackend)
    keys = chain(8)
    assert tier.save(keys, None, src, slots_of(range(8), 2)) == 8 and tier.flush(10)
    h = tier.prefetch(keys, dst, slots_of(range(8, 16), 2))
    assert h.wait(10) == 0 and h.outcome == "failed"    # not a hang: the batches behind the failed one ran
    assert not tier.healthy() and tier.backend.most == 1
    tier.close()


@pytest.mark.parametrize("name", ["file", "valkey", "valkey-cluster", "mooncake"])
def test_every_backend_refuses_a_config_of_another_class_alike(name):
    from kvtier.storage import backend_class
    cls = backend_class(name)
    with pytest.raises(TypeError, match=f"config must be a {cls.config_class.__name__}, got dict"):
        cls({"path": "/tmp"})


def test_the_tier_refuses_a_config_of_another_class(tmp_path):
    _, (host,) = small_pools("mha", ("layer_first",), page_size=4, pages=4)
    tier = file_tier(tmp_path, host)
    with pytest.raises(TypeError, match="config must be a TierConfig or None, got dict"):
        StorageTier(tier.backend, salt_of(host), {"io_threads": 2})
    tier.close()


def test_the_tiers_buffers_stay_within_the_documented_bound(tmp_path):
    """Host memory beyond the pools (docs/configuration.md): saves' copies up to max_pending_bytes,
    as much again kept for reuse, and io_threads x (READ_AHEAD + 1) x batch_pages blobs of prefetch
    reads in flight. Measured by tracemalloc, which counts numpy's buffers, under concurrent
    saves that overflow the queue and more prefetches than threads."""
    import tracemalloc
    _, (src, dst) = small_pools("mha", ("page_first", "page_first"), page_size=256, pages=64, layers=8)
    blob = tier_blob(src)
    cfg = TierConfig(max_pending_bytes=4 * blob, batch_pages=4, io_threads=2)
    tier = file_tier(tmp_path, src, capacity_pages=256, tier=cfg)
    keys = chain(16)
    for i in range(0, 16, 4):
        assert tier.save(keys[i : i + 4], None, src, slots_of(range(i, i + 4), 256)) == 4 and tier.flush(10)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        prefetches = [tier.prefetch(keys, dst, slots_of(range(16 * t, 16 * t + 16), 256)) for t in range(4)]

        def saves(tag: int) -> None:
            for r in range(6):
                tier.save(chain(8, tag=10 * tag + r), None, src, slots_of(range(8 * tag, 8 * tag + 8), 256))
        savers = [threading.Thread(target=saves, args=(t,)) for t in (1, 2)]
        for t in savers:
            t.start()
        for t in savers:
            t.join()
        assert all(h.wait(30) == 16 for h in prefetches) and tier.flush(30)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    bound = 2 * cfg.max_pending_bytes + cfg.io_threads * (READ_AHEAD + 1) * cfg.batch_pages * blob
    assert tier.metrics.snapshot()["save_dropped_pages_total.queue_full"] > 0   # the queue did overflow
    assert blob * 8 < peak <= bound + blob // 2, (peak / blob, bound / blob)
    for t in range(4):
        assert [canonical_page(dst, 16 * t + p) for p in range(16)] == [canonical_page(src, p) for p in range(16)]
    tier.close()
