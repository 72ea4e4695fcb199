"""The Triton copy kernel and the DMA plans, run on the CPU through TRITON_INTERPRET=1.

The interpreter executes the same kernel source on tiny CPU tensors; the
copy engine is played by ``ctypes.memmove`` row by row. Not covered here:
the compiled grid-stride loop (the interpreter cannot loop over a runtime
bound with numpy >= 2.4, so each program does one tile there), streams and
events; tests/transfer_gpu/ covers those on a GPU.
"""

from __future__ import annotations

import ctypes
import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

triton = pytest.importorskip("triton")

from kvtier.layouts import LAYOUTS, SUPPORTED  # noqa: E402
from kvtier.spec import KVSpec  # noqa: E402
from kvtier.transfer.dma.chunked import LayerChunkedPlan, layer_major
from kvtier.transfer.dma.plan import compact, dma_capable, plan
from kvtier.transfer.dma.chunked import grouped_plan
from kvtier.transfer.triton_kernels import copy_items, layer_ptr_table  # noqa: E402

SPECS = [
    KVSpec("mha", 3, torch.bfloat16, head_num=3, head_dim=20),        # 120-byte heads
    KVSpec("mha", 2, torch.float8_e4m3fn, head_num=2, head_dim=7),     # 7-byte heads: byte copies
    KVSpec("mla", 2, torch.float8_e4m3fn, kv_lora_rank=512, qk_rope_head_dim=144),  # 656-byte rows
    KVSpec("dsa", 2, torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8, index_head_dim=128),
]


def _slots(draw_perm, pages, ps, n_pages, contiguous):
    chosen = np.arange(n_pages) + 1 if contiguous else draw_perm[:n_pages]
    return (chosen[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int64)


def _reference(pl, host, dev, h, d, layers):
    for l in layers:
        for hs, ds in zip(h.tolist(), d.tolist()):
            for c in range(pl.n_chunks):
                off = pl.offset(hs, l, c)
                host[off:off + pl.chunk_bytes] = dev[l, ds, c * pl.chunk_bytes:(c + 1) * pl.chunk_bytes]


def _memmove_copies(p, i, host_base, stg_base, to_host):
    """Play the copy engine for chunk ``i``: pitched rows row by row, then the flat 1-D copies (as batched)."""
    tall, flat = p.calls(i)
    rows = [(h + r * hp, st + r * sp, w) for h, st, w, height, hp, sp in tall.tolist() for r in range(height)]
    for h, st, w in rows + [tuple(f) for f in flat.tolist()]:
        hs, ss = host_base + h, stg_base + st
        ctypes.memmove(hs, ss, w) if to_host else ctypes.memmove(ss, hs, w)


cases = st.tuples(
    st.sampled_from(range(len(SPECS))), st.sampled_from(["layer_first", "page_first", "page_head"]),
    st.sampled_from([1, 4]), st.booleans(), st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 64]),
    st.sampled_from([1, 2, 3]), st.sampled_from([1 << 40, 4096]),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases)
