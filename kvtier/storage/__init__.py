"""The storage (L3) interface: what every backend keeps, and the contract it keeps.

A backend stores opaque, self-describing *page blobs* (a header and a payload,
:mod:`kvtier.storage.format`) under 16-byte keys, in batches. It never interprets
a blob: the storage tier encodes pages before a ``put`` and verifies every blob
after a ``get`` before any byte reaches a host page, so a backend that loses,
truncates, reorders or mixes up values can only cause misses, never wrong bytes.

Backends are synchronous and batched; the storage tier calls them from its own
bounded thread pool, so a slow or dead store slows only its own hits. Expected
outcomes are return values (a missing key, a full store, a failed put); a
backend raises :class:`StorageError` only where the whole batch failed (the
store unreachable), which the tier counts and answers by skipping the store
until a health check passes.

Backends are found by name (:func:`backend_class`): the built-in ones, or
``"package.module:ClassName"`` for a third-party backend. Each has a frozen,
typed config class (``config_class``), checked at construction.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Sequence

KEY_BYTES = 16


class StorageError(RuntimeError):
    """A whole batch failed: the store is unreachable or refused the request."""


@dataclass(frozen=True)
class Usage:
    """What a backend holds: ``used_bytes`` of ``capacity_bytes`` (None: unbounded or
    unknown), in ``pages`` blobs."""

    used_bytes: int
    capacity_bytes: int | None
    pages: int


class StorageBackend:
    """A key -> blob store, in batches. Subclasses set ``name`` and ``config_class`` and
    implement the five calls below. Thread-safe: the tier may call from several threads.

    Keys are ``bytes`` of :data:`KEY_BYTES`. A blob is a ``bytes``-like object (``bytes``,
    ``memoryview``, a 1-D uint8 numpy array) of at most a few MiB.
    """

    name = ""
    config_class: type = object
    # True where the client spreads one get_into over threads of its own, so a second call in
    # flight only competes with the first: the tier then reads a prefetch's batches one after
    # another (verifying each while the next is read).
    serial_reads = False

    def _take_config(self, config) -> None:
        """Keep ``config`` as ``self.config``; a config of another class than ``config_class`` is
        refused (TypeError naming both) before anything is opened."""
        if not isinstance(config, self.config_class):
            raise TypeError(f"config must be a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config

    def exists(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are present: the length of the longest present
        prefix of a key chain (0 if the first is missing). May stop at the first miss."""
        raise NotImplementedError

    def put(self, keys: Sequence[bytes], blobs: Sequence) -> list[bool]:
        """Store each blob under its key (overwriting). Per key: True once it is stored and a
        later ``get`` may return it; False where it was not (the store full, a failed write):
        a failed put leaves no key behind (a key held before holds its earlier blob whole, or
        nothing), and never a partial blob under the key."""
        raise NotImplementedError

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        """Read each key's blob into its buffer (a writable memoryview of at least the blob's
        size). Per key: the blob's length, or -1 where it is missing or did not fit. A key
        deleted or evicted between ``exists`` and ``get_into`` is -1, never garbage; bytes past
        the returned length are unspecified. A backend that reads blob by blob on threads may also
        offer ``get_into_checked(keys, buffers, check)`` (see the file backend): the tier's check
        then runs on the reading thread right after each blob is read."""
        raise NotImplementedError

    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove these keys where present (absent keys are ignored)."""
        raise NotImplementedError

    def usage(self) -> Usage:
        raise NotImplementedError

    def healthy(self) -> bool:
        """A cheap check that the store answers (after a :class:`StorageError`, the tier calls
        this before using the store again)."""
        return True

    def close(self) -> None:
        """Release connections, threads and files; the backend is not used after."""

    # -- for ``kvtier bench storage`` (optional) ------------------------------------------------

    @classmethod
    def bench_config(cls, workdir: str, capacity_bytes: int):
        """A config to benchmark this backend with: its files (if any) under ``workdir``, room for
        ``capacity_bytes``. ``ValueError`` saying what is missing where it cannot run here (no
        server configured)."""
        raise ValueError(f"backend {cls.name!r} has no bench_config: it cannot be benchmarked by kvtier bench storage")

    @classmethod
    def raw_baseline(cls, config) -> "RawIO":
        """The same store driven without kvtier (plain file IO, the bare client), for the bench's
        ratio: a :class:`RawIO` over what ``config`` names. ``NotImplementedError``: none."""
        raise NotImplementedError


class RawIO:
    """A backend's store driven without kvtier, for the same bytes and keys as the backend: what
    the bench divides by. Same batching, same concurrency as the backend's config allows."""

    def put(self, keys: Sequence[bytes], blobs: Sequence) -> None:
        raise NotImplementedError

    def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> None:
        raise NotImplementedError

    def delete(self, keys: Sequence[bytes]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what it holds."""


_BUILTIN = {
    "file": "kvtier.storage.file:FileBackend",
    "valkey": "kvtier.storage.valkey:ValkeyBackend",
    "valkey-cluster": "kvtier.storage.valkey:ValkeyClusterBackend",
    "mooncake": "kvtier.storage.mooncake:MooncakeBackend",
}


def backend_class(name: str) -> type[StorageBackend]:
    """The backend class for ``name``: a built-in (``file``, ``valkey``, ``valkey-cluster``, ``mooncake``) or a
    ``"module:ClassName"`` path. ``ValueError`` naming the choices for anything else."""
    path = _BUILTIN.get(name, name)
    module, sep, cls = path.partition(":")
    if not sep or not module or not cls:
        raise ValueError(f"unknown storage backend {name!r}; use one of {sorted(_BUILTIN)} or "
                         "'package.module:ClassName' for a third-party backend")
    try:
        found = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"storage backend {name!r} cannot be loaded ({e}); for {module!r}, install its extra "
                         f"(e.g. pip install 'kvtier[{name}]') or check the module path") from e
    if not (isinstance(found, type) and issubclass(found, StorageBackend)):
        raise ValueError(f"storage backend {name!r} is {found!r}, not a kvtier.storage.StorageBackend subclass")
    return found


def open_backend(name: str, location: str | None, capacity_bytes: int) -> StorageBackend:
    """The backend ``name`` (as :func:`backend_class` takes it) over the store at ``location``:

    - ``file``: a directory, holding at most ``capacity_bytes`` of pages;
    - ``valkey``: ``valkey://host:port`` (``valkeys://`` for TLS; the password in
      ``KVTIER_VALKEY_PASSWORD``); ``valkey-cluster``: ``host:port,host:port,...`` (its start-up nodes);
    - ``mooncake``: ``mooncake://host:port?metadata=http://host:port/metadata`` (the master, and its
      metadata server; ``&metrics=http://host:port/metrics`` optionally, for the store's usage);
    - a third-party ``module:Class``: its config class's ``from_url(location, capacity_bytes)``.

    ``location=None`` takes a remote store from the environment (``KVTIER_VALKEY_URL``,
    ``KVTIER_VALKEY_CLUSTER``, ``KVTIER_MOONCAKE_MASTER`` with ``KVTIER_MOONCAKE_METADATA`` and
    ``KVTIER_MOONCAKE_METRICS``). ``ValueError`` naming the form expected, before any connection."""
    from urllib.parse import parse_qs, urlsplit

    cls = backend_class(name)
    if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
    if location is not None and (not isinstance(location, str) or not location):
        raise ValueError(f"the {name} store's location must be a non-empty string, got {location!r}")
    kind, config = cls.name, cls.config_class
    if kind == "file":
        if location is None:
            raise ValueError("the file store needs a directory: give its path as the location")
        return cls(config(location, capacity_bytes))
    if location is None and kind in ("valkey", "valkey-cluster", "mooncake"):
        return cls(cls.bench_config("", capacity_bytes))
    if kind == "valkey":
        return cls(config(url=location))
    if kind == "valkey-cluster":
        pairs = [n.strip().rpartition(":") for n in location.split(",")]
        if not all(h and p.isdigit() for h, _, p in pairs):
            raise ValueError(f"a valkey cluster is 'host:port,host:port,...', not {location!r}")
        return cls(config(nodes=tuple((h, int(p)) for h, _, p in pairs), cluster=True))
    if kind == "mooncake":
        parts, query = urlsplit(location), parse_qs(urlsplit(location).query)
        if parts.scheme != "mooncake" or not parts.netloc or "metadata" not in query:
            raise ValueError(f"a mooncake store is 'mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata', "
                             f"not {location!r}")
        return cls(config(parts.netloc, query["metadata"][0], master_metrics_url=query.get("metrics", [None])[0]))
    from_url = getattr(config, "from_url", None)
    if from_url is None:
        raise ValueError(f"storage backend {name!r} takes no location (its {config.__name__} has no from_url)")
    return cls(from_url(location, capacity_bytes=capacity_bytes))
