"""Failures on CUDA (needs a GPU): errors while a backup is queued or in the background thread
reach their handles, and a refused runtime copy leaves the next torch call alone. (A transfer
that fails part way: test_transfer_gpu_ordering.py.)"""

from __future__ import annotations

import pytest
import torch

from gpu_testlib import GPU_ONLY, SPECS, _b, _copy_engines_for_every_part, _pools  # noqa: F401
from kvtier.host_pool import host_pool_for
from kvtier.transfer import TransferEngine

pytestmark = GPU_ONLY


def test_an_error_while_a_backup_is_queued_reaches_its_handle():
    """Staging that cannot be allocated fails while the first chunk is queued (in the caller's
    thread): the handle raises it, as it would from the background thread, and a load of the
    same slots issued after it still runs (it waits without raising)."""
    from kvtier.transfer.dma import DMABackend, DMAConfig
    spec = SPECS["mha_odd"]
    dev, host = _pools(spec, 1, "layer_first", tokens=1024)
    eng = TransferEngine(host, "dma")
    good = eng.backend
    eng.backend = DMABackend(DMAConfig(staging_bytes=1 << 50, kernel_below=0))  # a petabyte
    h = torch.arange(512)
    hd = eng.backup(h, h)
    with pytest.raises(torch.OutOfMemoryError):
        hd.synchronize()
    eng.backend = good
    before = {k: st[:, 512:1024].clone() for k, st in dev.stacks.items()}
    eng.backup(h, torch.arange(512, 1024)).synchronize()
    eng.load(h, h).synchronize()   # ordered after the failed backup of the same slots: no raise
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, :512]), _b(before[k]))
    host.close()


def test_an_error_in_the_background_thread_reaches_its_handle_and_the_head_chunk_lands():
    """The first chunk is queued in the caller's thread, the rest by the engine's thread: a
    failure there is raised by the handle, and the bytes of the first chunk are on the host."""
    from kvtier.transfer.dma import DMABackend, DMAConfig

    class FailsAfterTheFirstChunk(DMABackend):
        def _backup_chunks(self, ring, cur, part, p, ptrs, d, host_base, chunks):
            if chunks.start > 0:
                raise RuntimeError("chunk after the first")
            super()._backup_chunks(ring, cur, part, p, ptrs, d, host_base, chunks)
    spec = SPECS["mha_odd"]
    dev, host = _pools(spec, 1, "layer_first", tokens=1024)
    eng = TransferEngine(host, "dma")
    eng.backend = FailsAfterTheFirstChunk(DMAConfig(staging_bytes=64 << 10, buffers=2, kernel_below=0))
    h, d = torch.arange(100, 612), torch.arange(512)
    plan = eng.backend.plan_part(host.transfer_parts()[0], h.numpy(), True)
    assert plan.n_chunks > 2
    first = plan.items(0)[1]
    hd = eng.backup(h, d)
    with pytest.raises(RuntimeError, match="chunk after the first"):
        hd.synchronize()
    ref = host_pool_for(dev, "layer_first", host_size_tokens=host.size)
    ref.backup_from_device_all_layer(dev, h[:first], d[:first], "direct")
    part = host.transfer_parts()[0]   # the part whose first chunk went ahead (the others never ran)
    got, want, pl = host.raw_bytes(part.name), ref.raw_bytes(part.name), part.host
    for layer in range(spec.layer_num):
        for slot in h[:first].tolist():
            at = pl.offset(slot, layer)
            assert torch.equal(got[at:at + pl.item_bytes], want[at:at + pl.item_bytes]), (layer, slot)
    ref.close()
    host.close()


def test_a_failed_runtime_copy_does_not_fail_the_next_unrelated_torch_call():
    """A copy the runtime refuses raises; the thread's last error was left set, and the next
    torch launch, whatever it was, raised it (a review, 2026-12-04; the batch path cleared it).
    (A pitch narrower than the row is refused when queued, with no fault on the device.)"""
    from kvtier.transfer import cudart
    dev = torch.empty(1 << 16, dtype=torch.uint8, device="cuda")
    host = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
    s = torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="cudaMemcpy2DAsync failed with error"):
        cudart.memcpy2d(host.data_ptr(), 16, dev.data_ptr(), 64, 64, 4, s.cuda_stream)  # width > dpitch
    x = torch.ones(8, device="cuda") * 2
    torch.cuda.synchronize()
    assert x.sum().item() == 16
