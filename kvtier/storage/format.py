"""What a stored page is: its salt, its key, its canonical bytes and its header.

- :class:`StorageSalt` names everything a page's bytes depend on (model, weights, KV kind,
  shape and dtype, page size, the TP rank's heads for MHA) and nothing they do not (the host
  layout, the process). Its 16-byte ``fingerprint`` is a hash of a versioned canonical
  encoding: equal in every interpreter that builds the same salt.
- :func:`store_key` binds the cache's chained page hash (the namespace is already mixed into
  the chain by ``kvtier.cache.hashing.namespace_seed``) to the salt: 16 bytes, keyed BLAKE2b.
- The payload is the page in one canonical order, whatever the host layout: for each
  component (``spec.components`` order), for each layer, the page's tokens in order, each
  token's item bytes -- the order of the device pool's rows. :class:`PageCodec` gathers a batch
  of host pages into it and scatters verified payloads back, through strided views of the
  pool's raw bytes built from its :class:`~kvtier.layouts.Placement`.
- A blob is a :data:`HEADER_BYTES` header and the payload. :meth:`PageCodec.verify` checks
  every field against what the reader expects and the payload's xxh3-64 before a byte reaches a
  host page, and raises :class:`PageRejected` with the reason: a rejected page is a miss.
"""

from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import Executor, wait
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
import xxhash
from numpy.lib.stride_tricks import as_strided

from ..allocator import AllocatorError, tokens_to_pages
from ..host_checks import _as_index_tensor
from ..spec import DSA, MHA, MLA, KVSpec
from ..validate import is_int, require_positive_int
from . import KEY_BYTES

MAGIC = b"KVTPAGE\x00"
FORMAT_VERSION = 1
HEADER_BYTES = 128
SALT_VERSION = b"kvtier-storage-salt-v1"
KEY_PERSON = b"kvtier-key-v1"

# magic, version, header bytes, flags, key, parent, salt fingerprint, kind, dtype, (pad),
# page size, layer count, head range [lo, hi), payload length, payload xxh3-64.
_FIELDS = struct.Struct("<8sHHI16s16s16sBBHIIIIQQ")
_HEADER_SUM_AT = HEADER_BYTES - 8
_FLAG_PARENT = 1
_KIND_CODES = {MHA: 1, MLA: 2, DSA: 3}
# Names as ``str(torch.dtype)`` without the prefix; 0 is any other (the fingerprint still tells).
_DTYPE_CODES = {name: i for i, name in enumerate(
    ("", "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
     "uint8", "int8", "float64"))}

MISS_REASONS = ("corrupt", "short", "wrong_key", "foreign")
CHUNK_BYTES = 256 << 10  # what gather copies before checksumming it: fits the L2 cache of common CPUs
THREADED_BYTES = 1 << 20  # gather on 2 threads: 1.3-1.4x at 1 MiB pages, 0.9-1.1x at 512 KiB (2-core CPU)
DIGEST_CHUNK = 2 << 20   # copy_digest's: 8 MiB blobs from the page cache 8.4 GB/s, 1 MiB 8.2, 512 KiB 7.0 (2-core CPU)


