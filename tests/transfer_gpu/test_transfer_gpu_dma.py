"""The DMA (copy engine) backend on CUDA (needs a GPU): parts in host order, layer chunks, copies
straight from the pool, grouped and draining loads, short parts through the kernel, and
chunks past 2 GiB; every byte checked against the direct backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_testlib import GPU_ONLY, SPECS, _b, _copy_engines_for_every_part, _pages, _pools, _round_trip_matches_direct  # noqa: F401
from kvtier.device_pool import pool_from_spec
from kvtier.host_pool import host_pool_for
from kvtier.spec import KVSpec
from kvtier.transfer import TransferEngine

pytestmark = GPU_ONLY


@pytest.mark.parametrize("sort_slots", [True, False])
@pytest.mark.parametrize("mode", ["every part by dma", "parts split", "every part by kernel"])
@pytest.mark.parametrize("name,layout,ps", [("mha_odd", "page_first", 1), ("mha_fp8", "page_head", 16),
                                            ("dsa", "layer_first", 1), ("dsa", "layer_first", 16),
                                            ("mla_fp8_656", "page_first", 16)])
@pytest.mark.parametrize("idx_device", ["cpu", "cuda"])
def test_dma_parts_in_host_order_and_kernel_parts_in_the_callers_match_direct(sort_slots, mode, name, layout, ps,
                                                                              idx_device):
    """The DMA backend moves its parts' slot pairs in host-slot order and sends parts with
    short copies through the kernel in the caller's order: with scattered host pages, in
    either order, every byte is where the direct backend puts it."""
    from kvtier.transfer.dma import DMABackend, DMAConfig
    from kvtier.transfer.dma.plan import mean_copy_bound
    spec = SPECS[name]
    rng = np.random.default_rng(hash((sort_slots, mode, name, layout, ps, idx_device)) % 2**32)
    dev, host = _pools(spec, ps, layout)
    parts = host.transfer_parts()
    scattered = np.sort(_pages(rng, host.page_num, 96 // ps if ps > 1 else 77, ps).numpy())
    bounds = sorted({mean_copy_bound(p.host, scattered, p.layer_num, DMAConfig().staging_bytes) for p in parts})
    if mode == "parts split" and len(bounds) < 2:
        pytest.skip("every part copies alike: nothing to split")
    kernel_below = {"every part by dma": 0, "every part by kernel": 1 << 40,
                    "parts split": int((bounds[0] + bounds[-1]) / 2)}[mode]
    eng = TransferEngine(host, "dma")
    eng.backend = DMABackend(DMAConfig(kernel_below=kernel_below, sort_slots=sort_slots, sort_below=1 << 62))
    _round_trip_matches_direct(eng, dev, host, layout, ps, idx_device, rng, contiguous=False)


@pytest.mark.parametrize("name", ["mha_odd", "mla_fp8_656", "dsa"])
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("drain", [0, 1, 2])
def test_layer_chunked_backups_match_direct(name, ps, contiguous, drain):
    """layer_first backups go in chunks of whole layers (every slot in each); staging for one
    layer's worth makes a chunk per layer, the first in the caller's thread and the rest in
    the engine's; with drains every ``drain`` chunks (``DMAConfig.backup_drain``) too."""
    from kvtier.transfer.dma import DMABackend, DMAConfig
    from kvtier.transfer.dma.chunked import LayerChunkedPlan
    spec = SPECS[name]
    rng = np.random.default_rng(hash((name, ps, contiguous, drain)) % 2**32)
    dev, host = _pools(spec, ps, "layer_first")
    n_slots = 96 if ps > 1 else 77
    widest = max(p.item_bytes for p in host.transfer_parts())
    eng = TransferEngine(host, "dma")
    eng.backend = DMABackend(DMAConfig(staging_bytes=n_slots * widest, kernel_below=0, backup_drain=drain))
    plans = [eng.backend.plan_part(p, np.arange(n_slots), True) for p in host.transfer_parts()]
    assert all(isinstance(p, LayerChunkedPlan) for p in plans) and max(p.n_chunks for p in plans) > 1
    _round_trip_matches_direct(eng, dev, host, "layer_first", ps, "cpu", rng, contiguous=contiguous)


