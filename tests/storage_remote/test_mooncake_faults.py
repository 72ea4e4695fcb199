"""The Mooncake backend against a real store that fails: the master killed during a batch of
puts and restarted empty, the store server killed during a batch of gets, the store
unreachable at start-up, the master or the store server paused, the pool full. In every
case: no crash, no call past its bound, no wrong byte reported as a hit, and the store used
again once it is back."""

from __future__ import annotations

import signal

import pytest

from storage_remote_testlib import LocalMooncake, after, blobs, buffers, keys, needs_mooncake, timed, until

needs_mooncake()

from kvtier.storage import StorageError  # noqa: E402
from kvtier.storage.mooncake import MooncakeBackend  # noqa: E402

TIMEOUT = 2.0
# A call's bound: Mooncake's RPC timeout, or its TCP progress timeout per round of a window's
# transfers, plus the start-up of a client (setup retries) on a first call.
BOUND = 3 * TIMEOUT + 3


@pytest.fixture
def store(tmp_path):
    s = LocalMooncake(tmp_path, segment_mb=128).start()
    yield s
    s.stop()


def exact(got, bufs, bs):
    return all(n == -1 or (n == len(v) and bytes(b[:n]) == v) for n, b, v in zip(got, bufs, bs))


def test_master_killed_during_a_batch_of_puts_then_restarted_empty(store):
    backend = MooncakeBackend(store.config(timeout_s=TIMEOUT))
    ks, bs = keys(64), blobs(64, 1 << 20)
    assert backend.put(ks[:2], bs[:2]) == [True, True]
    killer = after(0.05, lambda: store.signal("master", signal.SIGKILL))
    out, seconds = timed(lambda: backend.put(ks, bs))
    killer.join()
    assert isinstance(out, (StorageError, list)) and seconds < BOUND
    out, seconds = timed(lambda: backend.exists(ks))
    assert isinstance(out, StorageError) and seconds < BOUND
    assert not backend.healthy()
    store.start_master()  # empty: the store server mounts its memory again by itself
    until(lambda: store.capacity() > 0, 30, "the store server did not come back to the new master")
    until(backend.healthy, 30, "the backend did not see the master back")
    assert backend.exists(ks) == 0
    bufs = buffers(2, 1 << 20)
    assert backend.put(ks[:2], bs[:2]) == [True, True] and backend.get_into(ks[:2], bufs) == [1 << 20] * 2
    assert exact([1 << 20] * 2, bufs, bs[:2])
    backend.close()


def test_store_server_killed_during_a_batch_of_gets(store):
    backend = MooncakeBackend(store.config(timeout_s=TIMEOUT))
    ks, bs = keys(64), blobs(64, 1 << 20)
    assert all(backend.put(ks, bs))
    bufs = buffers(64, 1 << 20)
    killer = after(0.05, lambda: store.signal("store", signal.SIGKILL))
    out, seconds = timed(lambda: backend.get_into(ks, bufs))
    killer.join()
    assert seconds < BOUND and (isinstance(out, StorageError) or exact(out, bufs, bs))
    out, _ = timed(lambda: backend.get_into(ks[:4], bufs[:4]))
    assert isinstance(out, StorageError) or out == [-1] * 4
    out, _ = timed(lambda: backend.put(ks[:1], bs[:1]))  # the pool has no memory now
    assert isinstance(out, StorageError) or out == [False]
    store.start_store()
    until(lambda: backend.put(ks[:1], bs[:1]) == [True], 30, "the pool did not take puts again")
    assert backend.get_into(ks[:1], bufs[:1]) == [1 << 20] and exact([1 << 20], bufs[:1], bs[:1])
    backend.close()


def test_unreachable_at_start_up_then_used_once_it_is_up(tmp_path):
    store = LocalMooncake(tmp_path, segment_mb=64)
    backend = MooncakeBackend(store.config(timeout_s=TIMEOUT))
    out, seconds = timed(lambda: backend.put(keys(1), [b"x"]))
    assert isinstance(out, StorageError) and seconds < BOUND
    assert not backend.healthy()
    store.start()
    try:
        until(backend.healthy, 30, "the backend did not see the store")
        assert backend.put(keys(2), [b"a", b"b"]) == [True, True] and backend.exists(keys(2)) == 2
    finally:
        backend.close()
        store.stop()


@pytest.mark.parametrize("who", ["master", "store"])
def test_a_paused_server_fails_calls_within_the_bound_and_is_used_again_after(store, who):
    backend = MooncakeBackend(store.config(timeout_s=TIMEOUT))
    ks, bs = keys(16), blobs(16, 1 << 20)
    assert all(backend.put(ks, bs))
    store.signal(who, signal.SIGSTOP)
    try:
        bufs = buffers(16, 1 << 20)
        out, seconds = timed(lambda: backend.get_into(ks, bufs))
        assert seconds < BOUND and (isinstance(out, StorageError) or exact(out, bufs, bs))
        if who == "master":
            assert isinstance(out, StorageError) and not backend.healthy()
    finally:
        store.signal(who, signal.SIGCONT)
    until(backend.healthy, 30, "the store did not answer after SIGCONT")
    until(lambda: backend.put(ks[:1], bs[:1]) == [True], 30, "the store did not take puts after SIGCONT")
    bufs = buffers(1, 1 << 20)
    assert backend.get_into(ks[:1], bufs) == [1 << 20] and bytes(bufs[0]) == bs[0]
    backend.close()


def test_a_full_pool_refuses_puts_per_key(tmp_path):
    store = LocalMooncake(tmp_path, segment_mb=16).start()
    backend = MooncakeBackend(store.config())
    try:
        ks, bs = keys(40), blobs(40, 1 << 20)
        stored = []
        for i in range(0, 40, 8):
            stored += backend.put(ks[i:i + 8], bs[i:i + 8])
        assert stored[0] and not all(stored)
        bufs = buffers(40, 1 << 20)
        got = backend.get_into(ks, bufs)
        assert exact(got, bufs, bs) and all(n == -1 for n, ok in zip(got, stored) if not ok)
    finally:
        backend.close()
        store.stop()
