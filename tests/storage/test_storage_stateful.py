"""The file store against a model of it: puts, gets, chain lookups, deletes, capacity eviction,
restarts over the same directory and injected failures (pages damaged or removed behind the
store's back, writes that fail), every byte read checked against the model through the page
verification the tier runs."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict

import numpy as np
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.spec import KVSpec
from kvtier.storage.file import FileBackend, FileConfig
from kvtier.storage.format import HEADER_BYTES, PageCodec, PageRejected, StorageSalt, store_key

SALT = StorageSalt(KVSpec("mla", 1, torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=0), 2, "test/stateful")
CODEC = PageCodec(SALT)
BLOB = CODEC.blob_bytes
CAPACITY_PAGES = 5
KEYS = [store_key(SALT.fingerprint, i.to_bytes(4, "little")) for i in range(8)]
OK, PAYLOAD_FLIPPED, HEADER_FLIPPED, TRUNCATED, GONE = "ok", "payload", "header", "truncated", "gone"
DAMAGE = (PAYLOAD_FLIPPED, HEADER_FLIPPED, TRUNCATED, GONE)

key_indices = st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=4, unique=True)


class FileStoreMachine(RuleBasedStateMachine):
    """The model: key -> (payload, state) in least-recently-used order (oldest first), as the store
    documents it: lookups touch a chain's present prefix last page first, reads and puts touch
    their keys last first, a put evicts the oldest pages (never its own key) until it fits, and a
    restart orders the pages by modification time, dropping those whose header or length is bad."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvtier-stateful-")
        self.store = self._open()
        self.model: OrderedDict[bytes, tuple[bytes, str]] = OrderedDict()

    def _open(self) -> FileBackend:
        return FileBackend(FileConfig(self.dir, CAPACITY_PAGES * BLOB, io_threads=1))

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- the model's rules ---------------------------------------------------------------------

    def _touch(self, keys) -> None:
        for k in reversed(keys):
            if k in self.model:
                self.model.move_to_end(k)

    def _make_room(self, key: bytes) -> None:
        for victim in list(self.model):
            if len(self.model) * BLOB + BLOB <= CAPACITY_PAGES * BLOB:
                break
            if victim != key:
                del self.model[victim]

    # -- operations ------------------------------------------------------------------------------

    @rule(idx=key_indices, seed=st.integers(0, 2**32 - 1))
    def put(self, idx, seed):
        rng = np.random.default_rng(seed)
        keys = [KEYS[i] for i in idx]
        payloads = [rng.integers(0, 256, CODEC.payload_bytes, dtype=np.uint8).tobytes() for _ in keys]
        assert self.store.put(keys, [CODEC.encode(p, k) for k, p in zip(keys, payloads)]) == [True] * len(keys)
        for k, p in zip(keys, payloads):
            self._make_room(k)
            self.model.pop(k, None)
            self.model[k] = (p, OK)
        self._touch(keys)

    @rule(idx=key_indices)
    def get(self, idx):
        keys = [KEYS[i] for i in idx]
        bufs = [bytearray(BLOB) for _ in keys]
        got = self.store.get_into(keys, [memoryview(b) for b in bufs])
        self._touch(keys)
        for k, n, buf in zip(keys, got, bufs):
            payload, state = self.model.get(k, (None, None))
            if state in (None, GONE):
                assert n == -1
                self.model.pop(k, None)    # a page gone behind the store's back leaves its index too
                continue
            if state == OK:
                assert bytes(CODEC.verify(buf, n, k)) == payload
            else:
                try:
                    CODEC.verify(buf, n, k)
                except PageRejected as e:
                    assert e.reason == ("short" if state == TRUNCATED else "corrupt")
                else:
                    raise AssertionError(f"a {state} page passed verification")

    @rule(idx=st.lists(st.integers(0, len(KEYS) - 1), max_size=6, unique=True))
    def lookup(self, idx):
        keys = [KEYS[i] for i in idx]
        n = 0
        while n < len(keys) and keys[n] in self.model:
            n += 1
        assert self.store.exists(keys) == n
        self._touch(keys[:n])

    @rule(idx=key_indices)
    def delete(self, idx):
        keys = [KEYS[i] for i in idx]
        self.store.delete(keys)
        for k in keys:
            self.model.pop(k, None)

    @rule()
    def restart(self):
        self.store.close()
        kept = [(k, v) for k, v in self.model.items() if v[1] in (OK, PAYLOAD_FLIPPED)]
        kept.sort(key=lambda kv: (os.stat(self.store.path_of(kv[0])).st_mtime_ns, kv[0]))
        self.store = self._open()
        self.model = OrderedDict(kept)

    # -- injected failures -------------------------------------------------------------------------

    @precondition(lambda self: any(state == OK for _, state in self.model.values()))
    @rule(data=st.data(), damage=st.sampled_from(DAMAGE))
    def damage_a_page_behind_the_stores_back(self, data, damage):
        key = data.draw(st.sampled_from([k for k, (_, s) in self.model.items() if s == OK]))
        path = self.store.path_of(key)
        if damage == GONE:
            os.unlink(path)
        elif damage == TRUNCATED:
            os.truncate(path, BLOB - 1)
        else:
            at = HEADER_BYTES + 5 if damage == PAYLOAD_FLIPPED else 20
            with open(path, "r+b") as f:
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0xFF]))
        self.model[key] = (self.model[key][0], damage)

    @precondition(lambda self: any(k not in self.model for k in KEYS))
    @rule(data=st.data())
    def a_write_that_fails(self, data):
        """A page whose directory cannot hold it (a file stands where the directory goes): the put
        fails, its room was made as for any put, and no key or file is left behind."""
        free = [k for k in KEYS if k not in self.model
                and not any(o[0] == k[0] for o in self.model)]
        if not free:
            return
        key = data.draw(st.sampled_from(free))
        shard = os.path.dirname(self.store.path_of(key))
        shutil.rmtree(shard, ignore_errors=True)
        with open(shard, "wb"):
            pass
        try:
            assert self.store.put([key], [CODEC.encode(bytes(CODEC.payload_bytes), key)]) == [False]
        finally:
            os.unlink(shard)
        self._make_room(key)

    @rule(idx=key_indices)
    def a_page_larger_than_the_store(self, idx):
        key = KEYS[idx[0]]
        assert self.store.put([key], [bytes(CAPACITY_PAGES * BLOB + 1)]) == [False]

    # -- invariants ---------------------------------------------------------------------------------

    @invariant()
    def usage_matches_the_model_and_the_disk(self):
        u = self.store.usage()
        assert u.pages == len(self.model) and u.used_bytes == u.pages * BLOB <= CAPACITY_PAGES * BLOB
        files = [f for _, _, fs in os.walk(self.dir) for f in fs]
        assert all(f.endswith(".kvp") for f in files)
        assert len(files) == sum(state != GONE for _, state in self.model.values())


FileStoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_the_file_store_against_its_model = FileStoreMachine.TestCase
