"""Real servers for the distributed-storage tests: Valkey (one server or a 3-master cluster),
and a small loopback TCP proxy that delays traffic. Everything listens on 127.0.0.1 only, on
free ports, in a temporary directory; every wait is bounded; teardown kills what was started
(also when the test fails)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

valkey = pytest.importorskip("valkey", reason="needs the valkey client: pip install 'kvtier[valkey]'")

from kvtier.storage import KEY_BYTES, StorageError  # noqa: E402
from kvtier.storage import servers  # noqa: E402
from kvtier.storage.servers import LocalMooncake, free_port, loopback_only, until  # noqa: E402,F401


class DelayProxy:
    """A loopback TCP proxy to ``port`` that holds every chunk it forwards for ``delay_s`` (a
    slow network), and with ``cut_after`` closes both sides once that many bytes went from the
    client to the server (a connection lost mid-batch). Threads end at :meth:`close`."""

    def __init__(self, port: int, delay_s: float, cut_after: int | None = None):
        self.target, self.delay_s, self.cut_after = port, delay_s, cut_after
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.closed = threading.Event()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            self.socks += [client, upstream]
            for a, b, limit in ((client, upstream, self.cut_after), (upstream, client, None)):
                threading.Thread(target=self._pump, args=(a, b, limit), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        src.settimeout(0.2)
        sent = 0
        while not self.closed.is_set():
            try:
                data = src.recv(1 << 20)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:
                return
            time.sleep(self.delay_s)
            if limit is not None and sent + len(data) >= limit:
                data = data[: limit - sent]
            try:
                dst.sendall(data)
            except OSError:
                return
            sent += len(data)
            if limit is not None and sent >= limit:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:  # closed already by close() or the other pump
                        pass
                return

    def close(self) -> None:
        self.closed.set()
        for s in [self.listener, *self.socks]:
            s.close()


def make_tls_files(workdir: Path) -> tuple[str, str, str] | None:
    """A throw-away CA and a server certificate for 127.0.0.1 (``openssl`` CLI); None without it."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    d = Path(workdir)
    ext = d / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
         "-subj", "/CN=kvtier-test-ca"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj",
         "/CN=127.0.0.1"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
         "server.crt", "-days", "1", "-extfile", str(ext)],
    ]
    for step in steps:
        subprocess.run([openssl, *step], cwd=d, check=True, capture_output=True, timeout=60)
    return str(d / "server.crt"), str(d / "server.key"), str(d / "ca.crt")


def keys(n: int, tag: bytes = b"") -> list[bytes]:
    """``n`` distinct storage keys."""
    import hashlib
    return [hashlib.sha256(tag + b"%d" % i).digest()[:KEY_BYTES] for i in range(n)]


def blobs(n: int, size: int, seed: int = 0) -> list[bytes]:
    """``n`` random blobs of ``size`` bytes."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def buffers(n: int, size: int) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(n)]


def round_trip(backend, n: int = 12, size: int = 300_000, tag: bytes = b""):
    """Put ``n`` random blobs, check they exist and read back whole into larger buffers."""
    ks, bs = keys(n, tag), blobs(n, size, seed=len(tag))
    assert backend.put(ks, bs) == [True] * n
    assert backend.exists(ks) == n
    bufs = buffers(n, size + 100)
    assert backend.get_into(ks, bufs) == [size] * n
    assert all(bytes(b[:size]) == v for b, v in zip(bufs, bs))
    return ks, bs


def timed(fn):
    """``(fn()'s result, or the StorageError it raised; the seconds it took)``."""
    t = time.monotonic()
    try:
        out = fn()
    except StorageError as e:
        out = e
    return out, time.monotonic() - t


def after(seconds: float, action) -> threading.Thread:
    """Run ``action`` on another thread ``seconds`` from now (a kill during a batch)."""
    t = threading.Timer(seconds, action)
    t.start()
    return t


def env_without(*names: str) -> dict:
    return {k: v for k, v in os.environ.items() if k not in names}


def needs_mooncake():
    """Skip unless Mooncake Store can run here: its client installed, and a loopback-only network
    (its transfer engine listens on every interface, which tests must not do)."""
    pytest.importorskip("mooncake.store", reason="needs Mooncake: pip install 'kvtier[mooncake]' and apt-get "
                                                 "install libibverbs1")
    if not loopback_only():
        pytest.skip("Mooncake's transfer engine listens on every interface: run these tests in a loopback-only "
                    "network namespace, e.g. unshare -n sh -c 'ip link set lo up && python3 -m pytest "
                    "tests/storage_remote' (as .ci/run does)", allow_module_level=True)
    for name in ("mooncake_master", "mooncake_client"):
        try:
            servers.mooncake_binary(name)
        except RuntimeError as e:
            pytest.skip(str(e), allow_module_level=True)


class LocalValkey(servers.LocalValkey):
    """:class:`kvtier.storage.servers.LocalValkey`, skipping the test where no server binary is here."""

    def __init__(self, *args, **kw):
        try:
            super().__init__(*args, **kw)
        except RuntimeError as e:
            pytest.skip(str(e))


class ValkeyStore:
    """One Valkey server behind the uniform handle the tier-level tests drive."""

    name = "valkey"

    def __init__(self, workdir):
        self.server = LocalValkey(workdir).start()

    def backend(self, **kw):
        from kvtier.storage.valkey import ValkeyBackend
        return ValkeyBackend(self.server.config(**{"timeout_s": 1.0, **kw}))

    def kill(self) -> None:
        self.server.signal(0, signal.SIGKILL)

    def restart(self) -> None:
        self.server.start_server(0)

    def pause(self, paused: bool) -> None:
        self.server.signal(0, signal.SIGSTOP if paused else signal.SIGCONT)

    def overwrite(self, store_key: bytes, data: bytes) -> None:
        """Another client writes ``data`` under the page's key."""
        self.server.client().set(b"kvtier:" + store_key.hex().encode(), data)

    def stop(self) -> None:
        self.server.stop()


class MooncakeStore:
    """A Mooncake Store (metadata server, master, store server) behind the same handle."""

    name = "mooncake"

    def __init__(self, workdir):
        self.store = LocalMooncake(workdir, segment_mb=64).start()
        self.others = []

    def backend(self, **kw):
        from kvtier.storage.mooncake import MooncakeBackend
        return MooncakeBackend(self.store.config(**{"timeout_s": 2.0, **kw}))

    def kill(self) -> None:
        for name in ("store", "master"):
            self.store.signal(name, signal.SIGKILL)

    def restart(self) -> None:
        self.store.start_master()
        self.store.start_store()

    def pause(self, paused: bool) -> None:
        self.store.signal("master", signal.SIGSTOP if paused else signal.SIGCONT)

    def overwrite(self, store_key: bytes, data: bytes) -> None:
        other = self.backend()
        self.others.append(other)
        assert other.put([store_key], [data]) == [True]

    def stop(self) -> None:
        for b in self.others:
            b.close()
        self.store.stop()


def storage_builders():
    """The storage tier's own test builders (tests/storage/storage_testlib.py), importable from here."""
    import sys
    here = str(Path(__file__).resolve().parents[1] / "storage")
    if here not in sys.path:
        sys.path.append(here)
    import storage_testlib
    return storage_testlib
