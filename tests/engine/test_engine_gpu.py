"""The reference engine on CUDA: host-tier hits load the exact bytes, overlapped with the forward pass."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import Engine, EngineConfig, tiny
from kvtier.engine.engine import make_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
@pytest.mark.parametrize("io_backend,inputs", [(None, "sms"), ("direct", "sms"), ("dma", "pinned"), ("dma", "pageable")])
def test_host_hit_generates_what_a_device_hit_does(kind, io_backend, inputs):
    """Same prompt, prefix on the device vs loaded from the host layer by layer: same KV bytes, same tokens
    (whichever way the engine copies its step inputs: EngineConfig.inputs)."""
    cfg = tiny(kind, hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=64, intermediate_size=512,
               vocab_size=1000, dtype=torch.bfloat16)
    ecfg = EngineConfig(prefix_cache="tiers", device_tokens=8192, host_tokens=16384, page_size=16,
                        device="cuda", io_backend=io_backend, inputs=inputs)
    e = Engine(make_model(cfg, ecfg, seed=1), ecfg)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 1000, (4096,), generator=g).tolist()
    # 13 new tokens + 3 generated stay inside one page: only the prefix's pages are ever cached,
    # so both requests run the same shapes (q_start 4096, 13 new) and must give the same bits.
    prompt = prefix + torch.randint(0, 1000, (13,), generator=g).tolist()
    e.generate([prefix], 1)
    on_device = e.add_request(prompt, 3)
    e.run_until_done()
    assert on_device.reused_device == 4096
    before = prefix_bytes(e, prefix)
    e.kv.cache.evict_device(e.kv.capacity)
    assert e.kv.cache.match_prefix(prefix).device_len == 0
    from_host = e.add_request(prompt, 3)
    e.run_until_done()
    assert from_host.reused_host == 4096
    assert from_host.output_ids == on_device.output_ids
    after = prefix_bytes(e, prefix)
    assert all(torch.equal(before[n], after[n]) for n in before)


def prefix_bytes(e: Engine, prefix: list[int]) -> dict[str, torch.Tensor]:
    """Every layer's KV of the cached prefix, read through the cache's device slots."""
    torch.cuda.synchronize()
    slots = e.kv.cache.match_prefix(prefix).device_indices.to("cuda")
    assert len(slots) == len(prefix)
    return {n: t[:, slots].clone() for n, t in e.pool.stacks.items()}


def test_a_device_hit_step_copies_nothing_to_the_device_per_layer():
    """The rotary frequencies reach the device once, not by a blocking copy in every layer of
    every step (torch synchronizes the stream after a blocking host-to-device copy, so the host
    could not queue a layer ahead of the device). With inputs read by SMs a step queues fewer
    host-to-device copies than the model has layers (one per layer before)."""
    cfg = tiny("llama", hidden_size=256, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64, intermediate_size=512,
               vocab_size=1000, dtype=torch.bfloat16)
    ecfg = EngineConfig(prefix_cache="tiers", device_tokens=8192, host_tokens=16384, page_size=16, device="cuda")
    e = Engine(make_model(cfg, ecfg, seed=1), ecfg)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 1000, (2048,), generator=g).tolist()
    e.generate([prefix], 1)
    prompts = [prefix + torch.randint(0, 1000, (13,), generator=g).tolist() for _ in range(2)]
    e.generate([prompts[0]], 1)  # warm: kernels, the allocator, the rotary tables
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        seq = e.add_request(prompts[1], 1)
        e.run_until_done()
        torch.cuda.synchronize()
    assert seq.reused_device == 2048
    h2d = [ev for ev in prof.events() if "HtoD" in ev.name]
    assert len(h2d) < cfg.n_layers, [ev.name for ev in h2d]


@pytest.mark.parametrize("q_start", [0, 1024])
def test_sdpa_reads_kv_heads_in_place_where_flash_takes_grouped_query_attention(q_start, monkeypatch):
    """Llama-3-8B heads (32 query, 8 KV, 128 dims) in bf16 on the GPU: the flash kernel takes
    grouped-query attention itself, so ``sdpa_attention`` repeats no KV head (the repeats were
    8.9 ms of a 16k device-hit step's 23 ms of device work, H200 run 75), and its output
    matches attention over repeated heads, for a whole prefill and one after a prefix."""
    import torch.nn.functional as F

    from kvtier.engine import attention
    n, ctx = 128, q_start + 128
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(t, h, 128, device="cuda", generator=g, dtype=torch.bfloat16)
               for t, h in ((n, 32), (ctx, 8), (ctx, 8)))
    assert attention._flash_takes_gqa("cuda", torch.bfloat16, 32, 8, 128, 128, q_start == 0)
    repeats = []
    real = attention._expand_heads
    monkeypatch.setattr(attention, "_expand_heads", lambda x, h: repeats.append(h) or real(x, h))
    got = attention.sdpa_attention()(q, k, v, q_start, 128 ** -0.5)
    assert repeats == []
    kt, vt = (x.repeat_interleave(4, dim=1).transpose(0, 1)[None] for x in (k, v))
    mask = None if q_start == 0 else attention._lower_right(n, ctx)
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kt, vt, attn_mask=mask, is_causal=q_start == 0,
                                          scale=128 ** -0.5)[0].transpose(0, 1)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("io_backend", [None, "dma", "kernel"])
def test_a_long_run_on_the_gpu_holds_device_memory_and_objects_flat(io_backend):
    """The engine on CUDA with the tiers, over a workload that fills both pools and loads host
    hits back: once the host pool is full, 90 more requests leave the device memory torch holds,
    the Python objects and the threads where they were, and every slot released. (Bounded
    caches emptied before each count: DMA planning keeps up to 1,024 transfers' run lengths.)
    Written after run 155; not yet run on a GPU."""
    import gc
    import threading

    from kvtier.engine.workload import Workload, run_workload
    from kvtier_testlib import clear_bounded_caches

    def state():
        clear_bounded_caches()
        torch.cuda.synchronize()
        gc.collect()
        return torch.cuda.memory_allocated(), len(gc.get_objects()), threading.active_count()

    cfg = tiny("llama", hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=64, intermediate_size=512,
               vocab_size=1000, dtype=torch.bfloat16)
    # 384 device slots for three conversations of up to ~250 tokens: prefixes go to the host and
    # come back (on the CPU, this workload's second ten runs loaded 2,400 host-hit tokens).
    ecfg = EngineConfig(prefix_cache="tiers", device_tokens=384, host_tokens=4096, page_size=16, device="cuda",
                        io_backend=io_backend)
    e = Engine(make_model(cfg, ecfg, seed=1), ecfg)

    def wl(seed):
        return Workload(clients=3, rounds=3, system_tokens=96, user_tokens=48, output_tokens=4, vocab_size=1000,
                        seed=seed)
    for s in range(10):
        run_workload(e, wl(s))
    before = state()
    hits = e.kv.metrics()["hit_tokens_total.host"]
    for s in range(10, 20):
        run_workload(e, wl(s))
    after = state()
    assert e.kv.metrics()["hit_tokens_total.host"] > hits  # host hits were loaded back on the way
    assert after[0] == before[0], f"device memory grew by {after[0] - before[0]} bytes"
    assert after[1] - before[1] < 40, f"{after[1] - before[1]} more Python objects"
    assert after[2] == before[2]
    snap = e.kv.metrics()
    assert snap["tokens.device.locked"] == 0 and snap["tokens.device.request"] == 0
