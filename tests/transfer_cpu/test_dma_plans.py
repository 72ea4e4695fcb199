"""The DMA backend's plans (no GPU): copies split into runtime calls, chunks and their ramp,
the mean-copy bound, runs of consecutive slots, host-slot order, and DMAConfig's refusals.

The plans' byte-exactness on the CPU: test_dma_backups_cpu.py beside this file, and under the
Triton interpreter tests/kernels/interpret_cases.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from kvtier.layouts import LAYOUTS
from kvtier.spec import KVSpec
from kvtier.transfer.dma.plan import RAMP_DIV, chunk_bounds, mean_copy_bound, plan, split_copies
from kvtier.transfer.dma.chunked import ChunkedPlan
from kvtier.transfer.slots import HostOrder, Runs, run_class, run_count, run_starts
from kvtier.transfer.dma.chunked import grouped_plan
from kvtier_testlib import MHA, MLA


def test_split_copies_keeps_every_byte_once():
    rows = np.array([[0, 0, 64, 3, 1000, 64], [5000, 192, 32, 1, 32, 32], [9000, 224, 16, 4, 1 << 33, 16]])
    tall, flat = split_copies(rows, (1 << 31) - 1)
    h, s, w = flat.T
    assert tall.tolist() == [rows[0].tolist()]              # pitched, within the 2-D call's limit
    assert h.tolist() == [5000] + [9000 + r * (1 << 33) for r in range(4)]  # 1-D, and the too-far pitch split
    assert s.tolist() == [192, 224, 240, 256, 272] and w.tolist() == [32, 16, 16, 16, 16]
    none = split_copies(rows[:1], (1 << 31) - 1)[1]
    assert none.shape == (0, 3)


@pytest.mark.parametrize("layout,ps,max_pitch", [("page_first", 1, 1 << 40), ("page_head", 4, 1 << 40),
                                                  ("layer_first", 1, 1 << 40), ("page_first", 1, 4096)])
def test_plan_calls_are_each_chunks_copies_split_once(layout, ps, max_pitch):
    """The plan splits its copies into runtime calls once; per chunk they are what splitting
    that chunk's copies gives (so queueing a chunk costs no numpy work)."""
    pl = LAYOUTS[layout].placement(MHA.components[0], 32, 4096, ps)
    rng = np.random.default_rng(1)
    host = (rng.permutation(1024)[:300, None] * ps + np.arange(ps)).reshape(-1)
    p = plan(pl, host, 4, 256 << 10, max_pitch)
    assert p.n_chunks > 3
    for i in range(p.n_chunks):
        tall, flat = p.calls(i)
        want_tall, want_flat = split_copies(p.chunk(i)[2], max_pitch)
        assert np.array_equal(tall, want_tall)
        assert np.array_equal(flat, want_flat)


@given(n=st.integers(0, 5000), slots_pages=st.integers(1, 300), ps=st.sampled_from([1, 4, 64]),
       per_slot=st.integers(1, 1 << 16), ramp=st.sampled_from([0, 1, 1 << 12, 4 << 20]))
