"""The Valkey backend against real servers that fail: killed during a batch of puts and of
gets, restarted empty, unreachable at start-up, paused, slowed by a proxy, cut mid-batch,
full (with and without eviction), a cluster master lost. In every case: no crash, no call
past its timeout, no wrong byte reported as a hit, and the store used again once it is back."""

from __future__ import annotations

import signal
import time

import pytest

from storage_remote_testlib import DelayProxy, LocalValkey, after, blobs, buffers, free_port, keys, timed
from kvtier.storage import StorageError
from kvtier.storage.valkey import ValkeyBackend, ValkeyConfig

TIMEOUT = 1.0


@pytest.fixture
def server(tmp_path):
    s = LocalValkey(tmp_path).start()
    yield s
    s.stop()


def exact_hits(ks, bs, backend, size):
    """Every key the store reports present holds its whole blob; the count of those present."""
    bufs = buffers(len(ks), size)
    got = backend.get_into(ks, bufs)
    for n, buf, blob in zip(got, bufs, bs):
        assert n in (-1, len(blob)) and (n == -1 or bytes(buf[:n]) == blob)
    return sum(n > 0 for n in got)


def test_killed_during_a_batch_of_puts_then_restarted_empty(server):
    backend = ValkeyBackend(server.config(timeout_s=TIMEOUT))
    ks, bs = keys(96), blobs(96, 1 << 20)
    killer = after(0.05, lambda: server.signal(0, signal.SIGKILL))
    out, seconds = timed(lambda: backend.put(ks, bs))
    killer.join()
    assert isinstance(out, (StorageError, list)) and seconds < TIMEOUT + 2
    assert not backend.healthy()
    out, seconds = timed(lambda: backend.put(ks[:1], bs[:1]))
    assert isinstance(out, StorageError) and seconds < TIMEOUT + 1
    server.start_server(0)
    assert backend.healthy()
    assert backend.exists(ks) == 0  # restarted empty: every page a miss, none garbage
    assert backend.put(ks[:4], bs[:4]) == [True] * 4 and exact_hits(ks[:4], bs[:4], backend, 1 << 20) == 4


def test_killed_during_a_batch_of_gets(server):
    backend = ValkeyBackend(server.config(timeout_s=TIMEOUT))
    ks, bs = keys(96), blobs(96, 1 << 20)
    assert all(backend.put(ks, bs))
    bufs = buffers(96, 1 << 20)
    killer = after(0.05, lambda: server.signal(0, signal.SIGKILL))
    out, seconds = timed(lambda: backend.get_into(ks, bufs))
    killer.join()
    assert seconds < TIMEOUT + 2
    if isinstance(out, list):  # the batch finished first: every hit exact
        assert all(n == -1 or bytes(b[:n]) == v for n, b, v in zip(out, bufs, bs))
    server.start_server(0)
    assert backend.healthy() and backend.get_into(ks[:2], bufs[:2]) == [-1, -1]


def test_unreachable_at_start_up_then_used_once_it_is_up(tmp_path):
    server = LocalValkey(tmp_path)
    backend = ValkeyBackend(server.config(timeout_s=TIMEOUT))  # nothing listens on the port yet
    out, seconds = timed(lambda: backend.exists(keys(3)))
    assert isinstance(out, StorageError) and seconds < TIMEOUT + 1
    assert not backend.healthy()
    server.start()
    try:
        assert backend.healthy()
        assert backend.put(keys(2), [b"a", b"b"]) == [True, True] and backend.exists(keys(2)) == 2
    finally:
        server.stop()


def test_a_paused_server_times_out_every_call_and_is_used_again_after(server):
    backend = ValkeyBackend(server.config(timeout_s=TIMEOUT))
    ks, bs = keys(8), blobs(8, 100_000)
    assert all(backend.put(ks, bs))
    server.signal(0, signal.SIGSTOP)
    try:
        for call in (lambda: backend.get_into(ks, buffers(8, 100_000)), lambda: backend.put(ks, bs),
                     lambda: backend.exists(ks)):
            out, seconds = timed(call)
            assert isinstance(out, StorageError) and seconds < TIMEOUT + 1
        t = time.monotonic()
        assert not backend.healthy() and time.monotonic() - t < TIMEOUT + 1
    finally:
        server.signal(0, signal.SIGCONT)
    assert backend.healthy() and exact_hits(ks, bs, backend, 100_000) == 8


