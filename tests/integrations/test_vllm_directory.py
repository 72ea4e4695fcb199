"""The scheduler side of kvtier's vLLM spec without vLLM: :class:`HostDirectory` on keys and page
ids, and the storage tier behind it (:class:`StorageLink` over a real host pool and file store):
pinning, eviction order, refusals, write-back and write-through, reads verified before a byte
lands, a corrupted page a counted miss that is deleted."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import generate_latest

from kvtier.integrations import BlockMover, HostDirectory, StorageLink, host_slots, open_store
from kvtier.storage.format import PageCodec, StorageSalt
from kvtier.storage.tier import TierConfig
from vllm_testlib import vllm_kv_cache


def keys(*names: int) -> list[bytes]:
    return [n.to_bytes(4, "big") * 9 for n in names]  # 36 bytes, as vLLM's block hash + group


def stored(d: HostDirectory, *names: int) -> list[int]:
    new, pages, evicted = d.reserve(keys(*names))
    assert d.commit(new) == new
    return pages


def test_a_key_is_pending_while_written_ready_after_and_gone_when_the_write_failed():
    d = HostDirectory(4)
    new, pages, evicted = d.reserve(keys(1, 2))
    assert (new, len(pages), evicted) == (keys(1, 2), 2, []) and d.find(keys(1)[0]) == "pending"
    d.commit(keys(1), success=True)
    d.commit(keys(2), success=False)
    assert [d.find(k) for k in keys(1, 2, 3)] == ["ready", "miss", "miss"]
    assert d.allocator.available_pages() == 3
    assert d.reserve(keys(1))[0] == []  # held already: nothing to write


@pytest.mark.parametrize("eviction,first_out", [("lru", 2), ("lfu", 1)])
def test_eviction_takes_the_policys_first_unpinned_key_and_never_one_offered(eviction, first_out):
    d = HostDirectory(3, eviction=eviction)
    stored(d, 1, 2, 3)
    for _ in range(2):  # 2 and 3 loaded twice
        d.pin(keys(2, 3))
        d.unpin(keys(2, 3))
    d.touch(keys(1))  # 1 used last, never hit
    new, _, evicted = d.reserve(keys(4))
    assert evicted == keys(first_out) and new == keys(4)
    assert d.counters.snapshot()["evicted_chunks"] == 1


def test_a_store_is_refused_whole_when_too_few_pages_can_go():
    d = HostDirectory(3)
    stored(d, 1, 2, 3)
    d.pin(keys(1, 2))
    assert d.reserve(keys(4, 5)) is None  # only 3 may go: nothing is evicted
    assert d.find(keys(3)[0]) == "ready" and d.counters.snapshot()["store_refused"] == 1
    assert d.reserve(keys(3, 4)) is None  # 3 is offered: it stays
    d.unpin(keys(1))
    assert d.reserve(keys(4, 5))[2] == keys(1, 3)


def test_counters_reach_prometheus_and_their_increase_is_taken_once():
    d = HostDirectory(2, prefix="kvtier_vllm_")
    stored(d, 1)
    d.pin(keys(1))
    text = generate_latest(d.counters.registry).decode()
    assert 'kvtier_vllm_hit_chunks_total{tier="host"} 1.0' in text and "kvtier_vllm_host_used_chunks 1.0" in text
    assert d.counters.take()[("hit_chunks", ("host",))] == 1
    assert ("hit_chunks", ("host",)) not in d.counters.take()


# -- the storage tier behind the host ------------------------------------------------------------

def _tier(tmp_path, seed=0, write_policy="write_back", pages=4, queue_pages=None, save_ahead=0.25):
    buf, views = vllm_kv_cache(blocks=16, seed=seed)
    mover = BlockMover(views, 1, pages)
    config = None
    if queue_pages:
        blob = PageCodec(StorageSalt(mover.host.spec, 1, "tiny-llama", "salt")).blob_bytes
        config = TierConfig(max_pending_bytes=queue_pages * blob, batch_pages=1)
    link = StorageLink(mover, open_store("file", str(tmp_path / "store"), 0.01), "tiny-llama", "salt", config)
    return buf, mover, HostDirectory(pages, write_policy=write_policy, store=link, save_ahead=save_ahead)


def _until_settled(d: HostDirectory, key: bytes) -> str:
    deadline = time.monotonic() + 30
    while (state := d.find(key)) == "pending":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return state


def _store_blocks(mover: BlockMover, d: HostDirectory, names, blocks) -> None:
    new, pages, _ = d.reserve(keys(*names))
    mover.store(1, host_slots(pages, 0, len(pages), 1), torch.tensor(blocks).numpy())
    mover.wait([1])
    mover.finished()
    d.commit(new)


def test_write_back_saves_on_eviction_and_a_new_process_reads_it_back_verified(tmp_path):
    buf, mover, d = _tier(tmp_path)
    _store_blocks(mover, d, [1, 2, 3, 4], [5, 6, 7, 8])
    assert not list((tmp_path / "store").rglob("*.kvp"))  # write-back: nothing yet
    _store_blocks(mover, d, [9], [9])  # evicts 1 (least recently used): saved first
    d.store.tier.flush(10)
    assert len(list((tmp_path / "store").rglob("*.kvp"))) == 1
    d.flush()  # the rest, as at the worker's shutdown
    d.close()
    mover.close()
    other, mover2, d2 = _tier(tmp_path, seed=1)  # another cache's bytes: they must be overwritten
    assert d2.find(keys(42)[0]) == "miss"
    assert [_until_settled(d2, k) for k in keys(1, 2, 3)] == ["ready"] * 3
    pages = d2.pin(keys(1, 2, 3))
    assert d2.counters.snapshot()["hit_chunks.disk"] == 3
    mover2.load(2, host_slots(pages, 0, 3, 1), torch.tensor([0, 1, 2]).numpy())
    mover2.wait([2])
    assert torch.equal(other[:, :3], buf[:, 5:8])
    d2.close()
    mover2.close()


def test_a_page_corrupted_on_disk_is_a_counted_miss_and_deleted(tmp_path):
    buf, mover, d = _tier(tmp_path, write_policy="write_through")
    _store_blocks(mover, d, [1, 2], [3, 4])  # write-through: saved as stored
    d.store.tier.flush(10)
    files = sorted((tmp_path / "store").rglob("*.kvp"))
    assert len(files) == 2
    d.close()
    mover.close()
    for f in files:
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0x01
        f.write_bytes(bytes(raw))
    _, mover2, d2 = _tier(tmp_path)
    assert _until_settled(d2, keys(1)[0]) == "miss"
    snap = d2.counters.snapshot()
    assert snap["storage_missed_pages"] == 1 and snap["storage_rejected_pages.corrupt"] == 1
    assert "hit_chunks.disk" not in snap and d2.allocator.available_pages() == 4
    assert d2.find(keys(1)[0]) == "miss"  # deleted: not read again
    d2.close()
    mover2.close()


def _files(tmp_path) -> int:
    return len(list((tmp_path / "store").rglob("*.kvp")))


def _poll_until(d: HostDirectory, done) -> None:
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline
        d.store.tier.flush(10)
        d.poll()
        time.sleep(0.005)


def test_write_through_hands_over_what_a_full_queue_turned_away_as_it_drains(tmp_path):
    buf, mover, d = _tier(tmp_path, write_policy="write_through", pages=8, queue_pages=2)
    _store_blocks(mover, d, [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])  # 2 queued, 4 turned away
    assert d.store.tier.metrics.snapshot()["save_dropped_pages_total.queue_full"] == 4
    _poll_until(d, lambda: _files(tmp_path) == 6)
    assert all(c.saved for c in d.chunks.values())
    d.close()
    mover.close()


@pytest.mark.parametrize("save_ahead, on_disk", [(0.5, 4), (0.0, 2)])
def test_write_back_saves_ahead_so_a_burst_of_eviction_loses_nothing(tmp_path, save_ahead, on_disk):
    buf, mover, d = _tier(tmp_path, pages=8, queue_pages=2, save_ahead=save_ahead)
    _store_blocks(mover, d, list(range(1, 9)), list(range(8)))  # the host is full
    if save_ahead:
        _poll_until(d, lambda: _files(tmp_path) == 4)  # the 4 next in line for eviction, 2 at a time
        assert [c.saved for c in d.chunks.values()] == [True] * 4 + [False] * 4
    _store_blocks(mover, d, [9, 10, 11, 12], [8, 9, 10, 11])  # evicts 1-4 at once; the queue takes 2
    d.store.tier.flush(10)
    assert _files(tmp_path) == on_disk
    assert d.store.tier.metrics.snapshot()["save_dropped_pages_total.queue_full"] == 4 - on_disk
    d.close()
    mover.close()
