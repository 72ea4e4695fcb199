"""Mooncake Store as an L3 store: a distributed memory pool shared by many engines.

A page blob is one object under ``key_prefix + key.hex()`` (keys carry no process identity,
so every engine with the same prefix shares every page). The backend is one
``MooncakeDistributedStore`` client, set up from :class:`MooncakeConfig` on first use against
the store's master and metadata server; it moves bytes zero-copy, straight between the
caller's blobs or buffers and the store (``batch_upsert_from`` / ``batch_get_into`` with their
addresses), and asks ``batch_is_exist`` for lookups. Each key's result is checked: a negative
or out-of-range read is a miss, never a success. Stored bytes are never unpickled or executed.

Transports: TCP. Its transfers need no registered memory (a caller may still register long-
lived memory once with :meth:`MooncakeBackend.register_memory`). Mooncake's transfer engine
listens on every interface of the host (it has no bind option); run it where that is allowed.

Optional dependency: ``pip install 'kvtier[mooncake]'`` (``mooncake-transfer-engine-non-cuda``;
it needs ``libibverbs1`` from the system's packages even for TCP).
"""

from __future__ import annotations

import math
import os
import socket
import threading
import urllib.request
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlsplit

import numpy as np

from ..validate import is_finite_number, require_int_at_least
from . import KEY_BYTES, RawIO, StorageBackend, StorageError, Usage

_UNREACHABLE = (-800, -999, -900)  # TRANSFER_FAIL, and the RPC_* range: the store did not answer


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _host_port(value) -> bool:
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


@dataclass(frozen=True)
class MooncakeConfig:
    """How to reach the store; checked at construction, never changed.

    ``master``: the master's RPC address (``host:port``). ``metadata_server``: the transfer
    engine's metadata server (``http://host:port/metadata``). ``local_hostname``: the address
    this client publishes to peers. ``segment_bytes``: memory this process adds to the pool (0:
    a pure client; the pool's memory comes from store servers). ``local_buffer_bytes``: the
    client's own transfer buffer. ``timeout_s`` bounds a call to the master (Mooncake's RPC
    timeout) and a stalled transfer (its TCP progress timeout, half of it, at least 1 s), per
    window of ``window_keys`` keys; both are process-wide Mooncake settings, taken from the
    first backend set up in the process unless ``MC_RPC_TIMEOUT_MS`` /
    ``MC_TCP_PROGRESS_TIMEOUT_SEC`` are already in the environment. ``master_metrics_url``
    (optional, the master's ``/metrics``) lets :meth:`MooncakeBackend.usage` report totals.
    """

    master: str
    metadata_server: str
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    segment_bytes: int = 0
    local_buffer_bytes: int = 16 << 20
    timeout_s: float = 2.0
    window_keys: int = 8
    key_prefix: str = "kvtier:"
    master_metrics_url: str | None = None

    def __post_init__(self):
        _check(_host_port(self.master), f"master must be the master's 'host:port', e.g. '127.0.0.1:50051', got "
                                        f"{self.master!r}")
        _check(isinstance(self.metadata_server, str) and urlsplit(self.metadata_server).scheme == "http",
               f"metadata_server must be 'http://host:port/metadata', got {self.metadata_server!r}")
        _check(isinstance(self.local_hostname, str) and bool(self.local_hostname) and ":" not in self.local_hostname,
               f"local_hostname must be this host's address without a port, e.g. '127.0.0.1', got "
               f"{self.local_hostname!r}")
        _check(self.protocol == "tcp", f"protocol must be 'tcp', got {self.protocol!r} (RDMA needs every buffer "
                                       "registered with the store, which this backend does not do yet)")
        require_int_at_least("segment_bytes", self.segment_bytes, 0)
        require_int_at_least("local_buffer_bytes", self.local_buffer_bytes, 1 << 20)
        require_int_at_least("window_keys", self.window_keys, 1)
        _check(is_finite_number(self.timeout_s, 0, strict=True) and self.timeout_s <= 600,
               f"timeout_s must be a number of seconds in (0, 600], got {self.timeout_s!r}")
        _check(isinstance(self.key_prefix, str) and self.key_prefix.isprintable() and " " not in self.key_prefix,
               f"key_prefix must be a printable string without spaces, e.g. 'kvtier:a:', got {self.key_prefix!r}")
        _check(self.master_metrics_url is None or (isinstance(self.master_metrics_url, str) and urlsplit(
            self.master_metrics_url).scheme == "http"), f"master_metrics_url must be None or the master's "
                                                        f"'http://host:port/metrics', got {self.master_metrics_url!r}")

    def setup_dict(self) -> dict:
        """The ``MooncakeDistributedStore.setup`` configuration."""
        return {"local_hostname": self.local_hostname, "metadata_server": self.metadata_server,
                "global_segment_size": self.segment_bytes, "local_buffer_size": self.local_buffer_bytes,
                "protocol": self.protocol, "master_server_addr": self.master}

    def set_environment(self) -> None:
        """Mooncake's process-wide settings from this config, where the environment has none."""
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(1, round(self.timeout_s * 1000))))
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(max(1, math.ceil(self.timeout_s / 2))))
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.local_hostname)
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")


