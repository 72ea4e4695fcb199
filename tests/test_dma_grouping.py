"""Grouped per-layer loads, chunking and batched copies of the DMA backend: the planning side (no GPU).

The group is chosen on the GPU from timed trial loads; here the choice is
checked against the loads an H200 actually gave
(bench/results/probe_host_issue_h200.json), and the plans' byte-exactness
is checked under the Triton interpreter (tests/interpret_cases.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.layouts import LAYOUTS
from kvtier.spec import KVSpec
from hypothesis import given, settings, strategies as st

from kvtier.transfer.dma_plan import (RAMP_DIV, ChunkedPlan, LayerChunkedPlan, PoolPlan, Runs, chunk_bounds,
                                      choose_group, group_sizes, grouped_plan, HostOrder, layer_bounds, layer_major,
                                      mean_copy_bound, narrow_layer_rows, plan, pool_placement, pool_row_bytes,
                                      run_class, run_count, run_starts, split_copies)

PROBE = json.loads((Path(__file__).parent.parent / "bench/results/probe_host_issue_h200.json").read_text())
MHA = KVSpec("mha", 32, torch.bfloat16, head_num=8, head_dim=128)    # llama-3-8b: 2 KiB K or V rows
MLA = KVSpec("mla", 61, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64)  # deepseek-v3: 1152 B


def h200_load(name):
    """Whole per-layer loads (32k tokens, scatter included) an H200 gave per forced group, GB/s."""
    def rate(g):
        asked.append(g)
        return PROBE[f"{name}/g{g}/load"]["gbps"]
    asked: list[int] = []
    return rate, asked


@pytest.mark.parametrize("spec,layout,expected,tried", [
    # 1 KiB rows 8 KiB apart moved at 98% alone, yet loads with 4 layers per copy ran at 43 GB/s
    # against 54 for all 32: only timing the whole load shows it.
    (MHA, "page_head", 16, [32, 16, 8]),
    (MLA, "page_first", 32, [61, 32, 16]),   # 18 KiB rows: 46 GB/s; 37 KiB rows: 53
])
def test_group_is_the_fewest_layers_whose_timed_load_keeps_pace(spec, layout, expected, tried):
    pl = LAYOUTS[layout].placement(spec.components[0], spec.layer_num, 8192, 1)
    assert narrow_layer_rows(pl)
    rate, asked = h200_load(f"{spec.kind}/{layout}")
    assert choose_group(pl, rate, 0.97) == expected
    assert asked == tried  # from all layers down; stops at the first group that falls short


def test_group_search_stops_early_and_skips_layouts_with_long_rows():
    pl = LAYOUTS["page_first"].placement(MHA.components[0], 32, 8192, 1)
    asked = []
    assert choose_group(pl, lambda g: asked.append(g) or 50.0, 0.97) == 1
    assert asked == [32, 16, 8, 4, 2, 1]  # every group as fast: strictly per layer
    asked.clear()
    assert choose_group(pl, lambda g: asked.append(g) or (50.0 if g == 32 else 10.0), 0.97) == 32
    assert asked == [32, 16]
    lf = LAYOUTS["layer_first"].placement(MHA.components[0], 32, 8192, 64)
    assert choose_group(lf, lambda g: pytest.fail("no trial for layer_first"), 0.97) == 1


@given(slow=st.floats(1.0, 40.0), others=st.lists(st.floats(45.0, 55.0), min_size=6, max_size=6),
       small=st.floats(5.0, 30.0))
def test_a_disturbed_first_trial_does_not_set_the_bar(slow, others, small):
    """The all-layers trial slowed by other traffic (a pair's backup on the link): groups are
    held to the fastest trial so far, so the search stops where a group falls well short of
    it instead of clearing a low bar down to one layer per copy."""
    pl = LAYOUTS["page_first"].placement(MLA.components[0], 61, 8192, 1)
    rates = {61: slow, 32: others[0], 16: small, 8: others[1], 4: others[2], 2: others[3], 1: others[4]}
    assert choose_group(pl, rates.__getitem__, 0.97) == 32
    # Each rate as it came: a faster smaller group raises the bar for the next.
    seq = {61: 50.0, 32: 53.0, 16: 50.0}  # 16 is within 0.97 of 50 but not of 53
    assert choose_group(pl, lambda g: seq.get(g, 0.0), 0.97) == 32


def test_group_sizes():
    assert group_sizes(32) == [1, 2, 4, 8, 16, 32] and group_sizes(61)[-2:] == [32, 61] and group_sizes(1) == [1]


@pytest.mark.parametrize("layers,group,issues", [
    (7, 3, {0: 3, 3: 3, 6: 1}),
    (8, 4, {0: 4, 4: 4}),
    (5, 1, {i: 1 for i in range(5)}),
    (4, 4, {0: 4}),
])
def test_every_layer_is_issued_once_at_its_groups_first_layer(layers, group, issues):
    spec = KVSpec("mha", layers, torch.bfloat16, head_num=2, head_dim=16)
    pl = LAYOUTS["page_first"].placement(spec.components[0], layers, 256, 16)
    gp = grouped_plan(pl, np.arange(64), group, 1 << 20)
    assert {l: gp.issue_at(l) for l in range(layers) if gp.issue_at(l)} == issues
    covered = [l + i for l, n in issues.items() for i in range(n)]
    assert sorted(covered) == list(range(layers))
    assert set(gp.plans) == set(issues.values())
    # Moving g adjacent page_first layers widens each row g-fold (the point of grouping);
    # all layers of consecutive tokens are one contiguous run.
    item = pl.chunk_bytes
    assert gp.plans[group].min_width == (group * item if group < layers else 64 * layers * item)


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


@given(offsets=st.lists(st.integers(0, 4096), min_size=1, max_size=40), buf_off=st.integers(0, 64),
       layout=st.sampled_from(["layer_first", "page_first", "page_head"]), ps=st.sampled_from([1, 16]))
def test_word_plan_from_the_cached_layer_gcd_is_the_plan_from_every_address(offsets, buf_off, layout, ps):
    """The kernels' word size from the part's remembered address gcd equals the one from a
    pass over every layer's address: a wrong one would move misaligned words."""
    pytest.importorskip("triton")
    from kvtier.transfer.triton_kernels import WordPlan, layers_gcd
    mem = torch.zeros(8192, dtype=torch.uint8)
    layers = [mem[o:o + 16] for o in offsets]
    pl = LAYOUTS[layout].placement(MHA.components[0], 4, 64, ps)
    buf = mem[buf_off:]
    g = 0
    for v in (pl.page, pl.token, pl.layer_stride, pl.chunk, pl.chunk_bytes, pl.item_bytes, buf.data_ptr(),
              *(t.data_ptr() for t in layers)):
        g = math.gcd(g, v)
    word = next(w for w in (8, 4, 2, 1) if g % w == 0)
    want = WordPlan(word, 16 // word if g % 16 == 0 else 1)
    assert WordPlan.for_copy(pl, buf, layers, layers_gcd(layers)) == want == WordPlan.for_copy(pl, buf, layers)


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


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_slot_pairs_are_sorted_only_where_some_parts_copies_would_be_small(layout):
    """DMAConfig.sort_slots sorts scattered host pages only where, as given, some part's copies
    would average under sort_below bytes (the mean-copy bound); allocator slots never."""
    pytest.importorskip("triton")
    from kvtier.device_pool import pool_from_spec
    from kvtier.host_pool import host_pool_for
    from kvtier.transfer.dma import DMABackend, DMAConfig
    from kvtier.transfer.dma_plan import mean_copy_bound
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


@given(layers=st.integers(1, 80), group=st.integers(1, 16), every=st.integers(0, 12))
def test_a_load_drains_once_per_multiple_of_the_drain_count_and_never_before_its_first_copy(layers, group, every):
    """``DMAConfig.load_drain``: a load queued in groups of ``group`` layers drains before the
    group that holds each multiple of ``every`` (except at layer 0), never twice for one, and
    never when ``every`` is 0: other streams' copies wait for at most ``every`` layers and
    one group."""
    pytest.importorskip("triton")
    from kvtier.transfer.dma import drains_at
    calls = [(first, min(group, layers - first)) for first in range(0, layers, group)]
    drained = [first for first, n in calls if drains_at(first, n, every)]
    if every == 0:
        assert drained == []
        return
    wanted = {m for m in range(every, layers, every)}
    holding = {first for first, n in calls if any(first <= m < first + n for m in wanted)}
    assert set(drained) == holding - {0}
    assert len(drained) <= len(wanted)


@given(layered=st.booleans(), n_pages=st.integers(1, 200), ps=st.sampled_from([1, 16]),
       stage_kib=st.sampled_from([64, 256, 1024]), budget_kib=st.integers(0, 8192))
@settings(max_examples=60)
def test_head_chunks_are_the_fewest_first_chunks_that_hold_the_budget(layered, n_pages, ps, stage_kib, budget_kib):
    """``head_chunks``: at least one chunk, at most all; the chunks before the last one it
    takes hold less than the budget, and with the last they hold it (or it took them all).
    Chunk bytes counted as the chunks' own copies count them, for slot and layer chunks."""
    pytest.importorskip("triton")
    from kvtier.transfer.dma import head_chunks
    comp = MLA.components[0]
    pl = LAYOUTS["layer_first" if layered else "page_first"].placement(comp, 61, 256 * ps, ps)
    h = np.arange(n_pages * ps, dtype=np.int64)
    stage = stage_kib << 10
    p = (LayerChunkedPlan(pl, h, max(stage, h.size * pl.item_bytes), ramp=1 << 16) if layered
         else ChunkedPlan(pl, h, 61, max(stage, 61 * ps * pl.item_bytes), ramp=1 << 16))
    sizes = []
    for i in range(p.n_chunks):
        tall, flat = p.calls(i)
        sizes.append(int((tall[:, 2] * tall[:, 3]).sum()) + int(flat[:, 2].sum()))
    budget = budget_kib << 10
    n = head_chunks(p, 61, pl.item_bytes, budget)
    assert 1 <= n <= p.n_chunks
    assert n == 1 or sum(sizes[:n - 1]) < budget
    assert sum(sizes[:n]) >= budget or n == p.n_chunks


@given(layers=st.integers(0, 8), min_bytes=st.integers(0, 1 << 31), layer_bytes=st.integers(0, 1 << 28))
def test_a_load_drains_every_load_drain_layers_but_no_sooner_than_load_drain_bytes(layers, min_bytes, layer_bytes):
    """``drain_every``: 0 stays never; else the fewest layers, at least ``load_drain``, that move
    ``load_drain_bytes`` (a 32k MLA load: 15 layers of 37.7 MB, where MHA's 128 MiB layers
    keep 4)."""
    pytest.importorskip("triton")
    from kvtier.transfer.dma import drain_every
    every = drain_every(layers, min_bytes, layer_bytes)
    if layers == 0:
        assert every == 0
        return
    assert every >= layers and (every * max(layer_bytes, 1) >= min_bytes)
    assert every == layers or (every - 1) * max(layer_bytes, 1) < min_bytes
    mib = 1 << 20
    assert drain_every(4, 512 * mib, 32768 * 1152) == 15 and drain_every(4, 512 * mib, 32768 * 4096) == 4


@given(a=st.integers(-(2**40), 2**40))
def test_the_launch_key_tells_apart_whatever_triton_specializes_an_int_on(a):
    """The launcher path reuses a compiled kernel only for arguments in the same class: an int
    equal to 1, a multiple of 16 or not, in 32 bits or not, each gets a class of its own, as
    Triton specializes on each (a kernel compiled for a multiple of 16 would be wrong for 17)."""
    pytest.importorskip("triton")
    from kvtier.transfer.triton_kernels import arg_class
    for b in (1, 16, 17, 2**31, -(2**31) - 1, 0, 2**63, 2**64 - 16):
        if arg_class(a) == arg_class(b):
            assert (a == 1) == (b == 1) and (a % 16 == 0) == (b % 16 == 0)
            assert (-(2**31) <= a < 2**31) == (-(2**31) <= b < 2**31)
    assert arg_class(2**40) != arg_class(2**63)  # Triton's i64 and u64
    t = torch.zeros(64, dtype=torch.uint8)
    assert arg_class(t[:8]) != arg_class(t[1:9]) != arg_class(t[:8].view(torch.int64))


@given(n=st.integers(1, 2**40))
def test_next_pow2_is_tritons(n):
    triton = pytest.importorskip("triton")
    from kvtier.transfer.triton_kernels import next_pow2
    assert next_pow2(n) == triton.next_power_of_2(n)


def test_the_launch_geometry_follows_the_tile_size(monkeypatch):
    """Probes sweep TILE_BYTES and NUM_WARPS: each setting gets its own blocks and its own kept
    launcher, not the first setting's from the caches."""
    pytest.importorskip("triton")
    import kvtier.transfer.triton_kernels as tk
    pl = LAYOUTS["layer_first"].placement(MHA.components[0], 4, 4096, 1)
    wp = tk.WordPlan(8, 2)
    before = tk.launch_geometry(pl, wp, 1000, 4, 64, True, True)
    monkeypatch.setattr(tk, "TILE_BYTES", 4 * tk.TILE_BYTES)
    after = tk.launch_geometry(pl, wp, 1000, 4, 64, True, True)
    assert after.consts[3] == 4 * before.consts[3] and after.key != before.key
    monkeypatch.setattr(tk, "ROW_ORDER_BY_LAYOUT", False)
    assert tk.launch_geometry(pl, wp, 1000, 4, 64, True, True) == after  # layer_first: order 0 either way


def test_the_launcher_gets_every_argument_in_the_kernels_order():
    """The kept launcher takes the kernel's arguments by position, constants included: each
    value lands on the parameter of its name."""
    pytest.importorskip("triton")
    import kvtier.transfer.triton_kernels as tk
    pl = LAYOUTS["page_head"].placement(MHA.components[0], 4, 64, 16)
    g = tk._geometry(pl, 2, 8, 37, 3, 5, True, False, False, True)
    names = list(tk._copy_items.arg_names)
    const = [p.name for p in tk._copy_items.params if p.is_constexpr]
    assert names[-len(const):] == const == list(tk._CONST_NAMES)
    tensors = ("dev_ptrs", "buf", "buf_idx", "dev_idx")
    got = dict(zip(names, (*tk.launch_args(g, tensors, 1001, 1002), *g.consts)))
    want = {"dev_ptrs": "dev_ptrs", "buf": "buf", "buf_idx": "buf_idx", "dev_idx": "dev_idx", "item0": 1001,
            "layer0": 1002, "n_items": 37, "n_layers": 3, "n_rows": 3 * 37 * pl.n_chunks,
            "page": pl.page // 2,
            "token": pl.token // 2, "layer_stride": pl.layer_stride // 2, "chunk": pl.chunk // 2,
            "page_size": 16, "n_chunks": pl.n_chunks, "chunk_words": pl.chunk_bytes // 2,
            "item_words": pl.item_bytes // 2, "TO_BUF": True, "BUF_LINEAR": False, "VEC": 8}
    assert {k: got[k] for k in want} == want
    n_tiles = -(-got["n_rows"] // got["BLOCK_R"])
    assert got["n_tiles"] == -(-n_tiles // g.grid) and g.grid == min(n_tiles, 5)


@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=300))
def test_lengths_by_value_is_np_unique_with_inverse(lengths):
    """The planner's count of run lengths (by counting when they are small) gives np.unique's answer."""
    from kvtier.transfer.dma_plan import _lengths_by_value
    a = np.array(lengths, dtype=np.int64)
    d, inv = _lengths_by_value(a)
    want_d, want_inv = np.unique(a, return_inverse=True)
    assert np.array_equal(d, want_d) and np.array_equal(inv, want_inv.reshape(-1))
    assert np.array_equal(d[inv], a)
