"""The Mooncake Store backend against a real store started here on loopback (metadata server,
mooncake_master, a store server lending the memory); the backend is a pure client."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from storage_remote_testlib import LocalMooncake, blobs, buffers, keys, needs_mooncake, round_trip
from kvtier.storage import backend_class

needs_mooncake()

from kvtier.storage.mooncake import MooncakeBackend, MooncakeConfig  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = LocalMooncake(tmp_path_factory.mktemp("mooncake")).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def backend(store):
    b = MooncakeBackend(store.config())
    yield b
    b.close()


def test_the_registry_finds_the_backend():
    assert backend_class("mooncake") is MooncakeBackend


def test_put_get_exists_and_usage(backend):
    ks, bs = round_trip(backend, tag=b"basic")
    missing = keys(2, b"missing")
    assert backend.exists(ks[:3] + missing[:1] + ks[3:]) == 3 and backend.exists(missing) == 0
    bufs = buffers(3, 300_000)
    assert backend.get_into([ks[0], missing[0], ks[1]], bufs) == [300_000, -1, 300_000]
    assert bytes(bufs[2]) == bs[1]
    u = backend.usage()
    assert u.used_bytes >= 12 * 300_000 and u.capacity_bytes == 256 << 20 and u.pages >= 12


def test_a_put_replaces_the_value_under_a_key(backend):
    ks = keys(2, b"replace")
    assert backend.put(ks, [b"a" * 1000, b"b" * 1000]) == [True, True]
    assert backend.put(ks, [b"c" * 500, b"d" * 2000]) == [True, True]
    bufs = buffers(2, 4096)
    assert backend.get_into(ks, bufs) == [500, 2000]
    assert bytes(bufs[0][:500]) == b"c" * 500 and bytes(bufs[1][:2000]) == b"d" * 2000


def test_a_value_larger_than_its_buffer_is_a_miss_and_the_next_key_still_reads(backend):
    ks = keys(3, b"small-buffer")
    bs = [b"a" * 5000, b"b" * 70_000, b"c" * 10]
    assert backend.put(ks, bs) == [True] * 3
    bufs = [memoryview(bytearray(5000)), memoryview(bytearray(69_999)), memoryview(bytearray(10))]
    assert backend.get_into(ks, bufs) == [5000, -1, 10]
    assert bytes(bufs[0]) == bs[0] and bytes(bufs[2]) == bs[2]


def test_blobs_and_buffers_of_every_bytes_like_kind(backend):
    np = pytest.importorskip("numpy")
    ks = keys(3, b"kinds")
    arr = np.arange(1000, dtype=np.uint8)
    assert backend.put(ks, [arr, b"bytes", memoryview(bytearray(b"view"))]) == [True] * 3
    out = np.zeros(2000, np.uint8)
    assert backend.get_into(ks[:1], [memoryview(out)]) == [1000] and (out[:1000] == arr).all()


def test_bad_input_is_refused_by_name_before_anything_is_sent(backend):
    with pytest.raises(ValueError, match="length 16"):
        backend.put([b"short"], [b"x"])
    with pytest.raises(ValueError, match="one blob per key"):
        backend.put(keys(2, b"bad"), [b"x"])
    with pytest.raises(ValueError, match="writable"):
        backend.get_into(keys(1, b"bad"), [memoryview(b"readonly")])
    with pytest.raises(ValueError, match="bytes-like"):
        backend.put(keys(1, b"bad"), [object()])
    assert backend.exists(keys(2, b"bad")) == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(master="127.0.0.1", metadata_server="http://h:1/metadata"), "host:port"),
    (dict(master="h:1", metadata_server="etcd://h:1"), "metadata_server"),
    (dict(master="h:1", metadata_server="http://h:1/m", protocol="rdma"), "protocol must be 'tcp'"),
    (dict(master="h:1", metadata_server="http://h:1/m", local_hostname="h:1"), "local_hostname"),
    (dict(master="h:1", metadata_server="http://h:1/m", segment_bytes=-1), "segment_bytes"),
    (dict(master="h:1", metadata_server="http://h:1/m", local_buffer_bytes=10), "local_buffer_bytes"),
    (dict(master="h:1", metadata_server="http://h:1/m", timeout_s=0), "timeout_s"),
    (dict(master="h:1", metadata_server="http://h:1/m", window_keys=0), "window_keys"),
    (dict(master="h:1", metadata_server="http://h:1/m", key_prefix="a b"), "key_prefix"),
])
def test_bad_config_is_refused_at_construction_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MooncakeConfig(**kwargs)


def test_tenants_with_different_prefixes_cannot_read_each_other(store, backend):
    other = MooncakeBackend(store.config(key_prefix="kvtier:tenant-b:"))
    try:
        ks, _ = round_trip(backend, n=3, tag=b"tenant-a")
        assert other.exists(ks) == 0 and other.get_into(ks, buffers(3, 300_000)) == [-1, -1, -1]
    finally:
        other.close()


def test_another_process_reads_what_this_one_stored(store, backend):
    """Two engine processes, one store: the keys carry no process identity."""
    ks, bs = keys(4, b"shared"), blobs(4, 50_000, seed=7)
    assert backend.put(ks, bs) == [True] * 4
    code = (
        "import hashlib, sys\n"
        "from kvtier.storage.mooncake import MooncakeBackend, MooncakeConfig\n"
        f"b = MooncakeBackend(MooncakeConfig({store.config().master!r}, {store.config().metadata_server!r}))\n"
        f"ks = {ks!r}\n"
        "bufs = [memoryview(bytearray(50_000)) for _ in ks]\n"
        "assert b.get_into(ks, bufs) == [50_000] * 4\n"
        "sys.stdout.write(hashlib.sha256(b''.join(bytes(x) for x in bufs)).hexdigest())\n"
        "b.close()\n"
    )
    import hashlib
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == hashlib.sha256(b"".join(bs)).hexdigest()


def test_threads_share_one_backend(backend):
    errors = []

    def worker(t):
        try:
            for r in range(3):
                round_trip(backend, n=8, size=100_000, tag=b"thread-%d-%d" % (t, r))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors


def test_registered_memory_still_moves_bytes(store):
    np = pytest.importorskip("numpy")
    b = MooncakeBackend(store.config())
    try:
        arena = np.zeros(4 << 20, np.uint8)
        b.register_memory(arena)
        views = [memoryview(arena)[i << 20:(i + 1) << 20] for i in range(4)]
        ks, bs = keys(4, b"registered"), blobs(4, 1 << 20)
        assert b.put(ks, bs) == [True] * 4
        assert b.get_into(ks, views) == [1 << 20] * 4 and [bytes(v) for v in views] == bs
    finally:
        b.close()


def test_raw_io_and_bench_config(store, monkeypatch):
    monkeypatch.delenv("KVTIER_MOONCAKE_MASTER", raising=False)
    with pytest.raises(ValueError, match="KVTIER_MOONCAKE_MASTER"):
        MooncakeBackend.bench_config("/tmp", 1)
    cfg = store.config()
    monkeypatch.setenv("KVTIER_MOONCAKE_MASTER", cfg.master)
    monkeypatch.setenv("KVTIER_MOONCAKE_METADATA", cfg.metadata_server)
    raw = MooncakeBackend.raw_baseline(MooncakeBackend.bench_config("/tmp", 1))
    try:
        np = pytest.importorskip("numpy")
        ks = keys(4, b"raw")
        bs = [np.frombuffer(b, np.uint8).copy() for b in blobs(4, 1 << 20)]
        raw.put(ks, bs)
        out = [np.zeros(1 << 20, np.uint8) for _ in ks]
        raw.get(ks, [memoryview(o) for o in out])
        assert all((o == b).all() for o, b in zip(out, bs))
        raw.delete(ks)
    finally:
        raw.close()