@pytest.mark.parametrize("name", ["mha_odd", "mla_fp8_656", "dsa"])
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("drain", [0, 1])
@pytest.mark.parametrize("idx_device", ["cpu", "cuda"])
def test_backups_straight_from_the_pool_match_direct(name, ps, contiguous, drain, idx_device):
    """layer_first backups copied straight from the device pool (``DMAConfig.pool_rows``: no
    staging, no gather), in several chunks, the first in the caller's thread and the rest in
    the engine's, with drains every chunk or none: every byte where the direct backend puts it,
    and the load back (through staging) too."""
    from kvtier.transfer.dma import DMABackend, DMAConfig
    from kvtier.transfer.dma.chunked import PoolPlan
    spec = SPECS[name]
    rng = np.random.default_rng(hash((name, ps, contiguous, drain, idx_device)) % 2**32)
    dev, host = _pools(spec, ps, "layer_first")
    n_slots = 96 if ps > 1 else 77
    widest = max(p.item_bytes for p in host.transfer_parts())
    eng = TransferEngine(host, "dma")
    eng.backend = DMABackend(DMAConfig(staging_bytes=16 * spec.layer_num * widest, kernel_below=0, backup_drain=drain,
                                       pool_rows=1, head_bytes=1))
    d = _pages(np.random.default_rng(1), dev.size // ps, n_slots // ps, ps).numpy()  # DSA moves whole pages
    plans = [eng.backend.plan_part(p, np.arange(n_slots), True, dev_np=d) for p in host.transfer_parts()]
    assert all(isinstance(p, PoolPlan) for p in plans) and min(p.n_chunks for p in plans) > 2
    eng.backup(torch.arange(n_slots), torch.from_numpy(d)).synchronize()
    assert eng.backend.last_blocks == 0  # no gathers: no SMs
    _round_trip_matches_direct(eng, dev, host, "layer_first", ps, idx_device, rng, contiguous=contiguous)


@pytest.mark.parametrize("drain,group", [(1, 1), (2, 1), (3, 2), (1, 0)])
@pytest.mark.parametrize("name,layout,ps", [("mha_odd", "layer_first", 16), ("mla_fp8_656", "page_first", 1),
                                            ("dsa", "layer_first", 16)])
def test_dma_loads_that_drain_every_few_layers_match_direct(drain, group, name, layout, ps):
    """``DMAConfig.load_drain``: the side stream waits (through a kernel on a third stream)
    every ``drain`` layers, grouped loads included; every byte still lands where it should."""
    from kvtier.transfer.dma import DMABackend, DMAConfig
    rng = np.random.default_rng(hash((drain, group, name, layout, ps)) % 2**32)
    dev, host = _pools(SPECS[name], ps, layout)
    eng = TransferEngine(host, "dma")
    eng.backend = DMABackend(DMAConfig(kernel_below=0, load_drain=drain, load_drain_bytes=0, load_group=group))
    _round_trip_matches_direct(eng, dev, host, layout, ps, "cpu", rng, contiguous=False)


@pytest.mark.parametrize("drain_bytes,every", [(0, 1), ("3 layers", 3), ("2.5 layers", 3)])
def test_a_dma_load_drains_no_sooner_than_load_drain_bytes(drain_bytes, every):
    """``DMAConfig.load_drain_bytes``: with ``load_drain=1``, a load of 10 layers drains before
    every layer that follows ``load_drain_bytes`` of the load (counted in whole layers, at its
    bytes a layer), so small layers drain less often; the real drains, counted, and every byte
    still where it should be."""
    from kvtier.transfer.dma import DMABackend, DMAConfig, StagingRing
    spec = KVSpec("mla", 10, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64)
    dev, host = _pools(spec, 1, "layer_first", tokens=4096)
    layer_bytes = 4096 * spec.bytes_per_token // spec.layer_num
    nbytes = {0: 0, "3 layers": 3 * layer_bytes, "2.5 layers": 5 * layer_bytes // 2}[drain_bytes]
    eng = TransferEngine(host, DMABackend(DMAConfig(kernel_below=0, load_drain=1, load_drain_bytes=nbytes,
                                                    load_group=1)))
    h, d = torch.arange(4096), torch.randperm(4096)
    want = [_b(b[d.cuda()]).clone() for b in dev.kv_buffer]
    eng.backup(h, d).synchronize()
    for b in dev.kv_buffer:
        b.view(torch.uint8).zero_()
    drains = []
    real = StagingRing.drain

    def counted(ring, *a, **k):
        drains.append(1)
        return real(ring, *a, **k)
    StagingRing.drain = counted
    try:
        eng.load(h, d).synchronize()
    finally:
        StagingRing.drain = real
    assert len(drains) == len(range(every, spec.layer_num, every))
    assert all(torch.equal(_b(b[d.cuda()]), w) for b, w in zip(dev.kv_buffer, want))
    host.close()


def test_a_dma_load_that_drains_lets_a_pinned_input_copy_through():
    """Why loads drain (runs 36-40): a pinned host -> device copy queued on another stream
    during a DMA load landed only with the whole load; with a drain every layer it lands
    while the load's later layers are still to come."""
    from kvtier.transfer.dma import DMABackend, DMAConfig
    spec = KVSpec("mha", 16, torch.bfloat16, head_num=8, head_dim=128)  # 4 KiB per token and layer
    ps, tokens = 64, 32768  # 2 GiB per load: tens of ms on any PCIe link
    dev, host = _pools(spec, ps, "layer_first", tokens=tokens)
    eng = TransferEngine(host, "dma")
    eng.backend = DMABackend(DMAConfig(load_drain=1, load_drain_bytes=0, load_group=1))
    h = torch.arange(tokens)
    d = torch.arange(tokens)
    eng.backup(h, d).synchronize()
    src = torch.arange(32768, dtype=torch.int64).pin_memory()
    for _ in range(2):  # the second after plans and staging exist
        torch.cuda.synchronize()
        ld = eng.load(h, d)
        got = src.to("cuda", non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        arrived.synchronize()
        early = not ld.layer_done(spec.layer_num - 1)
        ld.synchronize()
    assert torch.equal(got.cpu(), src)
    assert early, "the input copy landed only after the whole load"
    host.close()


def test_a_dma_backup_that_drains_lets_a_small_read_through():
    """The backup side of drains: a small device -> host read (an engine's sampled tokens,
    ``.tolist()``) issued while a DMA backup's copies are queued returns before the backup
    is done when the backup drains after every chunk."""
    from kvtier.transfer.dma import DMABackend, DMAConfig
    spec = KVSpec("mha", 16, torch.bfloat16, head_num=8, head_dim=128)  # 4 KiB per token and layer
    ps, tokens = 64, 32768  # 2 GiB per backup: tens of ms on any PCIe link
    dev, host = _pools(spec, ps, "layer_first", tokens=tokens)
    eng = TransferEngine(host, "dma", background_backups=False)  # every copy queued before it returns
    eng.backend = DMABackend(DMAConfig(backup_drain=1))
    h = torch.arange(tokens)
    d = torch.arange(tokens)
    sampled = torch.arange(8, device="cuda")
    for _ in range(2):  # the second after plans and staging exist
        torch.cuda.synchronize()
        hd = eng.backup(h, d)
        got = (sampled + 1).tolist()
        early = not hd.done()
        hd.synchronize()
    assert got == list(range(1, 9))
    assert early, "the read returned only after the whole backup"
    host.close()  # the bytes of backups that drain: test_layer_chunked_backups_match_direct


@pytest.mark.parametrize("layout", ["page_first", "page_head"])
@pytest.mark.parametrize("group", [0, 1, 3])
def test_grouped_dma_loads_signal_each_layer_after_its_bytes(layout, group):
    """Loads that copy adjacent layers together: every layer's event still covers that layer's bytes."""
    from kvtier.transfer.dma import DMABackend, DMAConfig
    spec = KVSpec("mha", 8, torch.bfloat16, head_num=4, head_dim=64)
    ps = 16
    dev, host = _pools(spec, ps, layout, tokens=1024)
    eng = TransferEngine(host, "dma")
    eng.backend = DMABackend(DMAConfig(load_group=group, batch_min=1, kernel_below=0))
    rng = np.random.default_rng(group)
    h = _pages(rng, host.page_num, 40, ps, contiguous=group == 1)
    d = _pages(rng, dev.size // ps // 2, 40, ps)
    eng.backup(h, d).synchronize()
    before = {k: v.clone() for k, v in dev.stacks.items()}
    d2 = d + dev.size // 2
    compute = torch.cuda.Stream()
    ok = {}
    with torch.cuda.stream(compute):
        ld = eng.load(h, d2)
        for layer in range(spec.layer_num):
            ld.wait_layer(layer, compute)
            for k, st in dev.stacks.items():
                ok[(k, layer)] = torch.equal(_b(st[layer, d2.cuda()]), _b(before[k][layer, d.cuda()]))
    torch.cuda.synchronize()
    assert all(ok.values()), [k for k, v in ok.items() if not v]
    chosen = eng.backend.last_groups[0]
    assert chosen == (group or chosen) and 1 <= chosen <= spec.layer_num
    host.close()


def test_dma_through_the_seed_api_on_the_default_stream():
    """Batched copies refuse the legacy default stream: there the DMA path queues them one by one."""
    spec = SPECS["mha_odd"]
    dev, host = _pools(spec, 1, "layer_first")
    rng = np.random.default_rng(5)
    h, d = _pages(rng, host.page_num, 50, 1), _pages(rng, dev.size // 2, 50, 1)
    assert torch.cuda.current_stream().cuda_stream == 0
    host.backup_from_device_all_layer(dev, h, d, "dma")
    d2 = d + dev.size // 2
    for layer in range(spec.layer_num):
        host.load_to_device_per_layer(dev, h, d2, layer, "dma")
    torch.cuda.synchronize()
    for st in dev.stacks.values():
        assert torch.equal(_b(st[:, d2.cuda()]), _b(st[:, d.cuda()]))
    host.close()


def test_dma_load_group_is_chosen_by_timed_trials():
    """With load_group=0 a page-major load times trial loads on scratch memory, once per shape."""
    from kvtier.transfer.dma import DMABackend
    from kvtier.transfer.dma.chunked import group_sizes
    spec = KVSpec("mha", 16, torch.bfloat16, head_num=8, head_dim=128)
    dev, host = _pools(spec, 1, "page_first", tokens=8192)
    eng = TransferEngine(host, "dma")
    eng.backend = DMABackend()
    h = torch.arange(8192)
    eng.backup(h, h).synchronize()
    before = {k: st[:, :8192].clone() for k, st in dev.stacks.items()}
    d2 = h + 8192
    eng.load(h, d2).synchronize()
    rates = eng.backend.group_rates
    assert rates and all(r > 0 for r in rates.values())
    assert {k[-1] for k in rates} <= set(group_sizes(16)) and max(k[-1] for k in rates) == 16
    assert set(eng.backend.last_groups) <= set(group_sizes(16))
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, 8192:]), _b(before[k]))
    n = len(rates)
    eng.load(h, d2).synchronize()
    assert len(eng.backend.group_rates) == n  # decided once
    host.close()


@pytest.mark.parametrize("pool", [False, True])
@pytest.mark.parametrize("kernel_aside", [True, False])
@pytest.mark.parametrize("idx_device", ["cpu", "cuda"])
def test_dma_sends_parts_with_short_copies_through_the_kernel(idx_device, kernel_aside, pool):
    """DSA at page 16, scattered host pages: the K/V part's copies are long enough for the copy
    engine, the index-K part's are not; one transfer mixes both paths and moves every byte.
    The load is queued while the backup may still run: with ``kernel_aside`` the index-K part
    runs on a stream of its own, and the backup's handle (which the load is ordered after)
    must still cover it. With ``pool`` the K/V part copies straight from the device pool."""
    from kvtier.transfer.dma import DMABackend, DMAConfig
    from kvtier.transfer.dma.chunked import PoolPlan, pool_row_bytes
    from kvtier.transfer.slots import Runs
    spec = SPECS["dsa"]
    ps = 16
    dev, host = _pools(spec, ps, "layer_first", tokens=1024)
    ref = host_pool_for(dev, "layer_first", host_size_tokens=host.size)
    rng = np.random.default_rng(7)
    h = _pages(rng, host.page_num, 40, ps)
    d = _pages(rng, dev.size // ps // 2, 40, ps)
    probe = DMABackend(DMAConfig(kernel_below=0))
    parts = host.transfer_parts()
    slots, runs, order = probe.in_host_order(parts, h.numpy(), Runs.of(h.numpy()))  # the slots the engine plans
    sizes = {p.name: probe.plan_part(p, slots, True, runs=runs).mean_copy for p in parts}
    assert len(set(sizes.values())) == 2, sizes
    rows = {p.name: pool_row_bytes(p.host, slots, d.numpy()[order]) for p in parts}
    eng = TransferEngine(host, "dma")
    eng.backend = DMABackend(DMAConfig(kernel_below=int(np.sqrt(np.prod(list(sizes.values())))),
                                       kernel_aside=kernel_aside, pool_rows=int(max(rows.values())) if pool else 0))
    plans = eng.backend.plan_parts(parts, slots, runs, order, True, dev_np=d.numpy())
    assert [type(p).__name__ for p in plans].count("NoneType") == 1
    assert any(isinstance(p, PoolPlan) for p in plans) == pool
    for hp in (host, ref):
        for c in hp.component_tensors:
            hp.raw_bytes(c).fill_(0xA5)
    ref.backup_from_device_all_layer(dev, h, d, "direct")
    backup = eng.backup(h.to(idx_device), d.to(idx_device))
    d2 = d + dev.size // 2
    ld = eng.load(h.to(idx_device), d2.to(idx_device))
    ld.synchronize()
    backup.synchronize()
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c), ref.raw_bytes(c)), c
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, d2.cuda()]), _b(st[:, d.cuda()])), k
    ring = eng.backend.ring(torch.device("cuda", torch.cuda.current_device()), True)
    assert (ring.aside is not None) == kernel_aside
    host.close()
    ref.close()


