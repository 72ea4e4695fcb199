"""The storage tier's metrics: counters in a private Prometheus registry, gauges read from the tier
when collected, and the read and write rates the tier measures."""

from __future__ import annotations

import collections
import threading

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from .format import MISS_REASONS

PREFIX = "kvtier_storage_"
PREFETCH_OUTCOMES = ("complete", "partial", "miss", "timed_out", "skipped", "failed")
DROP_REASONS = ("queue_full", "down", "failed", "error")


class Rate:
    """Bytes per second over the last ``window`` timed operations (0 until one is seen)."""

    def __init__(self, window: int = 32):
        self._samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self._lock = threading.Lock()

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._samples.append((nbytes, seconds))

    @property
    def bps(self) -> float:
        with self._lock:
            seconds = sum(s for _, s in self._samples)
            return sum(b for b, _ in self._samples) / seconds if seconds else 0.0


class StorageMetrics:
    """The tier's counters in a private Prometheus registry (``registry``), and ``snapshot()``."""

    def __init__(self, state):
        self.registry = r = CollectorRegistry(auto_describe=True)

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, labels, registry=r)

        def labelled(name, doc, label, values):
            c = counter(name, doc, [label])
            return {v: c.labels(v) for v in values}

        self.lookup_pages = counter("lookup_pages", "Pages asked for by lookups")
        self.hit_pages = counter("hit_pages", "Pages lookups found in the store")
        self.read_pages = counter("read_pages", "Pages read, verified and written into host pages")
        self.read_bytes = counter("read_bytes", "Blob bytes read (verified or not)")
        self.read_seconds = counter("read_seconds", "Time in store reads and verification")
        self.written_pages = counter("written_pages", "Pages stored")
        self.written_bytes = counter("written_bytes", "Blob bytes stored")
        self.write_seconds = counter("write_seconds", "Time in store writes")
        self.skipped_pages = counter("save_skipped_pages", "Pages not written: the store held them already")
        self.dropped_pages = labelled("save_dropped_pages", "Pages offered and not stored", "reason", DROP_REASONS)
        self.corrupt_pages = labelled("corrupt_pages", "Blobs rejected on read, recomputed", "reason",
                                      [m for m in MISS_REASONS if m != "foreign"])
        self.foreign_pages = counter("foreign_pages", "Blobs of another salt or format rejected on read")
        self.missing_pages = counter("missing_pages", "Pages a lookup found and the read did not")
        self.prefetches = labelled("prefetches", "Prefetches by outcome", "outcome", PREFETCH_OUTCOMES)
        self.store_errors = counter("store_errors", "Store calls that failed whole (the store marked down)")
        r.register(_StateCollector(state))

    def rejected(self, reason: str) -> None:
        (self.foreign_pages if reason == "foreign" else self.corrupt_pages[reason]).inc()

    def snapshot(self) -> dict[str, float]:
        """Every sample as ``{"name.label": value}`` (name without the ``kvtier_storage_`` prefix)."""
        return {".".join([s.name.removeprefix(PREFIX), *s.labels.values()]): s.value
                for m in self.registry.collect() for s in m.samples if not s.name.endswith("_created")}


class _StateCollector:
    """Gauges read from the tier when the registry is collected."""

    NAMES = ("used_bytes", "capacity_bytes", "stored_pages", "pending_bytes", "read_bytes_per_second",
             "write_bytes_per_second", "up")

    def __init__(self, state):
        self._state = state

    def describe(self):
        return self._families(dict.fromkeys(self.NAMES, 0.0))

    def collect(self):
        return self._families(self._state())

    @staticmethod
    def _families(values: dict[str, float]):
        out = []
        for name, value in values.items():
            g = GaugeMetricFamily(PREFIX + name, name.replace("_", " "))
            g.add_metric([], value)
            out.append(g)
        return out
