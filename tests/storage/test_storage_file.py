"""The file backend over real directories: the interface's contract, LRU capacity, the index
rebuilt at start-up, and the checks of its config."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from kvtier.spec import KVSpec
from kvtier.storage import StorageBackend, Usage, backend_class
from kvtier.storage.file import FileBackend, FileConfig
from kvtier.storage.format import HEADER_BYTES, PageCodec, StorageSalt
from storage_testlib import blob_for, chain

SALT = StorageSalt(KVSpec("mla", 2, torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=0), 4, "test/file")
BLOB = PageCodec(SALT).blob_bytes


def pages(n: int, tag: int = 0):
    """``n`` (key, blob) pairs of a chain, each blob a verifiable page."""
    out = []
    for i, c in enumerate(chain(n, tag)):
        key, _, blob = blob_for(SALT, c, seed=tag * 1000 + i)
        out.append((key, blob))
    return out


def read(backend, keys) -> list[bytes | None]:
    bufs = [bytearray(BLOB + 16) for _ in keys]
    got = backend.get_into(keys, [memoryview(b) for b in bufs])
    return [None if n < 0 else bytes(b[:n]) for b, n in zip(bufs, got)]


@pytest.fixture
def store(tmp_path):
    b = FileBackend(FileConfig(tmp_path / "store", 8 * BLOB, io_threads=2))
    yield b
    b.close()


def test_put_get_exists_delete_round_trip(store):
    items = pages(5)
    keys, blobs = zip(*items)
    assert store.exists(keys) == 0
    assert store.put(keys, blobs) == [True] * 5
    assert read(store, keys) == list(blobs)
    assert store.exists(keys) == 5
    store.delete([keys[2]])
    assert store.exists(keys) == 2 and read(store, keys)[2] is None
    assert store.usage() == Usage(4 * BLOB, 8 * BLOB, 4)
    store.delete([keys[2], keys[0]])  # absent keys are ignored
    assert store.usage().pages == 3


def test_a_buffer_too_small_is_a_miss_not_a_partial_read(store):
    key, blob = pages(1)[0]
    store.put([key], [blob])
    small = bytearray(BLOB - 1)
    assert store.get_into([key], [memoryview(small)]) == [-1]
    assert small == bytearray(BLOB - 1)


def test_capacity_evicts_the_least_recently_used_and_a_chains_tail_first(store):
    first = pages(4, tag=1)
    second = pages(4, tag=2)
    store.put(*zip(*first))
    store.put(*zip(*second))
    assert store.exists([k for k, _ in first]) == 4  # touched: the first chain is now the most recent
    third = pages(2, tag=3)
    assert store.put(*zip(*third)) == [True, True]
    # The second chain was the least recent; its tail went before its head.
    assert store.exists([k for k, _ in second]) == 2
    assert store.exists([k for k, _ in first]) == 4
    assert store.usage().used_bytes <= 8 * BLOB
    assert sum(f.endswith(".kvp") for _, _, fs in os.walk(store.root) for f in fs) == store.usage().pages == 8


def test_a_page_larger_than_the_store_is_refused(tmp_path):
    b = FileBackend(FileConfig(tmp_path, BLOB - 1))
    key, blob = pages(1)[0]
    assert b.put([key], [blob]) == [False] and b.exists([key]) == 0


def test_a_restart_rebuilds_the_index_from_the_files(tmp_path):
    items = pages(6)
    b = FileBackend(FileConfig(tmp_path, 8 * BLOB))
    b.put(*zip(*items))
    b.close()
    again = FileBackend(FileConfig(tmp_path, 8 * BLOB))
    keys = [k for k, _ in items]
    assert again.exists(keys) == 6 and read(again, keys) == [blob for _, blob in items]
    assert again.usage() == Usage(6 * BLOB, 8 * BLOB, 6)
    smaller = FileBackend(FileConfig(tmp_path, 3 * BLOB))   # a lower capacity evicts the oldest at start-up
    assert smaller.usage().pages == 3 and smaller.usage().used_bytes <= 3 * BLOB


def test_start_up_deletes_pages_that_do_not_verify_and_dead_writers_temp_files(tmp_path):
    items = pages(4)
    b = FileBackend(FileConfig(tmp_path, 8 * BLOB))
    b.put(*zip(*items))
    paths = [b.path_of(k) for k, _ in items]
    with open(paths[0], "r+b") as f:   # a bad header
        f.write(b"garbage!")
    with open(paths[1], "r+b") as f:   # cut short
        f.truncate(BLOB // 2)
    os.rename(paths[2], b.path_of(items[3][0]) + ".x")          # not a page name: left alone
    shard = os.path.dirname(paths[3])
    dead = os.path.join(shard, f".{items[3][0].hex()}.999999999.1.tmp")
    mine = os.path.join(shard, f".{items[3][0].hex()}.{os.getpid()}.1.tmp")
    for p in (dead, mine):
        open(p, "wb").close()
    again = FileBackend(FileConfig(tmp_path, 8 * BLOB))
    assert [again.exists([k]) for k, _ in items] == [0, 0, 0, 1]
    assert not os.path.exists(paths[0]) and not os.path.exists(paths[1])
    assert not os.path.exists(dead) and not os.path.exists(mine)
    assert os.path.exists(b.path_of(items[3][0]) + ".x")


def test_plain_reads_match_mapped_reads(tmp_path):
    items = pages(3)
    mapped = FileBackend(FileConfig(tmp_path, 8 * BLOB))
    mapped.put(*zip(*items))
    plain = FileBackend(FileConfig(tmp_path, 8 * BLOB, read_mmap=False))
    keys = [k for k, _ in items]
    assert read(plain, keys) == read(mapped, keys) == [blob for _, blob in items]


def test_threads_putting_and_reading_at_once_never_see_a_wrong_byte(tmp_path):
    store = FileBackend(FileConfig(tmp_path, 6 * BLOB, io_threads=4))
    items = pages(12)
    want = dict(items)
    errors = []

    def worker(seed: int):
        rng = np.random.default_rng(seed)
        for _ in range(60):
            chosen = [items[i] for i in rng.choice(len(items), 3, replace=False)]
            keys = [k for k, _ in chosen]
            if rng.random() < 0.5:
                store.put(keys, [b for _, b in chosen])
            for k, got in zip(keys, read(store, keys)):
                if got is not None and got != want[k]:
                    errors.append(k)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    u = store.usage()
    assert u.used_bytes <= 6 * BLOB and u.used_bytes == u.pages * BLOB
    on_disk = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert len(on_disk) == u.pages and all(f.endswith(".kvp") for f in on_disk)


@pytest.mark.parametrize("kwargs, words", [
    (dict(path=""), "path"), (dict(capacity_bytes=0), "capacity_bytes"), (dict(capacity_bytes=HEADER_BYTES), "holds no page"),
    (dict(io_threads=0), "io_threads"), (dict(fsync="yes"), "fsync"), (dict(read_mmap=1), "read_mmap"),
])
def test_a_bad_file_config_is_refused_by_name(tmp_path, kwargs, words):
    with pytest.raises(ValueError, match=words):
        FileConfig(**(dict(path=str(tmp_path), capacity_bytes=1 << 20) | kwargs))


def test_a_path_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        FileBackend(FileConfig(f, 1 << 20))


def test_bad_keys_are_refused_before_anything_changes(store):
    with pytest.raises(ValueError, match="16 bytes"):
        store.put([b"short"], [b"x"])
    with pytest.raises(ValueError, match="one blob per key"):
        store.put([bytes(16)], [])
    assert store.usage().pages == 0


def test_backends_are_found_by_name_or_module_path():
    assert backend_class("file") is FileBackend
    assert backend_class("kvtier.storage.file:FileBackend") is FileBackend
    with pytest.raises(ValueError, match="unknown storage backend"):
        backend_class("nope")
    with pytest.raises(ValueError, match="cannot be loaded"):
        backend_class("kvtier.storage.file:Nope")
    with pytest.raises(ValueError, match="not a kvtier.storage.StorageBackend"):
        backend_class("kvtier.storage.file:FileConfig")
    assert issubclass(FileBackend, StorageBackend)