def test_kernel_and_dma_plan_match_reference(case):
    si, layout, ps, contiguous, seed, stage_kib, group, max_pitch = case
    spec = SPECS[si]
    if layout not in SUPPORTED[spec.kind]:
        return
    rng = np.random.default_rng(seed)
    size, dsize = 12 * ps, 10 * ps
    n_pages = int(rng.integers(1, 6))
    h = _slots(rng.permutation(12), 12, ps, n_pages, contiguous)
    d = _slots(rng.permutation(10), 10, ps, n_pages, False)
    ht, dt = torch.from_numpy(h), torch.from_numpy(d)
    for comp in spec.components:
        pl = LAYOUTS[layout].placement(comp, spec.layer_num, size, ps)
        L = spec.layer_num
        dev = torch.randint(0, 256, (L, dsize, comp.item_bytes), dtype=torch.uint8)
        layers = tuple(dev.unbind(0))
        ptrs = layer_ptr_table(layers, "cpu")
        ref = torch.full((pl.total_bytes,), 0xA5, dtype=torch.uint8)
        _reference(pl, ref, dev, h, d, range(L))
        # Zero-copy kernel, all layers.
        host = torch.full_like(ref, 0xA5)
        copy_items(pl, host, layers, ptrs, ht, dt, 0, h.size, 0, L, True, 8)
        assert torch.equal(host, ref)
        # DMA: gather into staging, then the planned copies (backup) ...
        if dma_capable(pl, h):
            host2 = torch.full_like(ref, 0xA5)
            p = plan(pl, h, L, stage_kib * 1024, max_pitch, ramp=1)  # first chunks small, as backups go
            stg = torch.empty(p.staging_bytes, dtype=torch.uint8)
            for i in range(p.n_chunks):
                j0, m, _ = p.chunk(i)
                copy_items(p.staging, stg, layers, ptrs, None, dt, j0, m, 0, L, True, 8)
                _memmove_copies(p, i, host2.data_ptr(), stg.data_ptr(), True)
            assert torch.equal(host2, ref)
        # ... and in chunks of whole layers, every slot in each (layer-major layouts) ...
        if layer_major(pl):
            host3 = torch.full_like(ref, 0xA5)
            lp = LayerChunkedPlan(pl, h, stage_kib * 1024, max_pitch, ramp=1)
            stg = torch.empty(lp.staging_bytes, dtype=torch.uint8)
            for i in range(lp.n_chunks):
                j0, m = lp.items(i)
                l0, nl = lp.layer_range(i)
                copy_items(lp.staging, stg, layers, ptrs, None, dt, j0, m, l0, nl, True, 8)
                _memmove_copies(lp, i, host3.data_ptr(), stg.data_ptr(), True)
            assert torch.equal(host3, ref)
        # ... and per-layer loads back into a poisoned device, by kernel and by DMA
        # (``group`` adjacent layers per copy, issued at each group's first layer).
        for use_dma in (False, True):
            if use_dma and not dma_capable(pl, h):
                continue
            out = torch.full_like(dev, 0x5A)
            olayers = tuple(out.unbind(0))
            optrs = layer_ptr_table(olayers, "cpu")
            gp = grouped_plan(pl, h, min(group, L), stage_kib * 1024, max_pitch=max_pitch)
            for l in range(L):
                buf = ref[l * pl.layer_stride:]
                if not use_dma:
                    copy_items(pl, buf, olayers, optrs, ht, dt, 0, h.size, l, 1, False, 8)
                    continue
                n = gp.issue_at(l)
                if n == 0:
                    continue
                p = gp.plans[n]
                stg = torch.empty(p.staging_bytes, dtype=torch.uint8)
                for i in range(p.n_chunks):
                    j0, m, _ = p.chunk(i)
                    _memmove_copies(p, i, buf.data_ptr(), stg.data_ptr(), False)
                    copy_items(p.staging, stg, olayers, optrs, None, dt, j0, m, l, n, False, 8)
            assert torch.equal(out[:, d], dev[:, d])
            rest = np.setdiff1d(np.arange(dsize), d)
            assert (out[:, rest] == 0x5A).all()


def test_compact_keeps_layout_order():
    spec = SPECS[0]
    comp = spec.components[0]
    for name, lay in LAYOUTS.items():
        pl = lay.placement(comp, 3, 64, 4)
        c = compact(pl, 64, 3)
        assert c == pl, name  # a full-size staging pool is the layout itself


def _drawn(ps: int, seed: int):
    """Scattered host and device pages (1-5) of ``ps`` slots, from pools of 12 and 10 pages."""
    rng = np.random.default_rng(seed)
    n_pages = int(rng.integers(1, 6))
    return _slots(rng.permutation(12), 12, ps, n_pages, False), _slots(rng.permutation(10), 10, ps, n_pages, False)


