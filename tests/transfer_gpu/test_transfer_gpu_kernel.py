"""The Triton kernel backend on CUDA (needs a GPU): whole pages a page per row, host-slot order,
the block quota, and the compiled kernel's launcher against Triton's own launch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_testlib import GPU_ONLY, SPECS, _b, _copy_engines_for_every_part, _pages, _pools, _round_trip_matches_direct  # noqa: F401
from kvtier.host_pool import host_pool_for
from kvtier.transfer import TransferEngine

pytestmark = GPU_ONLY


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
