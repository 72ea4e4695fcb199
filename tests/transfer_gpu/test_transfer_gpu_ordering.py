"""The engine's streams and ordering on CUDA (needs a GPU): pooled streams that alias, three
streams at once, backups behind loads, index tensors read while the stream is busy, the
background thread's turns, the bench's pair timeline, and a transfer that fails part way."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch

from gpu_testlib import GPU_ONLY, SPECS, _b, _copy_engines_for_every_part, _pages, _pools, _round_trip_matches_direct  # noqa: F401
from kvtier.host_pool import host_pool_for
from kvtier.spec import KVSpec
from kvtier.transfer import TransferEngine

pytestmark = GPU_ONLY


def _alias_of(stream: torch.cuda.Stream) -> torch.cuda.Stream:
    """Another stream object that PyTorch backs with ``stream``'s CUDA stream: it hands out
    32 pooled streams per priority in turn, so one comes round within 32 draws."""
    for _ in range(2 * 32):
        s = torch.cuda.Stream(priority=stream.priority)
        if s.cuda_stream == stream.cuda_stream:
            return s
    pytest.fail(f"no pooled stream at priority {stream.priority} came round to {stream.cuda_stream:#x}")


def test_pytorch_pools_streams_and_kvtier_draws_the_one_left_free():
    """PyTorch's pool comes round; with every pooled stream but one held by kvtier owners,
    :func:`streams.fresh` returns that one; with none left it warns and returns one anyway."""
    from kvtier.transfer import streams

    class Owner:
        def __init__(self, held):
            self.held = held

        def kvtier_streams(self):
            return self.held
    pool = {}
    for _ in range(2 * streams.POOL):
        s = torch.cuda.Stream()
        pool.setdefault(s.cuda_stream, s)
    assert len(pool) == streams.POOL, "PyTorch no longer pools its streams: kvtier.transfer.streams can go"
    gc.collect()  # engines of earlier tests give their streams back
    callers, streams._callers = streams._callers, set()
    try:
        free = next((h for h in pool if h not in streams._taken()), None)
        assert free is not None, "live kvtier owners hold every pooled stream"
        owner = Owner([s for h, s in pool.items() if h != free])
        streams.register(owner)
        assert streams.fresh(torch.device("cuda")).cuda_stream == free
        owner.held = list(pool.values())
        streams._warned = False
        with pytest.warns(RuntimeWarning, match="every CUDA stream PyTorch pools"):
            assert streams.fresh(torch.device("cuda")).cuda_stream in pool
    finally:
        streams._callers = callers | streams._callers


@pytest.mark.parametrize("who", ["ring", "caller"])
def test_aliased_streams_are_drawn_again_and_the_bytes_still_match_direct(who):
    """``ring``: the engine's backup and load streams share CUDA streams with the DMA
    staging rings' side streams (gathers and copies would take turns). ``caller``: the
    caller's current stream is the engine's load stream (the load would hold its compute).
    Either way the transfer moves every byte right and the streams are apart after it."""
    spec = SPECS["mha_odd"]
    rng = np.random.default_rng(7 if who == "ring" else 8)
    dev, host = _pools(spec, 16, "layer_first")
    eng = TransferEngine(host, "dma")
    h = torch.arange(64)
    eng.backup(h, h).synchronize()
    eng.load(h, h + 64).synchronize()  # both staging rings exist now
    rings = {to_host: eng.backend.ring(torch.device("cuda", torch.cuda.current_device()), to_host)
             for to_host in (True, False)}
    if who == "ring":
        eng.backup_stream = _alias_of(rings[True].side)
        eng.load_stream = _alias_of(rings[False].side)
        _round_trip_matches_direct(eng, dev, host, "layer_first", 16, "cpu", rng)
        assert eng.backup_stream.cuda_stream != rings[True].side.cuda_stream
        assert eng.load_stream.cuda_stream != rings[False].side.cuda_stream
    else:
        caller = _alias_of(eng.load_stream)
        with torch.cuda.stream(caller):
            _round_trip_matches_direct(eng, dev, host, "layer_first", 16, "cpu", rng)
        assert eng.load_stream.cuda_stream != caller.cuda_stream
        assert all(r.side.cuda_stream != caller.cuda_stream for r in rings.values())


def test_three_streams_stress():
    """Loads, backups and a forward-like kernel on three streams; every byte checked."""
    spec = SPECS["mha_odd"]
    ps, tokens = 16, 2048
    dev, host = _pools(spec, ps, "page_first", tokens)
    eng = TransferEngine(host, "auto")
    rng = np.random.default_rng(1)
    compute = torch.cuda.Stream()
    n_pages = 32
    expected = {}
    for step in range(20):
        hb = _pages(rng, host.page_num // 2, n_pages, ps)        # backups: first half of host
        hl_pages = rng.permutation(host.page_num // 2)[:n_pages] + host.page_num // 2
        d_src = _pages(rng, dev.size // ps // 2, n_pages, ps)    # read by backups
        d_dst = torch.from_numpy((rng.permutation(dev.size // ps // 2)[:n_pages] + dev.size // ps // 2)[:, None] * ps
                                 + np.arange(ps)).reshape(-1)
        with torch.cuda.stream(compute):
            for st in dev.stacks.values():  # forward-like work writes the source slots, then backup reads them
                st[:, d_src.cuda()] = st[:, d_src.cuda()].view(torch.uint8).add_(1).view(st.dtype)
        with torch.cuda.stream(compute):
            hd = eng.backup(hb, d_src)
        hl = torch.from_numpy((hl_pages[:, None] * ps + np.arange(ps)).reshape(-1))
        eng.backup(hl, d_src).synchronize()
        expected_rows = {k: st[:, d_src.cuda()].clone() for k, st in dev.stacks.items()}
        with torch.cuda.stream(compute):
            ld = eng.load(hl, d_dst)
            for layer in range(spec.layer_num):
                ld.wait_layer(layer, compute)
                for k, st in dev.stacks.items():
                    got = st[layer, d_dst.cuda()]
                    expected[(step, k, layer)] = torch.equal(_b(got), _b(expected_rows[k][layer]))
        hd.synchronize()
    torch.cuda.synchronize()
    assert all(expected.values()), [k for k, v in expected.items() if not v][:5]
    host.close()


@pytest.mark.parametrize("idx_device", ["cpu", "cuda"])
def test_a_backup_queued_behind_a_long_load_is_not_held_up_by_it(idx_device):
    """The copy engine runs queued copies in order. A load queues ~2 GiB of host -> device
    copies; a small backup of other slots issued after it must neither block the host nor
    wait on the GPU for the load (its index tensors once went through that same queue)."""
    spec = KVSpec("mha", 16, torch.bfloat16, head_num=8, head_dim=128)  # 64 KiB per token
    tokens = 32768
    dev, host = _pools(spec, 1, "layer_first", tokens=tokens)
    eng = TransferEngine(host, "dma")
    h = torch.arange(tokens)
    eng.backup(h, h).synchronize()  # warm: plans, staging, kernels
    small_h = torch.arange(tokens, tokens + 64, device=idx_device)
    small_d = torch.arange(2 * tokens - 64, 2 * tokens, device=idx_device)
    for _ in range(2):
        torch.cuda.synchronize()
        ld = eng.load(h, h)
        hd = eng.backup(small_h, small_d)
        returned_while_loading = not ld.done()
        hd.synchronize()
        backup_done_first = not ld.done()
        ld.synchronize()
    assert returned_while_loading and backup_done_first
    ref = {k: st[:, small_d.to("cuda")].clone() for k, st in dev.stacks.items()}
    for k, st in dev.stacks.items():
        st[:, small_d.to("cuda")] = 0
    ld = eng.load(small_h, small_d)
    ld.synchronize()
    for k, st in dev.stacks.items():
        assert torch.equal(_b(st[:, small_d.to("cuda")]), _b(ref[k]))
    host.close()


def _pool_and_reference(spec, layout):
    """A device pool of random bytes, a host pool on it and a second host pool for the
    direct backend's result, both hosts filled with 0xA5 (page size 1)."""
    dev, host = _pools(spec, 1, layout)
    ref = host_pool_for(dev, layout, host_size_tokens=host.size)
    for hp in (host, ref):
        for c in hp.component_tensors:
            hp.raw_bytes(c).fill_(0xA5)
    return dev, host, ref


