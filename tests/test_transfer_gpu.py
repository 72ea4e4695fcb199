"""Every CUDA backend x kind x layout moves exactly the right bytes (needs a GPU)."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch

from kvtier.device_pool import pool_from_spec
from kvtier.host_pool import host_pool_for
from kvtier.layouts import SUPPORTED
from kvtier.spec import KVSpec
from kvtier.transfer import TransferEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPECS = {
    "mha_odd": KVSpec("mha", 3, torch.bfloat16, head_num=3, head_dim=40),
    "mha_fp8": KVSpec("mha", 2, torch.float8_e4m3fn, head_num=5, head_dim=24),
    "mla_fp8_656": KVSpec("mla", 3, torch.float8_e4m3fn, kv_lora_rank=512, qk_rope_head_dim=144),
    "mla": KVSpec("mla", 2, torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16),
    "dsa": KVSpec("dsa", 2, torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16, index_head_dim=128),
}
CASES = [(s, lay, ps) for s, spec in SPECS.items() for lay in SUPPORTED[spec.kind] for ps in (1, 16)]


@pytest.fixture(autouse=True)
def _copy_engines_for_every_part():
    """These shapes are tiny: with its default ``kernel_below`` the DMA backend would send
    every part through the kernel, and the copy paths would go untested."""
    from dataclasses import replace

    from kvtier.transfer.base import get_backend
    dma = get_backend("dma", torch.device("cuda"))
    old = dma.config
    dma.config = replace(old, kernel_below=0)
    yield
    dma.config = old


def _pools(spec, ps, layout, tokens=256):
    dev = pool_from_spec(spec, 2 * tokens, ps, "cuda")
    for st in dev.stacks.values():
        st.view(torch.uint8).random_(0, 256)
    host = host_pool_for(dev, layout, host_size_tokens=2 * tokens)
    return dev, host


def _pages(rng, n_pages_total, n_pages, ps, contiguous=False):
    start = rng.integers(0, n_pages_total - n_pages + 1)
    pages = np.arange(start, start + n_pages) if contiguous else rng.permutation(n_pages_total)[:n_pages]
    return torch.from_numpy((pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int64))


def _b(t: torch.Tensor) -> torch.Tensor:
    """Bytes of ``t``: random bit patterns hold NaNs, which never compare equal as floats."""
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("backend", ["kernel", "dma", "auto"])
@pytest.mark.parametrize("name,layout,ps", CASES)
@pytest.mark.parametrize("idx_device", ["cpu", "cuda"])
def test_round_trip_matches_direct(backend, name, layout, ps, idx_device):
    spec = SPECS[name]
    rng = np.random.default_rng(hash((backend, name, layout, ps, idx_device)) % 2**32)
    dev, host = _pools(spec, ps, layout)
    _round_trip_matches_direct(TransferEngine(host, backend), dev, host, layout, ps, idx_device, rng)


def _round_trip_matches_direct(eng, dev, host, layout, ps, idx_device, rng, contiguous=None):
    """Back scattered (or, at random, consecutive) device pages up to host pages with ``eng``,
    compare the host bytes with the direct backend's, load them into other device pages and
    compare those with the source: every byte, and nothing else written."""
    ref_host = host_pool_for(dev, layout, host_size_tokens=host.size)
    n_pages = 96 // ps if ps > 1 else 77
    contiguous = rng.random() < 0.5 if contiguous is None else contiguous
    h = _pages(rng, host.page_num, n_pages, ps, contiguous=contiguous)
    d = _pages(rng, dev.size // ps, n_pages, ps)
    for hp in (host, ref_host):
        for c in hp.component_tensors:
            hp.raw_bytes(c).fill_(0xA5)
    ref_host.backup_from_device_all_layer(dev, h, d, "direct")
    before = {k: v.clone() for k, v in dev.stacks.items()}
    eng.backup(h.to(idx_device), d.to(idx_device)).synchronize()
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c), ref_host.raw_bytes(c)), c  # written exactly, nothing else
    for k in dev.stacks:
        assert torch.equal(_b(dev.stacks[k]), _b(before[k]))  # source unchanged
    # Load into other device slots and compare with the source rows.
    free = np.setdiff1d(np.arange(dev.size // ps), (d[::ps] // ps).numpy())
    d2 = torch.from_numpy((rng.permutation(free)[:n_pages, None] * ps + np.arange(ps)).reshape(-1))
    ld = eng.load(h.to(idx_device), d2.to(idx_device))
    ld.synchronize()
    assert ld.done() and all(ld.layer_done(i) for i in range(host.layer_num))
    untouched = np.setdiff1d(np.arange(dev.size), d2.numpy())
    for k, st in dev.stacks.items():
        keep = torch.from_numpy(untouched).cuda()
        assert torch.equal(_b(st[:, d2.cuda()]), _b(before[k][:, d.cuda()]))
        assert torch.equal(_b(st[:, keep]), _b(before[k][:, keep]))
    host.close()
    ref_host.close()


@pytest.mark.parametrize("backend", ["kernel", "dma", "auto"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_pool_on_huge_pages_is_pinned_and_round_trips(backend, layout):
    """A host pool made with ``huge_pages=True`` (its own mapping, advised for 2 MiB pages)
    is registered with CUDA and moves every byte as any other."""
    spec = SPECS["mla_fp8_656"]
    dev = pool_from_spec(spec, 512, 16, "cuda")
    for st in dev.stacks.values():
        st.view(torch.uint8).random_(0, 256)
    host = host_pool_for(dev, layout, host_size_tokens=512, huge_pages=True)
    assert host.pinned and host.huge_pages
    rng = np.random.default_rng(hash((backend, layout)) % 2**32)
    _round_trip_matches_direct(TransferEngine(host, backend), dev, host, layout, 16, "cpu", rng)


def _kernel_engine(host, backend: str, config, monkeypatch):
    """An engine whose kernel parts all go through one ``KernelBackend(config)``: that backend
    (``kernel``), the DMA backend sending every part through it (its runner's kernel moves, as
    ``auto``'s kernel picks go: ``dma``), or ``auto`` over both; and the list each of the
    kernel's ``copy_part`` calls appends ``(part, host slots, layer)`` to."""
    from kvtier.transfer.auto import AutoBackend
    from kvtier.transfer.dma import DMABackend, DMAConfig
    from kvtier.transfer.kernel import KernelBackend
    kb = KernelBackend(config)
    dma = DMABackend(DMAConfig(kernel_below=1 << 40 if backend == "dma" else 0), fallback=kb)
    seen = []
    real = KernelBackend.copy_part

    def spy(self, part, h, d, layer, blocks):
        seen.append((part, h, layer))
        return real(self, part, h, d, layer, blocks)
    monkeypatch.setattr(KernelBackend, "copy_part", spy)
    return TransferEngine(host, {"kernel": kb, "dma": dma, "auto": AutoBackend(kb, dma)}[backend]), seen


@pytest.mark.parametrize("backend", ["kernel", "dma", "auto"])
@pytest.mark.parametrize("name", ["mha_odd", "mla_fp8_656", "dsa"])
@pytest.mark.parametrize("chunk", [0, 256, 8192])
@pytest.mark.parametrize("broken", [False, True])
def test_whole_pages_move_a_page_per_row_and_match_direct(backend, name, chunk, broken, monkeypatch):
    """KernelConfig.page_rows: where a layer_first transfer moves whole pages, the kernel's
    parts (every part with ``kernel``, DSA's index-K with ``dma``) copy a page's run per row, cut
    into ``chunk`` bytes; with one pair out of its page's order, a row per token. Every byte
    either way, backup and load."""
    from kvtier.transfer.kernel import KernelConfig
    spec, ps = SPECS[name], 16
    dev, host = _pools(spec, ps, "layer_first")
    host.validate_indices = not broken  # DSA refuses a broken page, which the check is about here
    eng, seen = _kernel_engine(host, backend, KernelConfig(page_chunk_bytes=chunk), monkeypatch)
    rng = np.random.default_rng(hash((backend, name, chunk, broken)) % 2**32)
    if broken:
        h = _pages(rng, host.page_num, 96 // ps, ps)
        h[[3, 4]] = h[[4, 3]]
        d = _pages(rng, dev.size // ps, 96 // ps, ps)
        ref = host_pool_for(dev, "layer_first", host_size_tokens=host.size, validate_indices=False)
        ref.backup_from_device_all_layer(dev, h, d, "direct")
        eng.backup(h, d).synchronize()
        for c in host.component_tensors:
            assert torch.equal(host.raw_bytes(c), ref.raw_bytes(c)), c
        ref.close()
    else:
        _round_trip_matches_direct(eng, dev, host, "layer_first", ps, "cpu", rng)
    sizes = [part.host.page_size for part, _, _ in seen]
    if backend != "auto":  # auto's choice is its own; its bytes are checked all the same
        assert sizes and set(sizes) == ({ps} if broken else {1}), sizes
    host.close()


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
    from kvtier.transfer.dma_plan import mean_copy_bound
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
    from kvtier.transfer.dma_plan import LayerChunkedPlan
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
    from kvtier.transfer.dma_plan import PoolPlan
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


def _alias_of(stream: torch.cuda.Stream) -> torch.cuda.Stream:
    """Another stream object that PyTorch backs with ``stream``'s CUDA stream: it hands out
    32 pooled streams per priority in turn, so one comes round within 32 draws."""
    for _ in range(2 * 32):
        s = torch.cuda.Stream(priority=stream.priority)
        if s.cuda_stream == stream.cuda_stream:
            return s
    pytest.fail(f"no pooled stream at priority {stream.priority} came round to {stream.cuda_stream:#x}")


def test_pytorch_pools_streams_and_kvtier_draws_the_one_left_free():
    """PyTorch's pool comes round; with every pooled stream but one held by kvtier owners,
    :func:`streams.fresh` returns that one; with none left it warns and returns one anyway."""
    from kvtier.transfer import streams

    class Owner:
        def __init__(self, held):
            self.held = held

        def kvtier_streams(self):
            return self.held
    pool = {}
    for _ in range(2 * streams.POOL):
        s = torch.cuda.Stream()
        pool.setdefault(s.cuda_stream, s)
    assert len(pool) == streams.POOL, "PyTorch no longer pools its streams: kvtier.transfer.streams can go"
    gc.collect()  # engines of earlier tests give their streams back
    callers, streams._callers = streams._callers, set()
    try:
        free = next((h for h in pool if h not in streams._taken()), None)
        assert free is not None, "live kvtier owners hold every pooled stream"
        owner = Owner([s for h, s in pool.items() if h != free])
        streams.register(owner)
        assert streams.fresh(torch.device("cuda")).cuda_stream == free
        owner.held = list(pool.values())
        streams._warned = False
        with pytest.warns(RuntimeWarning, match="every CUDA stream PyTorch pools"):
            assert streams.fresh(torch.device("cuda")).cuda_stream in pool
    finally:
        streams._callers = callers | streams._callers


@pytest.mark.parametrize("who", ["ring", "caller"])
def test_aliased_streams_are_drawn_again_and_the_bytes_still_match_direct(who):
    """``ring``: the engine's backup and load streams share CUDA streams with the DMA
    staging rings' side streams (gathers and copies would take turns). ``caller``: the
    caller's current stream is the engine's load stream (the load would hold its compute).
    Either way the transfer moves every byte right and the streams are apart after it."""
    spec = SPECS["mha_odd"]
    rng = np.random.default_rng(7 if who == "ring" else 8)
    dev, host = _pools(spec, 16, "layer_first")
    eng = TransferEngine(host, "dma")
    h = torch.arange(64)
    eng.backup(h, h).synchronize()
    eng.load(h, h + 64).synchronize()  # both staging rings exist now
    rings = {to_host: eng.backend.ring(torch.device("cuda", torch.cuda.current_device()), to_host)
             for to_host in (True, False)}
    if who == "ring":
        eng.backup_stream = _alias_of(rings[True].side)
        eng.load_stream = _alias_of(rings[False].side)
        _round_trip_matches_direct(eng, dev, host, "layer_first", 16, "cpu", rng)
        assert eng.backup_stream.cuda_stream != rings[True].side.cuda_stream
        assert eng.load_stream.cuda_stream != rings[False].side.cuda_stream
    else:
        caller = _alias_of(eng.load_stream)
        with torch.cuda.stream(caller):
            _round_trip_matches_direct(eng, dev, host, "layer_first", 16, "cpu", rng)
        assert eng.load_stream.cuda_stream != caller.cuda_stream
        assert all(r.side.cuda_stream != caller.cuda_stream for r in rings.values())


def test_three_streams_stress():
    """Loads, backups and a forward-like kernel on three streams; every byte checked."""
    spec = SPECS["mha_odd"]
    ps, tokens = 16, 2048
    dev, host = _pools(spec, ps, "page_first", tokens)
    eng = TransferEngine(host, "auto")
    rng = np.random.default_rng(1)
    compute = torch.cuda.Stream()
    n_pages = 32
    expected = {}
    for step in range(20):
        hb = _pages(rng, host.page_num // 2, n_pages, ps)        # backups: first half of host
        hl_pages = rng.permutation(host.page_num // 2)[:n_pages] + host.page_num // 2
        d_src = _pages(rng, dev.size // ps // 2, n_pages, ps)    # read by backups
        d_dst = torch.from_numpy((rng.permutation(dev.size // ps // 2)[:n_pages] + dev.size // ps // 2)[:, None] * ps
                                 + np.arange(ps)).reshape(-1)
        with torch.cuda.stream(compute):
            for st in dev.stacks.values():  # forward-like work writes the source slots, then backup reads them
                st[:, d_src.cuda()] = st[:, d_src.cuda()].view(torch.uint8).add_(1).view(st.dtype)
        with torch.cuda.stream(compute):
            hd = eng.backup(hb, d_src)
        hl = torch.from_numpy((hl_pages[:, None] * ps + np.arange(ps)).reshape(-1))
        eng.backup(hl, d_src).synchronize()
        expected_rows = {k: st[:, d_src.cuda()].clone() for k, st in dev.stacks.items()}
        with torch.cuda.stream(compute):
            ld = eng.load(hl, d_dst)
            for layer in range(spec.layer_num):
                ld.wait_layer(layer, compute)
                for k, st in dev.stacks.items():
                    got = st[layer, d_dst.cuda()]
                    expected[(step, k, layer)] = torch.equal(_b(got), _b(expected_rows[k][layer]))
        hd.synchronize()
    torch.cuda.synchronize()
    assert all(expected.values()), [k for k, v in expected.items() if not v][:5]
    host.close()


def test_kernel_block_quota_bounds_grid():
    spec = SPECS["mla"]
    dev, host = _pools(spec, 1, "layer_first")
    eng = TransferEngine(host, "kernel", block_quota=2)
    h = torch.arange(200)
    eng.backup(h, h).synchronize()
    assert eng.backend.last_blocks <= 2
    with pytest.raises(ValueError, match="block_quota"):
        TransferEngine(host, "kernel", block_quota=0)
    host.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_head"])
def test_the_launcher_path_moves_the_bytes_of_tritons_own_launch(layout, monkeypatch):
    """Chunks of 1, 2, 16 and 17 items from item 0, 1 and 16 (ints Triton specializes on):
    each call through the compiled kernel's launcher lands the bytes Triton's full launch
    does, and the launcher is kept once per specialization."""
    import kvtier.transfer.triton_kernels as tk
    from kvtier.layouts import LAYOUTS
    spec = SPECS["mha_odd"]
    comp = spec.components[0]
    pl = LAYOUTS[layout].placement(comp, spec.layer_num, 64, 1)
    dev = torch.randint(0, 256, (spec.layer_num, 64, comp.item_bytes), dtype=torch.uint8, device="cuda")
    layers = tuple(dev.unbind(0))
    ptrs = tk.layer_ptr_table(layers, "cuda")
    rng = np.random.default_rng(3)
    h = torch.from_numpy(rng.permutation(64)).cuda()
    d = torch.from_numpy(rng.permutation(64)).cuda()
    monkeypatch.setattr(tk, "_launchers", {})
    for item0 in (0, 1, 16):
        for m in (1, 2, 16, 17):
            out = {}
            for fast in (False, True, True):  # the second fast call goes by the kept launcher
                monkeypatch.setattr(tk, "FAST_LAUNCH", fast)
                buf = torch.zeros(pl.total_bytes, dtype=torch.uint8, device="cuda")
                tk.copy_items(pl, buf, layers, ptrs, h, d, item0, m, 0, spec.layer_num, True, 4)
                back = torch.zeros_like(dev)
                tk.copy_items(pl, buf, tuple(back.unbind(0)), tk.layer_ptr_table(back.unbind(0), "cuda"), h, d,
                              item0, m, 0, spec.layer_num, False, 4)
                out.setdefault(fast, []).append((buf, back))
            ref_buf, ref_back = out[False][0]
            rows = d[item0:item0 + m]
            assert torch.equal(ref_back[:, rows], dev[:, rows])
            for buf, back in out[True]:
                assert torch.equal(buf, ref_buf) and torch.equal(back, ref_back)
    assert 0 < len(tk._launchers) <= 2 * 3 * 4


def test_a_launcher_that_refuses_the_arguments_falls_back_to_tritons_launch(monkeypatch):
    """An older Triton's compiled-kernel launcher takes only the runtime arguments: it refuses
    ours before launching (TypeError), and the copy goes by Triton's own path from then on."""
    import kvtier.transfer.triton_kernels as tk
    from kvtier.layouts import LAYOUTS
    spec = SPECS["mha_odd"]
    comp = spec.components[0]
    pl = LAYOUTS["page_first"].placement(comp, spec.layer_num, 64, 1)
    dev = torch.randint(0, 256, (spec.layer_num, 64, comp.item_bytes), dtype=torch.uint8, device="cuda")
    layers = tuple(dev.unbind(0))
    ptrs = tk.layer_ptr_table(layers, "cuda")
    h = torch.arange(64, device="cuda")
    monkeypatch.setattr(tk, "FAST_LAUNCH", True)
    monkeypatch.setattr(tk, "_launchers", {})
    want = torch.zeros(pl.total_bytes, dtype=torch.uint8, device="cuda")
    tk.copy_items(pl, want, layers, ptrs, h, h, 0, 64, 0, spec.layer_num, True, 4)  # keeps the launcher

    class Old:  # a launcher that counts its arguments as those of Triton before 3.3 do
        def __getitem__(self, grid):
            def run(*args):
                raise TypeError(f"function takes exactly 18 arguments ({len(args)} given)")
            return run
    (key,) = tk._launchers
    tk._launchers[key] = Old()
    got = torch.zeros_like(want)
    with pytest.warns(RuntimeWarning, match="launching through Triton's own path"):
        tk.copy_items(pl, got, layers, ptrs, h, h, 0, 64, 0, spec.layer_num, True, 4)
    assert torch.equal(got, want) and not tk.FAST_LAUNCH and not tk._launchers


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


@pytest.mark.parametrize("backend", ["kernel", "dma", "auto"])
@pytest.mark.parametrize("name", ["mha_odd", "mla_fp8_656", "dsa"])
@pytest.mark.parametrize("ps", [1, 16])
def test_kernel_backups_go_in_host_slot_order_and_loads_as_given(backend, name, ps, monkeypatch):
    """KernelConfig.host_order (on by default): through the engine, a backup's kernel
    parts get the pairs sorted by host slot, a load's as the caller gave them; every byte lands as the caller's
    pairs say (checked against the direct backend, and back on the device)."""
    from kvtier.transfer.kernel import KernelConfig
    spec = SPECS[name]
    dev, host = _pools(spec, ps, "layer_first")
    eng, seen = _kernel_engine(host, backend, KernelConfig(host_order=True), monkeypatch)
    rng = np.random.default_rng(hash((backend, name, ps)) % 2**32)
    _round_trip_matches_direct(eng, dev, host, "layer_first", ps, "cpu", rng, contiguous=False)
    if backend != "auto":  # auto's choice is its own; its bytes are checked all the same
        backups = [hh.cpu().numpy() for _, hh, layer in seen if layer is None]
        loads = [hh.cpu().numpy() for _, hh, layer in seen if layer is not None]
        assert backups and loads
        assert all((np.diff(hh) > 0).all() for hh in backups)
        assert not all((np.diff(hh) > 0).all() for hh in loads)  # the caller's scattered order


@pytest.mark.parametrize("idx_device", ["cpu", "cuda"])
def test_the_seed_api_moves_whole_pages_a_page_per_row_from_host_indices(idx_device):
    """Through the seed's calls (no engine, so no numpy indices handed on) the kernel reads
    host index tensors itself to find whole pages; device index tensors it does not read
    back (that would wait on the GPU), so those go a row per token. Every byte either way."""
    from kvtier.transfer.kernel import KernelBackend
    spec, ps = SPECS["dsa"], 16
    dev, host = _pools(spec, ps, "layer_first")
    ref = host_pool_for(dev, "layer_first", host_size_tokens=host.size)
    rng = np.random.default_rng(11)
    h, d = _pages(rng, host.page_num, 6, ps), _pages(rng, dev.size // ps // 2, 6, ps)
    seen = []
    real = KernelBackend.copy_part

    def spy(self, part, hh, dd, layer, blocks):
        seen.append(part.host.page_size)
        return real(self, part, hh, dd, layer, blocks)
    KernelBackend.copy_part = spy
    try:
        host.backup_from_device_all_layer(dev, h.to(idx_device), d.to(idx_device), "kernel")
        d2 = d + dev.size // 2
        for layer in range(spec.layer_num):
            host.load_to_device_per_layer(dev, h.to(idx_device), d2.to(idx_device), layer, "kernel")
    finally:
        KernelBackend.copy_part = real
    torch.cuda.synchronize()
    ref.backup_from_device_all_layer(dev, h, d, "direct")
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c), ref.raw_bytes(c)), c
    for st in dev.stacks.values():
        assert torch.equal(_b(st[:, d2.cuda()]), _b(st[:, d.cuda()]))
    assert set(seen) == ({1} if idx_device == "cpu" else {ps}), seen
    host.close()
    ref.close()


def test_auto_files_concurrent_samples_under_duplex_keys():
    """A backup and a load that overlap in time (~256 MiB each) are sampled under duplex keys."""
    from kvtier.transfer.online import DUPLEX
    spec = KVSpec("mha", 8, torch.bfloat16, head_num=8, head_dim=128)  # 32 KiB per token
    tokens = 8192
    dev, host = _pools(spec, 16, "layer_first", tokens=tokens)
    eng = TransferEngine(host, "auto")
    h = torch.arange(tokens)
    for _ in range(3):
        hd = eng.backup(h, h)
        ld = eng.load(h + tokens, h + tokens)
        hd.synchronize()
        ld.synchronize()
    eng.backend.timings.harvest(eng.backend.chooser)
    keys = [k for k, v in eng.backend.chooser.samples.items() if any(v.values())]
    assert any(k[-1] == DUPLEX and k[0] for k in keys) and any(k[-1] == DUPLEX and not k[0] for k in keys), keys
    # And what each pair moved together, filed for the load's choice (OnlineChooser.pair_loads):
    # both transfers' bytes over their joint span, no more than their own rates added.
    pairs = {k: v for k, v in eng.backend.chooser.pairs.items() if k[-1] == DUPLEX and not k[0] and any(v.values())}
    assert pairs, dict(eng.backend.chooser.pairs)
    for key, by in pairs.items():
        own = eng.backend.chooser.samples[key]
        # (A candidate only looked at has an empty list: auto's fewer-block backup, run 123.)
        back = [v for k, c in eng.backend.chooser.samples.items() if k[0] and k[-1] == DUPLEX for v in c.values() if v]
        for cand, rates in by.items():
            assert all(0 < r <= max(own[cand]) + max(max(b) for b in back) for r in rates), (rates, own, back)
    host.close()


def test_auto_tries_a_shared_zero_copy_backup_on_fewer_blocks_and_every_byte_lands():
    """Single scattered tokens, layer_first: only the kernel moves them (DMA's copies would be
    2 KiB). A backup sharing the link with a load is also tried on ``shared_backup_blocks``
    (run 121: such pairs 1.07 -> 1.28x for MHA); the bytes must land all the same."""
    from kvtier.transfer.auto import AutoBackend
    from kvtier.transfer.dma import DMABackend
    from kvtier.transfer.kernel import KernelBackend
    spec = KVSpec("mha", 8, torch.bfloat16, head_num=8, head_dim=128)  # 2 KiB per token, layer and K/V
    tokens = 8192
    dev, host = _pools(spec, 1, "layer_first", tokens=tokens)
    ref = host_pool_for(dev, "layer_first", host_size_tokens=2 * tokens)
    auto = AutoBackend(KernelBackend(), DMABackend())
    eng = TransferEngine(host, auto)
    perm = torch.from_numpy(np.random.default_rng(5).permutation(2 * tokens))
    h_back, h_load = perm[:tokens], perm[tokens:]  # backups to one half, loads from the other
    d_back, d_load = torch.arange(tokens), torch.arange(tokens, 2 * tokens)
    eng.backup(h_load, d_load).synchronize()
    want = {k: _b(st[:, d_load.cuda()]).clone() for k, st in dev.stacks.items()}
    for st in dev.stacks.values():
        st[:, d_load.cuda()] = 0
    # Whether a backup counts as shared depends on whether a load is in flight when it is chosen,
    # or its last one overlapped the load beside it. Issued after the load, it is chosen with the
    # load in flight. (Issued before it, as an engine may, the overlap was a matter of host timing:
    # 12 rounds explored the 8-block backup 3 times in run 124 and twice in run 126; 40 rounds once
    # in run 145, on a host whose backups were through before the load began.)
    for _ in range(40):
        ld = eng.load(h_load, d_load)
        hd = eng.backup(h_back, d_back)
        hd.synchronize()
        ld.synchronize()
        if auto.picks[("backup", "kernel@8")] >= auto.chooser.explore:
            break
    assert auto.picks[("backup", "kernel@8")] >= auto.chooser.explore, auto.picks
    assert auto.picks[("backup", "dma")] == 0 and auto.picks[("load", "dma")] == 0, auto.picks
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, d_load.cuda()]), want[k]), k
    ref.backup_from_device_all_layer(dev, h_load, d_load, "direct")
    ref.backup_from_device_all_layer(dev, h_back, d_back, "direct")
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c), ref.raw_bytes(c)), c
    host.close()
    ref.close()


@pytest.mark.parametrize("idx_device", ["cpu", "cuda"])
def test_a_backup_queued_behind_a_long_load_is_not_held_up_by_it(idx_device):
    """The copy engine runs queued copies in order. A load queues ~2 GiB of host -> device
    copies; a small backup of other slots issued after it must neither block the host nor
    wait on the GPU for the load (its index tensors once went through that same queue)."""
    spec = KVSpec("mha", 16, torch.bfloat16, head_num=8, head_dim=128)  # 64 KiB per token
    tokens = 32768
    dev, host = _pools(spec, 1, "layer_first", tokens=tokens)
    eng = TransferEngine(host, "dma")
    h = torch.arange(tokens)
    eng.backup(h, h).synchronize()  # warm: plans, staging, kernels
    small_h = torch.arange(tokens, tokens + 64, device=idx_device)
    small_d = torch.arange(2 * tokens - 64, 2 * tokens, device=idx_device)
    for _ in range(2):
        torch.cuda.synchronize()
        ld = eng.load(h, h)
        hd = eng.backup(small_h, small_d)
        returned_while_loading = not ld.done()
        hd.synchronize()
        backup_done_first = not ld.done()
        ld.synchronize()
    assert returned_while_loading and backup_done_first
    ref = {k: st[:, small_d.to("cuda")].clone() for k, st in dev.stacks.items()}
    for k, st in dev.stacks.items():
        st[:, small_d.to("cuda")] = 0
    ld = eng.load(small_h, small_d)
    ld.synchronize()
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, small_d.to("cuda")]), _b(ref[k]))
    host.close()


