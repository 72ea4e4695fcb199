"""The spec's worker on tensors in vLLM 0.32's KV layout (``LBHNC``, which the OffloadingConnector
asks every attention backend for: one buffer, per layer a ``(num_blocks, num_kv_heads,
block_size, 2 * head_dim)`` view, K then V in the last dimension), without vLLM: random blocks
go device -> host -> device through kvtier's transfer engine, every byte checked. On CUDA (marked
``gpu``) the default ``auto`` backend moves them; on the CPU, plain copies (vLLM's CPU build)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from conftest import devices
from kvtier.integrations import host_slots
from kvtier.integrations.vllm import KvtierPages, KvtierWorker
from vllm_testlib import vllm_kv_cache

try:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
except ImportError:  # the GPU machine runs this without vLLM: the same fields
    @dataclass
    class GPULoadStoreSpec:
        block_ids: list
        group_sizes: list
        block_indices: list


def _finish(worker: KvtierWorker, jobs: set[int]) -> list:
    results, deadline = [], time.monotonic() + 60
    while {r.job_id for r in results} != jobs:
        assert time.monotonic() < deadline, "jobs never finished"
        results += worker.get_finished()
    return results


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("blocks_per_chunk,first_block", [(1, 0), (2, 1), (4, 2)])
def test_blocks_go_to_host_and_back_byte_exact(device, blocks_per_chunk, first_block):
    buf, views = vllm_kv_cache(device)
    before = buf.clone()
    worker = KvtierWorker(views, blocks_per_chunk, num_chunks=12)
    rng = np.random.default_rng(blocks_per_chunk)
    src = rng.choice(64, size=9, replace=False).tolist()       # a request's GPU blocks, scattered
    chunks = rng.choice(12, size=(first_block % blocks_per_chunk + 9 + blocks_per_chunk - 1) // blocks_per_chunk,
                        replace=False).tolist()
    worker.submit_store(1, GPULoadStoreSpec(src, [9], [first_block]), KvtierPages(chunks))
    worker.wait({1})
    (stored,) = _finish(worker, {1})
    assert stored.success and stored.transfer_size == 9 * 3 * views[0].shape[1]
    assert torch.equal(buf, before), "a store changed the device cache"
    dst = [b for b in range(64) if b not in src][:9]
    worker.submit_load(2, KvtierPages(chunks), GPULoadStoreSpec(dst, [9], [first_block]))
    _finish(worker, {2})
    expect = before.clone()
    expect[:, dst] = before[:, src]
    assert torch.equal(buf, expect), "loaded blocks differ, or bytes outside them changed"
    slots = host_slots(chunks, first_block, 9, blocks_per_chunk)
    assert len(set(slots.tolist())) == 9 and all(s // blocks_per_chunk in chunks for s in slots)
    worker.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("io_backend", [None, "dma", "kernel", "direct"])
def test_llama_shaped_blocks_round_trip_on_cuda(io_backend):
    """32 layers of 8 KV heads x 128 in bfloat16, 16-token blocks (FlashAttention's): 64 KiB a
    layer's page; 256 random blocks out and back through each backend."""
    buf, views = vllm_kv_cache("cuda", layers=32, blocks=1024, heads=8, block_size=16, head_dim=128,
                               dtype=torch.bfloat16)
    before = buf.clone()
    worker = KvtierWorker(views, 1, num_chunks=512, io_backend=io_backend)
    gen = torch.Generator().manual_seed(1)
    perm, chunks = torch.randperm(1024, generator=gen).tolist(), torch.randperm(512, generator=gen)[:256].tolist()
    src, dst = perm[:256], perm[256:512]
    worker.submit_store(1, GPULoadStoreSpec(src, [256], [0]), KvtierPages(chunks))
    _finish(worker, {1})
    worker.submit_load(2, KvtierPages(chunks), GPULoadStoreSpec(dst, [256], [0]))
    _finish(worker, {2})
    torch.cuda.synchronize()
    expect = before.clone()
    expect[:, dst] = before[:, src]
    assert torch.equal(buf, expect)
    worker.shutdown()


def test_views_of_unequal_pages_are_refused_before_anything_is_allocated():
    _, views = vllm_kv_cache("cpu")
    with pytest.raises(ValueError, match=r"\(num_blocks, page_bytes\)"):
        KvtierWorker([views[0], views[1][:, :100]], 1, num_chunks=4)