@pytest.mark.parametrize("backend", ["kernel", "dma"])
def test_index_copies_are_kept_until_read_while_the_stream_is_busy(backend):
    """Host index tensors reach the GPU through pinned copies read by a kernel. Through the
    seed API nothing holds them once the call returns; while the stream is still busy the
    pinned block must not be handed out (and overwritten) by the next call's copy."""
    dev, host, ref = _pool_and_reference(SPECS["mha_odd"], "layer_first")
    torch.cuda._sleep(100_000_000)  # everything queued next waits ~50 ms
    for i in range(8):
        h, d = torch.arange(16 * i, 16 * i + 16), torch.arange(200 - 16 * i, 216 - 16 * i)
        host.backup_from_device_all_layer(dev, h, d, backend)
        ref.backup_from_device_all_layer(dev, h, d, "direct")
    torch.cuda.synchronize()
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c), ref.raw_bytes(c))
    host.close()
    ref.close()


@pytest.mark.parametrize("backend", ["kernel", "dma"])
def test_pinned_index_tensors_may_be_refilled_once_the_call_returns(backend):
    """A caller's index tensors already in pinned memory: the engine's stream is held (~50 ms)
    so the transfers' index reads run long after the calls return, and the caller refills its
    tensors with other slots meanwhile. The bytes land where the calls said."""
    dev, host, ref = _pool_and_reference(SPECS["mha_odd"], "page_first")
    eng = TransferEngine(host, backend)
    rng = np.random.default_rng(13)
    h, d = _pages(rng, host.size, 64, 1), _pages(rng, dev.size, 64, 1)
    eng.backup(h, d).synchronize()  # first use (tables, staging) out of the way
    for c in host.component_tensors:
        host.raw_bytes(c).fill_(0xA5)
    h_pinned, d_pinned = h.pin_memory(), d.pin_memory()
    torch.cuda._sleep(100_000_000)  # what is queued next waits ~50 ms
    handle = eng.backup(h_pinned, d_pinned)
    h_pinned.copy_(_pages(rng, host.size, 64, 1))  # the caller's next slots, before the reads ran
    d_pinned.copy_(_pages(rng, dev.size, 64, 1))
    handle.synchronize()
    ref.backup_from_device_all_layer(dev, h, d, "direct")
    for c in host.component_tensors:
        assert torch.equal(host.raw_bytes(c), ref.raw_bytes(c)), c
    host.close()
    ref.close()


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("backend", ["dma", "auto"])
def test_cuda_indices_are_read_back_once_per_transfer(backend, validate, monkeypatch):
    """With index tensors on the GPU the engine reads each back to the host once (the check
    and the planning share that copy), and the bytes still arrive."""
    import kvtier.transfer.triton_kernels as tk
    spec = SPECS["mha_odd"]
    dev, host = _pools(spec, 1, "layer_first")
    host.validate_indices = validate
    eng = TransferEngine(host, backend)
    rng = np.random.default_rng(5)
    h, d = _pages(rng, host.size, 64, 1).cuda(), _pages(rng, dev.size, 64, 1).cuda()
    eng.backup(h, d).synchronize()  # auto: its first transfer of a shape calibrates and ranks
    reads = []
    real = tk.fetch_index_to_host

    def counted(idx):
        reads.append(idx.numel())
        return real(idx)
    monkeypatch.setattr(tk, "fetch_index_to_host", counted)
    eng.backup(h, d).synchronize()
    assert reads == [64, 64]  # host and device slots, once each
    reads.clear()
    back = torch.from_numpy(np.setdiff1d(np.arange(dev.size), d.cpu().numpy())[-64:]).cuda()  # not d's slots
    eng.load(h, back).synchronize()
    assert reads == [64, 64]
    from kvtier.device_pool import layer_attr
    for c in spec.components:
        for buf in getattr(dev, layer_attr(c.name)):
            assert torch.equal(_b(buf[back]), _b(buf[d]))
    host.close()