def reachable(config: MooncakeConfig) -> None:
    """The master and the metadata server accept a TCP connection within ``timeout_s``;
    ``StorageError`` naming the one that does not (before Mooncake's own, slower, retries)."""
    meta = urlsplit(config.metadata_server)
    for host, port in (config.master.rpartition(":")[::2], (meta.hostname, meta.port or 80)):
        try:
            socket.create_connection((host, int(port)), timeout=config.timeout_s).close()
        except OSError as e:
            raise StorageError(f"mooncake: nothing answers at {host}:{port} ({e}): is the store running?") from None


def open_store(config: MooncakeConfig):
    """A set-up ``MooncakeDistributedStore`` client; ``StorageError`` if setup fails (a client
    whose setup failed is never used: its calls would crash the process)."""
    config.set_environment()
    reachable(config)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError(f"the mooncake storage backend needs Mooncake ({e}): pip install 'kvtier[mooncake]' "
                          "and apt-get install libibverbs1") from e
    store = MooncakeDistributedStore()
    rc = store.setup(config.setup_dict())
    if rc != 0:
        raise StorageError(f"mooncake: setup against master {config.master} and metadata server "
                           f"{config.metadata_server} failed (rc={rc}): is the store running?")
    return store


def _unreachable(codes: Sequence[int]) -> bool:
    return bool(codes) and all(c == _UNREACHABLE[0] or _UNREACHABLE[1] <= c <= _UNREACHABLE[2] for c in codes)


def address(buf, writable: bool) -> tuple[int, int, np.ndarray]:
    """The address and size of a contiguous byte buffer (``bytes``, ``bytearray``, ``memoryview``,
    numpy array), and an array that keeps it alive; ``ValueError`` naming the fix otherwise."""
    try:
        arr = np.frombuffer(buf, dtype=np.uint8)
    except (TypeError, ValueError) as e:
        raise ValueError(f"blobs and buffers must be contiguous bytes-like objects (bytes, bytearray, memoryview, "
                         f"numpy array), got {type(buf).__name__}: {e}") from None
    _check(not writable or arr.flags.writeable,
           "get_into buffers must be writable (a memoryview of a bytearray or numpy array)")
    return arr.ctypes.data, arr.nbytes, arr


