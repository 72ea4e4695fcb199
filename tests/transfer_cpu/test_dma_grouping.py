"""Grouped per-layer loads of the DMA backend, and when its loads drain: the planning side (no GPU).

The group is chosen on the GPU from timed trial loads; here the choice is
checked against the loads an H200 actually gave
(bench/results/h200/probes.json ("host_issue")). The plans themselves:
test_dma_plans.py and test_dma_backups_cpu.py beside this file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvtier.layouts import LAYOUTS
from kvtier.spec import KVSpec
from kvtier.transfer.dma.chunked import ChunkedPlan, LayerChunkedPlan
from kvtier.transfer.dma.chunked import choose_group, group_sizes, grouped_plan, narrow_layer_rows
from kvtier_testlib import MHA, MLA


PROBE = json.loads((Path(__file__).parents[2] / "bench/results/h200/probes.json").read_text())["host_issue"]


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