def _parts_and_reference(spec, layout, ps, h, d):
    """Per component: a TransferPart over a poisoned host buffer (12 pages) and random device
    rows (10 pages), the host bytes the direct copy of pairs ``h``, ``d`` would leave, and the
    device rows."""
    from kvtier.transfer.base import TransferPart
    parts, refs, devs = [], [], []
    for comp in spec.components:
        pl = LAYOUTS[layout].placement(comp, spec.layer_num, 12 * ps, ps)
        dev = torch.randint(0, 256, (spec.layer_num, 10 * ps, comp.item_bytes), dtype=torch.uint8)
        ref = torch.full((pl.total_bytes,), 0xA5, dtype=torch.uint8)
        _reference(pl, ref, dev, h, d, range(spec.layer_num))
        parts.append(TransferPart(comp.name, torch.full_like(ref, 0xA5), pl, tuple(dev.unbind(0))))
        refs.append(ref), devs.append(dev)
    return parts, refs, devs


page_cases = st.tuples(
    st.sampled_from(range(len(SPECS))), st.sampled_from(["layer_first", "page_first", "page_head"]),
    st.sampled_from([2, 4, 8]), st.sampled_from([0, 16, 256, 8192]), st.integers(0, 2**31 - 1),
    st.booleans(),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_cases)
def test_whole_pages_move_a_page_per_row(case):
    """KernelConfig.page_rows: where the slot pairs are whole pages, the kernel copies each
    page's run as one row (layer_first), and the bytes are those of the per-token copy; where
    one pair breaks a page, the per-token rows are used, and are right too."""
    from kvtier.transfer.base import TransferPart
    from kvtier.transfer.kernel import KernelBackend, KernelConfig, page_part, whole_pages
    si, layout, ps, cap, seed, broken = case
    spec = SPECS[si]
    if layout not in SUPPORTED[spec.kind]:
        return
    dsize, L = 10 * ps, spec.layer_num
    h, d = _drawn(ps, seed)
    if broken:  # one pair off its page's order: not whole pages any more
        h[[0, 1]] = h[[1, 0]]
    assert whole_pages(h, d, ps) == (not broken)
    assert not whole_pages(h, d, 1) and not whole_pages(h[: ps - 1], d[: ps - 1], ps)
    kb = KernelBackend(KernelConfig(page_chunk_bytes=cap))
    parts, refs, devs = _parts_and_reference(spec, layout, ps, h, d)
    for comp, part in zip(spec.components, parts):
        paged = page_part(part, cap)
        assert (paged is not None) == (layout == "layer_first"), layout
        if paged is not None:
            run = ps * comp.item_bytes
            low = run & -run  # the largest power of two dividing the run
            assert paged.host.chunk_bytes == (run if low < 16 or not cap else min(low, cap))
            assert paged.host.n_chunks * paged.host.chunk_bytes == run
    ht, dt = torch.from_numpy(h), torch.from_numpy(d)
    moves = kb.moves(parts, ht, dt, h, d)
    for (moved, _, _), part in zip(moves, parts):
        assert (moved is not part) == (layout == "layer_first" and not broken)
    # Backup, all layers, then a load of every layer into a poisoned device.
    for move in moves:
        kb.copy_part(*move, None, 8)
    for part, ref in zip(parts, refs):
        assert torch.equal(part.host_raw, ref)
    outs = [torch.full_like(dev, 0x5A) for dev in devs]
    back = [TransferPart(p.name, p.host_raw, p.host, tuple(o.unbind(0))) for p, o in zip(parts, outs)]
    for layer in range(L):
        for move in kb.moves(back, ht, dt, h, d):
            kb.copy_part(*move, layer, 8)
    rest = np.setdiff1d(np.arange(dsize), d)
    for out, dev in zip(outs, devs):
        assert torch.equal(out[:, d], dev[:, d])
        assert (out[:, rest] == 0x5A).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(SPECS))), st.sampled_from(["layer_first", "page_first", "page_head"]),
       st.sampled_from([1, 4]), st.integers(0, 2**31 - 1), st.booleans())
