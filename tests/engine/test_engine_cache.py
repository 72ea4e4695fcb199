"""The reference engine on kvtier's prefix cache: reuse, eviction, preemption, identical outputs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvtier.cache import HiCache
from kvtier.engine import Engine, EngineConfig, tiny
from kvtier.engine.engine import make_model
from kvtier.engine.workload import Workload, run_workload

KINDS = ("llama", "deepseek")
SHAPE = dict(hidden_size=64, n_layers=2, n_heads=4, intermediate_size=96, vocab_size=101)


def model_of(kind: str, seed: int = 0):
    return make_model(tiny(kind, **SHAPE), EngineConfig(), seed)


MODELS = {}  # filled lazily: one model per kind for the property test


def engine(model, mode: str, **kw) -> Engine:
    cfg = dict(prefix_cache=mode, device_tokens=512, host_tokens=4096, page_size=8)
    return Engine(model, EngineConfig(**{**cfg, **kw}))


def assert_all_released(e: Engine) -> None:
    """Nothing locked and no request slot left: every device slot is free or evictable."""
    snap = e.kv.metrics()
    assert snap["tokens.device.locked"] == 0 and snap["tokens.device.request"] == 0
    assert e.kv.cache.device_free_tokens() == e.kv.capacity


WL = Workload(clients=3, rounds=3, system_tokens=40, user_tokens=20, output_tokens=6, vocab_size=101, seed=5)


@pytest.mark.parametrize("kind", KINDS)
def test_outputs_identical_with_and_without_tiers(kind):
    """Same greedy tokens in all modes, while the small device pool evicts mid-run and the host tier serves hits."""
    model = model_of(kind)
    results = {}
    engines = {}
    for mode in ("none", "gpu", "tiers"):
        e = engine(model, mode, device_tokens=192)
        results[mode] = run_workload(e, WL).outputs()
        engines[mode] = e
    assert results["none"] == results["gpu"] == results["tiers"]
    assert len(results["none"]) == WL.total_turns()
    tiers = engines["tiers"].kv.metrics()
    assert tiers["evicted_tokens_total.device"] > 0  # eviction happened in the middle of the run
    assert tiers["hit_tokens_total.host"] > 0 and tiers["transfers_total.load"] > 0
    assert engines["gpu"].kv.metrics()["dropped_tokens_total"] > 0
    for mode in ("gpu", "tiers"):
        assert_all_released(engines[mode])
    none = engines["none"].kv.allocator
    assert none.available_size() == none.size


def test_scheduler_reuses_device_then_host_prefix():
    model = model_of("llama", seed=1)
    prompt = list(range(1, 65))  # 8 whole pages
    e = engine(model, "tiers")
    first = e.add_request(prompt, 4)
    e.run_until_done()
    assert first.reused_device == first.reused_host == 0 and first.computed == 64
    second = e.add_request(prompt + [7, 8, 9], 4)
    e.run_until_done()
    # 64 prompt tokens + 3 generated: the first request's 8 full pages (64 tokens) are reused;
    # its generated tokens differ from [7, 8, 9] so they do not match.
    assert second.reused_device == 64 and second.reused_host == 0 and second.computed == 3
    rate = e.prefill_seconds_per_token()
    e.kv.cache.poll()
    e.kv.cache.evict_device(e.kv.capacity)  # demote everything: only the host copy is left
    third = e.add_request(prompt + [7, 8, 9], 4)
    e.run_until_done()
    assert third.reused_host == 64 and third.reused_device == 0
    # the prefill rate the advisor reads leaves out the step that waited for the host load
    assert (e._prefill_tokens, e.prefill_seconds_per_token()) == (64 + 3, rate)
    fresh = engine(model, "none")
    assert fresh.generate([prompt + [7, 8, 9]], 4) == [second.output_ids] == [third.output_ids]
    assert_all_released(e)


def test_attention_waits_on_each_layer_of_a_host_load(monkeypatch):
    """Layer i of the forward pass waits on the load's layer i, once, in order."""
    model = model_of("deepseek")
    e = engine(model, "tiers")
    prompt = list(range(2, 50))
    e.generate([prompt], 2)
    e.kv.cache.poll()
    e.kv.cache.evict_device(e.kv.capacity)
    waits: list[int] = []
    real = HiCache.load_back

    class Spy:
        def __init__(self, load):
            self.load = load

        def wait_layer(self, layer, stream=None):
            waits.append(layer)
            return self.load.wait_layer(layer, stream)

    def spying_load_back(self, match, **kw):
        r = real(self, match, **kw)
        return None if r is None else type(r)(r.device_indices, Spy(r.layer_load), r.loaded_tokens, r.node,
                                              r.storage_tokens)

    monkeypatch.setattr(HiCache, "load_back", spying_load_back)
    e.generate([prompt + [1]], 3)
    assert waits == list(range(model.config.n_layers))