def test_dma_load_group_is_chosen_by_timed_trials():
    """With load_group=0 a page-major load times trial loads on scratch memory, once per shape."""
    from kvtier.transfer.dma import DMABackend
    from kvtier.transfer.dma_plan import group_sizes
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


def _pool_and_reference(spec, layout):
    """A device pool of random bytes, a host pool on it and a second host pool for the
    direct backend's result, both hosts filled with 0xA5 (page size 1)."""
    dev, host = _pools(spec, 1, layout)
    ref = host_pool_for(dev, layout, host_size_tokens=host.size)
    for hp in (host, ref):
        for c in hp.component_tensors:
            hp.raw_bytes(c).fill_(0xA5)
    return dev, host, ref


@pytest.mark.parametrize("backend", ["kernel", "dma"])
def test_index_copies_are_kept_until_read_while_the_stream_is_busy(backend):
    """Host index tensors reach the GPU through pinned copies read by a kernel. Through the
    seed API nothing holds them once the call returns; while the stream is still busy the
    pinned block must not be handed out (and overwritten) by the next call's copy."""
    dev, host, ref = _pool_and_reference(SPECS["mha_odd"], "layer_first")
    torch.cuda._sleep(100_000_000)  # everything queued next waits ~50 ms
    for i in range(8):
        h, d = torch.arange(16 * i, 16 * i + 16), torch.arange(200 - 16 * i, 216 - 16 * i)
        host.backup_from_device_all_layer(dev, h, d, backend)
        ref.backup_from_device_all_layer(dev, h, d, "direct")
    torch.cuda.synchronize()
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c), ref.raw_bytes(c))
    host.close()
    ref.close()


