"""Grouped per-layer loads and batched copies of the DMA backend: the planning side (no GPU).

The copy engine's speed for pitched rows is measured on the GPU; here the
choice of group is checked against the rates an H200 actually gave
(bench/results/probe_copy_paths_h200.json), and the plans' byte-exactness
is checked under the Triton interpreter (tests/interpret_cases.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.layouts import LAYOUTS
from kvtier.spec import KVSpec
from kvtier.transfer.dma_plan import (choose_group, group_sizes, grouped_plan, narrow_layer_rows,
                                      split_copies)

PROBE = json.loads((Path(__file__).parent.parent / "bench/results/probe_copy_paths_h200.json").read_text())
MHA = KVSpec("mha", 32, torch.bfloat16, head_num=8, head_dim=128)    # llama-3-8b: 2 KiB K or V rows
MLA = KVSpec("mla", 61, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64)  # deepseek-v3: 1152 B


def h200_rate(width: int, pitch: int, offset: int = 0) -> float:
    """Pitched-copy GB/s measured on the H200 over its contiguous copy; 0 where not measured."""
    got = PROBE.get(f"group/w{width}/pitch{pitch}/h2d")
    return got / PROBE["limit/registered/h2d"] if got else 0.0


@pytest.mark.parametrize("spec,layout,expected", [
    (MHA, "page_first", 16),   # 32 KiB rows 64 KiB apart: 99.5%; 16 KiB rows: 88%
    (MLA, "page_first", 16),   # 18 KiB rows 70 KiB apart: 99.4%; 9 KiB rows: 74%
    (MHA, "page_head", 4),     # 1 KiB rows 8 KiB apart: 99.6%; 256 B rows: 70% (pages and heads merge)
    (MHA, "layer_first", 1),   # a layer's rows are already one run per page
])
def test_group_is_the_fewest_layers_the_copy_engine_keeps_pace_with(spec, layout, expected):
    pl = LAYOUTS[layout].placement(spec.components[0], spec.layer_num, 8192, 64)
    assert narrow_layer_rows(pl) == (expected > 1)
    runs = np.arange(4096)  # host slots as the allocator hands them out
    group, built = choose_group(pl, runs, 32 << 20, h200_rate, 0.97, 256 << 10)
    assert group == expected
    assert group == 1 or built[group].min_width == group * pl.chunk_bytes


def test_group_grows_until_copies_are_long_enough_for_the_host_to_keep_up():
    pl = LAYOUTS["page_first"].placement(MHA.components[0], 32, 8192, 1)
    scattered = np.random.default_rng(0).permutation(4096)[:2048] * 2  # no two slots adjacent
    # Rows fast at any width, but one token per copy: 2 KiB copies cost more to queue than to
    # move; groups grow until two batched copies (a runtime call's worth) would carry 256 KiB,
    # and with no group that does, all layers go at once.
    group, built = choose_group(pl, scattered, 32 << 20, lambda w, p, o: 1.0, 0.97, 256 << 10)
    assert group == 32 and built[32].n_flat == 2048 and built[32].min_width == 32 * 2048
    assert sorted(built) == [1, 2, 4, 8, 16, 32]  # every smaller group was tried first
    assert choose_group(pl, np.arange(2048), 32 << 20, lambda w, p, o: 1.0, 0.97, 256 << 10)[0] == 1
    assert choose_group(pl, np.arange(2048), 32 << 20, lambda w, p, o: 0.5, 0.97, 256 << 10)[0] == 32

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
    tall, (h, s, w) = split_copies(rows, (1 << 31) - 1)
    assert tall.tolist() == [rows[0].tolist()]              # pitched, within the 2-D call's limit
    assert h.tolist() == [5000] + [9000 + r * (1 << 33) for r in range(4)]  # 1-D, and the too-far pitch split
    assert s.tolist() == [192, 224, 240, 256, 272] and w.tolist() == [32, 16, 16, 16, 16]
    none = split_copies(rows[:1], (1 << 31) - 1)[1]
    assert all(len(a) == 0 for a in none)


@pytest.mark.parametrize("bad", [{"load_group": -1}, {"load_group": True}, {"load_group": 1.5},
                                 {"group_target": 0.0}, {"group_target": 1.5}, {"batch_min": 0},
                                 {"buffers": 1}])
def test_dma_config_rejects_bad_values_by_name(bad):
    pytest.importorskip("triton")
    from kvtier.transfer.dma import DMAConfig
    with pytest.raises(ValueError, match=next(iter(bad))):
        DMAConfig(**bad)


def test_group_rates_are_measured_from_the_second_groups_offset_too():
    """On an H200, 8 KiB rows 64 KiB apart moved at 99.6% from layer 0 but 90% from layer 4
    (bench/results/probe_grouped_load_h200.json): a group qualifies only from both."""
    probe = json.loads((Path(__file__).parent.parent / "bench/results/probe_grouped_load_h200.json").read_text())
    pl = LAYOUTS["page_first"].placement(MHA.components[0], 32, 65536, 1)
    asked = []

    def rate(width, pitch, offset):
        g = width // pl.chunk_bytes
        asked.append((g, offset // pl.layer_stride))
        key = f"mha/page_first/g{g}/row_rate_64MiB" + (f"_layer{g}" if offset else "")
        return probe.get(key, 0.0)
    group, _ = choose_group(pl, np.arange(32768), 32 << 20, rate, 0.97, 256 << 10)
    assert group == 16  # g4 and g8 pass from layer 0 only
    assert (4, 0) in asked and (4, 4) in asked and (16, 16) in asked
