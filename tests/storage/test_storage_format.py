"""The page format: salts, keys, the canonical byte order across host layouts, and verification."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings, strategies as st

from kvtier.spec import KVSpec, preset
from kvtier.storage.format import (HEADER_BYTES, PageCodec, PageRejected, StorageSalt, read_header,
                                   store_key)
from storage_testlib import KIND_LAYOUTS, blob_for, canonical_page, chain, salt_of, slots_of, small_pools

CASES = [(kind, src, dst) for kind, lays in KIND_LAYOUTS.items() for src in lays for dst in lays]


@settings(max_examples=40)
@given(case=st.sampled_from(CASES), page_size=st.sampled_from([1, 16]),
       dtype=st.sampled_from([torch.bfloat16, torch.float8_e4m3fn]), layers=st.integers(1, 3),
       data=st.data())
def test_a_page_encoded_in_one_layout_decodes_in_another_as_through_the_device_pool(case, page_size, dtype, layers,
                                                                                  data):
    kind, src_layout, dst_layout = case
    dev, (src, dst, via) = small_pools(kind, (src_layout, dst_layout, dst_layout), page_size, pages=6,
                                       layers=layers, dtype=dtype, seed=data.draw(st.integers(0, 1000)))
    codec = PageCodec(salt_of(src))
    pages = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True))
    into = data.draw(st.permutations(range(6)))[: len(pages)]
    before = {c.name: dst.raw_bytes(c.name).clone() for c in dst.spec.components}
    rows = [np.empty(codec.payload_bytes, np.uint8) for _ in pages]
    sums = codec.gather(src, pages, rows)
    assert sums == [xxhash.xxh3_64_intdigest(r) for r in rows]
    codec.scatter(dst, into, rows)
    # The oracle: the same pages through the device pool, with the pools' own transfers.
    d_slots = torch.arange(len(pages) * page_size)
    for layer in range(layers):
        src.load_to_device_per_layer(dev, slots_of(pages, page_size), d_slots, layer)
    via.backup_from_device_all_layer(dev, slots_of(into, page_size), d_slots)
    for i, (p, q) in enumerate(zip(pages, into)):
        assert rows[i].tobytes() == canonical_page(src, p)
        assert canonical_page(dst, q) == canonical_page(via, q) == canonical_page(src, p)
    # Nothing outside the destination pages changed.
    touched = set(into)
    for c in dst.spec.components:
        after = dst.raw_bytes(c.name)
        pl = dst.placements[c.name]
        mask = torch.ones(after.numel(), dtype=torch.bool)
        for q in touched:
            for off, n in pl.page_pieces(q):
                mask[off : off + n] = False
        assert torch.equal(after[mask], before[c.name][mask])


@pytest.mark.parametrize("kind, layout", [(k, lay) for k, lays in KIND_LAYOUTS.items() for lay in lays])
def test_a_gather_on_threads_copies_and_sums_as_one_on_the_calling_thread(monkeypatch, kind, layout):
    from concurrent.futures import ThreadPoolExecutor
    import kvtier.storage.format as fmt
    _, (src,) = small_pools(kind, (layout,), page_size=4, pages=8, layers=3, seed=7)
    codec = PageCodec(salt_of(src))
    pages = [5, 0, 7, 2, 3]
    alone = [np.empty(codec.payload_bytes, np.uint8) for _ in pages]
    sums = codec.gather(src, pages, alone)
    monkeypatch.setattr(fmt, "THREADED_BYTES", 0)   # these pages are small: thread them anyway
    rows = [np.zeros(codec.payload_bytes, np.uint8) for _ in pages]
    with ThreadPoolExecutor(3) as threads:
        assert codec.gather(src, pages, rows, threads=threads) == sums
        assert codec.gather(src, pages, rows, checksum=False, threads=threads) == []
    assert [r.tobytes() for r in rows] == [a.tobytes() for a in alone] == [canonical_page(src, p) for p in pages]


def test_a_gather_on_threads_that_fails_raises_once_every_copy_has_ended(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor
    import kvtier.storage.format as fmt
    _, (src,) = small_pools("mha", ("page_first",), page_size=4, pages=8, layers=3)
    codec = PageCodec(salt_of(src))
    monkeypatch.setattr(fmt, "THREADED_BYTES", 0)
    submitted = []

    class Recording(ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            submitted.append(super().submit(*args, **kwargs))
            return submitted[-1]
    with Recording(2) as threads:
        with pytest.raises(IndexError):
            codec.gather(src, [1, 99, 2, 3], [np.empty(codec.payload_bytes, np.uint8) for _ in range(4)],
                         threads=threads)
        assert len(submitted) == 4 and all(f.done() for f in submitted)


def test_the_canonical_order_is_the_device_pools_row_order():
    dev, (host,) = small_pools("mha", ("page_head",), page_size=4, pages=4, layers=3)
    slots = slots_of([2], 4)
    for layer in range(3):
        host.load_to_device_per_layer(dev, slots, slots, layer)
    want = b"".join(dev.stacks[c][:, slots].contiguous().view(torch.uint8).numpy().tobytes() for c in ("k", "v"))
    codec = PageCodec(salt_of(host))
    row = np.empty(codec.payload_bytes, np.uint8)
    codec.gather(host, [2], [row])
    assert row.tobytes() == want


FINGERPRINT = ("from kvtier.spec import preset; from kvtier.storage.format import StorageSalt, store_key; "
               "s = StorageSalt(preset('deepseek-v3'), 64, 'org/model', weights_fingerprint='abc', tp_rank=3, tp_size=8); "
               "print(s.fingerprint.hex(), store_key(s.fingerprint, bytes(range(32))).hex())")


def test_fingerprints_and_keys_are_the_same_in_two_interpreters():
    outs = {subprocess.run([sys.executable, "-c", FINGERPRINT], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    assert len(outs) == 1
    here = StorageSalt(preset("deepseek-v3"), 64, "org/model", weights_fingerprint="abc", tp_rank=3, tp_size=8)
    assert outs.pop().split() == [here.fingerprint.hex(), store_key(here.fingerprint, bytes(range(32))).hex()]


def test_the_salt_names_everything_the_bytes_depend_on_and_nothing_else():
    mha = preset("llama-3-8b")
    base = StorageSalt(mha, 64, "m")
    differ = [
        StorageSalt(mha, 64, "other"), StorageSalt(mha, 64, "m", weights_fingerprint="w2"),
        StorageSalt(mha, 32, "m"), StorageSalt(KVSpec("mha", 32, "fp8", head_num=8, head_dim=128), 64, "m"),
        StorageSalt(KVSpec("mha", 32, "bf16", head_num=4, head_dim=128), 64, "m"),
        StorageSalt(mha, 64, "m", tp_rank=1, tp_size=2), StorageSalt(mha, 64, "m", head_range=(8, 16)),
    ]
    prints = {s.fingerprint for s in differ}
    assert base.fingerprint not in prints and len(prints) == len(differ)
    # MLA: one page for every rank; the spec's display name is not a byte of the page.
    mla = preset("deepseek-v3")
    assert StorageSalt(mla, 64, "m", tp_rank=0, tp_size=8).fingerprint == StorageSalt(mla, 64, "m", tp_rank=5,
                                                                                      tp_size=8).fingerprint
    renamed = KVSpec("mha", 32, torch.bfloat16, head_num=8, head_dim=128, name="another name")
    assert StorageSalt(renamed, 64, "m").fingerprint == base.fingerprint


@pytest.mark.parametrize("kwargs, words", [
    (dict(model_id=""), "model_id"), (dict(model_id=3), "model_id"), (dict(page_size=0), "page_size"),
    (dict(tp_rank=2, tp_size=2), "tp_rank"), (dict(tp_size=0), "tp_size"), (dict(weights_fingerprint=""), "weights"),
    (dict(head_range=(0, 4)), "head_range"), (dict(head_range=(-1, 7)), "head_range"),
])
def test_a_bad_salt_is_refused_by_name(kwargs, words):
    args = dict(spec=preset("llama-3-8b"), page_size=64, model_id="m") | kwargs
    with pytest.raises(ValueError, match=words):
        StorageSalt(**args)
    with pytest.raises(ValueError, match="head_range"):
        StorageSalt(preset("deepseek-v3"), 64, "m", head_range=(0, 1))


def test_store_key_refuses_what_is_not_a_fingerprint_and_a_chain_key():
    with pytest.raises(ValueError, match="fingerprint"):
        store_key(b"short", b"x")
    with pytest.raises(ValueError, match="chain_key"):
        store_key(bytes(16), b"")
    assert store_key(bytes(16), b"a") != store_key(bytes(range(16)), b"a") != store_key(bytes(16), b"b")


def _verify(salt, blob, key, parent=None):
    codec = PageCodec(salt)
    return codec.verify(blob, len(blob), key, parent)


def test_verify_names_each_reason():
    dev, (host,) = small_pools("mla", ("layer_first",))
    salt = salt_of(host)
    (a, b) = chain(2)
    key, payload, blob = blob_for(salt, a, seed=1)
    assert bytes(_verify(salt, blob, key)) == payload
    cases = {
        "short": [blob[:-1], blob[:HEADER_BYTES - 1], b""],
        "corrupt": [blob[:-1] + bytes([blob[-1] ^ 1]), bytes([blob[0] ^ 1]) + blob[1:], blob + b"\0"],
        "wrong_key": [blob_for(salt, b, seed=1)[2]],
        "foreign": [blob_for(salt_of(host, "another/model"), a, seed=1)[2]],
    }
    for reason, blobs in cases.items():
        for bad in blobs:
            with pytest.raises(PageRejected) as e:
                _verify(salt, bad, key)
            assert e.value.reason == reason, (reason, len(bad))
    parent_key = store_key(salt.fingerprint, b)
    with_parent = blob_for(salt, a, seed=1, parent=parent_key)[2]
    assert bytes(_verify(salt, with_parent, key, parent_key)) == payload
    with pytest.raises(PageRejected, match="parent"):
        _verify(salt, with_parent, key, key)


@settings(max_examples=60)
@given(at=st.integers(0, 10**9), bit=st.integers(0, 7))
def test_no_single_flipped_bit_anywhere_gets_a_page_through(at, bit):
    salt = StorageSalt(KVSpec("mla", 2, torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=0), 2, "m")
    key, _, blob = blob_for(salt, b"chain", seed=7)
    at %= len(blob)
    bad = bytearray(blob)
    bad[at] ^= 1 << bit
    with pytest.raises(PageRejected):
        _verify(salt, bytes(bad), key)


def test_read_header_checks_the_header_alone():
    salt = StorageSalt(preset("llama-3-8b"), 1, "m")
    key, _, blob = blob_for(salt, b"c", seed=0)
    h = read_header(blob[:HEADER_BYTES])
    assert (h.key, h.salt, h.payload_len, h.parent) == (key, salt.fingerprint, len(blob) - HEADER_BYTES, None)
    with pytest.raises(PageRejected, match="corrupt"):
        read_header(b"X" + blob[1:HEADER_BYTES])
