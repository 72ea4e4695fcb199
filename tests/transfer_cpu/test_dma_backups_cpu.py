"""DMA backups played on the CPU (no GPU): through staging, in chunks of whole layers and
straight from the device pool, each writes exactly the bytes a slot-by-slot copy writes; and
which of those plans the backend picks for a CPU pool.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvtier.layouts import LAYOUTS
from kvtier.spec import KVSpec
from kvtier.transfer.dma.chunked import ChunkedPlan, LayerChunkedPlan, PoolPlan, layer_bounds, layer_major, pool_placement, pool_row_bytes
from kvtier.transfer.slots import Runs, run_starts
from kvtier.transfer.dma.plan import plan
from kvtier_testlib import MHA


LAYER_MAJOR_SPECS = [MHA, KVSpec("mla", 61, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64),
                     KVSpec("dsa", 5, torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8, index_head_dim=128)]


def _play_backup(p, pl, dev, d):
    """Play a backup plan on the CPU: gather every chunk into staging as the kernel would
    (item ``j`` of the chunk, layer ``l0 + k`` at staging slot ``j``, layer ``k``), then
    its copies as the copy engine would. Returns the host bytes (0xA5 where nothing went)."""
    host = np.full(pl.total_bytes, 0xA5, dtype=np.uint8)
    for i in range(p.n_chunks):
        j0, m = p.items(i)
        l0, nl = p.layer_range(i)
        nl = nl or pl.layer_num
        stg = np.zeros(p.staging_bytes, dtype=np.uint8)
        for k in range(nl):
            for j in range(m):
                at = p.staging.offset(j, k)
                stg[at:at + pl.item_bytes] = dev[l0 + k, d[j0 + j]]
        _play_copies(p.calls(i), stg, host)
    return host


def _play_copies(calls, src, host) -> None:
    """A chunk's copies ``(pitched rows, 1-D copies)`` from ``src`` (staging or the device
    pool's bytes) to ``host``, as the copy engine would."""
    tall, flat = calls
    for h0, s0, w, height, hp, sp in tall.tolist():
        for r in range(height):
            host[h0 + r * hp:h0 + r * hp + w] = src[s0 + r * sp:s0 + r * sp + w]
    for h0, s0, w in flat.tolist():
        host[h0:h0 + w] = src[s0:s0 + w]


@given(layout=st.sampled_from(["layer_first", "page_first", "page_head"]), ps=st.sampled_from([1, 4]),
       n_pages=st.integers(1, 60), seed=st.integers(0, 2**16), keep=st.floats(0.2, 1.0), shuffled=st.booleans(),
       stage_kib=st.sampled_from([1, 4, 1024]), ramp=st.sampled_from([0, 1 << 10]),
       max_pitch=st.sampled_from([None, 256]), whole=st.booleans())
@settings(max_examples=60, deadline=None)
def test_staged_backup_puts_every_byte_where_the_reference_does(layout, ps, n_pages, seed, keep, shuffled,
                                                                stage_kib, ramp, max_pitch, whole):
    """A backup through staging (:class:`ChunkedPlan`, or :func:`plan` whole), played on the
    CPU, writes exactly the bytes a slot-by-slot copy writes, for host slots in runs of many
    lengths at once (some pages of a stretch kept: every run's copies are its length's
    template moved to where it starts, all lengths in one pass) or in no order."""
    spec = KVSpec("mha", 3, torch.bfloat16, head_num=2, head_dim=8)  # 32-byte K or V rows
    rng = np.random.default_rng(seed)
    size = 64 * ps
    comp = spec.components[0]
    pl = LAYOUTS[layout].placement(comp, spec.layer_num, size, ps)
    pages = np.sort(rng.permutation(64)[:n_pages])
    pages = pages[rng.random(pages.size) < keep] if pages.size > 1 else pages
    pages = rng.permutation(pages) if shuffled else pages
    h = (pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int64)
    d = rng.permutation(64 * ps)[:h.size]
    dev = rng.integers(0, 256, (spec.layer_num, 64 * ps, pl.item_bytes), dtype=np.uint8)
    p = (plan(pl, h, spec.layer_num, stage_kib << 10, max_pitch, ramp=ramp) if whole
         else ChunkedPlan(pl, h, spec.layer_num, stage_kib << 10, max_pitch, ramp=ramp))
    cb = pl.chunk_bytes  # page_head splits an item by head: chunk c of it lies apart
    want = np.full(pl.total_bytes, 0xA5, dtype=np.uint8)
    for layer in range(spec.layer_num):
        for hs, ds in zip(h.tolist(), d.tolist()):
            for c in range(pl.n_chunks):
                at = pl.offset(hs, layer, c)
                want[at:at + cb] = dev[layer, ds, c * cb:(c + 1) * cb]
    host = np.full(pl.total_bytes, 0xA5, dtype=np.uint8)
    for i in range(p.n_chunks):   # gather each chunk into staging, as the kernel would; then its copies
        j0, m = p.items(i)
        stg = np.zeros(p.staging_bytes, dtype=np.uint8)
        for k in range(spec.layer_num):
            for j in range(m):
                for c in range(p.staging.n_chunks):
                    at = p.staging.offset(j, k, c)
                    w = p.staging.chunk_bytes
                    stg[at:at + w] = dev[k, d[j0 + j], c * w:(c + 1) * w]
        _play_copies(p.calls(i), stg, host)
    assert np.array_equal(host, want)


