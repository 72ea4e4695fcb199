"""What the CUDA transfer tests (tests/transfer_gpu/test_transfer_gpu_*.py) share: their marks,
the specs and cases, pools of random bytes, page draws, byte views, the round trip checked
against the direct backend, and the fixture that keeps tiny shapes off the kernel fallback
(imported by every test file here; autouse, so it applies to each of their tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier import KVSpec, host_pool_for, pool_from_spec
from kvtier.layouts import SUPPORTED

GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


SPECS = {
    "mha_odd": KVSpec("mha", 3, torch.bfloat16, head_num=3, head_dim=40),
    "mha_fp8": KVSpec("mha", 2, torch.float8_e4m3fn, head_num=5, head_dim=24),
    "mla_fp8_656": KVSpec("mla", 3, torch.float8_e4m3fn, kv_lora_rank=512, qk_rope_head_dim=144),
    "mla": KVSpec("mla", 2, torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16),
    "dsa": KVSpec("dsa", 2, torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16, index_head_dim=128),
}
CASES = [(s, lay, ps) for s, spec in SPECS.items() for lay in SUPPORTED[spec.kind] for ps in (1, 16)]


@pytest.fixture(autouse=True)
def _copy_engines_for_every_part():
    """These shapes are tiny: with its default ``kernel_below`` the DMA backend would send
    every part through the kernel, and the copy paths would go untested."""
    from kvtier.transfer import Backends
    from kvtier.transfer.dma import DMAConfig
    real = Backends.__init__

    def init(self, kernel_config=None, dma_config=None):
        real(self, kernel_config, dma_config or DMAConfig(kernel_below=0))
    Backends.__init__ = init  # every engine's own set, made during the test
    yield
    Backends.__init__ = real


def _pools(spec, ps, layout, tokens=256):
    dev = pool_from_spec(spec, 2 * tokens, ps, "cuda")
    for st in dev.stacks.values():
        st.view(torch.uint8).random_(0, 256)
    host = host_pool_for(dev, layout, host_size_tokens=2 * tokens)
    return dev, host


def _pages(rng, n_pages_total, n_pages, ps, contiguous=False):
    start = rng.integers(0, n_pages_total - n_pages + 1)
    pages = np.arange(start, start + n_pages) if contiguous else rng.permutation(n_pages_total)[:n_pages]
    return torch.from_numpy((pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int64))


def _b(t: torch.Tensor) -> torch.Tensor:
    """Bytes of ``t``: random bit patterns hold NaNs, which never compare equal as floats."""
    return t.contiguous().view(torch.uint8)


def _round_trip_matches_direct(eng, dev, host, layout, ps, idx_device, rng, contiguous=None):
    """Back scattered (or, at random, consecutive) device pages up to host pages with ``eng``,
    compare the host bytes with the direct backend's, load them into other device pages and
    compare those with the source: every byte, and nothing else written."""
    ref_host = host_pool_for(dev, layout, host_size_tokens=host.size)
    n_pages = 96 // ps if ps > 1 else 77
    contiguous = rng.random() < 0.5 if contiguous is None else contiguous
    h = _pages(rng, host.page_num, n_pages, ps, contiguous=contiguous)
    d = _pages(rng, dev.size // ps, n_pages, ps)
    for hp in (host, ref_host):
        for c in hp.component_tensors:
            hp.raw_bytes(c).fill_(0xA5)
    ref_host.backup_from_device_all_layer(dev, h, d, "direct")
    before = {k: v.clone() for k, v in dev.stacks.items()}
    eng.backup(h.to(idx_device), d.to(idx_device)).synchronize()
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c), ref_host.raw_bytes(c)), c  # written exactly, nothing else
    for k in dev.stacks:
        assert torch.equal(_b(dev.stacks[k]), _b(before[k]))  # source unchanged
    # Load into other device slots and compare with the source rows.
    free = np.setdiff1d(np.arange(dev.size // ps), (d[::ps] // ps).numpy())
    d2 = torch.from_numpy((rng.permutation(free)[:n_pages, None] * ps + np.arange(ps)).reshape(-1))
    ld = eng.load(h.to(idx_device), d2.to(idx_device))
    ld.synchronize()
    assert ld.done() and all(ld.layer_done(i) for i in range(host.layer_num))
    untouched = np.setdiff1d(np.arange(dev.size), d2.numpy())
    for k, st in dev.stacks.items():
        keep = torch.from_numpy(untouched).cuda()
        assert torch.equal(_b(st[:, d2.cuda()]), _b(before[k][:, d.cuda()]))
        assert torch.equal(_b(st[:, keep]), _b(before[k][:, keep]))
    host.close()
    ref_host.close()