def test_a_load_queues_its_first_copies_before_its_device_slots_reach_the_device(monkeypatch):
    """A DMA load asks for its device slots on the device only once its first chunk's copies
    are queued (the copy engine need not wait for the index copy); a backup, before its first
    gather. Either way the caller may reuse its index tensors once the call returns."""
    import kvtier.transfer.dma.backend as backend_mod
    import kvtier.transfer.dma.issue as issue_mod
    spec = SPECS["mla"]
    dev, host = _pools(spec, 1, "page_first")
    eng = TransferEngine(host, "dma")
    rng = np.random.default_rng(11)
    h, d = _pages(rng, host.size, 96, 1, contiguous=True), _pages(rng, dev.size, 96, 1)
    eng.backup(h, d).synchronize()
    eng.load(h, d).synchronize()  # the layers-per-copy trials, once per shape
    order = []
    real_on, real_issue = issue_mod.on_device, issue_mod.issue_copies

    def on_device(idx, device):
        order.append(("index", idx.numel()))
        return real_on(idx, device)
    for mod in (issue_mod, backend_mod):
        monkeypatch.setattr(mod, "on_device", on_device)
    monkeypatch.setattr(issue_mod, "issue_copies",
                        lambda *a, **k: (order.append(("copy", a[4])), real_issue(*a, **k))[1])
    eng.backup(h, d).synchronize()
    assert order and order[0] == ("index", 96), order  # a backup gathers with them: they go first
    order.clear()
    free = np.setdiff1d(np.arange(dev.size), d.numpy())
    d2 = torch.from_numpy(rng.permutation(free)[:96].astype(np.int64))
    want = d2.clone()
    ld = eng.load(h, d2)
    d2.fill_(0)  # the caller reuses its tensor: everything was read during the call
    ld.synchronize()
    copies = [i for i, (what, _) in enumerate(order) if what == "copy"]
    assert copies and order[copies[0]] == ("copy", False), order
    assert order.index(("index", 96)) > copies[0], order  # asked for after the first copies
    from kvtier.device_pool import layer_attr
    for c in spec.components:
        for buf in getattr(dev, layer_attr(c.name)):
            assert torch.equal(_b(buf[want.cuda()]), _b(buf[d.cuda()]))
    host.close()


