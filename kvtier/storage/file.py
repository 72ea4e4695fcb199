"""The embedded default store: page blobs as files in a local directory.

Each blob is one file, ``<dir>/<first key byte, hex>/<key hex>.kvp``. A put writes a temporary
file (``.<key>.<pid>.<thread>.tmp``, invisible to the index) and renames it into place, so a
crash never leaves a partial page under a key and a key never points at space reused by
another page; a failed put removes its temporary file and leaves the key as it was. The
index (key -> size, in LRU order) lives in memory and is rebuilt at start-up from the files'
headers: a file whose header does not verify is deleted, temporary files of dead processes too.
Capacity is kept by evicting the least recently used pages before a write.

``fsync`` is off by default: the tier verifies every blob it reads (header and checksum), so a
page torn by a power loss is a counted miss, never wrong bytes; ``fsync=True`` also makes a
page durable before it is published. One directory per process: several processes may share
one (each sees the others' pages only after a restart, and counts only its own towards
``capacity_bytes``), and none can make another load a wrong byte.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..validate import is_int, require_positive_int
from . import KEY_BYTES, RawIO, StorageBackend, StorageError, Usage
from .format import HEADER_BYTES, PageRejected, copy_digest, read_header

logger = logging.getLogger("kvtier")

SUFFIX = ".kvp"
TMP_SUFFIX = ".tmp"
MAX_IO_THREADS = 64
PROGRESS_EVERY = 20_000  # files between progress lines of a start-up scan
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; Python names it from 3.13
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
FULL_DISK_RETRY_S = 30.0  # how long a full disk keeps the limit at what the store held then


@dataclass(frozen=True)
class FileConfig:
    """A directory store. ``path``: the directory (created if missing). ``capacity_bytes``: the
    most its pages may hold, headers included. ``fsync``: make each page durable before it is
    published (off: a torn page is caught by the read-side checksum). ``io_threads``: files read
    or written at once within one batch. ``read_mmap``: copy a page held in the page cache out of a
    mapping (8 MiB pages, 2 threads: 10-12 GB/s against read()'s 6 on the 2-core development
    machine; a page not in memory is read() as before); off: read() always, for filesystems where
    another program may shrink a page file under a reader (a mapping would fault)."""

    path: str
    capacity_bytes: int
    fsync: bool = False
    io_threads: int = 4
    read_mmap: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.path, os.PathLike):
            object.__setattr__(self, "path", os.fspath(self.path))
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"path must name a directory, got {self.path!r}")
        require_positive_int("capacity_bytes", self.capacity_bytes)
        if self.capacity_bytes <= HEADER_BYTES:
            raise ValueError(f"capacity_bytes={self.capacity_bytes} holds no page; give at least a few pages' worth "
                             "(e.g. 10 * 2**30 for 10 GiB)")
        for name in ("fsync", "read_mmap"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not is_int(self.io_threads) or not 1 <= self.io_threads <= MAX_IO_THREADS:
            raise ValueError(f"io_threads must be an integer in 1..{MAX_IO_THREADS}, got {self.io_threads!r}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        return True
    return True


class FileBackend(StorageBackend):
    """:class:`~kvtier.storage.StorageBackend` over a local directory (see the module's contract).

    Never raises for a single page: a full disk (ENOSPC, EDQUOT, EFBIG), a read-only directory
    (EROFS, EACCES) or any other write error is a put of False; a missing or unreadable file is
    a get of -1. Raises :class:`StorageError` for a whole batch only where the directory itself is
    gone. On a full disk the store also lowers its own limit to what it holds, so later puts
    evict old pages to make room rather than fail.
    """

    name = "file"
    config_class = FileConfig

    def __init__(self, config: FileConfig):
        self._take_config(config)
        self.root = os.path.abspath(config.path)
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ValueError(f"path {self.root!r} is a file; name a directory for the page store")
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise ValueError(f"path {self.root!r} cannot be created ({e.strerror}); name a writable directory") from None
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise ValueError(f"path {self.root!r} cannot be read by this user; name a directory it can read")
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> blob bytes; oldest first
        self._used = 0
        self._reserved = 0
        self._limit = config.capacity_bytes
        self._shrunk_at: float | None = None  # when a full disk lowered the limit
        self.errors: dict[str, int] = {}  # failed file operations by errno name
        self._gone = False  # the directory was found missing: indexed anew once it is back
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvtier-file")
        self._rebuild()

    # -- paths -------------------------------------------------------------------------------

    def _shard(self, key: bytes) -> str:
        return os.path.join(self.root, f"{key[0]:02x}")

    def path_of(self, key: bytes) -> str:
        """The file that holds ``key``'s blob (present or not)."""
        return os.path.join(self._shard(key), key.hex() + SUFFIX)

    # -- the interface -----------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> int:
        keys = _checked_keys(keys)
        self._check_root()
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self._index:
                n += 1
            self._touch(keys[:n])
        return n

    def put(self, keys: Sequence[bytes], blobs: Sequence) -> list[bool]:
        keys = _checked_keys(keys)
        if len(blobs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(blobs)} blobs; give one blob per key")
        views = [memoryview(b).cast("B") for b in blobs]
        self._check_root()
        done = self._map(self._put_one, list(zip(keys, views)))
        with self._lock:
            self._touch([k for k, ok in zip(keys, done) if ok])
        return done

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        return [n for n, _ in self.get_into_checked(keys, buffers)]

    def get_into_checked(self, keys: Sequence[bytes], buffers: Sequence[memoryview], check=None) -> list[tuple]:
        """:meth:`get_into`, and ``check(i, length, checksum)`` called on the reading thread right after
        blob ``i`` is read (``checksum``: its payload's, taken as it was copied out of the page cache;
        None where read from disk); per key ``(length, check's result or None)``."""
        keys = _checked_keys(keys)
        if len(buffers) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers; give one buffer per key")
        views = [memoryview(b).cast("B") for b in buffers]
        self._check_root()
        with self._lock:
            self._touch([k for k in keys if k in self._index])

        def one(item):
            n, digest = self._read_one(*item[1:], digest=check is not None)
            return n, None if check is None else check(item[0], n, digest)
        return self._map(one, [(i, k, v) for i, (k, v) in enumerate(zip(keys, views))])

    def delete(self, keys: Sequence[bytes]) -> None:
        keys = _checked_keys(keys)
        with self._lock:
            for k in keys:
                self._drop(k)

    def usage(self) -> Usage:
        with self._lock:
            return Usage(self._used, self.config.capacity_bytes, len(self._index))

    def healthy(self) -> bool:
        """The directory is there; one back after it was gone (moved back, or made again) is indexed anew."""
        if not os.path.isdir(self.root):
            return False
        if self._gone:
            with self._lock:
                self._index.clear()
                self._used = 0
            self._rebuild()
            self._gone = False
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @classmethod
    def bench_config(cls, workdir: str, capacity_bytes: int) -> FileConfig:
        return FileConfig(os.path.join(workdir, "store"), capacity_bytes)

    @classmethod
    def raw_baseline(cls, config: FileConfig) -> "FileRawIO":
        return FileRawIO(os.path.join(config.path, "raw"), config.io_threads)

    # -- one page ------------------------------------------------------------------------------

    def _put_one(self, item: tuple[bytes, memoryview]) -> bool:
        key, blob = item
        size = len(blob)
        if not self._reserve(key, size):
            return False
        tmp = os.path.join(self._shard(key), f".{key.hex()}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        try:
            self._write(tmp, blob)
            with self._lock:
                os.rename(tmp, self.path_of(key))
                self._reserved -= size
                self._used += size - self._index.pop(key, 0)
                self._index[key] = size
            return True
        except OSError as e:
            with self._lock:
                self._reserved -= size
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    self._limit = max(min(self._limit, self._used), HEADER_BYTES + 1)
                    self._shrunk_at = time.monotonic()
            self._failed("write", e)
            _unlink(tmp)
            return False

    def _write(self, tmp: str, blob: memoryview) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # the shard directory is new, or was removed under us
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
        try:
            written = 0
            while written < len(blob):
                written += os.write(fd, blob[written:])
            if self.config.fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _read_one(self, key: bytes, buf: memoryview, digest: bool = False) -> tuple[int, int | None]:
        """The blob of ``key`` into ``buf``: its length (-1: none) and, with ``digest`` and where it
        came from the page cache, its payload's checksum."""
        with self._lock:
            if key not in self._index:
                return -1, None
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            with self._lock:  # gone under us (another process, an operator): forget it
                self._drop(key, unlink=False)
            self._failed("open", e)
            return -1, None
        try:
            size = os.fstat(fd).st_size
            if size > len(buf):
                return -1, None
            if self.config.read_mmap:
                return self._read_mapped(fd, size, buf, digest)
            return _read_plain(fd, size, buf), None
        except OSError as e:
            self._failed("read", e)
            return -1, None
        finally:
            os.close(fd)

    @staticmethod
    def _read_mapped(fd: int, size: int, buf: memoryview, digest: bool) -> tuple[int, int | None]:
        """Copy a file held in the page cache out of a mapping of it (with ``digest``, its payload's
        checksum as it is copied); read() where any page of it is not in memory (a cold file reads
        faster so, and a mapped page that fails to read would fault)."""
        if size <= HEADER_BYTES:
            return _read_plain(fd, size, buf), None
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        src = None
        try:
            src = np.frombuffer(m, np.uint8)
            if not _resident(src):
                return _read_plain(fd, size, buf), None
            try:
                m.madvise(MADV_POPULATE_READ)   # map every page at once rather than fault them in one by one
            except OSError:
                pass                            # a kernel before 5.14: faulted in as copied
            dst = np.frombuffer(buf, np.uint8, count=size)
            if digest:
                return size, copy_digest(dst, src)
            np.copyto(dst, src)
            return size, None
        finally:
            del src  # the mapping closes only once no array points into it
            m.close()

    # -- bookkeeping (under the lock) ------------------------------------------------------------

    def _reserve(self, key: bytes, size: int) -> bool:
        """Make room for ``size`` more bytes by evicting least recently used pages (never ``key``);
        False where the page cannot fit at all."""
        with self._lock:
            if self._shrunk_at is not None and time.monotonic() - self._shrunk_at > FULL_DISK_RETRY_S:
                self._limit, self._shrunk_at = self.config.capacity_bytes, None  # the disk may have room again
            if size > self._limit:
                return False
            for victim in list(self._index):
                if self._used + self._reserved + size <= self._limit:
                    break
                if victim != key:
                    self._drop(victim)
            if self._used + self._reserved + size > self._limit:
                return False
            self._reserved += size
            return True

    def _drop(self, key: bytes, unlink: bool = True) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size
            if unlink:
                _unlink(self.path_of(key))

    def _touch(self, keys: Sequence[bytes]) -> None:
        # Last first: a chain's parents end up more recent than its children, so eviction takes
        # the tail of a prefix before its head (a missing head makes the whole tail unreachable).
        for k in reversed(keys):
            if k in self._index:
                self._index.move_to_end(k)

    def _failed(self, op: str, e: OSError) -> None:
        name = errno.errorcode.get(e.errno or 0, type(e).__name__)
        with self._lock:
            first = name not in self.errors
            self.errors[name] = self.errors.get(name, 0) + 1
        if first:
            logger.warning("file store %s: %s failed (%s); counted, the page is a miss or not stored%s", self.root, op,
                           e, "; lower capacity_bytes to leave the disk room" if name == "ENOSPC" else "")

    def _check_root(self) -> None:
        if not os.path.isdir(self.root):
            self._gone = True
            raise StorageError(f"file store directory {self.root!r} is gone")

    def _map(self, fn, items: list) -> list:
        if len(items) <= 1 or self.config.io_threads == 1:
            return [fn(i) for i in items]
        return list(self._pool.map(fn, items))

    # -- start-up ------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index the pages already in the directory, oldest first; delete those whose header does
        not verify and temporary files no live process is writing."""
        started = time.perf_counter()
        shards = sorted(e.path for e in os.scandir(self.root) if e.is_dir() and _is_shard(e.name))
        found: list[tuple[int, bytes, int]] = []
        for i, entries in enumerate(self._pool.map(self._scan_shard, shards)):
            found.extend(entries)
            if len(found) // PROGRESS_EVERY != (len(found) - len(entries)) // PROGRESS_EVERY:
                logger.info("file store %s: indexed %d pages (%d of %d directories)", self.root, len(found), i + 1,
                            len(shards))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._used += size
            for victim in list(self._index):
                if self._used <= self._limit:
                    break
                self._drop(victim)
        if found:
            logger.info("file store %s: %d pages, %.2f GB indexed in %.1f s", self.root, len(self._index),
                        self._used / 1e9, time.perf_counter() - started)

    def _scan_shard(self, shard: str) -> list[tuple[int, bytes, int]]:
        out = []
        for e in os.scandir(shard):
            if e.name.endswith(TMP_SUFFIX):
                _remove_stale_tmp(e.path, e.name)
            elif e.name.endswith(SUFFIX):
                entry = _indexable(e)
                if entry is None:
                    _unlink(e.path)
                else:
                    out.append(entry)
        return out


def directory_usage(path: str) -> Usage:
    """What the file store in ``path`` holds (its page files, by their sizes), read-only: nothing is
    indexed, checked or removed. ``ValueError`` where ``path`` is no directory."""
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory: name a file store's directory (FileConfig.path)")
    used = pages = 0
    for shard in os.scandir(path):
        if shard.is_dir() and _is_shard(shard.name):
            for e in os.scandir(shard.path):
                if e.name.endswith(SUFFIX) and e.is_file():
                    used += e.stat().st_size
                    pages += 1
    return Usage(used, None, pages)


class FileRawIO(RawIO):
    """The same bytes as plain files, with no kvtier: one file a key in one directory, written
    with open/write/close and read with open/read/close, ``threads`` files at once."""

    def __init__(self, path: str, threads: int):
        os.makedirs(path, exist_ok=True)
        self.path, self.threads = path, threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-raw")

    def put(self, keys, blobs) -> None:
        list(self._pool.map(self._put_one, keys, blobs))

    def get(self, keys, buffers) -> None:
        list(self._pool.map(self._get_one, keys, buffers))

    def delete(self, keys) -> None:
        for k in keys:
            _unlink(os.path.join(self.path, k.hex()))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _put_one(self, key: bytes, blob) -> None:
        with open(os.path.join(self.path, key.hex()), "wb", buffering=0) as f:
            f.write(blob)

    def _get_one(self, key: bytes, buf) -> None:
        with open(os.path.join(self.path, key.hex()), "rb", buffering=0) as f:
            f.readinto(buf)


def _read_plain(fd: int, size: int, buf: memoryview) -> int:
    got = 0
    while got < size and (n := os.preadv(fd, [buf[got:size]], got)) > 0:
        got += n
    return got


def _resident(pages: np.ndarray) -> bool:
    """Whether every page of a mapping is in memory (``mincore``), so reading it cannot fault."""
    n = (pages.size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    if _libc.mincore(ctypes.c_void_p(pages.ctypes.data), ctypes.c_size_t(pages.size), vec) != 0:
        return False
    return bool((np.frombuffer(vec, np.uint8) & 1).all())


def _is_shard(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


def _indexable(entry: os.DirEntry) -> tuple[int, bytes, int] | None:
    """``(mtime, key, size)`` of a page file whose name, header and length agree; else None."""
    try:
        key = bytes.fromhex(entry.name[: -len(SUFFIX)])
        with open(entry.path, "rb", buffering=0) as f:
            head = f.read(HEADER_BYTES)
            st = os.fstat(f.fileno())
        h = read_header(head)
    except (ValueError, OSError, PageRejected):
        return None
    if len(key) != KEY_BYTES or h.key != key or st.st_size != HEADER_BYTES + h.payload_len:
        return None
    return (st.st_mtime_ns, key, st.st_size)


def _remove_stale_tmp(path: str, name: str) -> None:
    pid = name.split(".")[2] if name.count(".") >= 4 else ""
    if not pid.isdigit() or int(pid) == os.getpid() or not _pid_alive(int(pid)):
        _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # already gone, or a read-only directory: the index no longer names it


def _checked_keys(keys: Sequence[bytes]) -> list[bytes]:
    keys = list(keys)
    for k in keys:
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise ValueError(f"storage keys are {KEY_BYTES} bytes (kvtier.storage.format.store_key), got {k!r}")
    return keys