@given(si=st.sampled_from(range(len(LAYER_MAJOR_SPECS))), ps=st.sampled_from([1, 4]), n_pages=st.integers(1, 40),
       seed=st.integers(0, 2**16), one_run=st.booleans(), stage_layers=st.sampled_from([1, 2, 3, 100]),
       ramp=st.sampled_from([0, 1, 4 << 20]), max_pitch=st.sampled_from([None, 4096]))
@settings(max_examples=40)
def test_layer_chunked_backup_puts_every_byte_where_the_reference_does(si, ps, n_pages, seed, one_run, stage_layers,
                                                                      ramp, max_pitch):
    """Chunks of whole layers (every slot in each), played on the CPU, write exactly the bytes
    a slot-by-slot copy writes, for any run structure, staging size and ramp."""
    spec = LAYER_MAJOR_SPECS[si]
    rng = np.random.default_rng(seed)
    size = 48 * ps
    for comp in spec.components:
        pl = LAYOUTS["layer_first"].placement(comp, spec.layer_num, size, ps)
        assert layer_major(pl)
        pages = (int(rng.integers(0, 48 - n_pages + 1)) + np.arange(n_pages)) if one_run else rng.permutation(48)[:n_pages]
        h = (pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int64)
        d = rng.permutation(64 * ps)[:h.size]
        dev = rng.integers(0, 256, (spec.layer_num, 64 * ps, pl.item_bytes), dtype=np.uint8)
        p = LayerChunkedPlan(pl, h, stage_layers * h.size * pl.item_bytes, max_pitch, ramp=ramp)
        assert p.layer_range(0)[0] == 0 and sum(p.layer_range(i)[1] for i in range(p.n_chunks)) == spec.layer_num
        want = np.full(pl.total_bytes, 0xA5, dtype=np.uint8)
        for layer in range(spec.layer_num):
            for hs, ds in zip(h.tolist(), d.tolist()):
                at = pl.offset(hs, layer)
                want[at:at + pl.item_bytes] = dev[layer, ds]
        assert np.array_equal(_play_backup(p, pl, dev, d), want)
        # A run of slots is one copy per layer (not cut at chunk edges), pitched or not.
        runs = Runs.of(h)
        assert p.n_flat + sum(int(r[3]) for r in p.whole().tall) == sum(runs.counts) * spec.layer_num


def test_layer_chunks_start_small_and_double():
    assert layer_bounds(61, 3, 1).tolist() == [0, 1, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 36, 39, 42, 45, 48, 51,
                                              54, 57, 60, 61]
    assert layer_bounds(32, 32, 32).tolist() == [0, 32]
    assert layer_bounds(5, 8, 1).tolist() == [0, 1, 3, 5]
    assert not layer_major(LAYOUTS["page_first"].placement(MHA.components[0], 32, 64, 1))