@pytest.mark.parametrize("backend", ["kernel", "dma"])
def test_pinned_index_tensors_may_be_refilled_once_the_call_returns(backend):
    """A caller's index tensors already in pinned memory: the engine's stream is held (~50 ms)
    so the transfers' index reads run long after the calls return, and the caller refills its
    tensors with other slots meanwhile. The bytes land where the calls said."""
    dev, host, ref = _pool_and_reference(SPECS["mha_odd"], "page_first")
    eng = TransferEngine(host, backend)
    rng = np.random.default_rng(13)
    h, d = _pages(rng, host.size, 64, 1), _pages(rng, dev.size, 64, 1)
    eng.backup(h, d).synchronize()  # first use (tables, staging) out of the way
    for c in host.component_tensors:
        host.raw_bytes(c).fill_(0xA5)
    h_pinned, d_pinned = h.pin_memory(), d.pin_memory()
    torch.cuda._sleep(100_000_000)  # what is queued next waits ~50 ms
    handle = eng.backup(h_pinned, d_pinned)
    h_pinned.copy_(_pages(rng, host.size, 64, 1))  # the caller's next slots, before the reads ran
    d_pinned.copy_(_pages(rng, dev.size, 64, 1))
    handle.synchronize()
    ref.backup_from_device_all_layer(dev, h, d, "direct")
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c), ref.raw_bytes(c)), c
    host.close()
    ref.close()


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
    from kvtier.transfer.dma_plan import PoolPlan, Runs, pool_row_bytes
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


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("backend", ["dma", "auto"])
def test_cuda_indices_are_read_back_once_per_transfer(backend, validate, monkeypatch):
    """With index tensors on the GPU the engine reads each back to the host once (the check
    and the planning share that copy), and the bytes still arrive."""
    import kvtier.transfer.triton_kernels as tk
    spec = SPECS["mha_odd"]
    dev, host = _pools(spec, 1, "layer_first")
    host.validate_indices = validate
    eng = TransferEngine(host, backend)
    rng = np.random.default_rng(5)
    h, d = _pages(rng, host.size, 64, 1).cuda(), _pages(rng, dev.size, 64, 1).cuda()
    eng.backup(h, d).synchronize()  # auto: its first transfer of a shape calibrates and ranks
    reads = []
    real = tk.fetch_index_to_host

    def counted(idx):
        reads.append(idx.numel())
        return real(idx)
    monkeypatch.setattr(tk, "fetch_index_to_host", counted)
    eng.backup(h, d).synchronize()
    assert reads == [64, 64]  # host and device slots, once each
    reads.clear()
    back = torch.from_numpy(np.setdiff1d(np.arange(dev.size), d.cpu().numpy())[-64:]).cuda()  # not d's slots
    eng.load(h, back).synchronize()
    assert reads == [64, 64]
    from kvtier.device_pool import layer_attr
    for c in spec.components:
        for buf in getattr(dev, layer_attr(c.name)):
            assert torch.equal(_b(buf[back]), _b(buf[d]))
    host.close()