class PageRejected(Exception):
    """A blob that must not be loaded. ``reason``: ``corrupt`` (bad magic, header or payload
    checksum, inconsistent lengths), ``short`` (fewer bytes than the header says),
    ``wrong_key`` (a page of this salt stored under another key or parent), ``foreign`` (another
    salt or format version: another model, weights, shape, dtype, page size or rank)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _dtype_name(spec: KVSpec) -> str:
    return str(spec.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class StorageSalt:
    """Everything a stored page's bytes depend on; checked at construction.

    ``model_id`` names the model (non-empty); ``weights_fingerprint`` (optional) tells apart
    weights served under one name (a checkpoint hash, a revision). ``tp_rank``/``tp_size`` and
    ``head_range`` (the rank's KV heads ``[lo, hi)``; default ``tp_rank * head_num`` onwards)
    count for MHA only: MLA and DSA pages are the same on every rank, so their salt leaves the
    rank out and one write serves all ranks.
    """

    spec: KVSpec
    page_size: int
    model_id: str
    weights_fingerprint: str | None = None
    tp_rank: int = 0
    tp_size: int = 1
    head_range: tuple[int, int] | None = None
    fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, KVSpec):
            raise ValueError(f"spec must be a kvtier KVSpec, got {type(self.spec).__name__}")
        require_positive_int("page_size", self.page_size)
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"model_id must name the model (e.g. 'meta-llama/Llama-3.1-8B'), got {self.model_id!r}: "
                             "pages stored under one empty name would be shared by every model of this shape")
        if self.weights_fingerprint is not None and not (isinstance(self.weights_fingerprint, str)
                                                         and self.weights_fingerprint):
            raise ValueError(f"weights_fingerprint must be a non-empty string or None, got {self.weights_fingerprint!r}")
        require_positive_int("tp_size", self.tp_size)
        if not is_int(self.tp_rank) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be an integer in 0..{self.tp_size - 1} (tp_size={self.tp_size}), "
                             f"got {self.tp_rank!r}")
        object.__setattr__(self, "head_range", self._checked_heads())
        object.__setattr__(self, "fingerprint", hashlib.sha256(SALT_VERSION + self.canonical()).digest()[:16])

    def _checked_heads(self) -> tuple[int, int] | None:
        spec = self.spec
        if spec.kind != MHA:
            if self.head_range is not None:
                raise ValueError(f"head_range is for MHA pages; a {spec.kind.upper()} page holds no heads, leave it None")
            return None
        if self.head_range is None:
            return (self.tp_rank * spec.head_num, (self.tp_rank + 1) * spec.head_num)
        hr = self.head_range
        if not (isinstance(hr, (tuple, list)) and len(hr) == 2 and all(map(is_int, hr)) and hr[0] >= 0
                and hr[1] - hr[0] == spec.head_num):
            raise ValueError(f"head_range must be (lo, lo + {spec.head_num}) with lo >= 0: this rank's {spec.head_num} "
                             f"KV heads, got {hr!r}")
        return (int(hr[0]), int(hr[1]))

    def canonical(self) -> bytes:
        """The versioned, canonical encoding the fingerprint hashes (sorted JSON)."""
        s = self.spec
        fields = {
            "model_id": self.model_id, "weights": self.weights_fingerprint, "kind": s.kind,
            "layer_num": s.layer_num, "dtype": _dtype_name(s), "page_size": self.page_size,
            "head_num": s.head_num, "head_dim": s.head_dim, "kv_lora_rank": s.kv_lora_rank,
            "qk_rope_head_dim": s.qk_rope_head_dim, "index_head_dim": s.index_head_dim,
            "index_k_bytes": s.index_k_bytes,
        }
        if s.kind == MHA:
            fields.update(tp_rank=self.tp_rank, tp_size=self.tp_size, head_range=list(self.head_range))
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @property
    def payload_bytes(self) -> int:
        return self.page_size * self.spec.bytes_per_token


def store_key(fingerprint: bytes, chain_key: bytes) -> bytes:
    """The 16-byte storage key of a page: BLAKE2b of the cache's chain key, keyed by the salt's
    fingerprint. Equal in every process for equal inputs."""
    if not isinstance(fingerprint, bytes) or len(fingerprint) != 16:
        raise ValueError(f"fingerprint must be 16 bytes (StorageSalt.fingerprint), got {fingerprint!r}")
    if not isinstance(chain_key, (bytes, bytearray)) or not chain_key:
        raise ValueError(f"chain_key must be the cache's page hash (non-empty bytes), got {chain_key!r}")
    return hashlib.blake2b(bytes(chain_key), digest_size=KEY_BYTES, key=fingerprint, person=KEY_PERSON).digest()


class PageHeader(NamedTuple):
    """A blob's header fields, as :func:`read_header` parses them."""

    version: int
    key: bytes
    parent: bytes | None
    salt: bytes
    kind: int
    dtype: int
    page_size: int
    layer_num: int
    head_lo: int
    head_hi: int
    payload_len: int
    checksum: int


def read_header(blob) -> PageHeader:
    """The header of ``blob`` (at least :data:`HEADER_BYTES` bytes-like), checked on its own:
    magic, format version and the header's checksum. Raises :class:`PageRejected`."""
    head = memoryview(blob).cast("B")[:HEADER_BYTES]
    if len(head) < HEADER_BYTES:
        raise PageRejected("short", f"{len(head)} bytes, less than the {HEADER_BYTES}-byte header")
    (magic, version, hbytes, flags, key, parent, salt, kind, dtype, _, ps, layers, lo, hi, plen,
     csum) = _FIELDS.unpack_from(head)
    if magic != MAGIC:
        raise PageRejected("corrupt", f"magic {magic!r} is not a kvtier page's")
    if version != FORMAT_VERSION or hbytes != HEADER_BYTES:
        raise PageRejected("foreign", f"format version {version} ({hbytes}-byte header); this reader is {FORMAT_VERSION}")
    if struct.unpack_from("<Q", head, _HEADER_SUM_AT)[0] != xxhash.xxh3_64_intdigest(head[:_HEADER_SUM_AT]):
        raise PageRejected("corrupt", "header checksum mismatch")
    return PageHeader(version, key, parent if flags & _FLAG_PARENT else None, salt, kind, dtype, ps, layers, lo, hi,
                      plen, csum)


class _ComponentView(NamedTuple):
    name: str
    offset: int   # where the component starts in the payload
    nbytes: int   # its bytes in one page: layers x tokens x item


class PageCodec:
    """Pages of one salt: host pages <-> payloads, payloads <-> blobs. Stateless after
    construction; safe to share between threads."""

    def __init__(self, salt: StorageSalt):
        if not isinstance(salt, StorageSalt):
            raise ValueError(f"salt must be a StorageSalt, got {type(salt).__name__}")
        self.salt = salt
        spec, ps = salt.spec, salt.page_size
        self.payload_bytes = salt.payload_bytes
        self.blob_bytes = HEADER_BYTES + self.payload_bytes
        views, at = [], 0
        for c in spec.components:
            views.append(_ComponentView(c.name, at, spec.layer_num * ps * c.item_bytes))
            at += spec.layer_num * ps * c.item_bytes
        self._views = tuple(views)
        lo, hi = salt.head_range or (0, 0)
        self._expect = (salt.fingerprint, _KIND_CODES[spec.kind], _DTYPE_CODES.get(_dtype_name(spec), 0), ps,
                        spec.layer_num, lo, hi, self.payload_bytes)

    # -- host pages <-> payloads ---------------------------------------------------------

    def check_pool(self, host_pool) -> None:
        """``ValueError`` unless ``host_pool`` holds pages of this salt's shape and page size."""
        spec = getattr(host_pool, "spec", None)
        if spec != self.salt.spec or getattr(host_pool, "page_size", None) != self.salt.page_size:
            have = spec.describe() if isinstance(spec, KVSpec) else type(host_pool).__name__
            raise ValueError(f"host pool ({have}, page {getattr(host_pool, 'page_size', '?')}) does not hold this "
                             f"store's pages ({self.salt.spec.describe()}, page {self.salt.page_size}): "
                             "build the StorageSalt from this pool's spec and page size")

    def pages_of(self, host_pool, host_slots, n_pages: int) -> np.ndarray:
        """The page ids of ``host_slots`` (token slots, whole pages of ``host_pool``), checked: the pool
        holds this salt's pages and the slots are ``n_pages`` whole pages; ``ValueError`` otherwise."""
        self.check_pool(host_pool)
        tokens = _as_index_tensor(host_slots, "host_slots").to("cpu").numpy()
        ps = self.salt.page_size
        if tokens.size != n_pages * ps:
            raise ValueError(f"host_slots holds {tokens.size} slots for {n_pages} chain keys; give {n_pages * ps} "
                             f"(one page of {ps} slots per key)")
        try:
            return tokens_to_pages(tokens, ps, host_pool.size) if tokens.size else tokens
        except AllocatorError as e:
            raise ValueError(f"host_slots must be whole pages of the host pool: {e}") from None

    def _pool_views(self, host_pool) -> list[tuple[np.ndarray, tuple[int, ...]]]:
        """Per component, a ``(pages, layer, token, chunk, byte)`` view of the pool's raw bytes, and
        the shape of one page of it (the placement's chunks: a token's item is their concatenation)."""
        out = []
        for v in self._views:
            raw = host_pool.raw_bytes(v.name).numpy()
            pl = host_pool.placements[v.name]
            page = (pl.layer_num, pl.page_size, pl.n_chunks, pl.chunk_bytes)
            shape = (host_pool.size // pl.page_size, *page)
            strides = (pl.page, pl.layer_stride, pl.token, pl.chunk, 1)
            last = sum((n - 1) * s for n, s in zip(shape, strides))
            assert last < raw.size and page[0] * page[1] * page[2] * page[3] == v.nbytes, (v, shape, strides)
            out.append((as_strided(raw, shape, strides, writeable=True), page))
        return out

    def gather(self, host_pool, pages: Sequence[int], rows: Sequence[np.ndarray], checksum: bool = True,
               threads: Executor | None = None) -> list[int]:
        """Copy host ``pages`` (page ids) into payload ``rows`` (uint8, ``payload_bytes`` each), canonical
        order; each page's payload checksum, for :meth:`seal` (``checksum=False``: none, an empty
        list: the plain copy ``kvtier bench storage`` compares with). The checksum reads each piece right
        after copying it, while it is in the CPU's cache: 3-15% on top of the copy (the bench's
        ``encode`` row, Llama-3-8B pages of 32 and 64 tokens, 2-core development machine), where
        reading the pages again costs 25-30%. ``threads``: an executor to copy pages on, a page a
        task, where pages are at least :data:`THREADED_BYTES` (the copy and the checksum release the GIL)."""
        views = self._pool_views(host_pool)
        if threads is not None and len(pages) > 1 and self.payload_bytes >= THREADED_BYTES:
            tasks = [threads.submit(self._gather_page, views, p, r, checksum) for p, r in zip(pages, rows)]
            wait(tasks)   # every copy has ended before a failure is raised: none writes into a row after
            sums = [t.result() for t in tasks]
        else:
            sums = [self._gather_page(views, page, row, checksum) for page, row in zip(pages, rows)]
        return sums if checksum else []

    def _gather_page(self, views, page: int, row: np.ndarray, checksum: bool) -> int:
        """One page of :meth:`gather` (``views``: :meth:`_pool_views`); its checksum."""
        h = xxhash.xxh3_64()
        for v, (pool_view, shape) in zip(self._views, views):
            part, src = np.asarray(row)[v.offset : v.offset + v.nbytes].reshape(shape), pool_view[int(page)]
            step = max(1, CHUNK_BYTES // (part.nbytes // shape[0]))
            for layer in range(0, shape[0], step):
                np.copyto(part[layer : layer + step], src[layer : layer + step])
                if checksum:
                    h.update(part[layer : layer + step])
        return h.intdigest()

    def scatter(self, host_pool, pages: Sequence[int], rows: Sequence[np.ndarray]) -> None:
        """Copy canonical payload ``rows`` into host ``pages``; only verified payloads belong here."""
        # numpy's strided copy runs on one core without the GIL; torch's copy_ of the same views
        # spread over two contended cores measured 0.5-13 GB/s against numpy's steady 5-12.
        for v, (pool_view, shape) in zip(self._views, self._pool_views(host_pool)):
            for page, row in zip(pages, rows):
                np.copyto(pool_view[int(page)], np.asarray(row)[v.offset : v.offset + v.nbytes].reshape(shape))

    # -- payloads <-> blobs -----------------------------------------------------------------

    def seal(self, blob: np.ndarray, key: bytes, parent: bytes | None = None, checksum: int | None = None) -> None:
        """Write the header of ``blob`` (a uint8 row of ``blob_bytes`` whose payload is in place):
        its key, parent key, this salt, and the payload's checksum (``checksum``, as :meth:`gather`
        gave it; None: computed here)."""
        if checksum is None:
            checksum = xxhash.xxh3_64_intdigest(blob[HEADER_BYTES : self.blob_bytes])
        fp, kind, dtype, ps, layers, lo, hi, plen = self._expect
        head = _FIELDS.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, _FLAG_PARENT if parent else 0, key,
                            parent or bytes(KEY_BYTES), fp, kind, dtype, 0, ps, layers, lo, hi, plen, checksum)
        head = head.ljust(_HEADER_SUM_AT, b"\0")
        blob[:HEADER_BYTES] = np.frombuffer(head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)), np.uint8)

    def encode(self, payload, key: bytes, parent: bytes | None = None) -> bytes:
        """One blob from one canonical payload (bytes-like of ``payload_bytes``)."""
        blob = np.zeros(self.blob_bytes, np.uint8)
        blob[HEADER_BYTES:] = np.frombuffer(payload, np.uint8)
        self.seal(blob, key, parent)
        return blob.tobytes()

    def verify(self, blob, nbytes: int, key: bytes, parent: bytes | None = None,
               checksum: int | None = None) -> memoryview:
        """The payload of the first ``nbytes`` of ``blob`` if it is the page stored under ``key``
        (and, where ``parent`` is given, written with that parent) for this salt, whole;
        else :class:`PageRejected` naming why. ``checksum``: the payload's, as :func:`copy_digest`
        computed it while reading the blob (None: computed here)."""
        mv = memoryview(blob).cast("B")[: max(nbytes, 0)]
        h = read_header(mv)
        if (h.salt, h.kind, h.dtype, h.page_size, h.layer_num, h.head_lo, h.head_hi) != self._expect[:7]:
            raise PageRejected("foreign", f"a page of salt {h.salt.hex()} ({h.page_size} tokens x {h.layer_num} "
                                          f"layers); this store's is {self._expect[0].hex()}")
        if h.key != key:
            raise PageRejected("wrong_key", f"page {h.key.hex()} read under key {key.hex()}")
        if parent is not None and h.parent is not None and h.parent != parent:
            raise PageRejected("wrong_key", f"page {key.hex()} has parent {h.parent.hex()}, expected {parent.hex()}")
        if h.payload_len != self.payload_bytes:
            raise PageRejected("corrupt", f"payload length {h.payload_len}, expected {self.payload_bytes}")
        if len(mv) < self.blob_bytes:
            raise PageRejected("short", f"{len(mv)} of {self.blob_bytes} bytes")
        if len(mv) > self.blob_bytes:
            raise PageRejected("corrupt", f"{len(mv)} bytes, more than the page's {self.blob_bytes}")
        payload = mv[HEADER_BYTES:]
        if (xxhash.xxh3_64_intdigest(payload) if checksum is None else checksum) != h.checksum:
            raise PageRejected("corrupt", "payload checksum mismatch")
        return payload


def copy_digest(dst: np.ndarray, src: np.ndarray) -> int:
    """Copy the blob ``src`` into ``dst`` (uint8, as long) and return its payload's checksum (the
    bytes past the header), computed a chunk at a time right after each is copied, while in the CPU's
    cache: a second pass over a copied 8 MiB page reads it from memory again."""
    h = xxhash.xxh3_64()
    np.copyto(dst[:HEADER_BYTES], src[:HEADER_BYTES])
    for i in range(HEADER_BYTES, len(src), DIGEST_CHUNK):
        j = min(i + DIGEST_CHUNK, len(src))
        np.copyto(dst[i:j], src[i:j])
        h.update(dst[i:j])
    return h.intdigest()