def test_chunk_bounds_cover_the_transfer_in_pages_and_ramp_up_by_doubling(n, slots_pages, ps, per_slot, ramp):
    slots = slots_pages * ps
    b = chunk_bounds(n, slots, ps, per_slot, ramp)
    sizes = np.diff(b)
    assert b[0] == 0 and b[-1] == n and (sizes > 0).all()
    assert (b[1:-1] % ps == 0).all() and (sizes <= slots).all()
    if not ramp:
        assert (sizes[:-1] == slots).all()
        return
    full = sizes[:-1]  # the last chunk is what is left
    assert (np.diff(full) >= 0).all()
    growing = full[full < slots]
    assert (growing[1:] == 2 * growing[:-1]).all()   # doubling ...
    if len(growing):                                  # ... from the smallest chunk worth a copy
        first = max(slots // RAMP_DIV, -(-ramp // per_slot))
        assert growing[0] == -(-first // ps) * ps and growing[0] * per_slot >= ramp


def test_ramped_plan_starts_small_and_keeps_each_chunk_inside_staging():
    pl = LAYOUTS["layer_first"].placement(MLA.components[0], 61, 40000, 1)
    rng = np.random.default_rng(2)
    host = np.sort(rng.permutation(40000)[:32768])  # runs as the allocator hands them out
    per_slot = 61 * pl.item_bytes
    flat = plan(pl, host, 61, 16 << 20)
    ramped = plan(pl, host, 61, 16 << 20, ramp=1 << 20)
    assert ramped.staging_bytes == flat.staging_bytes and ramped.n_chunks > flat.n_chunks
    assert 1 << 20 <= ramped.chunk(0)[1] * per_slot <= (16 << 20) // 8
    for p in (flat, ramped):
        moved = 0
        for i in range(p.n_chunks):
            j0, m, copies = p.chunk(i)
            moved += m
            rows = np.arange(copies[:, 3].max())
            live = rows[None, :] < copies[:, 3:4]
            start = (copies[:, 1:2] + rows[None, :] * copies[:, 5:6])[live]
            width = np.broadcast_to(copies[:, 2:3], live.shape)[live]
            order = np.argsort(start)
            start, width = start[order], width[order]
            # Staging bytes written once each, inside the buffer, and exactly the chunk's bytes.
            assert start[0] >= 0 and (start + width).max() <= p.staging_bytes
            assert (start[1:] >= start[:-1] + width[:-1]).all() and width.sum() == m * per_slot
        assert moved == host.size


def test_mean_copy_counts_close_pitched_rows_once_and_far_ones_each():
    # llama-3-8b K part, 4096 host slots: page_first keeps a token's layers together,
    # layer_first puts them 8 MiB apart.
    lf = LAYOUTS["layer_first"].placement(MHA.components[0], 32, 4096, 1)
    pf = LAYOUTS["page_first"].placement(MHA.components[0], 32, 4096, 1)
    scattered = np.random.default_rng(3).permutation(4096)[:512]
    assert plan(lf, np.arange(512), 32, 128 << 20).mean_copy >= 512 * 2048      # 1 MiB runs, one per layer
    assert plan(lf, scattered, 32, 128 << 20).mean_copy == pytest.approx(2048, rel=0.01)  # rows 8 MiB apart
    assert plan(pf, scattered, 32, 128 << 20).mean_copy == pytest.approx(32 * 2048, rel=0.01)  # a token's layers
    page_head = LAYOUTS["page_head"].placement(MHA.components[0], 32, 4096, 1)
    p = grouped_plan(page_head, np.arange(512), 16, 128 << 20)
    assert p.mean_copy >= 512 * 16 * 256                                       # 4 KiB rows 8 KiB apart: close


@given(layout=st.sampled_from(["layer_first", "page_first", "page_head"]), ps=st.sampled_from([1, 4, 16]),
       layers=st.sampled_from([1, 3, 32]), n_pages=st.integers(1, 120), seed=st.integers(0, 2**16),
       run=st.sampled_from([1, 3, 50]), stage_kib=st.sampled_from([64, 1024, 1 << 17]))
def test_mean_copy_bound_never_underestimates_the_plan(layout, ps, layers, n_pages, seed, run, stage_kib):
    """The DMA backend skips planning when the bound is under ``kernel_below``: it must never
    be below what the plan would have given, or a transfer DMA suits would go to the kernel."""
    pl = LAYOUTS[layout].placement(MHA.components[0], 32, 4096, ps)
    rng = np.random.default_rng(seed)
    starts = rng.permutation(4096 // ps // run)[: max(1, n_pages // run)] * run
    pages = (starts[:, None] + np.arange(run)).reshape(-1)[:n_pages]
    host = (pages[:, None] * ps + np.arange(ps)).reshape(-1)
    exact = plan(pl, host, layers, stage_kib << 10).mean_copy
    assert mean_copy_bound(pl, host, layers, stage_kib << 10) >= exact * (1 - 1e-9)


@given(layout=st.sampled_from(["layer_first", "page_first", "page_head"]), ps=st.sampled_from([1, 4, 16]),
       layers=st.sampled_from([1, 3, 32]), n_pages=st.integers(0, 120), seed=st.integers(0, 2**16),
       run=st.sampled_from([1, 3, 50]), stage_kib=st.sampled_from([64, 1024, 1 << 17]),
       ramp=st.sampled_from([0, 1 << 14, 4 << 20]), max_pitch=st.sampled_from([None, 4096]),
       order=st.sampled_from(["chunks", "reversed", "whole first"]), one_run=st.booleans())
def test_chunked_plan_is_the_plan_chunk_by_chunk(layout, ps, layers, n_pages, seed, run, stage_kib, ramp,
                                                 max_pitch, order, one_run):
    """Planned a chunk at a time (in any order), every chunk's calls and the whole-plan figures
    are exactly the plan's; also for one run of slots from anywhere (planned from templates)."""
    pl = LAYOUTS[layout].placement(MHA.components[0], 32, 4096, ps)
    rng = np.random.default_rng(seed)
    if one_run:
        pages = int(rng.integers(0, 4096 // ps - n_pages + 1)) + np.arange(n_pages)
    else:
        starts = rng.permutation(4096 // ps // run)[: max(1, n_pages // run)] * run
        pages = (starts[:, None] + np.arange(run)).reshape(-1)[:n_pages]
    host = (pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int64)
    if one_run:
        assert Runs.of(host).single == (n_pages > 0)
    want = plan(pl, host, layers, stage_kib << 10, max_pitch, ramp=ramp)
    got = ChunkedPlan(pl, host, layers, stage_kib << 10, max_pitch, ramp=ramp)
    assert got.staging == want.staging and got.staging_bytes == want.staging_bytes
    assert np.array_equal(got.bounds, want.bounds) and got.n_chunks == want.n_chunks
    if order == "whole first":
        assert (got.n_calls, got.n_flat, got.min_width) == (want.n_calls, want.n_flat, want.min_width)
    chunks = range(want.n_chunks)
    for i in reversed(chunks) if order == "reversed" else chunks:
        (gt, gf), (wt, wf) = got.calls(i), want.calls(i)
        assert np.array_equal(gt, wt) and np.array_equal(gf.reshape(-1, 3), wf.reshape(-1, 3))
        assert got.chunk(i)[:2] == want.chunk(i)[:2] and np.array_equal(got.chunk(i)[2], want.chunk(i)[2])
    assert got.mean_copy == want.mean_copy and got.n_calls == want.n_calls and got.n_flat == want.n_flat


@given(runs=st.lists(st.integers(1, 400), max_size=12), gap=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_runs_count_every_run_length(runs, gap, seed):
    """Runs.of: the lengths of the runs of consecutive slots, in any order of the runs, and
    the mean-length class the shape keys use; lengths counted (short runs) or sorted (a run
    far longer than their number)."""
    order = np.random.default_rng(seed).permutation(len(runs))
    starts = np.cumsum([0] + [k + gap for k in runs])[:-1]
    host = np.concatenate([np.arange(starts[i], starts[i] + runs[i]) for i in order] or [np.zeros(0, np.int64)])
    got = Runs.of(host.astype(np.int64))
    # At least one free slot after every run: runs never join, in whatever order they come.
    want = {}
    for k in runs:
        want[k] = want.get(k, 0) + 1
    assert dict(zip(got.lengths, got.counts)) == want and got.n == sum(runs)
    assert got.single == (len(runs) == 1)
    assert got.mean_class == (int(np.log2(max(sum(runs) / len(runs), 1))) if runs else 0)


@given(host=st.lists(st.integers(0, 60), max_size=80), sort=st.booleans())
def test_the_run_class_from_a_count_of_runs_is_the_one_from_runs_of(host, sort):
    """``auto`` keys a transfer's shape by :func:`run_class` without the runs' lengths (a
    count of runs, ~9x cheaper for 32k scattered slots): it must be what Runs.of gives, for
    any slots, repeated or out of order too."""
    h = np.array(sorted(host) if sort else host, dtype=np.int64)
    runs = Runs.of(h)
    assert run_count(h) == sum(runs.counts)
    assert run_class(h) == run_class(h, runs) == runs.mean_class


@given(n=st.integers(1, 300), first=st.integers(0, 1 << 40), seed=st.integers(0, 2**16), swaps=st.integers(0, 3))
def test_runs_of_one_run_agrees_with_the_run_starts(n, first, seed, swaps):
    """Runs.of's one-run shortcut (span n - 1, strictly increasing) gives what the run starts
    give, also for arrays that only look like one run: the same span with slots swapped or
    repeated."""
    host = np.arange(first, first + n, dtype=np.int64)
    rng = np.random.default_rng(seed)
    for _ in range(swaps if n > 2 else 0):
        i, j = rng.integers(1, n - 1, size=2)
        host[i], host[j] = host[j], host[i]
    if swaps == 3 and n > 2:
        host[1] = host[0]  # a repeat inside the span: not one run
    starts = run_starts(host)
    lengths, counts = np.unique(np.diff(np.append(starts, n)), return_counts=True)
    got = Runs.of(host)
    assert (got.lengths, got.counts) == (tuple(lengths.tolist()), tuple(counts.tolist()))
    assert got.single == (starts.size == 1)


def test_chunked_plan_keeps_its_own_copy_of_the_slots():
    """Chunks are planned when queued: a caller reusing its index array meanwhile changes nothing."""
    pl = LAYOUTS["layer_first"].placement(MHA.components[0], 32, 4096, 1)
    host = np.arange(2000, dtype=np.int64)
    want = plan(pl, host, 4, 64 << 10)
    got = ChunkedPlan(pl, host, 4, 64 << 10)
    host[:] = np.random.default_rng(0).permutation(4096)[:2000]
    assert want.n_chunks > 2
    for i in range(want.n_chunks):
        assert np.array_equal(got.calls(i)[1], want.calls(i)[1]) and np.array_equal(got.calls(i)[0], want.calls(i)[0])


@pytest.mark.parametrize("bad", [{"load_group": -1}, {"load_group": True}, {"load_group": 1.5},
                                 {"group_target": 0.0}, {"group_target": 1.5}, {"batch_min": 0},
                                 {"kernel_below": -1}, {"kernel_below": 1.5}, {"sort_slots": 1}, {"sort_below": -1},
                                 {"load_drain": -1}, {"load_drain": True},
                                 {"backup_drain": -1}, {"backup_drain": 2.0}, {"head_bytes": -1},
                                 {"load_drain_bytes": -1}, {"load_drain_bytes": True},
                                 {"kernel_aside": "yes"}, {"buffers": 1}, {"pool_rows": -1}, {"pool_rows": 1.5}])
def test_dma_config_rejects_bad_values_by_name(bad):
    pytest.importorskip("triton")
    from kvtier.transfer.dma import DMAConfig
    with pytest.raises(ValueError, match=next(iter(bad))):
        DMAConfig(**bad)


@given(n_pages=st.integers(0, 60), ps=st.sampled_from([1, 4, 64]), seed=st.integers(0, 2**16),
       whole=st.booleans(), repeat=st.booleans(), offset=st.sampled_from([0, 2**58]))
def test_host_order_sorts_slots_and_keeps_pages_whole(n_pages, ps, seed, whole, repeat, offset):
    """HostOrder: a permutation that sorts the host slots; whole pages move as a block, in
    order; slots already ascending need none; slots repeated in a load keep their order among
    themselves. ``slots`` are the host slots in that order. Slots too large to pack with their
    positions (``offset``) take the argsort path, with the same answer."""
    rng = np.random.default_rng(seed)
    pages = rng.permutation(128)[:n_pages]
    if repeat and pages.size:
        pages = rng.choice(pages, pages.size)
    host = (pages[:, None] * ps + np.arange(ps)).reshape(-1) + offset
    if not whole and host.size:
        host = rng.permutation(host)
    o = HostOrder.of(host, ps)
    if host.size < 2 or (np.diff(host) > 0).all():
        assert o is None
        return
    order, values = o.order, o.slots
    assert sorted(order.tolist()) == list(range(host.size))
    keys_at = host[order][::ps] if whole else host[order]   # whole pages: by first slot
    keys = np.diff(keys_at)
    assert (keys >= 0).all() and ((keys > 0).all() or repeat)
    assert np.array_equal(host[order], values)
    pos_at = order[::ps] if whole else order
    same = keys == 0
    assert (np.diff(pos_at)[same] > 0).all()   # equal slots (or pages) in the caller's order
    if whole:   # each page's slots stay in their order, next to each other
        assert (order.reshape(-1, ps) // ps == (order.reshape(-1, ps)[:, :1] // ps)).all()
        assert (values.reshape(-1, ps) == values.reshape(-1, ps)[:, :1] + np.arange(ps)).all()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_slot_pairs_are_sorted_only_where_some_parts_copies_would_be_small(layout):
    """DMAConfig.sort_slots sorts scattered host pages only where, as given, some part's copies
    would average under sort_below bytes (the mean-copy bound); allocator slots never."""
    pytest.importorskip("triton")
    from kvtier.device_pool import pool_from_spec
    from kvtier.host_pool import host_pool_for
    from kvtier.transfer.dma import DMABackend, DMAConfig
    from kvtier.transfer.dma.plan import mean_copy_bound
    spec = KVSpec("mla", 4, torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16)
    host = host_pool_for(pool_from_spec(spec, 512, 16, "cpu"), layout, host_size_tokens=512)
    parts = host.transfer_parts()
    scattered = (np.array([9, 2, 5, 14, 3])[:, None] * 16 + np.arange(16)).reshape(-1)
    runs = Runs.of(scattered)
    bound = min(mean_copy_bound(p.host, scattered, p.layer_num, DMAConfig().staging_bytes, runs=runs) for p in parts)
    for below, want_sorted in ((int(bound) + 1, True), (int(bound), False)):
        dma = DMABackend(DMAConfig(sort_below=below))
        s_np, s_runs, order = dma.in_host_order(parts, scattered, runs)
        assert (s_np is not scattered) == want_sorted == (order is not None)
        assert np.array_equal(s_np, np.sort(scattered) if want_sorted else scattered) and s_runs == Runs.of(s_np)
        assert order is None or np.array_equal(scattered[order], s_np)
    one_run = np.arange(64, 320, dtype=np.int64)
    assert DMABackend(DMAConfig(sort_below=1 << 62)).in_host_order(parts, one_run, Runs.of(one_run))[0] is one_run
    assert DMABackend(DMAConfig(sort_slots=False, sort_below=1 << 62)).in_host_order(parts, scattered, runs)[0] \
        is scattered


def test_dma_parts_get_the_slot_pairs_in_host_order_and_kernel_parts_the_callers():
    """runner_for (the step before queueing, CPU-checkable here): with some part by DMA, the
    pairs handed on are the caller's pairs permuted into host-slot order, and the kernel keeps
    the caller's; with every part by the kernel, or nothing sorted, the caller's pairs alone."""
    pytest.importorskip("triton")
    from kvtier.device_pool import pool_from_spec
    from kvtier.host_pool import host_pool_for
    from kvtier.transfer.dma import DMABackend, DMAConfig
    spec = KVSpec("mla", 4, torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16)
    host = host_pool_for(pool_from_spec(spec, 512, 16, "cpu"), "layer_first", host_size_tokens=512)
    parts = host.transfer_parts()
    h = (np.array([9, 2, 5, 14, 3])[:, None] * 16 + np.arange(16)).reshape(-1)
    d = torch.from_numpy(np.random.default_rng(0).permutation(512)[:h.size].astype(np.int64))
    dma = DMABackend(DMAConfig(sort_below=1 << 62))
    handed = []
    lazy = []
    dma.runner = lambda parts, plans, hh, dd, quota=None, kernel_idx=None, lazy_dev=False, kernel_np=None, to_host=False: (
        handed.append((hh, dd, kernel_idx, kernel_np)), lazy.append((lazy_dev, to_host)))
    s_np, runs, order = dma.in_host_order(parts, h, Runs.of(h))
    known = (h, d.numpy())  # the caller's pairs in numpy: handed on as they are, for the kernel's parts
    dma.runner_for(parts, ["a DMA plan"], order, s_np, torch.from_numpy(h), d, lazy_dev=True, kernel_np=known)
    assert lazy.pop() == (True, False)  # a load's device slots stay lazy through the reordering
    dma.runner_for(parts, ["a DMA plan"], order, s_np, torch.from_numpy(h), d, kernel_np=known, to_host=True)
    assert lazy.pop() == (False, True)  # a backup's direction reaches the kernel parts (host order)
    handed.pop()
    hh, dd, kernel_idx, kernel_np = handed.pop()
    assert (np.diff(hh.numpy()) > 0).all()
    assert sorted(zip(hh.tolist(), dd.tolist())) == sorted(zip(h.tolist(), d.tolist()))
    assert np.array_equal(kernel_idx[0].numpy(), h) and kernel_idx[1] is d and kernel_np is known
    for plans, o in (([None], order), (["a DMA plan"], None)):
        dma.runner_for(parts, plans, o, s_np, torch.from_numpy(h), d, kernel_np=known)
        hh, dd, kernel_idx, kernel_np = handed.pop()
        assert np.array_equal(hh.numpy(), h) and dd is d and kernel_idx is None and kernel_np is known


@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=300))
def test_lengths_by_value_is_np_unique_with_inverse(lengths):
    """The planner's count of run lengths (by counting when they are small) gives np.unique's answer."""
    from kvtier.transfer.slots import _lengths_by_value
    a = np.array(lengths, dtype=np.int64)
    d, inv = _lengths_by_value(a)
    want_d, want_inv = np.unique(a, return_inverse=True)
    assert np.array_equal(d, want_d) and np.array_equal(inv, want_inv.reshape(-1))
    assert np.array_equal(d[inv], a)