def test_a_load_queues_its_first_copies_before_its_device_slots_reach_the_device(monkeypatch):
    """A DMA load asks for its device slots on the device only once its first chunk's copies
    are queued (the copy engine need not wait for the index copy); a backup, before its first
    gather. Either way the caller may reuse its index tensors once the call returns."""
    import kvtier.transfer.dma as dma_mod
    spec = SPECS["mla"]
    dev, host = _pools(spec, 1, "page_first")
    eng = TransferEngine(host, "dma")
    rng = np.random.default_rng(11)
    h, d = _pages(rng, host.size, 96, 1, contiguous=True), _pages(rng, dev.size, 96, 1)
    eng.backup(h, d).synchronize()
    eng.load(h, d).synchronize()  # the layers-per-copy trials, once per shape
    order = []
    real_on, real_issue = dma_mod.on_device, dma_mod._issue
    monkeypatch.setattr(dma_mod, "on_device", lambda idx, device: (order.append(("index", idx.numel())),
                                                                  real_on(idx, device))[1])
    monkeypatch.setattr(dma_mod, "_issue", lambda *a, **k: (order.append(("copy", a[4])), real_issue(*a, **k))[1])
    eng.backup(h, d).synchronize()
    assert order and order[0] == ("index", 96), order  # a backup gathers with them: they go first
    order.clear()
    free = np.setdiff1d(np.arange(dev.size), d.numpy())
    d2 = torch.from_numpy(rng.permutation(free)[:96].astype(np.int64))
    want = d2.clone()
    ld = eng.load(h, d2)
    d2.fill_(0)  # the caller reuses its tensor: everything was read during the call
    ld.synchronize()
    copies = [i for i, (what, _) in enumerate(order) if what == "copy"]
    assert copies and order[copies[0]] == ("copy", False), order
    assert order.index(("index", 96)) > copies[0], order  # asked for after the first copies
    from kvtier.device_pool import layer_attr
    for c in spec.components:
        for buf in getattr(dev, layer_attr(c.name)):
            assert torch.equal(_b(buf[want.cuda()]), _b(buf[d.cuda()]))
    host.close()


