"""The spec's extra-config keys (typed, each bad value refused by name before anything is built),
the salt of its storage keys, and its manager in vLLM's own terms (vLLM's types, no engine)."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.integrations.vllm import EXTRA_KEYS, SpecSettings
from vllm_testlib import needs_vllm


@pytest.mark.parametrize("extra,key", [
    ({}, "host_gb"),
    ({"host_gb": -1}, "host_gb"),
    ({"host_gb": "4"}, "host_gb"),
    ({"host_gb": True}, "host_gb"),
    ({"host_gb": float("nan")}, "host_gb"),
    ({"host_gb": 1, "eviction": "fifo"}, "eviction"),
    ({"host_gb": 1, "io_backend": "magic"}, "io_backend"),
    ({"host_gb": 1, "write_policy": "write_sometimes"}, "write_policy"),
    ({"host_gb": 1, "storage_backend": "tape", "storage_url": "/x", "storage_gb": 1}, "storage_backend"),
    ({"host_gb": 1, "storage_backend": "file", "storage_gb": 1}, "storage_url"),
    ({"host_gb": 1, "storage_backend": "file", "storage_url": "/x"}, "storage_gb"),
    ({"host_gb": 1, "storage_url": "/x"}, "storage_url"),
    ({"host_gb": 1, "storage_gb": 2}, "storage_gb"),
    ({"host_gb": 1, "cpu_bytes_to_use": 4 << 30}, "cpu_bytes_to_use"),
    ({"host_gb": 1, "canonical_layout": True}, "canonical_layout"),
])
def test_a_bad_key_is_refused_in_one_line_naming_it(extra, key):
    with pytest.raises(ValueError) as e:
        SpecSettings.from_extra(extra)
    msg = str(e.value)
    assert f"kv_connector_extra_config['{key}']" in msg and "\n" not in msg


def test_good_keys_are_typed_and_vllms_own_pass_through():
    s = SpecSettings.from_extra({"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
                                 "blocks_per_chunk": 2, "host_gb": 4, "eviction": "lfu", "storage_backend": "file",
                                 "storage_url": "/var/kv", "storage_gb": 100, "write_policy": "write_through"})
    assert (s.host_gb, s.eviction, s.io_backend, s.storage_url, s.write_policy) == (
        4, "lfu", None, "/var/kv", "write_through")
    assert set(EXTRA_KEYS) == {f.name for f in dataclasses.fields(SpecSettings)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.host_gb = 8


# -- with vLLM's own types --------------------------------------------------------------------------

def _config(extra: dict | None = None, groups: int = 1, **changes):
    from vllm.v1.kv_offload import config as c

    parallel = c.OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=0,
                                          is_parallelism_agnostic=True)
    fields = dict(
        groups=tuple(c.OffloadingGroupConfig(32, (f"layers.{i}.attn",), i) for i in range(groups)),
        worker_kv_bytes_per_block=32768, enable_kv_cache_events=True,
        extra_config={"host_gb": 0.001, **(extra or {})}, engine_id="e0",
        model=c.OffloadingModelConfig("tiny-llama", "float32"), cache=c.OffloadingCacheConfig(32, 1),
        parallel=parallel, kv_cache_layout="LBHNC")
    for name, value in changes.items():
        if name in ("tp_size", "rank", "world_size"):
            fields["parallel"] = dataclasses.replace(fields["parallel"], **{name: value})
        elif name == "dtype":
            fields["model"] = c.OffloadingModelConfig("tiny-llama", value)
        elif name == "blocks_per_chunk":
            fields["cache"] = c.OffloadingCacheConfig(32, value)
        else:
            fields[name] = value
    return c.OffloadingConfig(**fields)


@needs_vllm
def test_the_salt_changes_with_everything_a_blocks_bytes_depend_on():
    from vllm.v1.kv_offload.config import OffloadingModelConfig

    from kvtier.integrations.vllm import vllm_salt

    base = vllm_salt(_config())
    assert vllm_salt(_config()) == base and len(base) == 32
    variants = [_config(dtype="bfloat16"), _config(blocks_per_chunk=2), _config(tp_size=2, world_size=2),
                _config(rank=1, world_size=2), _config(kv_cache_layout="LBNHC"), _config(worker_kv_bytes_per_block=1),
                _config(model=OffloadingModelConfig("other-model", "float32"))]
    salts = {vllm_salt(v) for v in variants}
    assert base not in salts and len(salts) == len(variants)


@needs_vllm
@pytest.mark.parametrize("config,key", [
    (dict(extra={"host_gb": 1e-6}), "host_gb"),
    (dict(groups=2), "one KV cache group"),
    (dict(extra={"storage_backend": "file", "storage_url": "/x", "storage_gb": 1}, world_size=2, tp_size=2),
     "storage_backend"),
])
def test_the_spec_refuses_what_it_cannot_serve_when_vllm_builds_it(config, key):
    from kvtier.integrations.vllm import KvtierOffloadingSpec

    with pytest.raises(ValueError, match=key):
        KvtierOffloadingSpec(_config(**config))


@needs_vllm
def test_the_manager_answers_lookups_stores_and_stats_in_vllms_terms():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    from kvtier.integrations.vllm import KvtierOffloadingSpec, KvtierPages

    spec = KvtierOffloadingSpec(_config())  # 0.001 GB: 30 chunks of 32 KiB
    m, ctx, key = spec.get_manager(), ReqContext("r1"), b"k" * 36
    assert spec.num_chunks == 30 and m.lookup(key, ctx) == LookupResult.MISS
    out = m.prepare_store([key], ctx)
    assert out.keys_to_store == [key] and isinstance(out.store_spec, KvtierPages) and out.evicted_keys == []
    assert m.lookup(key, ctx) == LookupResult.HIT_PENDING
    m.complete_store([key], ctx)
    assert m.lookup(key, ctx) == LookupResult.HIT
    assert m.prepare_load([key], ctx).block_ids.tolist() == out.store_spec.block_ids.tolist()
    m.complete_load([key], ctx)
    events = list(m.take_events())
    assert [(e.keys, e.removed) for e in events] == [([key], False)]
    stats = m.get_stats()
    assert isinstance(stats, OffloadingConnectorStats)
    reduced = stats.reduce()
    assert reduced["vllm:kv_offload_kvtier_hit_chunks:('host',)"] == 1
    assert reduced["vllm:kv_offload_kvtier_stored_chunks"] == 1 and reduced["vllm:kv_offload_kvtier_lookups"] == 3
    assert set(spec.build_metric_definitions({})) >= {n for n in stats.data["types"]}
    m.reset_cache()
    assert m.lookup(key, ctx) == LookupResult.MISS


@needs_vllm
def test_storage_on_the_cpu_build_is_refused_where_its_worker_runs_apart(monkeypatch):
    from vllm.platforms import current_platform

    from kvtier.integrations.vllm import KvtierOffloadingSpec

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU build only")
    storage = {"storage_backend": "file", "storage_url": "/x", "storage_gb": 1}
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        KvtierOffloadingSpec(_config(extra=storage))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert KvtierOffloadingSpec(_config(extra=storage)).settings.storage_url == "/x"
