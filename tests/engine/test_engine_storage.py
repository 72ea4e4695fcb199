"""The reference engine with a storage tier behind its host tier, and a host load that fails: the
outputs are what recomputing gives, a second engine over the same directory loads what the first
stored, and a failed load is computed again in full."""

from __future__ import annotations

import pytest

from cache_testlib import HeldTransferEngine
from kvtier.cache import CacheConfig, HiCache
from kvtier.engine import Engine, EngineConfig, tiny
from kvtier.engine.engine import make_model
from kvtier.engine.kv_manager import PrefixCache
from kvtier.engine.workload import Workload, run_requests, run_workload
from kvtier.host_pool import host_pool_for

SHAPE = dict(hidden_size=64, n_layers=2, n_heads=4, intermediate_size=96, vocab_size=101)
WL = Workload(clients=3, rounds=4, system_tokens=40, user_tokens=20, output_tokens=6, vocab_size=101, seed=5)


def engine(model, mode: str = "tiers", **kw) -> Engine:
    cfg = dict(prefix_cache=mode, device_tokens=192, host_tokens=128, page_size=8)
    return Engine(model, EngineConfig(**{**cfg, **kw}))


@pytest.fixture(scope="module")
def llama():
    return make_model(tiny("llama", **SHAPE), EngineConfig(), 0)


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
@pytest.mark.parametrize("write", ["write_through", "write_back"])
def test_a_storage_tier_keeps_outputs_and_a_restart_loads_from_it(tmp_path, kind, write):
    model = make_model(tiny(kind, **SHAPE), EngineConfig(), 0)
    store = dict(storage="file", storage_url=str(tmp_path / "store"), model_id="tiny", storage_write=write,
                 host_tokens=512)
    ref = run_workload(engine(model, "none"), WL).outputs()
    first = engine(model, **store)
    result = run_workload(first, WL)
    assert result.outputs() == ref
    first.kv.cache.check()
    first.close()   # under write-back, the host tier's pages are saved now
    snap = first.kv.cache.metrics.snapshot()
    assert snap["storage_written_pages_total"] > 0 and snap["storage_up"] == 1
    restarted = engine(model, **store)
    last = WL.rounds - 1
    prompts = {(c, last): WL.prompt(c, last, ref) for c in range(WL.clients)}
    again = run_requests(restarted, prompts, WL.output_tokens)
    assert again.outputs() == {k: ref[k] for k in prompts}
    stored = sum(t.reused_storage for t in again.turns)
    assert stored > 0 and restarted.stats()["cache"]["hit_tokens_total.storage"] == stored
    # Every page reached the store (write-through: as backed up; write-back: evicted, or saved at close):
    # all but each prompt's partial last page comes back.
    assert stored + sum(t.reused_device for t in again.turns) >= sum(len(p) - 8 for p in prompts.values())
    restarted.close()


def test_the_advisor_path_keeps_outputs_with_storage(tmp_path, llama):
    ref = run_workload(engine(llama, "none"), WL).outputs()
    e = engine(llama, storage="file", storage_url=str(tmp_path), model_id="tiny", use_advisor=True,
               storage_write="write_through")
    assert run_workload(e, WL).outputs() == ref
    e.close()


def test_a_failed_host_load_is_computed_again_in_full(llama):
    """The load under a prefill fails partway (layer 0 only): the step's requests give their slots back
    and run again, the failed one without loading; its tokens are what recomputing gives."""
    e = engine(llama, "none")
    host = host_pool_for(e.pool, "layer_first", host_size_tokens=1024)
    held = HeldTransferEngine(host)   # the real engine, completions held; the next load fails
    e.kv = e.scheduler.kv = PrefixCache(HiCache(e.pool, host, CacheConfig(page_size=8), transfer_engine=held))
    prompt = list(range(1, 65))
    e.generate([prompt], 4)
    e.kv.cache.evict_device(e.kv.capacity)   # waits for the backup: the host copy is all that is left
    held.fail_loads = 1
    seq = e.add_request(prompt + [7, 8, 9], 4)
    other = e.add_request([5, 6, 7], 4)      # in the same step, loading nothing
    e.run_until_done()
    assert seq.load_failed and seq.reused_host == 0 and seq.computed == 67
    assert seq.output_ids == engine(llama, "none").generate([prompt + [7, 8, 9]], 4)[0]
    assert other.output_ids == engine(llama, "none").generate([[5, 6, 7]], 4)[0]
    snap = e.kv.metrics()
    assert snap["transfer_failures_total.load"] == 1
    assert snap["tokens.device.locked"] == 0 and snap["tokens.device.request"] == 0
    e.kv.cache.check()


@pytest.mark.parametrize("changes, words", [
    (dict(storage="file"), "needs storage_url"),
    (dict(storage="file", storage_url="/tmp/x"), "model_id must name"),
    (dict(storage="file", storage_url="/tmp/x", model_id="m", prefix_cache="gpu"), "needs prefix_cache='tiers'"),
    (dict(storage="tape", storage_url="/tmp/x", model_id="m"), "unknown storage backend 'tape'"),
    (dict(storage="file", storage_url="/tmp/x", model_id="m", storage_bytes=0), "storage_bytes"),
    (dict(storage="file", storage_url="/tmp/x", model_id="m", weights_fingerprint=""), "weights_fingerprint"),
    (dict(storage_write="never"), "storage_write"),
    (dict(storage_prefetch="always"), "storage_prefetch"),
])
def test_bad_storage_settings_are_refused_by_name(changes, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**changes)
