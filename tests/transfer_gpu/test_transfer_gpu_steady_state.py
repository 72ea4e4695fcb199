"""Memory on CUDA (needs a GPU): dropped pools and engines give their memory back at once, and
hundreds of transfers hold device memory, Python objects and threads flat."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from gpu_testlib import GPU_ONLY, _b, _copy_engines_for_every_part, _pages, _pools  # noqa: F401
from kvtier.spec import KVSpec
from kvtier.transfer import TransferEngine

pytestmark = GPU_ONLY


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
    transfers' run lengths (``dma.plan._bound``), so scattered slots drawn afresh add an entry
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
