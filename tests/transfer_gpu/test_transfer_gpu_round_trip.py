"""Every CUDA backend x kind x layout moves exactly the right bytes (needs a GPU): round trips
checked against the direct backend, from pools of every kind of storage and index tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_testlib import CASES, GPU_ONLY, SPECS, _b, _copy_engines_for_every_part, _pools, _round_trip_matches_direct  # noqa: F401
from kvtier.device_pool import pool_from_spec
from kvtier.host_pool import host_pool_for
from kvtier.transfer import TransferEngine

pytestmark = GPU_ONLY


@pytest.mark.parametrize("backend", ["kernel", "dma", "auto"])
@pytest.mark.parametrize("name,layout,ps", CASES)
@pytest.mark.parametrize("idx_device", ["cpu", "cuda"])
def test_round_trip_matches_direct(backend, name, layout, ps, idx_device):
    spec = SPECS[name]
    rng = np.random.default_rng(hash((backend, name, layout, ps, idx_device)) % 2**32)
    dev, host = _pools(spec, ps, layout)
    _round_trip_matches_direct(TransferEngine(host, backend), dev, host, layout, ps, idx_device, rng)


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
