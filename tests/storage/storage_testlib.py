"""Builders shared by the storage tests: small pools of every kind, salts, stores over real
directories, and the bytes of host pages in the canonical order (read through the pool's
seed-shaped typed tensors, not through the codec under test)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from kvtier.storage.file import FileBackend, FileConfig
from kvtier.storage.format import PageCodec, StorageSalt, store_key
from kvtier.storage.tier import StorageTier, TierConfig
from kvtier_testlib import fill_host_random, make_device_pool, make_host_pool

KIND_LAYOUTS = {"mha": ("layer_first", "page_first", "page_head"), "mla": ("layer_first", "page_first"),
                "dsa": ("layer_first",)}


def small_pools(kind: str, layouts, page_size: int = 4, pages: int = 8, layers: int = 2, dtype=torch.bfloat16,
                seed: int = 0):
    """A device pool and one host pool per layout, each host pool filled with random bytes."""
    dev = make_device_pool(kind, pages * page_size, page_size, dtype, layers, heads=2, head_dim=16, lora=32,
                           rope=16, index_head_dim=128)
    hosts = [make_host_pool(dev, lay, pages * page_size) for lay in layouts]
    for i, h in enumerate(hosts):
        fill_host_random(h, seed + i)
    return dev, hosts


def salt_of(pool, model_id: str = "test/model", **kw) -> StorageSalt:
    return StorageSalt(pool.spec, pool.page_size, model_id, **kw)


def canonical_page(host, page: int) -> bytes:
    """A host page's bytes in the canonical order: per component, per layer, the page's tokens, read
    through the pool's typed tensors (the layout's own indexing)."""
    ps = host.page_size
    out = []
    for c in host.spec.components:
        t = host.component_tensors[c.name]
        for layer in range(host.layer_num):
            for slot in range(page * ps, (page + 1) * ps):
                if host.layout == "layer_first":
                    item = t[layer, slot]
                elif host.layout == "page_first":
                    item = t[slot, layer]
                else:  # page_head: (pages, heads, page_size, layers, head_dim)
                    item = t[slot // ps, :, slot % ps, layer]
                out.append(item.contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(out)


def chain(n: int, tag: int = 0) -> list[bytes]:
    """``n`` distinct chain keys (stand-ins for the cache's page hashes)."""
    return [tag.to_bytes(4, "little") + i.to_bytes(28, "little") for i in range(n)]


def slots_of(pages, page_size: int) -> torch.Tensor:
    p = torch.as_tensor(list(pages), dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size)).reshape(-1)


class GatedFileBackend(FileBackend):
    """A file store that answers when the test says: puts wait for ``put_gate``, and every read after
    the first waits for ``read_gate`` (both open unless the test clears them)."""

    def __init__(self, config: FileConfig):
        super().__init__(config)
        self.put_gate, self.read_gate, self.reading = threading.Event(), threading.Event(), threading.Event()
        self.put_gate.set()
        self.read_gate.set()

    def put(self, keys, blobs):
        self.put_gate.wait(30)
        return super().put(keys, blobs)

    def get_into(self, keys, buffers):
        if self.reading.is_set():
            self.read_gate.wait(30)
        self.reading.set()
        return super().get_into(keys, buffers)


def file_tier(path, host, capacity_pages: int = 64, tier: TierConfig | None = None, backend=FileBackend, **file_kw):
    salt = salt_of(host)
    codec = PageCodec(salt)
    store = backend(FileConfig(str(path), capacity_pages * codec.blob_bytes, **file_kw))
    return StorageTier(store, salt, tier or TierConfig())


def blob_for(salt: StorageSalt, chain_key: bytes, seed: int, parent: bytes | None = None) -> tuple[bytes, bytes, bytes]:
    """``(store key, payload, blob)`` of a random page stored under ``chain_key``."""
    codec = PageCodec(salt)
    payload = np.random.default_rng(seed).integers(0, 256, codec.payload_bytes, dtype=np.uint8).tobytes()
    key = store_key(salt.fingerprint, chain_key)
    return key, payload, codec.encode(payload, key, parent)
