"""Model-based test of HiCache with real CPU pools and held-back transfers.

Random interleavings of requests (match, lock, load-back, compute, insert,
unlock), aborts, evictions, transfer completions in random order, polls,
slot hogs, backups and loads that fail, and clear(), over every kind, several layouts, page
sizes, write and eviction policies, with and without a host tier. Checked after every
step (and by ``HiCache.check()``):

- every device-ready cached page holds the KV bytes of its own tokens
  (bytes derive from the namespace and the whole prefix), and so does
  every prefix a request reads after load-back;
- a match never claims more than was inserted, and finds everything
  inserted since the last time the cache dropped anything;
- allocators and tree agree exactly; no page is in two places; no capacity
  is exceeded; lock counts equal the requests holding each node; held
  paths are never evicted; device residency is closed under ancestors;
- after every request is released and the cache cleared, every allocator
  is back to its initial free count;
- token ids come as lists, numpy arrays and tensors at random, so nodes of
  either form meet queries of either form;
- every page backed up to the host has its chain key, and every key a node
  keeps is the chain recomputed here from its tokens (the seed from the
  namespace), so keys stay exact through splits and evictions.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter

import numpy as np
import torch
import xxhash
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache_testlib import HeldTransferEngine, common_pages, kv_matches, kv_values, write_kv
from kvtier_testlib import make_device_pool, make_host_pool
from kvtier.cache import CacheConfig, HiCache, LoadFailedError, StorageHook
from kvtier.cache.hashing import namespace_seed

DIGEST = {"sha256": lambda b: hashlib.sha256(b).digest(), "xxh3_128": xxhash.xxh3_128_digest}
FORMS = {"list": list, "array": lambda seq: np.array(seq, dtype=np.int64), "tensor": torch.tensor}

KINDS_LAYOUTS = [("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_head"),
                 ("mla", "layer_first"), ("mla", "page_first"), ("dsa", "layer_first")]
NAMESPACES = ["a", "b"]


class Request:
    def __init__(self, ns, seq, match):
        self.ns, self.seq, self.m = ns, seq, match
        self.prefix = match.device_indices  # slots holding KV of seq[:len(prefix)]
        self.load = None


class CallingBack(StorageHook):
    """Finds the cache whole while it runs (check()), then at random evicts from inside the
    offer, as a storage tier making room would, or fails."""

    def __init__(self, machine):
        self.m = machine

    def offer(self, page_hashes, host_indices):
        cache, rng = self.m.cache, self.m.rng
        cache.check()
        if rng.random() < 0.3:
            cache.evict_host(cache.page_size)
        if rng.random() < 0.2:
            raise OSError("the storage tier is down")


class CacheMachine(RuleBasedStateMachine):
    @initialize(kind_layout=st.sampled_from(KINDS_LAYOUTS), page_size=st.sampled_from([1, 2, 4]),
                write=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
                eviction=st.sampled_from(["lru", "lfu"]), with_host=st.sampled_from([True, True, True, False]),
                dev_pages=st.integers(7, 14), host_ratio=st.sampled_from([0.5, 1, 2, 3]), seed=st.integers(0, 2**16),
                key_hash=st.sampled_from(["xxh3_128", "sha256"]))
    def setup(self, kind_layout, page_size, write, eviction, with_host, dev_pages, host_ratio, seed, key_hash):
        kind, layout = kind_layout
        ps = page_size if kind != "dsa" else max(page_size, 2)
        self.ps, self.rng = ps, random.Random(seed)
        self.max_len = 4 * ps + ps // 2 + 1
        dev_size = max(dev_pages, 5) * ps
        self.dev = make_device_pool(kind, dev_size, ps, torch.float16, 2, heads=2, head_dim=4, lora=6, rope=2)
        self.host = make_host_pool(self.dev, layout, int(dev_size * host_ratio)) if with_host else None
        self.engine = HeldTransferEngine(self.host) if with_host else None
        cfg = CacheConfig(page_size=ps, write_policy=write, selective_hits=2, eviction=eviction,
                          max_inflight_backups=3, max_inflight_loads=2, key_hash=key_hash)
        self.cache = HiCache(self.dev, self.host, cfg, transfer_engine=self.engine,
                             storage_hook=CallingBack(self) if with_host else None)
        self.dev_initial = self.cache.tiers.device_alloc.available_pages()
        self.host_initial = self.host.allocator.available_pages() if with_host else 0
        self.inserted: list[tuple[str, tuple, float]] = []
        self.requests: list[Request] = []
        self.hogs: list[torch.Tensor] = []

    # -- helpers -----------------------------------------------------------------

    def dropped(self) -> float:
        return self.cache.metrics.snapshot()["dropped_tokens_total"]

    def values(self, ns, seq):
        return kv_values(seq, NAMESPACES.index(ns))

    def draw_seq(self, data, ns):
        base = [s for n, s, _ in self.inserted if n == ns]
        seq = []
        if base and data.draw(st.integers(0, 3)):  # mostly a follow-up of an earlier sequence
            src = data.draw(st.sampled_from(base))
            seq = list(src[: data.draw(st.sampled_from([len(src), len(src), len(src) // 2]) | st.integers(0, len(src)))])
        more = data.draw(st.lists(st.integers(0, 2), min_size=self.ps, max_size=3 * self.ps + 1))
        seq = (seq + more)[: self.max_len]
        return tuple(seq) if seq else (0,)

    def check_match_bounds(self, ns, seq, m):
        total = m.device_len + m.host_len
        assert total % self.ps == 0 and total <= len(seq)
        dropped = self.dropped()
        upper = max([common_pages(seq, s, self.ps) for n, s, _ in self.inserted if n == ns] or [0])
        lower = max([common_pages(seq, s, self.ps) for n, s, d in self.inserted if n == ns and d == dropped] or [0])
        assert lower <= total <= upper, (lower, total, upper)

    def legit_refusal(self, n_tokens):
        assert self.cache.device_free_tokens() < n_tokens

    # -- rules -------------------------------------------------------------------------

    @precondition(lambda self: len(self.requests) < 3)
    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES), load=st.booleans(), lock_at_match=st.booleans(),
          form=st.sampled_from(sorted(FORMS)))
    def start_request(self, data, ns, load, lock_at_match, form):
        seq = self.draw_seq(data, ns)
        m = self.cache.match_prefix(FORMS[form](seq), namespace=ns, lock=lock_at_match)
        self.check_match_bounds(ns, seq, m)
        assert kv_matches(self.dev, m.device_indices, self.values(ns, seq)[: m.device_len])
        if not lock_at_match:
            self.cache.lock(m.node)
        req = Request(ns, seq, m)
        if load and m.host_len:
            r = self.cache.load_back(m)
            if r is None:
                self.legit_refusal(m.host_len)
            else:
                assert len(r.device_indices) == m.device_len + m.host_len
                assert torch.equal(r.device_indices[: m.device_len], m.device_indices)
                req.prefix, req.load = r.device_indices, r.layer_load
        self.requests.append(req)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), form=st.sampled_from(sorted(FORMS)))
    def finish_request(self, data, form):
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        if req.load is not None:
            try:
                for layer in range(self.dev.layer_num):
                    req.load.wait_layer(layer)
            except LoadFailedError:
                self.cache.unlock(req.m.node)  # told: it would match again, or recompute
                return
        vals = self.values(req.ns, req.seq)
        p, L = len(req.prefix), len(req.seq)
        assert kv_matches(self.dev, req.prefix, vals[:p])
        need = -(-(L - p) // self.ps) * self.ps
        own = self.cache.alloc_device(need)
        if own is None:
            self.legit_refusal(need)
            self.cache.unlock(req.m.node)
            return
        write_kv(self.dev, own[: L - p], vals[p:])
        slots = torch.cat([req.prefix, own[: L - p]])
        cached = self.cache.insert(FORMS[form](req.seq), slots, namespace=req.ns)
        assert cached >= req.m.device_len + req.m.host_len
        full = L // self.ps * self.ps
        self.cache.free_device(own[full - p :])
        self.cache.unlock(req.m.node)
        self.inserted.append((req.ns, req.seq[:full], self.dropped()))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort_request(self, data):
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.cache.unlock(req.m.node)

    @rule(n=st.integers(0, 6))
    def evict_device(self, n):
        before = self.cache.tiers.device_alloc.available_pages()
        freed = self.cache.evict_device(n)
        assert self.cache.tiers.device_alloc.available_pages() - before == freed // self.ps

    @rule(n=st.integers(0, 4))
    def evict_host(self, n):
        self.cache.evict_host(n)

    @precondition(lambda self: self.engine is not None)
    @rule(count=st.integers(0, 3))
    def complete_transfers(self, count):
        self.engine.release(count, self.rng)

    @precondition(lambda self: self.host is not None)
    @rule()
    def fail_next_backup(self):
        """The next backup fails as one the background thread could not queue."""
        self.engine.fail_backups += 1

    @precondition(lambda self: self.host is not None)
    @rule()
    def fail_next_load(self):
        """The next load fails partway (layer 0 only), as a caller's engine's may."""
        self.engine.fail_loads += 1

    @precondition(lambda self: self.host is not None)
    @rule()
    def fail_next_backup_on_release(self):
        self.engine.fail_released_backups += 1

    @rule()
    def poll(self):
        self.cache.poll()

    @precondition(lambda self: len(self.hogs) < 2)
    @rule(pages=st.integers(1, 4))
    def hog(self, pages):
        slots = self.cache.alloc_device(pages * self.ps)
        if slots is None:
            self.legit_refusal(pages * self.ps)
        else:
            self.hogs.append(slots)

    @precondition(lambda self: self.hogs)
    @rule()
    def unhog(self):
        self.cache.free_device(self.hogs.pop())

    @rule(now=st.integers(0, 5))
    def clear(self, now):
        if now:  # clear rarely, so that state builds up
            return
        if any(req.m.node.parent is not None for req in self.requests):
            before = (self.cache.tree.device_pages, self.cache.tree.host_pages)
            try:
                self.cache.clear()
            except RuntimeError:
                assert (self.cache.tree.device_pages, self.cache.tree.host_pages) == before
                return
            raise AssertionError("clear() with locked nodes must raise")
        self.cache.clear()
        self.inserted.clear()
        held = sum(len(h) for h in self.hogs) // self.ps
        assert self.cache.tiers.device_alloc.available_pages() == self.dev_initial - held
        if self.host is not None:
            assert self.host.allocator.available_pages() == self.host_initial

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def checked(self):
        self.cache.check()

    @invariant()
    def accounting(self):
        c, tree, ps = self.cache, self.cache.tree, self.ps
        owner = Counter(c.tiers.owner.tolist())
        assert owner[2] == tree.device_pages
        assert owner[1] == sum(len(h) for h in self.hogs) // ps
        assert c.tiers.device_alloc.available_pages() + tree.device_pages + owner[1] == self.dev_initial
        if self.host is not None:
            assert self.host.allocator.available_pages() + tree.host_pages == self.host_initial
        assert c.device_free_tokens() <= self.dev_initial * ps

    @invariant()
    def tree_shape_and_bytes(self):
        c, tree = self.cache, self.cache.tree
        locks = Counter()
        for req in self.requests:
            assert req.m.node.alive
            for n in tree.path_to(req.m.node):
                locks[n] += 1
                assert n.device is not None or n.host is not None
        dev_pages, host_pages = [], []
        for ns, root in tree.roots.items():
            assert root.namespace == ns and (root.children or root.own_locks), "a root holding nothing is kept"
            stack = [(child, []) for child in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                toks = prefix + list(map(int, node.tokens))
                assert node.lock_ref == locks[node]
                assert node.device is not None or node.host is not None
                self.check_keys(root, node, toks[len(prefix):])
                if node.device is not None:
                    dev_pages += node.device.tolist()
                    assert node.parent.parent is None or node.parent.device is not None
                    if node.device_ready:
                        vals = self.values(root.namespace, toks)[len(prefix):]
                        slots = torch.from_numpy(node.device)[:, None] * self.ps + torch.arange(self.ps)
                        assert kv_matches(self.dev, slots.reshape(-1), vals), "cached device bytes corrupted"
                if node.host is not None:
                    host_pages += node.host.tolist()
                assert node.dev_children == sum(ch.device is not None for ch in node.children.values())
                stack += [(ch, toks) for ch in node.children.values()]
        assert len(set(dev_pages)) == len(dev_pages) == tree.device_pages
        assert len(set(host_pages)) == len(host_pages) == tree.host_pages

    def check_keys(self, root, node, tokens):
        """A backed-up page has its key; a kept key is the chain recomputed from the tokens."""
        assert node.host is None or node.hashes is not None, "a host page without its chain key"
        if node.hashes is None:
            return
        algo = self.cache.config.key_hash
        parent = node.parent.hashes
        prev = namespace_seed(self.cache.salt, root.namespace, algo) if node.parent is root else parent[-1]
        assert node.parent is not root or parent == [prev]
        want = []
        for i in range(0, len(tokens), self.ps):
            prev = DIGEST[algo](prev + np.array(tokens[i : i + self.ps], dtype="<i8").tobytes())
            want.append(prev)
        assert node.hashes == want, "a kept chain key is not its page's"

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for req in self.requests:
            self.cache.unlock(req.m.node)
        for h in self.hogs:
            self.cache.free_device(h)
        self.requests, self.hogs = [], []
        self.cache.clear()
        self.cache.check()
        assert self.cache.tiers.device_alloc.available_pages() == self.dev_initial
        assert (self.cache.tiers.owner == 0).all()
        if self.host is not None:
            assert self.host.allocator.available_pages() == self.host_initial
            assert not self.engine.pending
            self.host.close()


CacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=80, deadline=None)
TestCacheMachine = CacheMachine.TestCase