def test_a_slow_network_past_the_timeout_fails_the_call_and_within_it_works(server):
    proxy = DelayProxy(server.ports[0], delay_s=0.4)
    try:
        ks, bs = keys(4), blobs(4, 10_000)
        slow = ValkeyBackend(ValkeyConfig(nodes=(("127.0.0.1", proxy.port),), timeout_s=0.3))
        out, seconds = timed(lambda: slow.put(ks, bs))
        assert isinstance(out, StorageError) and seconds < 0.3 + 1
        patient = ValkeyBackend(ValkeyConfig(nodes=(("127.0.0.1", proxy.port),), timeout_s=5))
        assert patient.put(ks, bs) == [True] * 4 and exact_hits(ks, bs, patient, 10_000) == 4
    finally:
        proxy.close()


def test_a_connection_cut_mid_batch_leaves_no_truncated_value(server):
    """Valkey applies a SET only once all its bytes arrived: keys before the cut hold their
    whole value, the key cut in half holds nothing."""
    ks, bs = keys(40), blobs(40, 200_000)
    proxy = DelayProxy(server.ports[0], delay_s=0, cut_after=(20 * 200_000 + 40 * 100))
    try:
        out, _ = timed(lambda: ValkeyBackend(ValkeyConfig(nodes=(("127.0.0.1", proxy.port),),
                                                          timeout_s=TIMEOUT)).put(ks, bs))
        assert isinstance(out, (StorageError, list))
    finally:
        proxy.close()
    stored = exact_hits(ks, bs, ValkeyBackend(server.config()), 200_000)
    assert 0 < stored < 40


def test_a_full_store_without_eviction_refuses_puts_per_key(tmp_path):
    server = LocalValkey(tmp_path, settings=("maxmemory 8mb", "maxmemory-policy noeviction")).start()
    try:
        backend = ValkeyBackend(server.config())
        ks, bs = keys(24), blobs(24, 1 << 20)
        stored = backend.put(ks, bs)
        assert stored[0] and not all(stored)
        bufs = buffers(24, 1 << 20)
        got = backend.get_into(ks, bufs)
        assert [n > 0 for n in got] == stored
        assert all(bytes(b) == v for n, b, v in zip(got, bufs, bs) if n > 0)
        assert backend.usage().capacity_bytes == 8 << 20
    finally:
        server.stop()


def test_a_full_store_with_eviction_evicts_whole_values(tmp_path):
    server = LocalValkey(tmp_path, settings=("maxmemory 8mb", "maxmemory-policy allkeys-lru")).start()
    try:
        backend = ValkeyBackend(server.config())
        ks, bs = keys(24), blobs(24, 1 << 20)
        assert backend.put(ks, bs) == [True] * 24
        present = exact_hits(ks, bs, backend, 1 << 20)
        assert 0 < present < 24 and backend.exists(ks) < 24
    finally:
        server.stop()


def test_a_cluster_master_lost_fails_only_its_keys_and_all_lost_fails_the_call(tmp_path):
    cluster = LocalValkey(tmp_path, cluster=True).start()
    try:
        backend = ValkeyBackend(cluster.config(timeout_s=TIMEOUT))
        ks, bs = keys(30), blobs(30, 10_000)
        assert all(backend.put(ks, bs))
        cluster.signal(2, signal.SIGKILL)
        lost = [cluster.client(0).cluster("KEYSLOT", b"kvtier:" + k.hex().encode()) >= 2 * (16384 // 3) for k in ks]
        bufs = buffers(30, 10_000)
        got = backend.get_into(ks, bufs)
        assert [n == -1 for n in got] == lost and any(lost) and not all(lost)
        assert all(bytes(b) == v for n, b, v in zip(got, bufs, bs) if n > 0)
        assert backend.put(ks, bs) == [not x for x in lost]
        assert not backend.healthy()
        cluster.signal(0, signal.SIGKILL)
        cluster.signal(1, signal.SIGKILL)
        out, seconds = timed(lambda: backend.exists(ks))
        assert isinstance(out, StorageError) and seconds < TIMEOUT + 2
    finally:
        cluster.stop()


def test_nothing_listening_is_refused_fast():
    backend = ValkeyBackend(ValkeyConfig(nodes=(("127.0.0.1", free_port()),), timeout_s=5))
    out, seconds = timed(lambda: backend.put(keys(1), [b"x"]))
    assert isinstance(out, StorageError) and seconds < 1


def test_a_port_taken_between_picking_and_binding_is_picked_again(tmp_path):
    """Ports are picked free and bound later by the server; another process may take one in between
    (a Mooncake master lost its metrics port so in CI). The server's start-up fails at once on it,
    with its log, and the start goes on with fresh ports."""
    import socket

    s = LocalValkey(tmp_path)
    taken = s.ports[0]
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", taken))
        thief.listen()
        started = time.monotonic()
        s.start()
        try:
            assert s.ports[0] != taken and s.client().ping()
            assert time.monotonic() - started < 10   # not after the 15 s wait for a server that died
        finally:
            s.stop()