def test_backups_move_in_host_slot_order_and_loads_as_given(si, layout, ps, seed, host_order):
    """KernelConfig.host_order: a backup's pairs are handed to the kernel sorted by host slot
    (device slots permuted alike), a load's as given, and every byte lands where the caller's
    pairs say, either way."""
    from kvtier.transfer.kernel import KernelBackend, KernelConfig
    spec = SPECS[si]
    if layout not in SUPPORTED[spec.kind]:
        return
    h, d = _drawn(ps, seed)
    kb = KernelBackend(KernelConfig(host_order=host_order, page_rows=False))
    ht, dt = torch.from_numpy(h), torch.from_numpy(d)
    parts, refs, devs = _parts_and_reference(spec, layout, ps, h, d)
    backup = kb.moves(parts, ht, dt, h, d, to_host=True)
    for _, mh, md in backup:
        if host_order:
            assert (np.diff(mh.numpy()) > 0).all()
        else:
            assert torch.equal(mh, ht)
        assert sorted(zip(mh.tolist(), md.tolist())) == sorted(zip(h.tolist(), d.tolist()))
    for move in backup:
        kb.copy_part(*move, None, 8)
    for part, ref in zip(parts, refs):
        assert torch.equal(part.host_raw, ref)
    for _, mh, md in kb.moves(parts, ht, dt, h, d, to_host=False):
        assert torch.equal(mh, ht) and torch.equal(md, dt)


@pytest.mark.parametrize("direction", ["backup", "load"])
def test_strided_index_tensors_move_the_slots_they_name(direction):
    """A strided view of indices was read by the kernel as if packed: a backup of host slots
    [0, 1, 2] from device slots [5, 6, 7] wrote 5, 6 and then host slot 10, which nobody named
    (a review, 2026-12-04). Indices are made contiguous before any kernel reads them, and the
    kernel refuses a strided one."""
    from dataclasses import replace

    from kvtier.device_pool import pool_from_spec
    from kvtier.host_pool import host_pool_for
    from kvtier.transfer.kernel import KernelBackend
    spec = KVSpec("mla", 1, torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8)
    dev = pool_from_spec(spec, 16, 1, "cpu")
    dev.stacks["kv"].copy_(torch.arange(16.).view(1, 16, 1, 1).expand(1, 16, 1, 24))   # slot s holds s
    host = host_pool_for(dev, "layer_first", host_size_tokens=16)
    host.kv_buffer.fill_(-1)
    parts = [replace(p, mapped=lambda: True) for p in host.transfer_parts()]          # as pinned parts
    h = torch.tensor([0, 10, 1, 11, 2, 12])[::2]
    d = torch.tensor([5, 13, 6, 14, 7, 15])[::2]
    if direction == "backup":
        KernelBackend().prepare(parts, h, d, True)(None)
        assert host.kv_buffer[0, :, 0, 0].tolist() == [5, 6, 7] + [-1] * 13
    else:
        host.kv_buffer.copy_(torch.arange(100., 116.).view(1, 16, 1, 1).expand(1, 16, 1, 24))
        before = dev.stacks["kv"].clone()
        KernelBackend().prepare(parts, h, d, False)(0)
        want = before[0, :, 0, 0].clone()
        want[5:8] = torch.tensor([100., 101., 102.])
        assert torch.equal(dev.stacks["kv"][0, :, 0, 0], want)
    pl = host.placements["kv"]
    with pytest.raises(ValueError, match="contiguous int64"):
        copy_items(pl, host.raw_bytes("kv"), tuple(p.device_layers[0] for p in parts[:1]),
                   layer_ptr_table(parts[0].device_layers, "cpu"), h, d, 0, 3, 0, 1, True, 8)
