"""Property tests: every kind x layout x page size x dtype x odd head shape x scattered slots.

The oracle reads host bytes through the seed-shaped typed tensors (``k_buffer``,
``kv_buffer``, ``index_k_buffer``), not through the placements under test.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvtier.layouts import SUPPORTED
from conftest import devices
from kvtier_testlib import (
    as_bytes, device_bytes, fill_random, make_device_pool, make_host_pool, pages_to_slots,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn]
CASES = [(k, lay) for k in ("mha", "mla", "dsa") for lay in SUPPORTED[k]]


@st.composite
def scenarios(draw):
    kind, layout = draw(st.sampled_from(CASES))
    page_size = draw(st.sampled_from([1, 16, 64]))
    shape = dict(
        heads=draw(st.sampled_from([1, 3, 5])),
        head_dim=draw(st.sampled_from([24, 40, 72])),
        lora=draw(st.sampled_from([48, 96, 112])),
        rope=draw(st.sampled_from([0, 16, 24])),
        index_head_dim=draw(st.sampled_from([128, 256])),
    )
    dev_pages = draw(st.integers(4, 8))
    host_pages = draw(st.integers(3, 6))
    n_pages = draw(st.integers(1, min(dev_pages // 2, host_pages)))
    src, dst = draw(st.permutations(range(dev_pages)).map(lambda p: (p[:n_pages], p[n_pages : 2 * n_pages])))
    scattered_host = draw(st.booleans())
    host_pick = draw(st.permutations(range(host_pages)))[:n_pages] if scattered_host else None
    # MHA and MLA may also move single tokens in any order; DSA moves whole pages only.
    token_level = kind != "dsa" and page_size > 1 and draw(st.booleans())
    return dict(
        kind=kind, layout=layout, page_size=page_size, dtype=draw(st.sampled_from(DTYPES)),
        layers=draw(st.integers(1, 3)), shape=shape, dev_pages=dev_pages, host_pages=host_pages,
        src=list(src), dst=list(dst), host_pick=host_pick, token_level=token_level,
        seed=draw(st.integers(0, 2**31 - 1)), indices_on_device=draw(st.booleans()),
    )


def slot_rows(host, comp: str, slot: int, layer: int) -> torch.Tensor:
    """One token's item of one layer, read through the seed-shaped typed tensor."""
    t = host.component_tensors[comp]
    ps = host.page_size
    if host.layout == "layer_first":
        return t[layer, slot]
    if host.layout == "page_first":
        return t[slot, layer]
    return t[slot // ps, :, slot % ps, layer]  # page_head: (heads, head_dim)


def host_bytes(host, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for c in host.spec.components:
        per_layer = [
            torch.stack([as_bytes(slot_rows(host, c.name, s, layer)).reshape(-1) for s in slots.tolist()])
            for layer in range(host.layer_num)
        ]
        out[c.name] = torch.stack(per_layer)
    return out


def transfer_slots(sc, host):
    ps = sc["page_size"]
    src = pages_to_slots(sc["src"], ps)
    dst = pages_to_slots(sc["dst"], ps)
    if sc["host_pick"] is None:
        h = host.alloc(len(src))
    else:
        h = pages_to_slots(sc["host_pick"], ps)
    if sc["token_level"]:
        gen = torch.Generator().manual_seed(sc["seed"])
        perm = torch.randperm(len(src), generator=gen)
        src, h = src[perm], h[torch.randperm(len(h), generator=gen)]
    return src, dst, h


def synchronize(pool):
    if pool.device.type == "cuda":
        torch.cuda.synchronize()


def backed_up_pages(sc):
    """Pools with ``src`` pages backed up to freshly allocated host pages ``h``."""
    dev, host = build(sc, "cpu")
    src = pages_to_slots(sc["src"], sc["page_size"])
    h = host.alloc(len(src))
    host.backup_from_device_all_layer(dev, h, src, "direct")
    return dev, host, h


def build(sc, device):
    dev = make_device_pool(sc["kind"], sc["dev_pages"] * sc["page_size"], sc["page_size"], sc["dtype"],
                           sc["layers"], device, **sc["shape"])
    host = make_host_pool(dev, sc["layout"], sc["host_pages"] * sc["page_size"])
    fill_random(dev, sc["seed"])
    return dev, host


@pytest.mark.parametrize("device", devices())
@settings(max_examples=150)
@given(sc=scenarios())
def test_backup_then_per_layer_load_is_byte_identical(device, sc):
    dev, host = build(sc, device)
    src, dst, h = transfer_slots(sc, host)
    if device == "cuda":
        assert host.pinned and host.raw_bytes(host.spec.components[0].name).is_pinned()
    expected = device_bytes(dev, src)
    if sc["indices_on_device"]:  # index tensors may live on either device
        src, dst, h = src.to(device), dst.to(device), h.to(device)
    host.backup_from_device_all_layer(dev, h, src, "direct")
    synchronize(dev)
    got_host = host_bytes(host, h.cpu())
    for name in expected:
        assert torch.equal(got_host[name], expected[name]), f"backup of {name}"

    host_before = {c.name: host.raw_bytes(c.name).clone() for c in host.spec.components}
    untouched = torch.tensor(sorted(set(range(dev.size)) - set(dst.tolist())), dtype=torch.int64)
    dev_before = device_bytes(dev, untouched)
    for layer in range(dev.layer_num):
        host.load_to_device_per_layer(dev, h, dst, layer, "direct")
    synchronize(dev)
    got = device_bytes(dev, dst)
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"load of {name}"
        assert torch.equal(device_bytes(dev, untouched)[name], dev_before[name]), "load wrote outside dst"
        assert torch.equal(host.raw_bytes(name), host_before[name]), "load changed its source"


@settings(max_examples=80)
@given(sc=scenarios())
def test_backup_changes_nothing_outside_its_host_slots(sc):
    dev, host = build(sc, "cpu")
    src, _, h = transfer_slots(sc, host)
    others = torch.tensor(sorted(set(range(host.size)) - set(h.tolist())), dtype=torch.int64)
    before = host_bytes(host, others) if len(others) else None
    dev_before = device_bytes(dev, torch.arange(dev.size))
    host.backup_from_device_all_layer(dev, h, src, "direct")
    if before is not None:
        after = host_bytes(host, others)
        assert all(torch.equal(after[n], before[n]) for n in before)
    after_dev = device_bytes(dev, torch.arange(dev.size))
    assert all(torch.equal(after_dev[n], dev_before[n]) for n in dev_before), "backup changed its source"


@settings(max_examples=80)
@given(sc=scenarios())
def test_flat_page_round_trips_between_two_host_pools(sc):
    dev, host, h = backed_up_pages(sc)
    ps = sc["page_size"]
    other = make_host_pool(dev, sc["layout"], sc["host_pages"] * ps)
    other_slots = other.alloc(len(h)).flip(0).reshape(-1, ps).flip(1).reshape(-1)  # other pages, reversed
    for i in range(0, len(h), ps):
        page = host.get_data_page(int(h[i]))
        assert page.dim() == 1 and page.numel() * page.element_size() == host.page_bytes
        target = int(other_slots[i : i + ps].min())
        other.set_from_flat_data_page(target, page)
        back = other.get_data_page(target)
        assert torch.equal(as_bytes(back), as_bytes(page))
        a = host_bytes(host, h[i : i + ps])
        b = host_bytes(other, torch.arange(target, target + ps))
        assert all(torch.equal(a[n], b[n]) for n in a)


def _merge(intervals):
    merged = []
    for start, n in sorted(intervals):
        if merged and merged[-1][1] == start:
            merged[-1][1] = start + n
        else:
            merged.append([start, start + n])
    return merged


@settings(max_examples=80)
@given(sc=scenarios())
def test_page_buffer_meta_covers_exactly_the_pages_bytes(sc):
    _, host, h = backed_up_pages(sc)
    ps = sc["page_size"]
    ptrs, sizes = host.get_page_buffer_meta(h)
    assert sum(sizes) == len(h) // ps * host.page_bytes
    # Bytes read through the pointers are the flat pages, back to back.
    through_ptrs = b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))
    flat = b"".join(as_bytes(host.get_data_page(int(h[i]))).numpy().tobytes() for i in range(0, len(h), ps))
    assert through_ptrs == flat
    # The pointers cover exactly the addresses of the pages' tokens, nothing else.
    expected = []
    for c in host.spec.components:
        for s in h.tolist():
            for layer in range(host.layer_num):
                rows = slot_rows(host, c.name, s, layer)
                rows = rows.reshape(-1, rows.shape[-1]) if rows.dim() > 1 else rows.reshape(1, -1)
                for r in rows:
                    expected.append((r.data_ptr(), r.numel() * r.element_size()))
    assert _merge(zip(ptrs, sizes)) == _merge(expected)
