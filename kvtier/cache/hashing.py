"""Chain keys: the salted, chained, versioned page hashes that name cached pages in storage (L3).

A page's key is ``H(previous page's key || the page's token ids as little-endian int64)``.
The chain of a namespace starts from its seed, ``sha256(KEY_FORMAT | algorithm | salt |
namespace)`` cut to the key's length. The salt names everything a page's KV bytes depend
on: kind, shape, dtype, page size and model id, and not the host layout (a stored page is
in one canonical order whatever the layout, so pools of different layouts share a store).
Equal keys therefore mean equal prefixes of equal bytes, in any process and any run.

Keys are computed only when a page needs one (its node is backed up to the host, offered to
storage, or asked for), for a node's pages at once, and kept on the node: a cache without a
host tier never hashes. ``H`` is ``CacheConfig.key_hash``:

- ``xxh3_128`` (default): 16-byte keys. 2.7x faster than SHA-256 at page 1, 3.8x at page 64
  (5.7 against 15.3 ms per 32k pages of 1 token, 98 against 371 us per 512 pages of 64, the
  2-core CPU; docs/performance.md). Collisions of unrelated prefixes are as unlikely as for
  any 128-bit hash, but xxh3 is not built to resist inputs crafted to collide.
- ``sha256``: 32-byte keys, cryptographic: for keys shared with other engines, or a store
  that tenants who do not trust one another share under one namespace.
"""

from __future__ import annotations

import hashlib

import numpy as np
import xxhash

# Bumped whenever the bytes hashed change; part of every seed, so keys of two formats never meet.
KEY_FORMAT = b"kvtier-chain-v2"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


DIGESTS = {"xxh3_128": xxhash.xxh3_128_digest, "sha256": _sha256}
KEY_BYTES = {"xxh3_128": 16, "sha256": 32}
KEY_HASHES = tuple(DIGESTS)


def namespace_seed(salt: bytes, namespace: str, algorithm: str = "xxh3_128") -> bytes:
    """The chain's starting value for one namespace."""
    head = KEY_FORMAT + b"|" + algorithm.encode() + b"|" + len(salt).to_bytes(4, "little")
    return hashlib.sha256(head + salt + namespace.encode()).digest()[: KEY_BYTES[algorithm]]


def token_bytes(tokens, n: int) -> bytes:
    """The first ``n`` token ids as little-endian int64 bytes; ValueError if they are not integers."""
    arr = tokens[:n] if isinstance(tokens, np.ndarray) else np.asarray(tokens[:n])
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers that fit int64, got {arr.dtype} values such as "
                         f"{arr.reshape(-1)[0]!r}; pass ints, or an integer array or tensor")
    return arr.astype("<i8", copy=False).tobytes()


def chain_hashes(prev: bytes, tokens, page_size: int, algorithm: str = "xxh3_128") -> list[bytes]:
    """Keys of the whole pages of ``tokens`` (a list or an int64 array), chained from ``prev``."""
    digest = DIGESTS[algorithm]
    step = page_size * 8
    raw = token_bytes(tokens, len(tokens) // page_size * page_size)
    out: list[bytes] = []
    for i in range(0, len(raw), step):
        prev = digest(prev + raw[i : i + step])
        out.append(prev)
    return out


class ChainKeys:
    """The keys of one cache's pages: its salt, algorithm and page size.

    :meth:`of_node` works on the tree's nodes (``tokens``, ``parent``, ``namespace`` and
    ``hashes``: None until computed, then one key per page; a root's is ``[seed]``).
    """

    def __init__(self, salt: bytes, algorithm: str, page_size: int):
        self.salt, self.algorithm, self.page_size = salt, algorithm, page_size

    def seed(self, namespace: str) -> bytes:
        return namespace_seed(self.salt, namespace, self.algorithm)

    def chain(self, prev: bytes, tokens) -> list[bytes]:
        return chain_hashes(prev, tokens, self.page_size, self.algorithm)

    def of_query(self, tree, namespace: str, tokens) -> list[bytes]:
        """The keys of every whole page of ``tokens`` in ``namespace`` of ``tree`` (a
        :class:`~.radix.RadixTree`): those of the cached pages they follow computed once and
        kept on their nodes, the rest chained on from there."""
        root = tree.root(namespace)
        if root is None:  # nothing cached in it: no root made for a read
            return self.chain(self.seed(namespace), tokens)
        path, matched, partial = tree.walk(root, tokens)
        known = [h for n in path for h in self.of_node(n)]
        if partial is not None:
            known += self.of_node(partial[0])[: partial[1] // self.page_size]
            matched += partial[1]
        prev = known[-1] if known else self.of_node(root)[-1]
        return known + self.chain(prev, tokens[matched:])

    def of_node(self, node) -> list[bytes]:
        """The keys of ``node``'s pages; computed on first use with those of its ancestors
        that lack theirs, and kept on each node (a split divides them)."""
        todo = []
        while node.hashes is None and node.parent is not None:
            todo.append(node)
            node = node.parent
        if node.hashes is None:  # a root
            node.hashes = [self.seed(node.namespace)]
        prev = node.hashes[-1]
        for n in reversed(todo):
            n.hashes = self.chain(prev, n.tokens)
            prev = n.hashes[-1]
        return todo[0].hashes if todo else node.hashes