def test_backups_go_in_layer_chunks_only_for_one_run_of_slots():
    """One run (allocator slots) of a layer-major layout: chunks of whole layers. Scattered
    pages keep chunks of slots (layer chunks made a pitched call per run and chunk: 0.57x
    where slot chunks gave 0.79x on an H200, run 26); page-major layouts always do."""
    pytest.importorskip("triton")
    from kvtier.device_pool import pool_from_spec
    from kvtier.host_pool import host_pool_for
    from kvtier.transfer.dma import DMABackend, DMAConfig
    spec = KVSpec("mla", 4, torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16)
    dma = DMABackend(DMAConfig(kernel_below=0))
    for layout, want_layers in (("layer_first", True), ("page_first", False)):
        host = host_pool_for(pool_from_spec(spec, 512, 16, "cpu"), layout, host_size_tokens=512)
        part = host.transfer_parts()[0]
        one_run = np.arange(64, 320, dtype=np.int64)
        scattered = (np.array([9, 2, 5, 14])[:, None] * 16 + np.arange(16)).reshape(-1)
        assert isinstance(dma.plan_part(part, one_run, True), LayerChunkedPlan) == want_layers
        assert not isinstance(dma.plan_part(part, scattered, True), LayerChunkedPlan)


def _play_pool_backup(p, pool_bytes):
    """Play a :class:`PoolPlan` backup on the CPU: its copies, as the copy engine would, from
    the device pool's bytes (``pool_bytes``, layer 0's first byte at 0) to a poisoned host."""
    host = np.full(p._pl.total_bytes, 0xA5, dtype=np.uint8)
    for i in range(p.n_chunks):
        _play_copies(p.calls(i), pool_bytes, host)
    return host


@given(si=st.sampled_from(range(len(LAYER_MAJOR_SPECS))), ps=st.sampled_from([1, 4, 16]), n_pages=st.integers(0, 40),
       seed=st.integers(0, 2**16), host_run=st.booleans(), dev=st.sampled_from(["pages", "one run", "tokens"]),
       gap=st.integers(0, 3), stage_slots=st.sampled_from([1, 5, 64, 10_000]), ramp=st.sampled_from([0, 4 << 20]),
       max_pitch=st.sampled_from([None, 1024]))
@settings(max_examples=60)
def test_pool_backup_puts_every_byte_where_the_reference_does(si, ps, n_pages, seed, host_run, dev, gap, stage_slots,
                                                             ramp, max_pitch):
    """A backup straight from the device pool (no staging), played on the CPU, writes exactly
    the bytes a slot-by-slot copy writes, for host pages in one run or scattered, device slots
    in pages, in one run or token by token, layers ``gap`` extra bytes apart, any chunking
    (first chunks ramped or not) and pitches too wide for a 2-D call (then row by row)."""
    spec = LAYER_MAJOR_SPECS[si]
    rng = np.random.default_rng(seed)
    size = 48 * ps
    dev_slots = 64 * ps
    for comp in spec.components:
        pl = LAYOUTS["layer_first"].placement(comp, spec.layer_num, size, ps)
        pages = (int(rng.integers(0, 48 - n_pages + 1)) + np.arange(n_pages)) if host_run \
            else rng.permutation(48)[:n_pages]
        h = (pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int64)
        if dev == "pages":
            d = (rng.permutation(64)[:n_pages, None] * ps + np.arange(ps)).reshape(-1)
        elif dev == "one run":
            d = int(rng.integers(0, dev_slots - h.size + 1)) + np.arange(h.size)
        else:
            d = rng.permutation(dev_slots)[:h.size]
        d = d.astype(np.int64)
        pitch = dev_slots * pl.item_bytes + gap
        pool = pool_placement(pl, pitch, dev_slots)
        layers = rng.integers(0, 256, (spec.layer_num, pitch), dtype=np.uint8)
        pool_bytes = layers.reshape(-1)
        p = PoolPlan(pl, pool, h, d, spec.layer_num, stage_slots * spec.layer_num * pl.item_bytes, max_pitch,
                     ramp=ramp)
        want = np.full(pl.total_bytes, 0xA5, dtype=np.uint8)
        for layer in range(spec.layer_num):
            for hs, ds in zip(h.tolist(), d.tolist()):
                at = pl.offset(hs, layer)
                want[at:at + pl.item_bytes] = layers[layer, ds * pl.item_bytes:(ds + 1) * pl.item_bytes]
        assert np.array_equal(_play_pool_backup(p, pool_bytes), want)
        assert p.bounds[0] == 0 and p.bounds[-1] == h.size and (np.diff(p.bounds) > 0).all()
        # One copy per run consecutive on both sides (cut at chunk edges), over every layer.
        runs = sum(run_starts(h[a:b], None, d[a:b]).size for a, b in zip(p.bounds[:-1], p.bounds[1:]))
        whole = p.whole()
        assert whole.n_flat + sum(int(r[3]) for r in whole.tall) == runs * spec.layer_num
        if max_pitch is None:
            assert whole.n_calls == runs and whole.n_flat == (runs if spec.layer_num == 1 else 0)
        if h.size:
            assert pool_row_bytes(pl, h, d) == pytest.approx(h.size * pl.item_bytes / run_starts(h, None, d).size)