@pytest.mark.parametrize("background", [True, False, "no-wait"])
@pytest.mark.parametrize("backend", ["dma", "auto", "kernel"])
def test_a_backup_and_a_load_issued_back_to_back_move_the_right_bytes(backend, background):
    """The backup's copies are queued by the engine's thread (or inline) while the caller
    queues a load of other slots through the same backend; then a load reads what the
    backup wrote. Many chunks each way (16 MiB staging), so the two threads interleave.
    "no-wait": the thread does not give way to the load (``give_way_s = 0``)."""
    from dataclasses import replace

    spec = KVSpec("mha", 8, torch.bfloat16, head_num=8, head_dim=128)  # 32 KiB per token
    tokens = 4096
    dev, host = _pools(spec, 16, "page_first", tokens=tokens)
    for c in host.component_tensors:
        host.raw_bytes(c).view(torch.uint8).random_(0, 256)
    eng = TransferEngine(host, backend, background_backups=background is not False)
    if background == "no-wait":
        eng.give_way_s = 0.0
    dma = eng.backends.get("dma", torch.device("cuda"))  # auto's too
    old, dma.config = dma.config, replace(dma.config, staging_bytes=16 << 20)
    try:
        rng = np.random.default_rng(3)
        h1, h2 = torch.arange(tokens), torch.arange(tokens, 2 * tokens)
        d1 = _pages(rng, tokens // 16, tokens // 16 // 2, 16)                   # first half of the device
        d2 = _pages(rng, tokens // 16, tokens // 16 // 2, 16) + tokens          # second half
        ref = host_pool_for(dev, "page_first", host_size_tokens=host.size)
        for _ in range(3):
            host_before = {c: host.raw_bytes(c).clone() for c in host.component_tensors}
            src = {k: st[:, d1.cuda()].clone() for k, st in dev.stacks.items()}
            hd = eng.backup(h1[: d1.numel()], d1)
            ld = eng.load(h2[: d2.numel()], d2)
            hd.synchronize()
            ld.synchronize()
            # The load read h2's bytes as they were: backing d2 up into a copy of them changes nothing.
            for c in host.component_tensors:
                ref.raw_bytes(c).copy_(host_before[c])
            ref.backup_from_device_all_layer(dev, h2[: d2.numel()], d2, "direct")
            for c in host.component_tensors:
                assert torch.equal(ref.raw_bytes(c), host_before[c]), c
            eng.load(h1[: d1.numel()], d2).synchronize()   # what the backup wrote, into d2
            for k, st in dev.stacks.items():
                assert torch.equal(_b(st[:, d2.cuda()]), _b(src[k])), k
            for st in dev.stacks.values():
                st.view(torch.uint8).random_(0, 256)
        ref.close()
    finally:
        dma.config = old
    host.close()


def test_backups_complete_when_the_background_thread_gets_no_turn():
    """The engine's thread is held (as a caller busy in Python starves it of the GIL): two
    backups to the same host slots are left pending after their heads. Polling the second's
    ``done()`` queues both in the caller's thread, in order, so the host ends with the second's
    bytes (H200 run 58: a busy caller slowed a backup to 0.05x of the link)."""
    import threading
    from dataclasses import replace

    spec = KVSpec("mha", 8, torch.bfloat16, head_num=8, head_dim=128)  # 32 KiB per token
    tokens = 2048
    dev, host = _pools(spec, 16, "page_first", tokens=2 * tokens)
    eng = TransferEngine(host, "dma")
    dma = eng.backend
    old, dma.config = dma.config, replace(dma.config, staging_bytes=4 << 20, head_bytes=0)
    gate = threading.Event()
    try:
        for st in dev.stacks.values():
            st.view(torch.uint8).random_(0, 256)
        ref = host_pool_for(dev, "page_first", host_size_tokens=host.size)
        for c in host.component_tensors:
            ref.raw_bytes(c).copy_(host.raw_bytes(c))
        backlog = eng._started_backlog()
        held = eng._issuer.submit(gate.wait, 60)  # the thread's next turn comes after this
        rng = np.random.default_rng(5)
        h = torch.arange(tokens)
        d1, d2 = _pages(rng, 2 * tokens // 16, tokens // 16, 16), _pages(rng, 2 * tokens // 16, tokens // 16, 16)
        first, second = eng.backup(h, d1), eng.backup(h, d2)
        assert len(backlog) == 2 and not first._queued.done()  # only the first head is queued
        deadline = time.perf_counter() + 20
        while not second.done():
            assert time.perf_counter() < deadline, "the backup waited for the held thread"
        assert first.done() and len(backlog) == 0 and not held.done()
        ref.backup_from_device_all_layer(dev, h, d2, "direct")
        for c in host.component_tensors:
            assert torch.equal(ref.raw_bytes(c), host.raw_bytes(c)), c
        ref.close()
    finally:
        gate.set()
        dma.config = old
    host.close()


def test_bench_pairs_log_a_timeline_in_order():
    """The transfer bench's pair rows carry their timeline (``pair_ms``): every field there,
    the calls returning in order, and each transfer ending after its call returned."""
    from kvtier.bench.transfer import run_bench
    notes = []

    def on_row(rows, groups, picks, final=False, samples="", **extra):
        if not final and rows[-1].direction == "both":
            notes.append(extra.get("pair", ""))
    run_bench(512, 1, ("dma",), ("mha",), (16,), 4, progress=False, on_row=on_row,
              layouts={"page_first"}, slots=("allocator",))
    assert len(notes) == 1
    f = notes[0].split()
    t = dict(zip(f[::2], map(float, f[1::2])))
    assert list(t) == ["backup_returned", "load_returned", "backup_queued", "backup_done", "load_done"]
    assert 0 < t["backup_returned"] <= t["load_returned"] <= t["backup_queued"]
    assert t["backup_done"] > 0 and t["load_done"] > t["backup_returned"]


def test_a_transfer_that_fails_part_way_returns_only_once_what_it_queued_has_run():
    """A load whose third layer fails to queue, a backup (queued inline) that fails after its
    copies: the engine raised at once, with copies still queued into the slots, and a cache
    gives those slots back on an error (device pages of a load, host pages of a backup)."""
    from kvtier.transfer.kernel import KernelBackend

    class FailsPartWay(KernelBackend):
        def prepare(self, parts, host_idx, dev_idx, to_host, *args, **kwargs):
            inner = super().prepare(parts, host_idx, dev_idx, to_host, *args, **kwargs)

            def run(layer):
                inner(layer)
                if layer is None or layer == 2:
                    raise RuntimeError("queueing failed part way")
            return run

    spec = KVSpec("mha", 8, torch.bfloat16, head_num=8, head_dim=128)  # 32 KiB a token
    tokens = 16384                                                       # 512 MiB each way
    dev, host = _pools(spec, 16, "layer_first", tokens=tokens)
    eng = TransferEngine(host, FailsPartWay(), background_backups=False)
    h, d = torch.arange(tokens), torch.arange(tokens)
    with pytest.raises(RuntimeError, match="part way"):
        eng.load(h, d)
    assert eng.load_stream.query()
    with pytest.raises(RuntimeError, match="part way"):
        eng.backup(h, d)
    assert eng.backup_stream.query()
    host.close()
