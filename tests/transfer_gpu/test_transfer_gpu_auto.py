"""The ``auto`` backend on CUDA (needs a GPU): duplex samples, a shared backup on fewer blocks,
per-layer loads, shapes kept for DMA, and a candidate set aside when it raised."""

from __future__ import annotations

import numpy as np
import torch

from gpu_testlib import GPU_ONLY, SPECS, _b, _copy_engines_for_every_part, _pools  # noqa: F401
from kvtier.host_pool import host_pool_for
from kvtier.spec import KVSpec
from kvtier.transfer import TransferEngine

pytestmark = GPU_ONLY


def test_auto_files_concurrent_samples_under_duplex_keys():
    """A backup and a load that overlap in time (~256 MiB each) are sampled under duplex keys."""
    from kvtier.transfer.online import DUPLEX
    spec = KVSpec("mha", 8, torch.bfloat16, head_num=8, head_dim=128)  # 32 KiB per token
    tokens = 8192
    dev, host = _pools(spec, 16, "layer_first", tokens=tokens)
    eng = TransferEngine(host, "auto")
    h = torch.arange(tokens)
    for _ in range(3):
        hd = eng.backup(h, h)
        ld = eng.load(h + tokens, h + tokens)
        hd.synchronize()
        ld.synchronize()
    eng.backend.timings.harvest(eng.backend.chooser)
    keys = [k for k, v in eng.backend.chooser.samples.items() if any(v.values())]
    assert any(k[-1] == DUPLEX and k[0] for k in keys) and any(k[-1] == DUPLEX and not k[0] for k in keys), keys
    # And what each pair moved together, filed for the load's choice (OnlineChooser.pair_loads):
    # both transfers' bytes over their joint span, no more than their own rates added.
    pairs = {k: v for k, v in eng.backend.chooser.pairs.items() if k[-1] == DUPLEX and not k[0] and any(v.values())}
    assert pairs, dict(eng.backend.chooser.pairs)
    for key, by in pairs.items():
        own = eng.backend.chooser.samples[key]
        # (A candidate only looked at has an empty list: auto's fewer-block backup, run 123.)
        back = [v for k, c in eng.backend.chooser.samples.items() if k[0] and k[-1] == DUPLEX for v in c.values() if v]
        for cand, rates in by.items():
            assert all(0 < r <= max(own[cand]) + max(max(b) for b in back) for r in rates), (rates, own, back)
    host.close()


def test_auto_tries_a_shared_zero_copy_backup_on_fewer_blocks_and_every_byte_lands():
    """Single scattered tokens, layer_first: only the kernel moves them (DMA's copies would be
    2 KiB). A backup sharing the link with a load is also tried on ``shared_backup_blocks``
    (run 121: such pairs 1.07 -> 1.28x for MHA); the bytes must land all the same."""
    from kvtier.transfer.auto import AutoBackend
    from kvtier.transfer.dma import DMABackend
    from kvtier.transfer.kernel import KernelBackend
    spec = KVSpec("mha", 8, torch.bfloat16, head_num=8, head_dim=128)  # 2 KiB per token, layer and K/V
    tokens = 8192
    dev, host = _pools(spec, 1, "layer_first", tokens=tokens)
    ref = host_pool_for(dev, "layer_first", host_size_tokens=2 * tokens)
    auto = AutoBackend(KernelBackend(), DMABackend())
    eng = TransferEngine(host, auto)
    perm = torch.from_numpy(np.random.default_rng(5).permutation(2 * tokens))
    h_back, h_load = perm[:tokens], perm[tokens:]  # backups to one half, loads from the other
    d_back, d_load = torch.arange(tokens), torch.arange(tokens, 2 * tokens)
    eng.backup(h_load, d_load).synchronize()
    want = {k: _b(st[:, d_load.cuda()]).clone() for k, st in dev.stacks.items()}
    for st in dev.stacks.values():
        st[:, d_load.cuda()] = 0
    # Whether a backup counts as shared depends on whether a load is in flight when it is chosen,
    # or its last one overlapped the load beside it. Issued after the load, it is chosen with the
    # load in flight. (Issued before it, as an engine may, the overlap was a matter of host timing:
    # 12 rounds explored the 8-block backup 3 times in run 124 and twice in run 126; 40 rounds once
    # in run 145, on a host whose backups were through before the load began.)
    for _ in range(40):
        ld = eng.load(h_load, d_load)
        hd = eng.backup(h_back, d_back)
        hd.synchronize()
        ld.synchronize()
        if auto.picks[("backup", "kernel@8")] >= auto.chooser.explore:
            break
    assert auto.picks[("backup", "kernel@8")] >= auto.chooser.explore, auto.picks
    assert auto.picks[("backup", "dma")] == 0 and auto.picks[("load", "dma")] == 0, auto.picks
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, d_load.cuda()]), want[k]), k
    ref.backup_from_device_all_layer(dev, h_load, d_load, "direct")
    ref.backup_from_device_all_layer(dev, h_back, d_back, "direct")
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c), ref.raw_bytes(c)), c
    host.close()
    ref.close()


