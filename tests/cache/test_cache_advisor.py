"""The load-or-recompute advisor: measured bandwidth against the caller's prefill estimate."""

from __future__ import annotations

import pytest

from cache_testlib import make_cache, serve
from kvtier.cache.policy import BandwidthMeter

SEQ = list(range(40, 56))   # 16 tokens


def host_match(cache):
    serve(cache, SEQ)
    cache.evict_device(10**6)
    m = cache.match_prefix(SEQ)
    assert m.host_len == 16
    return m


def test_without_a_measurement_loading_is_advised_to_get_one():
    cache, *_ = make_cache(held=False)
    a = cache.advise(host_match(cache), prefill_seconds_per_token=1e-3)
    assert a.load and a.load_seconds is None and a.host_tokens == 16


def test_decision_flips_where_loading_gets_slower_than_recomputing():
    cache, dev, *_ = make_cache(held=False, load_gbps_prior=1.0)
    m = host_match(cache)
    nbytes = 16 * dev.spec.bytes_per_token
    a = cache.advise(m, prefill_seconds_per_token=1e-3)
    assert a.load and a.host_bytes == nbytes and a.load_seconds == pytest.approx(nbytes / 1e9)
    assert a.recompute_seconds == pytest.approx(16e-3)
    per_token_break_even = nbytes / 1e9 / 16
    assert cache.advise(m, per_token_break_even * 1.01).load
    assert not cache.advise(m, per_token_break_even * 0.99).load
    snap = cache.metrics.snapshot()
    assert (snap["advice_total.load"], snap["advice_total.recompute"]) == (2, 1)


def test_margin_shifts_the_break_even():
    cache, dev, *_ = make_cache(held=False, load_gbps_prior=1.0, advisor_margin=0.5)
    m = host_match(cache)
    per_token_break_even = 16 * dev.spec.bytes_per_token / 1e9 / 16
    assert not cache.advise(m, per_token_break_even * 1.5).load
    assert cache.advise(m, per_token_break_even * 2.5).load


def test_bandwidth_is_measured_online_from_completed_loads():
    cache, *_ = make_cache(held=False)
    m = host_match(cache)
    cache.lock(m.node)
    r = cache.load_back(m)
    r.layer_load.synchronize()
    cache.poll()
    cache.unlock(m.node)
    snap = cache.metrics.snapshot()
    bps = snap["bandwidth_bytes_per_second.load"]
    assert snap["transfers_total.load"] == 1
    assert bps == pytest.approx(snap["transfer_bytes_total.load"] / snap["transfer_seconds_total.load"])
    cache.evict_device(10**6)
    m = cache.match_prefix(SEQ)
    a = cache.advise(m, prefill_seconds_per_token=1.0)
    assert a.load and a.load_seconds == pytest.approx(a.host_bytes / bps)
    assert not cache.advise(m, prefill_seconds_per_token=0.0).load


def test_a_device_hit_needs_no_advice():
    cache, *_ = make_cache(held=False)
    serve(cache, SEQ)
    a = cache.advise(cache.match_prefix(SEQ), 1e-3)
    assert (a.host_tokens, a.load, a.decision) == (0, False, "recompute")
    assert cache.metrics.snapshot()["advice_total.recompute"] == 0


def test_meter_is_an_ewma_and_ignores_empty_samples():
    m = BandwidthMeter(0.5)
    m.add(0, 1.0)
    m.add(100, 0.0)
    assert m.bps == 0 and m.samples == 0
    m.add(100, 1.0)
    m.add(300, 1.0)
    assert m.bps == pytest.approx(200.0)


def test_bad_prefill_estimate_is_refused():
    cache, *_ = make_cache(held=False)
    with pytest.raises(ValueError, match="prefill_seconds_per_token"):
        cache.advise(cache.match_prefix(SEQ), -1.0)