@pytest.mark.parametrize("background", [True, False, "no-wait"])
@pytest.mark.parametrize("backend", ["dma", "auto", "kernel"])
def test_a_backup_and_a_load_issued_back_to_back_move_the_right_bytes(backend, background):
    """The backup's copies are queued by the engine's thread (or inline) while the caller
    queues a load of other slots through the same backend; then a load reads what the
    backup wrote. Many chunks each way (16 MiB staging), so the two threads interleave.
    "no-wait": the thread does not give way to the load (``give_way_s = 0``)."""
    from dataclasses import replace

    from kvtier.transfer.base import get_backend
    spec = KVSpec("mha", 8, torch.bfloat16, head_num=8, head_dim=128)  # 32 KiB per token
    tokens = 4096
    dev, host = _pools(spec, 16, "page_first", tokens=tokens)
    for c in host.component_tensors:
        host.raw_bytes(c).view(torch.uint8).random_(0, 256)
    eng = TransferEngine(host, backend, background_backups=background is not False)
    if background == "no-wait":
        eng.give_way_s = 0.0
    dma = get_backend("dma", torch.device("cuda"))
    old, dma.config = dma.config, replace(dma.config, staging_bytes=16 << 20)
    try:
        rng = np.random.default_rng(3)
        h1, h2 = torch.arange(tokens), torch.arange(tokens, 2 * tokens)
        d1 = _pages(rng, tokens // 16, tokens // 16 // 2, 16)                   # first half of the device
        d2 = _pages(rng, tokens // 16, tokens // 16 // 2, 16) + tokens          # second half
        ref = host_pool_for(dev, "page_first", host_size_tokens=host.size)
        for _ in range(3):
            host_before = {c: host.raw_bytes(c).clone() for c in host.component_tensors}
            src = {k: st[:, d1.cuda()].clone() for k, st in dev.stacks.items()}
            hd = eng.backup(h1[: d1.numel()], d1)
            ld = eng.load(h2[: d2.numel()], d2)
            hd.synchronize()
            ld.synchronize()
            # The load read h2's bytes as they were: backing d2 up into a copy of them changes nothing.
            for c in host.component_tensors:
                ref.raw_bytes(c).copy_(host_before[c])
            ref.backup_from_device_all_layer(dev, h2[: d2.numel()], d2, "direct")
            for c in host.component_tensors:
                assert torch.equal(ref.raw_bytes(c), host_before[c]), c
            eng.load(h1[: d1.numel()], d2).synchronize()   # what the backup wrote, into d2
            for k, st in dev.stacks.items():
                assert torch.equal(_b(st[:, d2.cuda()]), _b(src[k])), k
            for st in dev.stacks.values():
                st.view(torch.uint8).random_(0, 256)
        ref.close()
    finally:
        dma.config = old
    host.close()


def test_backups_complete_when_the_background_thread_gets_no_turn():
    """The engine's thread is held (as a caller busy in Python starves it of the GIL): two
    backups to the same host slots are left pending after their heads. Polling the second's
    ``done()`` queues both in the caller's thread, in order, so the host ends with the second's
    bytes (H200 run 58: a busy caller slowed a backup to 0.05x of the link)."""
    import threading
    from dataclasses import replace

    from kvtier.transfer.base import get_backend
    spec = KVSpec("mha", 8, torch.bfloat16, head_num=8, head_dim=128)  # 32 KiB per token
    tokens = 2048
    dev, host = _pools(spec, 16, "page_first", tokens=2 * tokens)
    eng = TransferEngine(host, "dma")
    dma = get_backend("dma", torch.device("cuda"))
    old, dma.config = dma.config, replace(dma.config, staging_bytes=4 << 20, head_bytes=0)
    gate = threading.Event()
    try:
        for st in dev.stacks.values():
            st.view(torch.uint8).random_(0, 256)
        ref = host_pool_for(dev, "page_first", host_size_tokens=host.size)
        for c in host.component_tensors:
            ref.raw_bytes(c).copy_(host.raw_bytes(c))
        backlog = eng._started_backlog()
        held = eng._issuer.submit(gate.wait, 60)  # the thread's next turn comes after this
        rng = np.random.default_rng(5)
        h = torch.arange(tokens)
        d1, d2 = _pages(rng, 2 * tokens // 16, tokens // 16, 16), _pages(rng, 2 * tokens // 16, tokens // 16, 16)
        first, second = eng.backup(h, d1), eng.backup(h, d2)
        assert len(backlog) == 2 and not first._queued.done()  # only the first head is queued
        deadline = time.perf_counter() + 20
        while not second.done():
            assert time.perf_counter() < deadline, "the backup waited for the held thread"
        assert first.done() and len(backlog) == 0 and not held.done()
        ref.backup_from_device_all_layer(dev, h, d2, "direct")
        for c in host.component_tensors:
            assert torch.equal(ref.raw_bytes(c), host.raw_bytes(c)), c
        ref.close()
    finally:
        gate.set()
        dma.config = old
    host.close()


def test_an_error_while_a_backup_is_queued_reaches_its_handle():
    """Staging that cannot be allocated fails while the first chunk is queued (in the caller's
    thread): the handle raises it, as it would from the background thread, and a load of the
    same slots issued after it still runs (it waits without raising)."""
    from kvtier.transfer.dma import DMABackend, DMAConfig
    spec = SPECS["mha_odd"]
    dev, host = _pools(spec, 1, "layer_first", tokens=1024)
    eng = TransferEngine(host, "dma")
    good = eng.backend
    eng.backend = DMABackend(DMAConfig(staging_bytes=1 << 50, kernel_below=0))  # a petabyte
    h = torch.arange(512)
    hd = eng.backup(h, h)
    with pytest.raises(torch.OutOfMemoryError):
        hd.synchronize()
    eng.backend = good
    before = {k: st[:, 512:1024].clone() for k, st in dev.stacks.items()}
    eng.backup(h, torch.arange(512, 1024)).synchronize()
    eng.load(h, h).synchronize()   # ordered after the failed backup of the same slots: no raise
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, :512]), _b(before[k]))
    host.close()


