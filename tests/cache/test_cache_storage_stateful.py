"""Model-based test of HiCache with a storage tier over a real directory (test_cache_stateful.py's
sibling, storage added).

Random interleavings of requests (match, which may look up and prefetch from storage; load back,
all or part of the storage hit; compute; insert; unlock), aborts, evictions of both tiers (which
save to storage under write-back), held transfers completed in random order, polls, flushes,
reads that stall, pages damaged on disk, the store's directory removed and made again, loads that
fail, and clear(), over every kind, write and prefetch policy, with a store of a few pages (it
evicts), saving ahead of host eviction or not. Checked after every step (and by ``HiCache.check()``, which covers the prefetches in
flight: their host pages and the locks on the nodes they continue):

- every device-ready cached page, and every prefix a request reads after load-back (storage
  pages included), holds the KV bytes of its own tokens (they derive from the namespace and the
  whole prefix): a damaged, foreign or missing stored page is never loaded;
- a match and its storage part never claim more than was ever inserted;
- host pages: the tree's, plus those of prefetches in flight, plus the free ones, are all of them;
- lock counts are the requests' plus one per prefetch on the node it continues;
- at the end, every allocator is back to its initial count.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections import Counter

import numpy as np
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache_testlib import common_pages, kv_matches, kv_values, make_storage_cache, write_kv
from kvtier.cache import LoadFailedError
from kvtier.storage.format import PageCodec, PageRejected, StorageSalt, read_header
from kvtier.storage.tier import TierConfig

KINDS_LAYOUTS = [("mha", "page_first"), ("mha", "layer_first"), ("mla", "page_first"), ("dsa", "layer_first")]
NAMESPACES = ["a", "b"]


class Request:
    def __init__(self, ns, seq, match):
        self.ns, self.seq, self.m, self.node = ns, seq, match, match.node
        self.prefix = match.device_indices
        self.load = None


class StorageCacheMachine(RuleBasedStateMachine):
    @initialize(kind_layout=st.sampled_from(KINDS_LAYOUTS), page_size=st.sampled_from([1, 2, 4]),
                write=st.sampled_from(["write_back", "write_through"]), ahead=st.sampled_from([0.0, 0.5, 1.0]),
                policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
                dev_pages=st.integers(5, 10), host_pages=st.integers(2, 8), store_pages=st.integers(3, 40),
                seed=st.integers(0, 2**16))
    def setup(self, kind_layout, page_size, write, ahead, policy, dev_pages, host_pages, store_pages, seed):
        kind, layout = kind_layout
        ps = page_size if kind != "dsa" else max(page_size, 2)
        self.ps, self.rng, self.policy = ps, random.Random(seed), policy
        self.max_len = 4 * ps + ps // 2 + 1
        self.dir = tempfile.mkdtemp(prefix="kvtier-stateful-")
        self.store_dir = os.path.join(self.dir, "store")
        cfg = TierConfig(prefetch_timeout_s=0.2, prefetch_timeout_per_page_s=0.0, prefetch_timeout_max_s=1.0,
                         health_interval_s=0.02, batch_pages=2)
        self.cache, self.dev, self.host, self.engine, self.tier = make_storage_cache(
            self.store_dir, kind, layout, ps, dev_pages, max(host_pages, 2), store_pages, held=True, tier_config=cfg,
            storage_write=write, storage_save_ahead=ahead, storage_prefetch=policy, max_inflight_backups=3, max_inflight_loads=2,
            max_inflight_prefetches=2)
        self.gate = self.tier.backend.open_gate
        self.dev_initial = self.cache.tiers.device_alloc.available_pages()
        self.host_initial = self.host.allocator.available_pages()
        self.inserted: list[tuple[str, tuple]] = []   # everything ever inserted: the store may hold any of it
        self.requests: list[Request] = []

    def values(self, ns, seq):
        return kv_values(seq, NAMESPACES.index(ns))

    def draw_seq(self, data, ns):
        """Mostly a follow-up of an earlier sequence. Every draw has one shape whatever the state:
        the tier's threads make the state depend a little on timing, and hypothesis's data must not."""
        base = [s for n, s in self.inserted if n == ns]
        pick, cut, follow = data.draw(st.integers(0, 2**16)), data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
        seq = []
        if base and follow:
            src = base[pick % len(base)]
            seq = list(src[: (len(src), len(src), len(src) // 2, pick % (len(src) + 1))[cut]])
        more = data.draw(st.lists(st.integers(0, 2), min_size=self.ps, max_size=3 * self.ps + 1))
        seq = (seq + more)[: self.max_len]
        return tuple(seq) if seq else (0,)

    def quiesce(self) -> None:
        """Let the store's threads finish what they started (saves written, prefetches read) where
        nothing stalls them, so the next step sees the same store whatever the timing."""
        if self.gate.is_set():
            self.tier.flush(30)
            for pf in list(self.cache.storage.pending.values()):
                pf.handle.wait(30)

    def check_bounds(self, ns, seq, m):
        upper = max([common_pages(seq, s, self.ps) for n, s in self.inserted if n == ns] or [0])
        total = m.total_len + m.storage_len
        assert total % self.ps == 0 and m.total_len <= total <= upper, (m.total_len, m.storage_len, upper)

    # -- requests -------------------------------------------------------------------------------

    @precondition(lambda self: len(self.requests) < 3)
    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES), load=st.sampled_from([True, True, True, False]),
          part=st.integers(0, 3))
    def start_request(self, data, ns, load, part):
        seq = self.draw_seq(data, ns)
        m = self.cache.match_prefix(list(seq), namespace=ns, lock=True)
        self.check_bounds(ns, seq, m)
        assert kv_matches(self.dev, m.device_indices, self.values(ns, seq)[: m.device_len])
        req = Request(ns, seq, m)
        if load and (m.host_len or m.storage_len):
            want = None if part == 3 else part * self.ps   # all of the storage part, or a split of it
            r = self.cache.load_back(m, storage_tokens=want)
            if r is None:
                assert self.cache.device_free_tokens() < m.host_len + m.storage_len
            else:
                assert len(r.device_indices) >= m.device_len + m.host_len
                assert len(r.device_indices) <= m.total_len + (m.storage_len if want is None else want)
                assert r.storage_tokens <= r.loaded_tokens
                req.prefix, req.load, req.node = r.device_indices, r.layer_load, r.node
        self.requests.append(req)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data):
        req = self.requests.pop(data.draw(st.integers(0, 2)) % len(self.requests))
        if req.load is not None:
            try:
                for layer in range(self.dev.layer_num):
                    req.load.wait_layer(layer)
            except LoadFailedError:
                self.cache.unlock(req.node)
                return
        vals = self.values(req.ns, req.seq)
        p, L = len(req.prefix), len(req.seq)
        assert kv_matches(self.dev, req.prefix, vals[:p]), "a request read bytes that are not its prefix's"
        need = -(-(L - p) // self.ps) * self.ps
        own = self.cache.alloc_device(need)
        if own is None:
            assert self.cache.device_free_tokens() < need
            self.cache.unlock(req.node)
            return
        write_kv(self.dev, own[: L - p], vals[p:])
        self.cache.insert(list(req.seq), torch.cat([req.prefix, own[: L - p]]), namespace=req.ns)
        full = L // self.ps * self.ps
        self.cache.free_device(own[full - p:])
        self.cache.unlock(req.node)
        self.inserted.append((req.ns, req.seq[:full]))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort_request(self, data):
        req = self.requests.pop(data.draw(st.integers(0, 2)) % len(self.requests))
        self.cache.unlock(req.node)

    # -- the tiers and the store ------------------------------------------------------------------

    @rule(tier=st.sampled_from(["device", "host", "both"]), pages=st.integers(1, 16))
    def evict(self, tier, pages):
        """Evict pages of a tier; ``both``: the device, then the host (to storage only, where it saved them)."""
        if tier != "host":
            self.cache.evict_device(pages * self.ps)
        if tier != "device":
            self.cache.evict_host(pages * self.ps)

    @rule(count=st.integers(0, 3))
    def complete_transfers(self, count):
        self.engine.release(count, self.rng)

    @rule(flush=st.booleans())
    def poll(self, flush):
        if flush and self.gate.is_set():
            assert self.cache.flush(30)
        else:
            self.cache.poll()

    @rule(fault=st.sampled_from(["flip", "truncate", "empty", "foreign", "remove", "remove_and_back",
                                                 "restore", "fail_load", "stall", "unstall"]))
    def fault(self, fault):
        """A fault: a stored page damaged on disk, the store's directory removed (and made again, empty),
        the next load failing, reads of the store stalling (best-effort only: loads take what arrived)."""
        if fault in ("flip", "truncate", "empty", "foreign"):
            self.damage_a_stored_page(fault)
        elif fault.startswith("remove"):
            shutil.rmtree(self.store_dir, ignore_errors=True)
            if fault == "remove_and_back":
                os.makedirs(self.store_dir, exist_ok=True)
        elif fault == "restore":
            os.makedirs(self.store_dir, exist_ok=True)
        elif fault == "fail_load":
            self.engine.fail_loads += 1
        elif self.policy == "best_effort":
            (self.gate.clear if fault == "stall" else self.gate.set)()

    def damage_a_stored_page(self, how):
        # Which pages are on disk depends on the tier's threads: chosen by the machine's own random
        # numbers, not drawn from hypothesis's data (which must not depend on timing).
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(self.store_dir) for f in fs if f.endswith(".kvp"))
        if not files:
            return
        path = self.rng.choice(files)
        try:
            blob = bytearray(open(path, "rb").read())
        except OSError:
            return  # evicted meanwhile by a save on the tier's thread
        if how == "flip" and blob:
            blob[self.rng.randrange(len(blob))] ^= 1 << self.rng.randrange(8)
        elif how == "truncate":
            blob = blob[: len(blob) // 2]
        elif how == "empty":
            blob = b""
        elif how == "foreign":  # another model's page under this key: whole, sealed with another salt
            try:
                key = read_header(blob).key
            except PageRejected:
                return
            arr = np.frombuffer(bytes(blob), np.uint8).copy()
            PageCodec(StorageSalt(self.tier.salt.spec, self.ps, "another/model")).seal(arr, key)
            blob = arr.tobytes()
        with open(path, "wb") as f:
            f.write(blob)

    @rule(now=st.integers(0, 9))
    def clear(self, now):
        if now != 5 or self.requests:  # rarely (5, not 0: 0 comes up often), so that state builds up
            return
        self.cache.clear()
        assert self.host.allocator.available_pages() == self.host_initial and not self.cache.storage.pending

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def checked(self):
        self.quiesce()
        self.cache.check()

    @invariant()
    def accounting(self):
        c, tree = self.cache, self.cache.tree
        held = sum(len(pf.pages) for pf in c.storage.pending.values())
        assert self.host.allocator.available_pages() + tree.host_pages + held == self.host_initial
        assert c.tiers.device_alloc.available_pages() + tree.device_pages == self.dev_initial  # requests: tree pages
        locks = Counter()
        for req in self.requests:
            for n in tree.path_to(req.node):
                locks[n] += 1
        for pf in c.storage.pending.values():
            for n in tree.path_to(pf.anchor):
                locks[n] += 1
        for n in tree.nodes():
            assert n.lock_ref == locks[n], (n, locks[n])

    @invariant()
    def cached_device_bytes(self):
        for ns, root in self.cache.tree.roots.items():
            stack = [(child, []) for child in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                toks = prefix + list(map(int, node.tokens))
                if node.device is not None and node.device_ready:
                    vals = self.values(ns, toks)[len(prefix):]
                    slots = torch.from_numpy(node.device)[:, None].long() * self.ps + torch.arange(self.ps)
                    assert kv_matches(self.dev, slots.reshape(-1), vals), "cached device bytes corrupted"
                stack += [(ch, toks) for ch in node.children.values()]

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        self.gate.set()
        for req in self.requests:
            self.cache.unlock(req.node)
        self.requests = []
        self.cache.clear()
        self.cache.check()
        assert self.cache.tiers.device_alloc.available_pages() == self.dev_initial
        assert self.host.allocator.available_pages() == self.host_initial
        assert not self.engine.pending
        self.tier.close()
        self.host.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StorageCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=80, deadline=None)
TestStorageCacheMachine = StorageCacheMachine.TestCase