# -- written in the session of 2026-12-04 with no device: to run on the next one -------------

def test_a_dma_chunk_copy_over_2_gib_goes_as_one_plain_copy():
    """A 1-D copy went as a 2-D one with its width as pitch, which the runtime refuses past
    2^31 - 1 bytes: with staging chunks of 2 GiB or more every such chunk failed (a review,
    from reading). Past that it goes by cudaMemcpyAsync. (~14 GB of device memory, ~9 GB of pinned host memory.)"""
    from kvtier.transfer.dma import DMABackend, DMAConfig
    from kvtier.transfer.dma.plan import MAX_PITCH
    spec = KVSpec("mha", 64, torch.bfloat16, head_num=16, head_dim=128)   # 256 KiB a token for K, as for V
    tokens = 17408
    dev = pool_from_spec(spec, tokens, 16, "cuda")
    for st in dev.stacks.values():
        st.view(torch.uint8).random_(0, 256)
    host = host_pool_for(dev, "page_first", host_size_tokens=tokens)
    dma = DMABackend(DMAConfig(staging_bytes=2300 << 20, buffers=2, kernel_below=0))
    p = dma.plan_part(host.transfer_parts()[0], np.arange(tokens), True)
    assert max(int(p.calls(i)[1][:, 2].max()) for i in range(p.n_chunks)) > MAX_PITCH
    h = torch.arange(tokens)
    TransferEngine(host, dma).backup(h, h).synchronize()
    for name, on_host in (("k", host.k_buffer), ("v", host.v_buffer)):
        for s in (torch.arange(64), torch.arange(tokens - 64, tokens)):       # in the first and the last chunk
            want = dev.stacks[name][:, s.cuda()].transpose(0, 1).contiguous().view(torch.uint8).cpu()
            assert torch.equal(on_host[s].contiguous().view(torch.uint8), want), name
    host.close()