def test_an_error_in_the_background_thread_reaches_its_handle_and_the_head_chunk_lands():
    """The first chunk is queued in the caller's thread, the rest by the engine's thread: a
    failure there is raised by the handle, and the bytes of the first chunk are on the host."""
    from kvtier.transfer.dma import DMABackend, DMAConfig

    class FailsAfterTheFirstChunk(DMABackend):
        def _backup_chunks(self, ring, cur, part, p, ptrs, d, host_base, chunks):
            if chunks.start > 0:
                raise RuntimeError("chunk after the first")
            super()._backup_chunks(ring, cur, part, p, ptrs, d, host_base, chunks)
    spec = SPECS["mha_odd"]
    dev, host = _pools(spec, 1, "layer_first", tokens=1024)
    eng = TransferEngine(host, "dma")
    eng.backend = FailsAfterTheFirstChunk(DMAConfig(staging_bytes=64 << 10, buffers=2, kernel_below=0))
    h, d = torch.arange(100, 612), torch.arange(512)
    plan = eng.backend.plan_part(host.transfer_parts()[0], h.numpy(), True)
    assert plan.n_chunks > 2
    first = plan.items(0)[1]
    hd = eng.backup(h, d)
    with pytest.raises(RuntimeError, match="chunk after the first"):
        hd.synchronize()
    ref = host_pool_for(dev, "layer_first", host_size_tokens=host.size)
    ref.backup_from_device_all_layer(dev, h[:first], d[:first], "direct")
    part = host.transfer_parts()[0]   # the part whose first chunk went ahead (the others never ran)
    got, want, pl = host.raw_bytes(part.name), ref.raw_bytes(part.name), part.host
    for layer in range(spec.layer_num):
        for slot in h[:first].tolist():
            at = pl.offset(slot, layer)
            assert torch.equal(got[at:at + pl.item_bytes], want[at:at + pl.item_bytes]), (layer, slot)
    ref.close()
    host.close()


def test_bench_pairs_log_a_timeline_in_order():
    """The transfer bench's pair rows carry their timeline (``pair_ms``): every field there,
    the calls returning in order, and each transfer ending after its call returned."""
    from kvtier.bench.transfer import run_bench
    notes = []

    def on_row(rows, groups, picks, final=False, samples="", **extra):
        if not final and rows[-1].direction == "both":
            notes.append(extra.get("pair", ""))
    run_bench(512, 1, ("dma",), ("mha",), (16,), 4, progress=False, on_row=on_row,
              layouts={"page_first"}, slots=("allocator",))
    assert len(notes) == 1
    f = notes[0].split()
    t = dict(zip(f[::2], map(float, f[1::2])))
    assert list(t) == ["backup_returned", "load_returned", "backup_queued", "backup_done", "load_done"]
    assert 0 < t["backup_returned"] <= t["load_returned"] <= t["backup_queued"]
    assert t["backup_done"] > 0 and t["load_done"] > t["backup_returned"]


@pytest.mark.parametrize("backend", ["kernel", "dma", "auto"])
def test_a_dropped_pool_gives_back_its_device_memory(backend):
    """The shared backends keep per-part pointer tables; they used to hold the parts, so every
    pool a process had moved stayed allocated. Dropped after transfers both ways, a pool's
    device memory goes. (Measured from just before the drop: staging buffers a backend makes
    on first use stay with it, as they should.)"""
    spec = KVSpec("mha", 8, torch.bfloat16, head_num=8, head_dim=128)  # 32 KiB per token
    dev, host = _pools(spec, 16, "page_first", tokens=16384)
    pool = sum(st.numel() * st.element_size() for st in dev.stacks.values())  # 1 GiB
    eng = TransferEngine(host, backend)
    idx = torch.arange(8192)
    eng.backup(idx, idx).synchronize()
    eng.load(idx, idx).synchronize()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    host.close()
    del dev, host, eng
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= held - pool * 9 // 10


@pytest.mark.parametrize("backend", ["kernel", "dma", "auto"])
@pytest.mark.parametrize("background", [True, False])
def test_a_dropped_engine_frees_its_host_pool_at_once(backend, background):
    """Once an engine, its pools and its handles are dropped, the host memory is freed then,
    not when Python's cyclic collector next runs (that is disabled here): H200 run 116, the
    bench's 34 GB pools of earlier cases were still held (engine -> backlog -> engine) and the
    next case's pool was refused."""
    import weakref
    spec = KVSpec("mha", 4, torch.bfloat16, head_num=8, head_dim=128)
    tokens = 4096
    dev, host = _pools(spec, 16, "layer_first", tokens=tokens)
    gc.collect()
    gc.disable()
    try:
        eng = TransferEngine(host, backend, background_backups=background)
        h = torch.arange(tokens)
        for _ in range(2):
            hd, ld = eng.backup(h, h), eng.load(h + tokens, h + tokens)
            hd.synchronize()
            ld.synchronize()
        memory = weakref.ref(host._buffers[0].tensor)
        host.close()
        del eng, host, hd, ld
        held = memory()
        referrers = [type(r).__name__ for r in gc.get_referrers(held)] if held is not None else []
        del held
        assert memory() is None, f"host memory still held by {referrers}"
    finally:
        gc.enable()


def _steady_state() -> tuple[int, int, int]:
    """What a leak would grow: device memory torch holds, Python objects the collector
    tracks, threads. Bounded caches are emptied first: DMA planning remembers up to 1,024
    transfers' run lengths (``dma_plan._bound``), so scattered slots drawn afresh add an entry
    a transfer until it is full (run 155: 53 objects over 48 rounds, the same on a CPU, and -4
    with the caches emptied)."""
    import threading

    from kvtier_testlib import clear_bounded_caches
    clear_bounded_caches()
    torch.cuda.synchronize()
    gc.collect()
    return torch.cuda.memory_allocated(), len(gc.get_objects()), threading.active_count()