class MooncakeBackend(StorageBackend):
    """Page blobs in Mooncake Store, zero-copy, in windows of ``window_keys`` keys per call;
    see the module doc. Thread-safe (the client is; setup happens once, under a lock). The
    client is set up on first use, so a store that is down at start-up fails calls with
    :class:`StorageError` (and :meth:`healthy` with False) until it is up."""

    name = "mooncake"
    config_class = MooncakeConfig
    serial_reads = True  # two batches in flight: get 0.92x of the raw client (quartiles 0.76-1.03), one: 0.97x (0.93-1.01); 2-core CPU

    def __init__(self, config: MooncakeConfig):
        self._take_config(config)
        self._lock = threading.Lock()
        self._store = None
        self._suspect = False
        self._registered: list[np.ndarray] = []

    def _client(self):
        with self._lock:
            if self._store is None:
                self._store = open_store(self.config)
                for arr in self._registered:
                    self._store.register_buffer(arr.ctypes.data, arr.nbytes)
            return self._store

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        bad = next((k for k in keys if not isinstance(k, bytes) or len(k) != KEY_BYTES), None)
        _check(bad is None, f"storage keys must be bytes of length {KEY_BYTES}, got {bad!r}")
        return [self.config.key_prefix + k.hex() for k in keys]

    def _windows(self, call: str, names: list[str], *columns, **options) -> list[int]:
        """``call`` over windows of ``window_keys`` keys: every per-key code, in order.
        ``StorageError`` at the first window that the store did not answer at all. After such a
        failure, each call first checks that the master accepts a connection (refused: fails at
        once, not after Mooncake's reconnect attempts), until a call succeeds."""
        if self._suspect:
            reachable(self.config)
        fn = getattr(self._client(), call)
        step = self.config.window_keys
        out: list[int] = []
        for i in range(0, len(names), step):
            codes = list(fn(names[i:i + step], *(c[i:i + step] for c in columns), **options))
            if len(codes) != len(names[i:i + step]):
                raise StorageError(f"mooncake {call} returned {len(codes)} results for {len(names[i:i + step])} keys")
            self._suspect = _unreachable(codes)
            if self._suspect:
                raise StorageError(f"mooncake at {self.config.master}: {call} failed for every key (codes "
                                   f"{sorted(set(codes))}): the store did not answer within timeout_s")
            out += codes
        return out

    def put(self, keys: Sequence[bytes], blobs: Sequence) -> list[bool]:
        """``batch_upsert_from`` from each blob's own memory (an existing key is replaced: Mooncake
        publishes the new value whole once written). False where the store refused it (its
        segments full) or the transfer failed."""
        _check(len(keys) == len(blobs), f"put got {len(keys)} keys but {len(blobs)} blobs; pass one blob per key")
        names = self._names(keys)
        spans = [address(b, writable=False) for b in blobs]
        codes = self._windows("batch_upsert_from", names, [s[0] for s in spans], [s[1] for s in spans])
        return [c == 0 for c in codes]

    def get_into(self, keys: Sequence[bytes], buffers: Sequence) -> list[int]:
        """``batch_get_into`` straight into each buffer. Per key: the bytes read, or -1 for a
        missing key, a value larger than its buffer, a failed transfer or an expired lease."""
        _check(len(keys) == len(buffers),
               f"get_into got {len(keys)} keys but {len(buffers)} buffers; pass one buffer per key")
        names = self._names(keys)
        spans = [address(b, writable=True) for b in buffers]
        codes = self._windows("batch_get_into", names, [s[0] for s in spans], [s[1] for s in spans])
        return [n if 0 < n <= s[1] else -1 for n, s in zip(codes, spans)]

    def exists(self, keys: Sequence[bytes]) -> int:
        codes = self._windows("batch_is_exist", self._names(keys))
        return next((i for i, c in enumerate(codes) if c != 1), len(codes))

    def delete(self, keys: Sequence[bytes]) -> None:
        """``batch_remove``, forced past read leases: a read racing the delete may return a blob
        that fails the tier's verification (a counted miss), never one that passes it."""
        self._windows("batch_remove", self._names(keys), force=True)

    def usage(self) -> Usage:
        """Totals from the master's ``/metrics`` (``master_metrics_url``); without it, unknown
        (0 bytes of no known capacity: the client API reports no totals)."""
        url = self.config.master_metrics_url
        if url is None:
            return Usage(0, None, 0)
        try:
            with urllib.request.urlopen(url, timeout=self.config.timeout_s) as r:
                text = r.read().decode()
        except OSError as e:
            raise StorageError(f"mooncake master metrics at {url}: {e}") from None
        values = dict(line.split()[:2] for line in text.splitlines() if line.startswith("master_") and " " in line)
        get = lambda name: int(float(values.get(name, 0)))  # noqa: E731
        return Usage(get("master_allocated_bytes"), get("master_total_capacity_bytes") or None,
                     get("master_key_count"))

    def healthy(self) -> bool:
        """The master and the metadata server accept connections, and the master answers a lookup
        within ``timeout_s``. Never raises."""
        try:
            reachable(self.config)
            codes = self._client().batch_is_exist([self.config.key_prefix + "health"])
            return not _unreachable(list(codes))
        except Exception:
            return False

    def register_memory(self, buf) -> None:
        """Register long-lived memory (a host pool's bytes, a staging arena) with the store, once
        (kept referenced until :meth:`close`). TCP transfers work without it."""
        _, _, arr = address(buf, writable=False)
        with self._lock:
            self._registered.append(arr)
            store = self._store
        if store is not None and store.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
            raise StorageError(f"mooncake: register_buffer of {arr.nbytes} bytes failed")

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
            self._registered = []
        if store is not None:
            store.close()

    @classmethod
    def bench_config(cls, workdir: str, capacity_bytes: int) -> MooncakeConfig:
        """The store named by ``KVTIER_MOONCAKE_MASTER`` (``host:port``) and
        ``KVTIER_MOONCAKE_METADATA`` (``http://host:port/metadata``), with room for
        ``capacity_bytes`` in its pool; ``ValueError`` naming them where they are unset."""
        master, meta = os.environ.get("KVTIER_MOONCAKE_MASTER"), os.environ.get("KVTIER_MOONCAKE_METADATA")
        _check(bool(master and meta), "benchmarking mooncake needs a running store: set KVTIER_MOONCAKE_MASTER="
                                      "host:port and KVTIER_MOONCAKE_METADATA=http://host:port/metadata")
        return MooncakeConfig(master, meta, master_metrics_url=os.environ.get("KVTIER_MOONCAKE_METRICS"))

    @classmethod
    def raw_baseline(cls, config: MooncakeConfig) -> "MooncakeRawIO":
        return MooncakeRawIO(config)