def test_auto_per_layer_loads_leave_no_transfer_open():
    """``load_to_device_per_layer(..., "auto")`` prepares each layer on its own; each used to
    open a timing that only a whole load's last layer closed, so every other layer's stayed
    'in flight' for good, and every later backup was chosen as if sharing the link with a load."""
    from kvtier.transfer.auto import AutoBackend
    from kvtier.transfer.dma import DMABackend
    from kvtier.transfer.kernel import KernelBackend
    spec = SPECS["mla"]
    dev, host = _pools(spec, 16, "layer_first")
    auto = AutoBackend(KernelBackend(), DMABackend())
    h = torch.arange(128)
    d = torch.arange(128, 256)
    for _ in range(3):
        for layer in range(dev.layer_num):
            auto.load(host.transfer_parts(), h, d, layer)
    torch.cuda.synchronize()
    auto.timings.harvest(auto.chooser)
    assert not auto.timings._pending
    assert not auto.timings.busy(False, 0) and not auto.timings.sharing(True, 0)
    ref = torch.arange(256, 384)
    for layer in range(dev.layer_num):   # the bytes all the same: against the direct backend
        host.load_to_device_per_layer(dev, h, ref, layer, "direct")
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, d.cuda()]), _b(st[:, ref.cuda()])), k
    host.close()


# -- written in the session of 2026-12-04 with no device: to run on the next one -------------

def _runs(n_runs: int, run: int, every: int = 300) -> torch.Tensor:
    """Host slots in ``n_runs`` runs of ``run`` consecutive slots, ``every`` apart (never joining)."""
    return torch.from_numpy((np.arange(n_runs)[:, None] * every + np.arange(run)).reshape(-1).astype(np.int64))


def test_auto_keeps_dma_for_a_shape_after_one_transfer_too_short_for_copies():
    """A shape key covers run lengths within a power of two: MLA-like rows of 160 B in runs of
    240 suit copies (38 KiB, over kernel_below) and in runs of 150 do not (24 KiB). One transfer
    of the second kind took DMA off the shape for good, and one first kept it off. Now DMA stays
    where it has samples, and a kernel-only shape is ranked again every RECHECK transfers."""
    from kvtier.transfer.auto import RECHECK, AutoBackend
    from kvtier.transfer.dma import DMABackend
    from kvtier.transfer.kernel import KernelBackend
    spec = SPECS["mla"]
    dev, host = _pools(spec, 1, "layer_first", tokens=4096)            # host slots 0..8191
    parts = host.transfer_parts()
    a, b, d = _runs(10, 240), _runs(16, 150), torch.arange(2400)       # up to slots 2939 and 4649
    auto = AutoBackend(KernelBackend(), DMABackend())              # kernel_below at its default
    for _ in range(2 * auto.chooser.explore):
        auto.load(parts, a, d, 0)
        torch.cuda.synchronize()
    assert auto.picks[("load", "dma")] >= auto.chooser.explore, auto.picks
    auto.load(parts, b, d[: b.numel()], 0)                         # goes by the kernel
    torch.cuda.synchronize()
    assert all("dma" in c for c in auto._candidates.values()), auto._candidates
    fresh = AutoBackend(KernelBackend(), DMABackend())
    fresh._models = auto._models   # the same calibration, under which the prior ranks DMA for ``a``
    fresh.load(parts, b, d[: b.numel()], 0)                        # a kernel-only shape first ...
    assert all(c == ["kernel"] for c in fresh._candidates.values()), fresh._candidates
    for _ in range(RECHECK):
        fresh.load(parts, a, d, 0)                                 # ... ranked again with these
        torch.cuda.synchronize()
    assert any("dma" in c for c in fresh._candidates.values()), fresh._candidates
    for layer in range(dev.layer_num):
        fresh.load(parts, a, d, layer)
    torch.cuda.synchronize()
    ref = torch.arange(2400, 4800)
    for layer in range(dev.layer_num):
        host.load_to_device_per_layer(dev, a, ref, layer, "direct")
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, d.cuda()]), _b(st[:, ref.cuda()])), k
    host.close()


def test_auto_sets_aside_a_candidate_whose_transfer_raised():
    """A candidate that raised got no sample, so it stayed first to explore and every transfer
    of the shape failed. It is set aside for the shape; the next transfer goes by the other."""
    from kvtier.transfer.auto import AutoBackend
    from kvtier.transfer.dma import DMABackend
    from kvtier.transfer.kernel import KernelBackend
    spec = SPECS["mla"]
    dev, host = _pools(spec, 16, "page_first", tokens=1024)
    dma = DMABackend()
    auto = AutoBackend(KernelBackend(), dma)
    parts = host.transfer_parts()
    h, d = torch.arange(1024), torch.arange(1024)

    def broken(*args, **kwargs):
        raise RuntimeError("copy engine unavailable")
    dma.runner_for = broken
    outcomes = []
    for _ in range(2 * auto.chooser.explore + 1):          # DMA is explored whichever the prior ranks first
        try:
            auto.backup(parts, h, d)
            outcomes.append("ok")
        except RuntimeError:
            outcomes.append("raised")
        torch.cuda.synchronize()
    assert outcomes.count("raised") == 1 and auto.picks[("backup", "dma")] == 1, (outcomes, auto.picks)
    assert any("dma" in failed for failed in auto._failed.values()) and outcomes[-1] == "ok"
    ref = host_pool_for(dev, "page_first", host_size_tokens=host.size)
    ref.backup_from_device_all_layer(dev, h, d, "direct")
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c)[: ref.raw_bytes(c).numel()], ref.raw_bytes(c)), c
    host.close()
    ref.close()
