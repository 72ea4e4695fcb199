"""What the cache did, in a Prometheus registry of its own.

Nothing is exported unless the caller wants it: the registry is private to
one cache (``prometheus_client.generate_latest(cache.metrics.registry)``
renders it, ``start_http_server(port, registry=...)`` serves it), and
:meth:`CacheMetrics.snapshot` gives the same numbers as a plain dict.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from .tiers import REQUEST

PREFIX = "kvtier_cache_"
TIERS = ("device", "host")
HIT_TIERS = ("device", "host", "storage")
DIRECTIONS = ("backup", "load")


class _StateCollector:
    """Gauges read from the cache when the registry is collected."""

    def __init__(self, state: Callable[[], dict]):
        self._state = state

    def describe(self):
        return self._families({"tokens": {}, "queue_depth": {}, "bandwidth": {}})

    def collect(self):
        return self._families(self._state())

    @staticmethod
    def _families(s: dict):
        tokens = GaugeMetricFamily(PREFIX + "tokens", "Tokens per tier and state", labels=["tier", "state"])
        for (tier, state), v in s["tokens"].items():
            tokens.add_metric([tier, state], v)
        depth = GaugeMetricFamily(PREFIX + "queue_depth", "Transfers in flight", labels=["queue"])
        for q, v in s["queue_depth"].items():
            depth.add_metric([q], v)
        bw = GaugeMetricFamily(PREFIX + "bandwidth_bytes_per_second",
                               "Measured transfer bandwidth (0: not measured yet)", labels=["direction"])
        for d, v in s["bandwidth"].items():
            bw.add_metric([d], v)
        return [tokens, depth, bw]


class CacheMetrics:
    """Counters the cache increments, plus gauges read from its state."""

    def __init__(self, state: Callable[[], dict], lock=None):
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, labels, registry=r)

        self.query_tokens = counter("query_tokens", "Whole-page prompt tokens looked up")
        hits = counter("hit_tokens", "Prompt tokens found, by the tier that held them (host hits the "
                       "advisor had recomputed too: see advice)", ["tier"])
        self.hit_tokens = {t: hits.labels(tier=t) for t in HIT_TIERS}
        ev = counter("evicted_tokens", "Tokens evicted from a tier", ["tier"])
        self.evicted_tokens = {t: ev.labels(tier=t) for t in TIERS}
        self.demoted_tokens = counter("demoted_tokens", "Device tokens given a host copy on eviction")
        self.dropped_tokens = counter("dropped_tokens", "Tokens removed from the cache altogether")
        nb = counter("transfer_bytes", "Bytes moved between tiers", ["direction"])
        self.transfer_bytes = {d: nb.labels(direction=d) for d in DIRECTIONS}
        sec = counter("transfer_seconds", "Issue-to-completion time of transfers", ["direction"])
        self.transfer_seconds = {d: sec.labels(direction=d) for d in DIRECTIONS}
        cnt = counter("transfers", "Transfers completed", ["direction"])
        self.transfers = {d: cnt.labels(direction=d) for d in DIRECTIONS}
        fail = counter("transfer_failures", "Transfers that failed (retired, their pages freed)", ["direction"])
        self.transfer_failures = {d: fail.labels(direction=d) for d in DIRECTIONS}
        self.stall_seconds = counter("stall_seconds", "Time the cache blocked waiting for a transfer")
        adv = counter("advice", "Load-or-recompute decisions", ["decision"])
        self.advice = {d: adv.labels(decision=d) for d in ("load", "recompute")}
        skip = counter("backups_skipped", "Backups not issued", ["reason"])
        self.backups_skipped = {r_: skip.labels(reason=r_) for r_ in ("queue_full", "host_full", "error")}
        bp = counter("backpressure", "Requests for device room refused", ["call"])
        self.backpressure = {c: bp.labels(call=c) for c in ("alloc_device", "load_back")}
        self.storage_offered_pages = counter("storage_offered_pages", "Host pages offered to the storage hook")
        self.storage_saved_ahead_pages = counter("storage_saved_ahead_pages",
                                                 "Host pages saved to storage ahead of their eviction (write_back)")
        self.storage_offer_failures = counter("storage_offer_failures",
                                              "Offers to the storage hook that raised (their pages freed all the same)")
        refused = counter("storage_prefetch_refused", "Storage hits not prefetched", ["reason"])
        self.prefetch_refused = {r_: refused.labels(reason=r_) for r_ in ("queue_full", "host_full")}
        r.register(_StateCollector(state))

    def attach(self, registry: CollectorRegistry) -> None:
        """Serve another registry's metrics (a storage tier's, ``kvtier_storage_*``) from this one."""
        self.registry.register(_Forward(registry))

    def snapshot(self) -> dict[str, float]:
        """Every sample as ``{"name.label1.label2": value}`` (name without the prefix; a storage
        tier's as ``storage_<name>``, with ``storage_corrupt`` and ``storage_foreign``: the pages
        it rejected on read, summed), read under the cache's lock (``lock``): the counters of one
        operation are all in, or none (a match between reading the queried and the hit tokens
        showed more hits than queries)."""
        out: dict[str, float] = {}
        with self._lock:
            metrics = list(self.registry.collect())
        for metric in metrics:
            for s in metric.samples:
                if s.name.endswith("_created"):
                    continue
                key = ".".join([s.name.removeprefix(PREFIX).removeprefix("kvtier_"), *s.labels.values()])
                out[key] = s.value
        if "storage_foreign_pages_total" in out:
            out["storage_corrupt"] = sum(v for k, v in out.items() if k.startswith("storage_corrupt_pages_total."))
            out["storage_foreign"] = out["storage_foreign_pages_total"]
        return out


class _Forward:
    """The collected metrics of another registry, as this registry's own."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def describe(self):
        return []

    def collect(self):
        return self._registry.collect()


def cache_state(cache) -> dict:
    """The gauges' readings of a :class:`~.controller.HiCache`, under its lock."""
    with cache._lock:
        t, ps, tiers = cache.tree, cache.page_size, cache.tiers
        tokens = {
            ("device", "cached"): t.device_pages * ps, ("device", "locked"): t.device_locked_pages * ps,
            ("device", "free"): tiers.device_alloc.available_pages() * ps,
            ("device", "request"): int((tiers.owner == REQUEST).sum()) * ps,
            ("host", "cached"): t.host_pages * ps, ("host", "locked"): t.host_locked_pages * ps,
            ("host", "free"): tiers.host_alloc.available_pages() * ps if tiers.host_alloc else 0,
        }
        depth = {k: tiers.inflight.depth(k) for k in ("backup", "load")}
        if cache.storage is not None:
            depth["prefetch"] = len(cache.storage.pending)
        bw = {k: m.bps for k, m in tiers.meters.items()}
        return {"tokens": tokens, "queue_depth": depth, "bandwidth": bw}