class MooncakeRawIO(RawIO):
    """The same bytes through ``MooncakeDistributedStore`` alone: its own client, every blob and
    buffer registered once, then ``batch_upsert_from`` / ``batch_get_into`` with their addresses,
    ``window_keys`` keys a call as the backend does (no per-key checks)."""

    def __init__(self, config: MooncakeConfig):
        self.config = config
        self.store = open_store(config)
        self.seen: dict[int, np.ndarray] = {}

    def _addresses(self, bufs) -> tuple[list[int], list[int]]:
        arrs = [np.frombuffer(b, dtype=np.uint8) for b in bufs]
        for a in arrs:
            if a.ctypes.data not in self.seen:
                self.store.register_buffer(a.ctypes.data, a.nbytes)
                self.seen[a.ctypes.data] = a
        return [a.ctypes.data for a in arrs], [a.nbytes for a in arrs]

    def _names(self, keys) -> list[str]:
        return [self.config.key_prefix + "raw:" + k.hex() for k in keys]

    def _calls(self, call, keys, bufs) -> None:
        names, (ptrs, sizes), step = self._names(keys), self._addresses(bufs), self.config.window_keys
        for i in range(0, len(names), step):
            getattr(self.store, call)(names[i:i + step], ptrs[i:i + step], sizes[i:i + step])

    def put(self, keys, blobs) -> None:
        self._calls("batch_upsert_from", keys, blobs)

    def get(self, keys, buffers) -> None:
        self._calls("batch_get_into", keys, buffers)

    def delete(self, keys) -> None:
        self.store.batch_remove(self._names(keys), True)

    def close(self) -> None:
        self.store.close()