@pytest.mark.parametrize("kind", KINDS)
def test_preemption_resumes_through_host_tier(kind):
    """Decoding outgrows the pool; the preempted request's pages go to the host and come back."""
    model = model_of(kind, seed=2)
    prompts = [[(i * 7 + j) % 101 for j in range(60)] for i in range(3)]
    e = engine(model, "tiers", device_tokens=208)
    seqs = [e.add_request(p, 40) for p in prompts]
    e.run_until_done()
    assert e.scheduler.preemptions > 0
    resumed = [s for s in seqs if s.preemptions]
    assert resumed and all(s.reused_on_resume > 0 for s in resumed)
    snap = e.kv.metrics()
    assert snap["hit_tokens_total.host"] > 0 and snap["transfers_total.load"] > 0
    alone = [engine(model, "none").generate([p], 40)[0] for p in prompts]
    assert [s.output_ids for s in seqs] == alone
    assert_all_released(e)


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_write_policies_keep_outputs(policy):
    model = model_of("llama", seed=3)
    wl = Workload(clients=2, rounds=3, system_tokens=32, user_tokens=16, output_tokens=5, vocab_size=101)
    ref = run_workload(engine(model, "none"), wl).outputs()
    e = engine(model, "tiers", device_tokens=128, write_policy=policy)
    assert run_workload(e, wl).outputs() == ref
    assert_all_released(e)


def test_advisor_path_keeps_outputs():
    model = model_of("llama", seed=4)
    wl = Workload(clients=2, rounds=3, system_tokens=32, user_tokens=16, output_tokens=5, vocab_size=101)
    ref = run_workload(engine(model, "none"), wl).outputs()
    e = engine(model, "tiers", device_tokens=128, use_advisor=True)
    assert run_workload(e, wl).outputs() == ref


@pytest.mark.parametrize("mode", ["none", "gpu", "tiers"])
def test_a_request_that_fills_the_pool_exactly_runs(mode):
    """60 prompt tokens and 5 new ones hold 64 slots at most (the last token is never fed
    back); a 64-slot pool refused it as needing 65 (a review, 2026-12-04)."""
    model = model_of("llama", seed=4)
    prompt = list(range(1, 61))
    want = engine(model, "none", device_tokens=128).generate([prompt], 5)
    assert engine(model, mode, device_tokens=64).generate([prompt], 5) == want
    with pytest.raises(ValueError, match="needs 65 token slots"):
        engine(model, mode, device_tokens=64).add_request(list(range(1, 62)), 5)


@pytest.mark.parametrize("mode", ["none", "gpu", "tiers"])
def test_request_larger_than_the_pool_is_refused_up_front(mode):
    e = engine(model_of("llama"), mode, device_tokens=64)
    with pytest.raises(ValueError, match="needs 74 token slots.*holds 64"):
        e.add_request(list(range(70)), 5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.add_request([1, 500], 5)
    assert not e.has_work()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), kind=st.sampled_from(KINDS), page_size=st.sampled_from([1, 4, 16]),
       device_pages=st.integers(2, 12), mode=st.sampled_from(["gpu", "tiers"]))
