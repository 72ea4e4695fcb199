"""Namespaces, page hashes, the storage hook, metrics, and bad input (refused before any change)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings, strategies as st
from prometheus_client import REGISTRY, generate_latest

from cache_testlib import kv_matches, kv_values, make_cache, serve, write_kv
from kvtier.cache import CacheConfig, HiCache
from kvtier.cache.hashing import KEY_FORMAT, chain_hashes, namespace_seed
from kvtier.cache.radix import RadixTree
from kvtier_testlib import make_device_pool, make_host_pool

SEQ = list(range(10, 26))


def state(cache):
    t = cache.tiers
    return (t.device_alloc.available_pages(), t.owner.copy().tolist(), cache.tree.device_pages,
            cache.tree.host_pages, [(len(n), n.lock_ref) for n in cache.tree.nodes()])


# -- namespaces -----------------------------------------------------------------------

def test_namespaces_never_share_entries():
    cache, dev, host, engine = make_cache(held=False)
    serve(cache, SEQ, namespace="model-a", ns_id=0)
    assert cache.match_prefix(SEQ, namespace="model-b").total_len == 0
    serve(cache, SEQ, namespace="model-b", ns_id=1)        # different KV bytes for the same tokens
    a, b = (cache.match_prefix(SEQ, namespace=ns) for ns in ("model-a", "model-b"))
    assert a.device_len == b.device_len == 16
    assert not set(a.device_indices.tolist()) & set(b.device_indices.tolist())
    assert kv_matches(dev, a.device_indices, kv_values(SEQ, 0))
    assert kv_matches(dev, b.device_indices, kv_values(SEQ, 1))
    ha, hb = cache.page_hashes(SEQ, "model-a"), cache.page_hashes(SEQ, "model-b")
    assert len(ha) == 4 and not set(ha) & set(hb)
    cache.evict_device(10**6)
    serve(cache, SEQ, namespace="model-b", ns_id=1)        # loads b's own host copy back


# -- page hashes ------------------------------------------------------------------------

DIGEST = {"sha256": lambda b: hashlib.sha256(b).digest(), "xxh3_128": xxhash.xxh3_128_digest}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**40), min_size=0, max_size=40), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from(["sha256", "xxh3_128"]))
def test_hash_chain_is_prefix_stable_and_matches_its_digest(tokens, ps, algo):
    seed = namespace_seed(b"salt", "ns", algo)
    arr = np.array(tokens, dtype=np.int64)
    hashes = chain_hashes(seed, arr, ps, algo)
    assert chain_hashes(seed, tokens, ps, algo) == hashes          # a list keys alike
    assert len(hashes) == len(tokens) // ps
    prev = seed
    for i, h in enumerate(hashes):
        page = np.array(tokens[i * ps : (i + 1) * ps], dtype="<i8").tobytes()
        assert h == DIGEST[algo](prev + page) and len(h) == len(seed)
        prev = h
    half = len(tokens) // 2
    assert chain_hashes(seed, arr[:half], ps, algo) == hashes[: half // ps]


def test_key_format_is_pinned():
    """Keys are stored: a change of their bytes must change KEY_FORMAT (and this test)."""
    assert KEY_FORMAT == b"kvtier-chain-v2"
    for algo, want in [("xxh3_128", "05181bfd9f8299e07a961b97c2e20df1"), ("sha256", "a8fe520dbcdfc55be5dbbd60c33a72042a3442f928a20b851a474a036fb2ad16")]:
        seed = namespace_seed(b"salt", "default", algo)
        assert chain_hashes(seed, [1, 2, 3, 4, 5, 6, 7, 8], 4, algo)[-1].hex() == want, algo


def test_keys_are_equal_in_another_interpreter():
    code = ("import torch; from kvtier.cache import CacheConfig, HiCache; from kvtier_testlib import make_device_pool;"
            "dev = make_device_pool('mha', 32, 4, torch.float16, 2, heads=2, head_dim=4);"
            "c = HiCache(dev, None, CacheConfig(page_size=4, model_id='m', key_hash='{}'));"
            "print(','.join(h.hex() for h in c.page_hashes(list(range(10, 26)), 'ns')))")
    tests = str(Path(__file__).resolve().parents[1])
    for algo in ("xxh3_128", "sha256"):
        out = subprocess.run([sys.executable, "-c", code.format(algo)], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                  "PYTHONHASHSEED": "random"}).stdout.strip()
        dev = make_device_pool("mha", 32, 4, torch.float16, 2, heads=2, head_dim=4)
        here = HiCache(dev, None, CacheConfig(page_size=4, model_id="m", key_hash=algo))
        serve(here, SEQ, namespace="ns")                       # cached nodes compute and keep their keys
        assert out == ",".join(h.hex() for h in here.page_hashes(SEQ, "ns"))
        assert out.split(",") == [h.hex() for h in here.chain_keys(here.match_prefix(SEQ, namespace="ns").node)]


def test_hashes_are_salted_by_shape_page_size_model_and_namespace_not_layout():
    def hashes(ps=4, model_id="", ns="default", heads=2, layout=None, algo="xxh3_128"):
        dev = make_device_pool("mha", 32, ps, torch.float16, 2, heads=heads, head_dim=4)
        host = None if layout is None else make_host_pool(dev, layout, 32)
        cfg = CacheConfig(page_size=ps, model_id=model_id, key_hash=algo)
        return HiCache(dev, host, cfg).page_hashes(SEQ, ns)[0]

    base = hashes()
    assert hashes() == base == hashes(layout="page_first") == hashes(layout="layer_first")
    for other in (hashes(ps=2), hashes(model_id="llama-ft"), hashes(ns="lora-7"), hashes(heads=3), hashes(algo="sha256")):
        assert other != base
    assert namespace_seed(b"x", "a") != namespace_seed(b"x", "b")


def test_device_only_cache_never_hashes_and_nodes_keep_keys_once_computed():
    cache, *_ = make_cache(host_pages=0)
    serve(cache, SEQ)
    serve(cache, SEQ[:8] + [1] * 8)               # splits SEQ's node after 2 pages
    nodes = cache.tree.path_to(cache.match_prefix(SEQ).node)
    assert len(nodes) == 2 and all(n.hashes is None for n in cache.tree.nodes())
    assert all(r.hashes is None for r in cache.tree.roots.values())
    keys = cache.page_hashes(SEQ)
    assert [h for n in nodes for h in n.hashes] == keys
    assert cache.chain_keys(nodes[1]) == keys[2:] and cache.chain_keys(cache.tree.roots["default"]) == []
    m = cache.match_prefix(SEQ[:8] + [7] * 9)
    assert m.total_len == 8 and cache.chain_keys_after(m, SEQ[:8] + [7] * 9) == cache.page_hashes(SEQ[:8] + [7] * 9)[2:]
    with pytest.raises(ValueError, match="fewer than"):
        cache.chain_keys_after(m, SEQ[:4])


# -- the storage hook ---------------------------------------------------------------------

def test_host_eviction_offers_intact_pages_with_their_hashes():
    offered = []

    class Hook:
        def offer(self, page_hashes, host_indices):
            # The pages must still be intact when offered: load them somewhere and look.
            scratch = cache.alloc_device(len(host_indices))
            cache.engine.load(host_indices, scratch).synchronize()
            offered.append((page_hashes, kv_matches(dev, scratch, kv_values(SEQ, 0))))
            cache.free_device(scratch)

    dev = make_device_pool("mha", 64, 4, torch.float16, 2, heads=2, head_dim=4)
    from kvtier_testlib import make_host_pool
    host = make_host_pool(dev, "page_first", 32)
    cache = HiCache(dev, host, CacheConfig(page_size=4), storage_hook=Hook())
    serve(cache, SEQ)
    cache.evict_device(10**6)
    assert cache.evict_host(10**6) == 16
    assert offered == [(cache.page_hashes(SEQ), True)]
    assert cache.match_prefix(SEQ).total_len == 0
    assert cache.metrics.snapshot()["storage_offered_pages_total"] == 4


# -- metrics ----------------------------------------------------------------------------------

def test_metrics_live_in_a_registry_of_their_own():
    before = {m.name for m in REGISTRY.collect()}
    c1, *_ = make_cache(held=False)
    c2, *_ = make_cache(held=False)
    serve(c1, SEQ)
    serve(c1, SEQ)
    text = generate_latest(c1.metrics.registry).decode()
    assert 'kvtier_cache_hit_tokens_total{tier="device"} 16.0' in text
    assert "kvtier_cache_bandwidth_bytes_per_second" in text and "kvtier_cache_queue_depth" in text
    assert c2.metrics.snapshot()["hit_tokens_total.device"] == 0
    snap = c1.metrics.snapshot()
    assert snap["transfers_total.backup"] == 1 and snap["transfer_bytes_total.backup"] > 0
    assert snap["tokens.device.cached"] == 16 and snap["tokens.host.cached"] == 16
    assert {m.name for m in REGISTRY.collect()} == before


# -- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,needle", [
    (dict(page_size=0), "page_size"),
    (dict(page_size=4, write_policy="write_around"), "write_through_selective"),
    (dict(page_size=4, eviction="arc"), "lfu"),
    (dict(page_size=4, selective_hits=0), "selective_hits"),
    (dict(page_size=4, io_backend="nvme"), "direct"),
    (dict(page_size=4, max_inflight_loads=-1), "max_inflight_loads"),
    (dict(page_size=4, bandwidth_ewma=1.5), "bandwidth_ewma"),
    (dict(page_size=4, advisor_margin=float("nan")), "advisor_margin"),
])
def test_config_rejects_bad_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        CacheConfig(**kwargs)


def test_config_is_frozen():
    cfg = CacheConfig(page_size=4)
    with pytest.raises(Exception):
        cfg.page_size = 8


def test_pool_mismatches_are_refused():
    dev = make_device_pool("mha", 32, 4, torch.float16, 2, heads=2, head_dim=4)
    with pytest.raises(ValueError, match="page_size"):
        HiCache(dev, None, CacheConfig(page_size=8))


def test_misuse_raises_before_changing_anything():
    cache, dev, host, engine = make_cache(held=False)
    serve(cache, SEQ)
    own = cache.alloc_device(8)
    tree_slots = cache.match_prefix(SEQ).device_indices
    before = state(cache)
    with pytest.raises(ValueError, match="multiple of page_size"):
        cache.alloc_device(6)
    with pytest.raises(ValueError, match="cached in the tree"):
        cache.free_device(tree_slots[:4])
    with pytest.raises(ValueError, match="whole"):
        cache.free_device(own[:3])
    with pytest.raises(ValueError, match="twice"):
        cache.free_device(torch.cat([own[:4], own[:4]]))
    other = [1, 2, 3, 4] * 4
    with pytest.raises(ValueError, match="not the caller's"):
        cache.insert(other, tree_slots)                      # the tree's slots, but for other tokens
    with pytest.raises(ValueError, match=r"at position 16 are not one whole page"):  # counted from the query's start
        cache.insert(SEQ + [90, 91, 92, 93], torch.cat([tree_slots, own[:4].flip(0)]))
    with pytest.raises(ValueError, match=r"at position 4 are not one whole page"):  # in the part the tree holds
        cache.insert(SEQ, torch.cat([tree_slots[:4], tree_slots[4:8].flip(0), tree_slots[8:]]))
    with pytest.raises(ValueError, match="device_indices for only"):
        cache.insert(SEQ[:4], own)
    with pytest.raises(ValueError, match="token_ids must be integers"):
        cache.match_prefix([0.5, 1.5])
    with pytest.raises(ValueError, match="namespace"):
        cache.match_prefix(SEQ, namespace="")
    m = cache.match_prefix(SEQ)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(m.node)
    with pytest.raises(ValueError, match="lock"):
        cache.load_back(m)
    cache.lock(m.node)
    with pytest.raises(RuntimeError, match="unlock"):
        cache.clear()
    cache.unlock(m.node)
    with pytest.raises(TypeError):
        cache.lock("node")
    assert state(cache) == before
    cache.free_device(own)
    cache.clear()
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(m.node)                                    # a handle from before clear()
    assert cache.tiers.device_alloc.available_pages() == cache.tiers.device_alloc.num_pages


def test_insert_frees_duplicates_and_keeps_partial_page_with_the_caller():
    cache, dev, host, engine = make_cache(host_pages=0, dev_pages=12)
    serve(cache, SEQ)
    dup = cache.alloc_device(20)
    write_kv(dev, dup[:18], kv_values(SEQ + [5, 6], 0))
    free_before = cache.tiers.device_alloc.available_pages()
    assert cache.insert(SEQ + [5, 6], dup[:18]) == 16
    assert cache.tiers.device_alloc.available_pages() == free_before + 4   # 4 duplicate pages freed
    cache.free_device(dup[16:])                                             # the partial page is ours
    assert cache.match_prefix(SEQ + [5, 6]).device_len == 16


def test_radix_tree_alone_needs_no_pools():
    tree = RadixTree(2)
    root = tree.root("ns", create=True)
    a = tree.add_leaf(root, np.arange(8))
    path, matched, partial = tree.walk(root, np.array([0, 1, 2, 3, 9, 9]))
    assert (path, matched) == ([], 0) and partial == (a, 4)
    upper = tree.split(a, 4)
    assert upper.parent is root and a.parent is upper and len(a) == 4
    assert tree.walk(root, np.arange(8))[1] == 8


def test_combined_load_waits_for_and_finishes_with_every_part():
    """Several loads seen as one (a prefix spread over host runs): ``wait`` and the engine's
    ``_finished`` follow every part, not the empty base handle (they used to say done at once)."""
    from cache_testlib import HeldTransferEngine
    from kvtier.cache.inflight import LOAD, CacheLoad, Op
    from kvtier.device_pool import pool_from_spec
    from kvtier.host_pool import host_pool_for
    from kvtier.spec import KVSpec
    spec = KVSpec("mha", 2, torch.float32, head_num=2, head_dim=4)
    dev = pool_from_spec(spec, 64, 4, "cpu")
    host = host_pool_for(dev, "layer_first", host_size_tokens=64)
    eng = HeldTransferEngine(host)
    parts = [eng.load(torch.arange(0, 4), torch.arange(0, 4)), eng.load(torch.arange(8, 12), torch.arange(8, 12))]
    both = CacheLoad([Op(LOAD, [], p, p.nbytes, 0.0) for p in parts], 2)
    assert not both._finished() and not both.done()
    both.wait()
    assert all(p.done() for p in parts) and both._finished() and both.done() and not both.failed
    both.wait()
    assert all(p.done() for p in parts) and both._finished() and both.done()