def test_backups_copy_straight_from_the_pool_where_rows_are_long_enough():
    """``DMAConfig.pool_rows``: a layer_first backup whose runs consecutive on both sides average
    that many bytes a layer copies from the device pool with no staging; shorter runs, a load,
    a page-major layout, no device slots on the host, ``pool_rows=0`` or device layers that
    are not one stack keep the staging path."""
    pytest.importorskip("triton")
    from kvtier.device_pool import pool_from_spec
    from kvtier.host_pool import host_pool_for
    from kvtier.transfer.base import TransferPart
    from kvtier.transfer.dma import DMABackend, DMAConfig, pool_pitch
    spec = KVSpec("mla", 4, torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16)  # 160-byte items
    dev_pool = pool_from_spec(spec, 1024, 16, "cpu")
    h = (np.array([9, 2, 5, 14])[:, None] * 16 + np.arange(16)).reshape(-1)
    d_pages = (np.array([30, 7, 12, 1])[:, None] * 16 + np.arange(16)).reshape(-1)   # 16-slot runs: 2560 B
    d_tokens = np.random.default_rng(0).permutation(1024)[:h.size]                   # 1-slot runs: 160 B
    for layout in ("layer_first", "page_first"):
        host = host_pool_for(dev_pool, layout, host_size_tokens=512)
        part = host.transfer_parts()[0]
        assert pool_pitch(part) == 1024 * 160
        for rows, d, to_host, want in ((2560, d_pages, True, True), (2561, d_pages, True, False),
                                       (161, d_tokens, True, False), (160, d_tokens, True, True),
                                       (0, d_pages, True, False), (1, d_pages, False, False),
                                       (1, None, True, False)):
            dma = DMABackend(DMAConfig(kernel_below=0, pool_rows=rows, load_group=1))  # no timed trials here
            p = dma.plan_part(part, h, to_host, dev_np=d)
            assert isinstance(p, PoolPlan) == (want and layout == "layer_first"), (layout, rows, to_host)
            assert p is not None
        # Layers out of order, or not evenly spaced, are no stack: one pitch cannot step through them.
        stack = torch.zeros((5, 1024, 160), dtype=torch.uint8)
        for layers in (tuple(reversed(part.device_layers)), (stack[0], stack[1], stack[2], stack[4])):
            apart = TransferPart(part.name, part.host_raw, part.host, layers)
            assert pool_pitch(apart) is None
            assert not isinstance(DMABackend(DMAConfig(pool_rows=1)).plan_part(apart, h, True, dev_np=d_pages),
                                  PoolPlan)
        # plan_parts permutes the device slots with the host's: the plan pairs them as the caller did.
        dma = DMABackend(DMAConfig(kernel_below=0, pool_rows=1, sort_below=1 << 62))
        s_np, runs, order = dma.in_host_order([part], h, Runs.of(h))
        if layout == "layer_first":
            (p,) = dma.plan_parts([part], s_np, runs, order, True, dev_np=d_tokens)
            assert sorted(zip(p._idx.tolist(), p._dev.tolist())) == sorted(zip(h.tolist(), d_tokens.tolist()))
            assert (np.diff(p._idx) > 0).all()
        host.close()
