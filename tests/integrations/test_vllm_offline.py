"""kvtier's offloading spec inside stock ``vllm.LLM`` (vLLM's CPU build), end to end. Each run
serves three clients three turns (200-token histories, 50 new tokens a turn, 16 greedy tokens
out) on a tiny random Llama with 32-token blocks; the first runs share one child process (one
engine after another), and the runs over an existing storage directory are new processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_testlib import cached, needs_vllm, outputs, run_llms, write_tiny_model

pytestmark = [needs_vllm, pytest.mark.slow]

BLOCK = 32
HOST = {"host_gb": 0.01}  # 305 chunks of 32 KiB: the workload's 33 fit
SMALL = 20  # blocks of vLLM's own cache: a turn's three prompts (24-30 blocks) evict the last turn's


def _storage(path: Path, **kw) -> dict:
    return {**HOST, "storage_backend": "file", "storage_url": str(path), "storage_gb": 1, **kw}


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stores")
    return {"back": root / "write-back", "through": root / "write-through"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def runs(model, stores) -> dict[str, dict]:
    """One process: no offloading and the host tier, each with vLLM's prefix cache reset after
    every turn and with a small vLLM cache; then the two storage tiers' first processes."""
    names = ["baseline", "host", "gpu_only", "tiered", "store_back", "store_through"]
    results = run_llms(model, [
        {"extra": None, "reset": True},
        {"extra": HOST, "reset": True},
        {"extra": None, "gpu_blocks": SMALL},
        {"extra": {**HOST, "eviction": "lfu"}, "gpu_blocks": SMALL},
        {"extra": _storage(stores["back"]), "reset": True},
        {"extra": _storage(stores["through"], write_policy="write_through"), "reset": True},
    ])
    return dict(zip(names, results))


def _metric(result: dict, name: str) -> float:
    return result["metrics"].get(name, 0)


def test_without_offloading_a_reset_prefix_cache_serves_nothing(runs):
    assert cached(runs["baseline"]) == [[0, 0, 0]] * 3


def test_after_vllms_prefix_cache_is_reset_prompts_hit_kvtiers_host_tier(runs):
    run = runs["host"]
    assert outputs(run) == outputs(runs["baseline"])
    # Turn 2 finds turn 1's 250-token prompts (7 whole blocks), turn 3 turn 2's 316 (9 blocks).
    assert cached(run) == [[0, 0, 0], [7 * BLOCK] * 3, [9 * BLOCK] * 3]
    host = sum(map(sum, cached(run)))
    assert _metric(run, "vllm:prompt_tokens_cached_by_source.host") == host
    assert _metric(run, "vllm:prompt_tokens_cached_by_source.device") == 0
    assert _metric(run, "vllm:kv_offload_kvtier_hit_chunks.host") == host // BLOCK
    # Each client's prompts: 7 blocks, then 2 more a turn (prompts only: vLLM's default).
    assert _metric(run, "vllm:kv_offload_kvtier_stored_chunks") == 3 * (7 + 2 + 2)


def test_when_vllms_small_cache_evicts_the_host_tier_serves_with_identical_outputs(runs):
    gpu_only, tiered = runs["gpu_only"], runs["tiered"]
    assert outputs(gpu_only) == outputs(tiered) == outputs(runs["baseline"])
    assert sum(map(sum, cached(tiered))) > sum(map(sum, cached(gpu_only)))
    assert _metric(tiered, "vllm:prompt_tokens_cached_by_source.host") > 0


def test_a_new_process_over_the_same_directory_gets_hits_from_disk(model, runs, stores):
    first = runs["store_back"]
    assert outputs(first) == outputs(runs["baseline"])
    assert _metric(first, "vllm:prompt_tokens_cached_by_source.disk") == 0
    assert len(list(stores["back"].rglob("*.kvp"))) == 33  # write-back: every chunk at shutdown
    (second,) = run_llms(model, [{"extra": _storage(stores["back"]), "reset": True}])
    assert outputs(second) == outputs(first)
    # The same prompts as the first process's: turn 1's 7 blocks come from disk.
    assert cached(second)[0] == [7 * BLOCK] * 3
    assert _metric(second, "vllm:prompt_tokens_cached_by_source.disk") >= 21 * BLOCK
    assert _metric(second, "vllm:kv_offload_kvtier_storage_hit_pages") >= 21


def test_a_corrupted_page_on_disk_is_never_loaded(model, runs, stores):
    store = _storage(stores["through"], write_policy="write_through")
    assert outputs(runs["store_through"]) == outputs(runs["baseline"])
    pages = sorted(stores["through"].rglob("*.kvp"))
    assert len(pages) == 33
    for page in pages:  # one payload byte of every page (the 128-byte header stays valid)
        raw = bytearray(page.read_bytes())
        raw[4096] ^= 0xFF
        page.write_bytes(bytes(raw))
    (again,) = run_llms(model, [{"extra": store, "reset": True}])
    assert outputs(again) == outputs(runs["baseline"])
    assert cached(again)[0] == [0, 0, 0]
    assert _metric(again, "vllm:prompt_tokens_cached_by_source.disk") == 0
    assert _metric(again, "vllm:kv_offload_kvtier_storage_rejected_pages.corrupt") >= 3
    assert _metric(again, "vllm:kv_offload_kvtier_storage_hit_pages") == 0