@pytest.mark.parametrize("backend", ["kernel", "dma", "auto"])
def test_hundreds_of_transfers_hold_memory_objects_and_threads_flat(backend):
    """No leak in the steady state. After every shape below has run once (staging rings,
    pointer tables, compiled kernels and `auto`'s samples are made on first use), 240 more
    transfers of the same shapes (backups, whole loads, per-layer loads, a backup and a load
    at once; slots drawn afresh each time, CPU and CUDA index tensors) leave the device memory
    torch holds, the Python objects alive and the threads where they were, and no transfer
    of the engine open; the bytes of the last round trip are checked against the source."""
    spec = KVSpec("mha", 4, torch.bfloat16, head_num=8, head_dim=128)  # 16 KiB per token
    tokens = 4096
    dev, host = _pools(spec, 16, "layer_first", tokens=tokens)
    eng = TransferEngine(host, backend)
    rng = np.random.default_rng(7)
    shapes = [(16, False), (64, True), (128, False), (256, True)]  # pages, consecutive

    def round_(pages, contiguous, on_cuda):
        h = _pages(rng, host.page_num // 2, pages, 16, contiguous)
        d = _pages(rng, dev.size // 16 // 2, pages, 16, contiguous)
        h2, d2 = h + tokens, d + tokens   # in the other halves: a pair's load apart from these
        if on_cuda:
            h, d, h2, d2 = h.cuda(), d.cuda(), h2.cuda(), d2.cuda()
        eng.backup(h, d).synchronize()
        eng.load(h, d2).synchronize()
        for layer in range(dev.layer_num):  # as an engine that loads layer by layer calls it
            host.load_to_device_per_layer(dev, h2, d, layer, backend)
        b, ld = eng.backup(h, d), eng.load(h2, d2)
        b.synchronize()
        ld.synchronize()
        return h, d, d2

    for pages, contiguous in shapes:  # the warm-up: every shape twice, both index devices
        for on_cuda in (False, True):
            round_(pages, contiguous, on_cuda)
            h, d, d2 = round_(pages, contiguous, on_cuda)
    # Measured with a round's index tensors held, as after the loop (its last round is of the
    # same shape, with CUDA indices: run 154 counted those 96 KiB as growth).
    before = _steady_state()
    for i in range(48):  # 5 transfers a round (the per-layer load counted once)
        pages, contiguous = shapes[i % len(shapes)]
        h, d, d2 = round_(pages, contiguous, bool(i % 2))
    after = _steady_state()
    assert after[0] == before[0], f"device memory grew by {after[0] - before[0]} bytes over 240 transfers"
    assert after[1] - before[1] < 48, f"{after[1] - before[1]} more Python objects after 240 transfers"
    assert after[2] == before[2], f"threads went from {before[2]} to {after[2]}"
    assert len(eng._inflight) <= 2 and all(f.handle._finished() for f in eng._inflight)
    # The last pair's backup wrote d's bytes (from h2's, by the per-layer loads) to h: load h
    # by the direct backend into d2 and compare.
    for layer in range(dev.layer_num):
        host.load_to_device_per_layer(dev, h.cpu(), d2.cpu(), layer, "direct")
    for name, st in dev.stacks.items():
        assert torch.equal(_b(st[:, d2.cuda()]), _b(st[:, d.cuda()])), name
    host.close()


def test_auto_per_layer_loads_leave_no_transfer_open():
    """``load_to_device_per_layer(..., "auto")`` prepares each layer on its own; each used to
    open a timing that only a whole load's last layer closed, so every other layer's stayed
    'in flight' for good, and every later backup was chosen as if sharing the link with a load."""
    from kvtier.transfer.auto import AutoBackend
    from kvtier.transfer.dma import DMABackend
    from kvtier.transfer.kernel import KernelBackend
    spec = SPECS["mla"]
    dev, host = _pools(spec, 16, "layer_first")
    auto = AutoBackend(KernelBackend(), DMABackend())
    h = torch.arange(128)
    d = torch.arange(128, 256)
    for _ in range(3):
        for layer in range(dev.layer_num):
            auto.load(host.transfer_parts(), h, d, layer)
    torch.cuda.synchronize()
    auto.timings.harvest(auto.chooser)
    assert not auto.timings._pending
    assert not auto.timings.busy(False, 0) and not auto.timings.sharing(True, 0)
    ref = torch.arange(256, 384)
    for layer in range(dev.layer_num):   # the bytes all the same: against the direct backend
        host.load_to_device_per_layer(dev, h, ref, layer, "direct")
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, d.cuda()]), _b(st[:, ref.cuda()])), k
    host.close()


def test_a_transfer_that_fails_part_way_returns_only_once_what_it_queued_has_run():
    """A load whose third layer fails to queue, a backup (queued inline) that fails after its
    copies: the engine raised at once, with copies still queued into the slots, and a cache
    gives those slots back on an error (device pages of a load, host pages of a backup)."""
    from kvtier.transfer.kernel import KernelBackend

    class FailsPartWay(KernelBackend):
        def prepare(self, parts, host_idx, dev_idx, to_host, *args, **kwargs):
            inner = super().prepare(parts, host_idx, dev_idx, to_host, *args, **kwargs)

            def run(layer):
                inner(layer)
                if layer is None or layer == 2:
                    raise RuntimeError("queueing failed part way")
            return run

    spec = KVSpec("mha", 8, torch.bfloat16, head_num=8, head_dim=128)  # 32 KiB a token
    tokens = 16384                                                       # 512 MiB each way
    dev, host = _pools(spec, 16, "layer_first", tokens=tokens)
    eng = TransferEngine(host, FailsPartWay(), background_backups=False)
    h, d = torch.arange(tokens), torch.arange(tokens)
    with pytest.raises(RuntimeError, match="part way"):
        eng.load(h, d)
    assert eng.load_stream.query()
    with pytest.raises(RuntimeError, match="part way"):
        eng.backup(h, d)
    assert eng.backup_stream.query()
    host.close()


def test_a_failed_runtime_copy_does_not_fail_the_next_unrelated_torch_call():
    """A copy the runtime refuses raises; the thread's last error was left set, and the next
    torch launch, whatever it was, raised it (a review, 2026-12-04; the batch path cleared it).
    (A pitch narrower than the row is refused when queued, with no fault on the device.)"""
    from kvtier.transfer import cudart
    dev = torch.empty(1 << 16, dtype=torch.uint8, device="cuda")
    host = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
    s = torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="cudaMemcpy2DAsync failed with error"):
        cudart.memcpy2d(host.data_ptr(), 16, dev.data_ptr(), 64, 64, 4, s.cuda_stream)  # width > dpitch
    x = torch.ones(8, device="cuda") * 2
    torch.cuda.synchronize()
    assert x.sum().item() == 16


# -- written in the session of 2026-12-04 with no device: to run on the next one -------------

@pytest.mark.parametrize("backend", ["kernel", "dma", "auto"])
def test_strided_cuda_index_tensors_move_the_slots_they_name(backend):
    """Index tensors that are strided views on the GPU: the kernels read an index as packed,
    so one read as it lay named other slots (seen under the interpreter); they are made
    contiguous first."""
    spec = SPECS["mla"]
    dev, host = _pools(spec, 1, "layer_first")
    ref = host_pool_for(dev, "layer_first", host_size_tokens=host.size)
    rng = np.random.default_rng(11)
    h = torch.from_numpy(rng.permutation(host.size)[:40])
    d = torch.from_numpy(rng.permutation(dev.size)[:40])
    for hp in (host, ref):
        for c in hp.component_tensors:
            hp.raw_bytes(c).fill_(0xA5)
    ref.backup_from_device_all_layer(dev, h, d, "direct")
    hs = torch.stack([h, h.flip(0)], 1).cuda()[:, 0]
    ds = torch.stack([d, d.flip(0)], 1).cuda()[:, 0]
    assert not hs.is_contiguous() and torch.equal(hs.cpu(), h)
    before = {k: v.clone() for k, v in dev.stacks.items()}
    eng = TransferEngine(host, backend)
    eng.backup(hs, ds).synchronize()
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c), ref.raw_bytes(c)), c
    free = torch.from_numpy(np.setdiff1d(np.arange(dev.size), d.numpy())[:40])
    d2 = torch.stack([free, free.flip(0)], 1).cuda()[:, 0]
    eng.load(hs, d2).synchronize()
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, free.cuda()]), _b(before[k][:, d.cuda()]))
    host.close()
    ref.close()