def test_any_request_mix_generates_what_each_request_does_alone(data, kind, page_size, device_pages, mode):
    """Random prompts sharing random prefixes, on a small pool (eviction, preemption, host hits): each
    request's tokens equal its tokens when served alone without a cache, and every slot comes back."""
    model = MODELS.setdefault(kind, model_of(kind, seed=9))
    trunk = data.draw(st.lists(st.integers(0, 100), min_size=0, max_size=48))
    reqs = []
    for _ in range(data.draw(st.integers(1, 6))):
        cut = data.draw(st.integers(0, len(trunk)))
        tail = data.draw(st.lists(st.integers(0, 100), min_size=1, max_size=12))
        reqs.append((trunk[:cut] + tail, data.draw(st.integers(1, 16))))
    largest = max(len(p) + n for p, n in reqs)
    device_tokens = max(device_pages, -(-largest // page_size) + 1) * page_size
    e = engine(model, mode, device_tokens=device_tokens, page_size=page_size, max_batch_tokens=64)
    seqs = [e.add_request(p, n) for p, n in reqs]
    e.run_until_done()
    alone = engine(model, "none", device_tokens=device_tokens, page_size=page_size)
    assert [s.output_ids for s in seqs] == [alone.generate([p], n)[0] for p, n in reqs]
    assert_all_released(e)


def test_hits_are_counted_once_per_admitted_request():
    """A request the scheduler could not admit for room asks the cache again later; its hits
    were counted at every ask (a review, 2026-12-04: 1,104 hit tokens counted in a workload whose
    requests reused 704)."""
    model = model_of("llama", seed=4)
    e = engine(model, "gpu", device_tokens=32, page_size=4)
    p = list(range(1, 13))                   # three pages, cached by the first request
    e.generate([p + [50]], 1)
    m0 = e.kv.metrics()
    e.add_request(list(range(60, 77)), 4)    # takes the other five pages for a while
    y = e.add_request(p + [51, 52], 2)       # hits the three pages, waits for room
    e.run_until_done()
    m1 = e.kv.metrics()
    assert y.reused_device == 12
    assert m1["hit_tokens_total.device"] - m0["hit_tokens_total.device"] == 12
    assert m1["query_tokens_total"] - m0["query_tokens_total"] == 16 + 12   # both prompts, once each
    assert_all_released(e)


def test_generate_checks_every_prompt_before_queueing_any():
    """generate([ok, bad]) raised for the second after queueing the first, which then ran in the
    next, unrelated generate (a review, 2026-12-04)."""
    e = engine(model_of("llama"), "gpu", device_tokens=64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.generate([[1, 2, 3], [1, 500]], 2)
    with pytest.raises(ValueError, match="needs 74 token slots"):
        e.generate([[1, 2, 3], list(range(70))], 5)
    assert not e.has_work()
    assert e.generate([[4, 5]], 2) == engine(model_of("llama"), "none").generate([[4, 5]], 2)


@pytest.mark.parametrize("prompt, namespace, match", [
    ([4, 5, 6], "", "namespace must be a non-empty string"),
    ([4, 5, 6], None, "namespace must be a non-empty string"),
    ([1.7, 2, 3], "default", "token ids must be integers, got 1.7"),
    ([True, 2], "default", "token ids must be integers, got True"),
])
def test_a_bad_request_is_refused_when_added_and_the_others_still_finish(prompt, namespace, match):
    """A bad namespace or a non-integer token id was accepted and raised inside admission at
    every later step, so no request ever finished; a float id was truncated without a prefix
    cache (a review, 2026-12-04)."""
    for mode in ("none", "gpu"):
        e = engine(model_of("llama"), mode, device_tokens=256)
        good = e.add_request([1, 2, 3], 4)
        with pytest.raises(ValueError, match=match):
            e.add_request(prompt, 4, namespace=namespace)
        e.run_until_done()
        assert len(good.output_ids) == 4
        if mode != "none":
            assert_all_released(e)


def test_a_request_sharing_a_prefix_still_loading_is_admitted_when_it_fits():
    """Two requests share a prefix on the host only; the first one's load is in flight (held
    here, as a GPU load is within one scheduling step) when the second is matched. The prefix
    is on the device behind that load, locked, so it was counted both as room the second needed
    and as room not free: the second, which fits, was refused (a review)."""
    from cache_testlib import make_cache, serve
    from kvtier.engine.kv_manager import PrefixCache
    from kvtier.engine.sequence import Sequence
    cache, dev, host, held = make_cache(page_size=4, dev_pages=5, host_pages=16)
    prefix = list(range(1, 9))                                  # two pages
    serve(cache, prefix + [9])
    held.release()
    cache.poll()
    cache.evict_device(20)                                      # the prefix on the host only
    kv = PrefixCache(cache)
    a, b = Sequence(prefix + [10, 11, 12], 5), Sequence(prefix + [13, 14, 15], 1)
    assert kv.admit(a) and a.reused_host == 8                    # its load issued, still held
    m = cache.match_prefix(b.token_ids[:-1], lock=True, count=False)
    assert (m.device_len, m.host_len, m.load_len) == (0, 8, 0)
    cache.unlock(m.node)
    assert kv.admit(b)                                           # 3 own tokens: one page, and two are free
    assert b.slots[:8] == a.slots[:8]
    held.release()
    cache.poll()
    for s in (a, b):
        s.num_computed = len(s.token_ids)
        kv.release(s)
    assert cache.device_free_tokens() == 20 and not cache.tree.locked_nodes


@pytest.mark.parametrize("kind", KINDS)
def test_a_long_run_holds_the_engine_flat(kind):
    """No leak over a server's life: once the host pool is full (10 workloads of fresh
    conversations), 20 more leave the Python objects alive where they were (a kept object
    per request would add 180; the run swings by a few) and every slot released."""
    import gc
    e = engine(model_of(kind), "tiers", device_tokens=192, host_tokens=512)

    def wl(seed):
        return Workload(clients=3, rounds=3, system_tokens=40, user_tokens=20, output_tokens=6, vocab_size=101,
                        seed=seed)
    for s in range(10):
        run_workload(e, wl(s))
    gc.collect()
    before = len(gc.get_objects())
    for s in range(10, 30):
        run_workload(e, wl(s))
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert grown < 40, f"{grown} more Python objects after 180 more requests"
    assert_all_released(e)