@pytest.mark.parametrize("backend", ["kernel", "dma", "auto"])
@pytest.mark.parametrize("pinned", [False, True])
def test_a_host_pool_in_an_engines_own_tensor_is_registered_and_round_trips(backend, pinned):
    """A subclass's ``init_kv_buffer`` tensor becomes the pool's storage (HostBuffer.adopt):
    registered for the GPU when it is pageable, taken as it is when already pinned."""
    from kvtier.host_pool import MLATokenToKVPoolHost
    spec = SPECS["mla"]
    dev = pool_from_spec(spec, 512, 16, "cuda")
    for st in dev.stacks.values():
        st.view(torch.uint8).random_(0, 256)
    mine = {}

    class Own(MLATokenToKVPoolHost):
        def init_kv_buffer(self):
            made = super().init_kv_buffer()
            mine["t"] = torch.empty(made.shape, dtype=made.dtype, pin_memory=pinned)
            return mine["t"]
    host = Own(dev, 0, 0, 16, "layer_first", host_size_tokens=512)
    assert host.pinned and host.kv_buffer.data_ptr() == mine["t"].data_ptr()
    rng = np.random.default_rng(hash((backend, pinned)) % 2**32)
    _round_trip_matches_direct(TransferEngine(host, backend), dev, host, "layer_first", 16, "cpu", rng)


@pytest.mark.parametrize("backend", ["kernel", "dma", "auto"])
def test_transfers_follow_device_buffers_an_engine_replaced(backend):
    """An engine that rebuilds its per-layer buffers: loads and backups go to and from the new
    tensors (the parts, and the kernel's pointer tables with them, are made again)."""
    spec = SPECS["mla"]
    dev, host = _pools(spec, 16, "layer_first")
    eng = TransferEngine(host, backend)
    h = host.alloc(64)
    eng.backup(h, torch.arange(64)).synchronize()
    src = [_b(t[:64]).clone() for t in dev.kv_buffer]
    dev.kv_buffer = [torch.zeros_like(t) for t in dev.kv_buffer]
    eng.load(h, torch.arange(128, 192)).synchronize()
    for layer, t in enumerate(dev.kv_buffer):
        assert torch.equal(_b(t[128:192]), src[layer])
        assert not _b(t[:128]).any() and not _b(t[192:]).any()
    h2 = host.alloc(64)
    eng.backup(h2, torch.arange(128, 192)).synchronize()
    assert torch.equal(_b(host.kv_buffer[:, h2]), _b(host.kv_buffer[:, h]))
    host.close()


def _runs(n_runs: int, run: int, every: int = 300) -> torch.Tensor:
    """Host slots in ``n_runs`` runs of ``run`` consecutive slots, ``every`` apart (never joining)."""
    return torch.from_numpy((np.arange(n_runs)[:, None] * every + np.arange(run)).reshape(-1).astype(np.int64))


def test_auto_keeps_dma_for_a_shape_after_one_transfer_too_short_for_copies():
    """A shape key covers run lengths within a power of two: MLA-like rows of 160 B in runs of
    240 suit copies (38 KiB, over kernel_below) and in runs of 150 do not (24 KiB). One transfer
    of the second kind took DMA off the shape for good, and one first kept it off. Now DMA stays
    where it has samples, and a kernel-only shape is ranked again every RECHECK transfers."""
    from kvtier.transfer.auto import RECHECK, AutoBackend
    from kvtier.transfer.dma import DMABackend
    from kvtier.transfer.kernel import KernelBackend
    spec = SPECS["mla"]
    dev, host = _pools(spec, 1, "layer_first", tokens=4096)            # host slots 0..8191
    parts = host.transfer_parts()
    a, b, d = _runs(10, 240), _runs(16, 150), torch.arange(2400)       # up to slots 2939 and 4649
    auto = AutoBackend(KernelBackend(), DMABackend())              # kernel_below at its default
    for _ in range(2 * auto.chooser.explore):
        auto.load(parts, a, d, 0)
        torch.cuda.synchronize()
    assert auto.picks[("load", "dma")] >= auto.chooser.explore, auto.picks
    auto.load(parts, b, d[: b.numel()], 0)                         # goes by the kernel
    torch.cuda.synchronize()
    assert all("dma" in c for c in auto._candidates.values()), auto._candidates
    fresh = AutoBackend(KernelBackend(), DMABackend())
    fresh.load(parts, b, d[: b.numel()], 0)                        # a kernel-only shape first ...
    assert all(c == ["kernel"] for c in fresh._candidates.values()), fresh._candidates
    for _ in range(RECHECK):
        fresh.load(parts, a, d, 0)                                 # ... ranked again with these
        torch.cuda.synchronize()
    assert any("dma" in c for c in fresh._candidates.values()), fresh._candidates
    for layer in range(dev.layer_num):
        fresh.load(parts, a, d, layer)
    torch.cuda.synchronize()
    ref = torch.arange(2400, 4800)
    for layer in range(dev.layer_num):
        host.load_to_device_per_layer(dev, a, ref, layer, "direct")
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, d.cuda()]), _b(st[:, ref.cuda()])), k
    host.close()


def test_auto_sets_aside_a_candidate_whose_transfer_raised():
    """A candidate that raised got no sample, so it stayed first to explore and every transfer
    of the shape failed. It is set aside for the shape; the next transfer goes by the other."""
    from kvtier.transfer.auto import AutoBackend
    from kvtier.transfer.dma import DMABackend
    from kvtier.transfer.kernel import KernelBackend
    spec = SPECS["mla"]
    dev, host = _pools(spec, 16, "page_first", tokens=1024)
    dma = DMABackend()
    auto = AutoBackend(KernelBackend(), dma)
    parts = host.transfer_parts()
    h, d = torch.arange(1024), torch.arange(1024)

    def broken(*args, **kwargs):
        raise RuntimeError("copy engine unavailable")
    dma.runner_for = broken
    outcomes = []
    for _ in range(2 * auto.chooser.explore + 1):          # DMA is explored whichever the prior ranks first
        try:
            auto.backup(parts, h, d)
            outcomes.append("ok")
        except RuntimeError:
            outcomes.append("raised")
        torch.cuda.synchronize()
    assert outcomes.count("raised") == 1 and auto.picks[("backup", "dma")] == 1, (outcomes, auto.picks)
    assert any("dma" in failed for failed in auto._failed.values()) and outcomes[-1] == "ok"
    ref = host_pool_for(dev, "page_first", host_size_tokens=host.size)
    ref.backup_from_device_all_layer(dev, h, d, "direct")
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c)[: ref.raw_bytes(c).numel()], ref.raw_bytes(c)), c
    host.close()
    ref.close()


def test_a_dma_chunk_copy_over_2_gib_goes_as_one_plain_copy():
    """A 1-D copy went as a 2-D one with its width as pitch, which the runtime refuses past
    2^31 - 1 bytes: with staging chunks of 2 GiB or more every such chunk failed (a review,
    from reading). Past that it goes by cudaMemcpyAsync. (~14 GB of device memory, ~9 GB of pinned host memory.)"""
    from kvtier.transfer.dma import DMABackend, DMAConfig
    from kvtier.transfer.dma_plan import MAX_PITCH
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
