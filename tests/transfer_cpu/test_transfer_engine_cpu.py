"""The transfer engine's CPU path (no GPU needed): round trips and handles, its refusals, the
background thread's ordering, the backends' tables, and its steady state. The transfer
benchmark's smoke runs: test_transfer_bench_cpu.py beside this file."""

from __future__ import annotations

import numpy as np
import pytest
import torch


from cpu_testlib import _small_reserve  # noqa: F401 (autouse: for every test here)
from kvtier.device_pool import pool_from_spec
from kvtier.host_pool import host_pool_for
from kvtier.spec import KVSpec
from kvtier.transfer import TransferEngine


def test_engine_round_trip_and_handles():
    spec = KVSpec("mha", 2, torch.bfloat16, head_num=3, head_dim=8)
    dev = pool_from_spec(spec, 64, 4, "cpu")
    for st in dev.stacks.values():
        st.view(torch.uint8).random_(0, 256)
    host = host_pool_for(dev, "page_head", host_size_tokens=64)
    eng = TransferEngine(host)
    h, d = torch.arange(8, 16), torch.arange(32, 40)
    before = {k: v.clone() for k, v in dev.stacks.items()}
    hd = eng.backup(h, d)
    assert hd.done() and hd.nbytes == 8 * spec.bytes_per_token
    ld = eng.load(h, torch.arange(0, 8))
    assert ld.done() and all(ld.layer_done(i) for i in range(2))
    ld.wait_layer(1)  # no-op on the CPU
    hd.wait()
    for k, st in dev.stacks.items():
        assert torch.equal(st[:, :8].view(torch.uint8), before[k][:, 32:40].view(torch.uint8))
    assert (eng.stats.backups, eng.stats.loads) == (1, 1)
    assert eng.stats.load_bytes == eng.stats.backup_bytes == hd.nbytes


def test_engine_rejects_bad_quota_and_gpu_backends_on_cpu():
    spec = KVSpec("mla", 2, torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8)
    dev = pool_from_spec(spec, 32, 1, "cpu")
    host = host_pool_for(dev, "layer_first", host_size_tokens=32)
    with pytest.raises(ValueError, match="block_quota"):
        TransferEngine(host, block_quota=-1)
    with pytest.raises(ValueError, match="direct"):
        TransferEngine(host, "dma")


def test_io_backend_may_be_a_configured_backend():
    """``io_backend`` takes a backend instance as well as a name (how a ``DMAConfig`` knob is
    set); one that needs CUDA is refused on a CPU pool before anything is built, naming it
    and the fix; the cache's config takes one too."""
    from kvtier.cache import CacheConfig
    from kvtier.transfer import DirectBackend
    direct = DirectBackend()
    spec = KVSpec("mla", 2, torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8)
    dev = pool_from_spec(spec, 32, 1, "cpu")
    dev.stacks["kv"].view(torch.uint8).random_(0, 256)
    host = host_pool_for(dev, "layer_first", host_size_tokens=32)
    eng = TransferEngine(host, direct)
    assert eng.backend is direct
    eng.backup(torch.arange(4), torch.arange(8, 12))
    eng.load(torch.arange(4), torch.arange(4))
    b = dev.stacks["kv"].view(torch.uint8)  # random bytes: compare bytes (NaN != NaN)
    assert torch.equal(b[:, :4], b[:, 8:12])
    assert CacheConfig(page_size=1, io_backend=direct).io_backend is direct
    with pytest.raises(ValueError, match="io_backend"):
        CacheConfig(page_size=1, io_backend="fastest")
    pytest.importorskip("triton")
    from kvtier.transfer.dma import DMABackend, DMAConfig
    with pytest.raises(ValueError, match=r"DMABackend\(\.\.\.\) \(a 'dma' backend\) needs a CUDA device pool.*'direct'"):
        TransferEngine(host, DMABackend(DMAConfig(load_drain=0)))


def test_engine_rejects_a_background_flag_that_is_not_a_bool():
    spec = KVSpec("mla", 2, torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8)
    host = host_pool_for(pool_from_spec(spec, 32, 1, "cpu"), "layer_first", host_size_tokens=32)
    with pytest.raises(ValueError, match="background_backups must be True or False, got 'yes'"):
        TransferEngine(host, background_backups="yes")


def test_a_handle_whose_background_queueing_failed_raises_it_but_still_orders_others():
    """A backup queued by the engine's thread: the handle is not done until the copies are
    queued; an error there reaches whoever asks (done, wait, synchronize), while the
    engine's own ordering of later transfers waits without raising it."""
    from concurrent.futures import Future

    from kvtier.transfer.engine import TransferHandle
    queued = Future()
    h = TransferHandle(64, None, queued=queued)
    assert not h.done() and not h._finished()
    queued.set_exception(MemoryError("staging"))
    assert h._finished()
    for ask in (h.done, h.synchronize, h.wait):
        with pytest.raises(MemoryError, match="staging"):
            ask()
    h.wait(raise_error=False)  # what the engine does for a transfer ordered after this one
    ok = Future()
    ok.set_result(None)
    assert TransferHandle(64, None, queued=ok).done()


def test_in_flight_overlap_checks_ranges_before_members():
    from kvtier.transfer.engine import _InFlight
    f = _InFlight(None, np.array([10, 12, 14]), np.array([100, 101]), True)
    assert not f.overlaps(np.array([20, 30]), np.array([0, 99]))      # disjoint ranges
    assert not f.overlaps(np.array([11, 13]), np.array([99, 102]))    # ranges meet, members do not
    assert f.overlaps(np.array([5, 14]), np.array([0]))               # a shared host slot
    assert f.overlaps(np.array([1]), np.array([101, 300]))            # a shared device slot
    assert not f.overlaps(np.array([], dtype=np.int64), np.array([], dtype=np.int64))


def test_in_flight_slots_do_not_change_when_the_caller_reuses_its_index_tensors():
    """The engine hands ``_InFlight`` numpy views of the caller's CPU index tensors; a caller
    that refills them after the call must not move what later transfers are ordered after."""
    from kvtier.transfer.engine import _InFlight
    h, d = torch.arange(10, 20), torch.arange(100, 110)
    f = _InFlight(None, h.numpy(), d.numpy(), True)
    h.fill_(500)
    d.fill_(900)
    assert f.overlaps(np.array([15]), np.array([0]))      # still host slot 15
    assert f.overlaps(np.array([0]), np.array([105]))     # still device slot 105
    assert not f.overlaps(np.array([500]), np.array([900]))


def test_the_background_thread_gives_way_to_a_load_being_prepared_but_never_for_long():
    """Between its chunks the backup thread waits while a load is prepared (until the load's
    first layer is queued), and at most GIVE_WAY_S from the load's start in all (not at every
    chunk: H200 run 127); the hook is per thread."""
    import threading
    import time

    from kvtier.transfer import engine as engine_mod
    from kvtier.transfer.base import between_chunks, chunk_hook
    spec = KVSpec("mla", 2, torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8)
    eng = TransferEngine(host_pool_for(pool_from_spec(spec, 32, 1, "cpu"), "layer_first", host_size_tokens=32))
    waited = []

    def backup_thread():
        with chunk_hook(eng._pause_for_loads):
            t0 = time.perf_counter()
            between_chunks()
            waited.append(time.perf_counter() - t0)
    between_chunks()  # no hook in this thread: nothing happens
    t = threading.Thread(target=backup_thread)
    t.start()
    t.join()
    assert waited[0] < engine_mod.GIVE_WAY_S  # no load being prepared: no wait
    with eng._load_first():
        t = threading.Thread(target=backup_thread)
        t.start()
        time.sleep(0.001)
        assert t.is_alive()        # waiting for the load
    t.join()                       # released when the load's first layer is queued
    assert waited[1] < 10 * engine_mod.GIVE_WAY_S
    with eng._load_first():        # a load that takes long: the wait is bounded
        t0 = time.perf_counter()
        backup_thread()
        assert engine_mod.GIVE_WAY_S * 0.9 <= time.perf_counter() - t0 < 10 * engine_mod.GIVE_WAY_S
        backup_thread()            # ... and spent: the next chunk does not wait again
        assert waited[-1] < engine_mod.GIVE_WAY_S / 2, waited
    eng.give_way_s = 0.0           # no giving way at all
    with eng._load_first():
        backup_thread()
        assert waited[-1] < engine_mod.GIVE_WAY_S / 2, waited


def test_backends_do_not_keep_a_dropped_pools_memory():
    """The shared backends keep a pointer table per transfer part; they held the parts, and with
    them every pool a process had moved (host and device memory), for good. Now a dropped
    pool's memory goes, and its tables with it."""
    import gc
    import weakref

    from kvtier.transfer.cuda_common import PartTables
    tables = PartTables()
    spec = KVSpec("mha", 2, torch.bfloat16, head_num=2, head_dim=8)
    dev = pool_from_spec(spec, 64, 1, "cpu")
    host = host_pool_for(dev, "layer_first", host_size_tokens=64)
    kept = host_pool_for(pool_from_spec(spec, 64, 1, "cpu"), "layer_first", host_size_tokens=64)
    memory = [weakref.ref(t) for t in host.component_tensors.values()]
    memory += [weakref.ref(t) for t in dev.stacks.values()]
    for p in host.transfer_parts() + kept.transfer_parts():
        before = tables.gcd(p, torch.device("cpu"))
        assert tables.gcd(p, torch.device("cpu")) == before  # built once, found again
    assert len(tables._tables) == 4
    del dev, host, p
    gc.collect()
    assert all(r() is None for r in memory)
    assert len(tables._tables) == 2  # the live pool's parts keep theirs
    assert all(hit[0]() in kept.transfer_parts() for hit in tables._tables.values())


def test_check_mapped_goes_by_the_parts_own_record():
    """``check_mapped`` asks the part's owner (the host pool's buffer) whether its bytes are
    registered, rather than the CUDA runtime each transfer; a CPU pool's parts say no."""
    from dataclasses import replace

    from kvtier.transfer.cuda_common import check_mapped
    spec = KVSpec("mha", 2, torch.bfloat16, head_num=2, head_dim=8)
    host = host_pool_for(pool_from_spec(spec, 64, 1, "cpu"), "layer_first", host_size_tokens=64)
    part = host.transfer_parts()[0]
    with pytest.raises(ValueError, match="registered with CUDA"):
        check_mapped(part)
    check_mapped(replace(part, mapped=lambda: True))  # what a registered buffer reports
    with pytest.raises(ValueError, match="registered with CUDA"):
        check_mapped(replace(part, mapped=None))      # no record: the runtime says no on CPU


def test_layer_numbers_and_bad_engine_input_are_named():
    """layer_done(7) and layer_done(-3) of a 2-layer load answered "loaded" (on the GPU a
    negative layer counted from the end); backup(5, 6) failed on len() and TransferEngine(a
    device pool) on a missing attribute, before the checks that name the argument."""
    spec = KVSpec("mla", 2, torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8)
    dev = pool_from_spec(spec, 32, 4, "cpu")
    host = host_pool_for(dev, "layer_first", host_size_tokens=32)
    eng = TransferEngine(host)
    ld = eng.load(torch.arange(4), torch.arange(4, 8))
    for bad in (7, -3, 2, True, 1.0):
        with pytest.raises(ValueError, match=r"layer must be an integer in 0\.\.1"):
            ld.layer_done(bad)
        with pytest.raises(ValueError, match=r"layer must be an integer in 0\.\.1"):
            ld.wait_layer(bad)
    assert ld.layer_done(1)
    stats = (eng.stats.backups, eng.stats.backup_bytes)
    for h, d in ((5, 6), (torch.tensor(5), torch.tensor(6)), (torch.zeros(2, 2, dtype=torch.long), torch.arange(4))):
        with pytest.raises(ValueError, match="host_indices must be a one-dimensional sequence of slots"):
            eng.backup(h, d)
    assert (eng.stats.backups, eng.stats.backup_bytes) == stats
    eng.backup([0, 1, 2, 3], [4, 5, 6, 7])
    with pytest.raises(TypeError, match="TransferEngine moves KV for a host pool .* got MLATokenToKVPool"):
        TransferEngine(dev)


def test_hundreds_of_cpu_transfers_hold_the_objects_flat():
    """The CPU path's steady state (the GPU one: tests/transfer_gpu/test_transfer_gpu_steady_state.py): after a warm-up,
    200 backups and loads of scattered pages through one engine and the seed API leave the
    Python objects alive where they were, and the bytes of the last round trip are right."""
    import gc
    from kvtier_testlib import fill_random, pages_to_slots
    spec = KVSpec("mla", 3, torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8)
    dev = pool_from_spec(spec, 1024, 16, "cpu")
    fill_random(dev, 3)
    host = host_pool_for(dev, "page_first", host_size_tokens=1024)
    eng = TransferEngine(host)
    rng = np.random.default_rng(3)

    def round_():
        h = pages_to_slots(rng.permutation(32)[:8], 16)
        d = pages_to_slots(rng.permutation(32)[:8], 16)
        eng.backup(h, d).synchronize()
        eng.load(h, d + 512).synchronize()
        for layer in range(dev.layer_num):
            host.load_to_device_per_layer(dev, h, d + 512, layer, "direct")
        return d
    for _ in range(20):
        d = round_()
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(100):
        d = round_()
    gc.collect()
    assert len(gc.get_objects()) - before < 20
    for st in dev.stacks.values():
        assert torch.equal(st[:, d + 512].view(torch.uint8), st[:, d].view(torch.uint8))


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_head"])
@pytest.mark.parametrize("dtype, head_dim", [(torch.float8_e4m3fn, 3), (torch.bfloat16, 1), (torch.bfloat16, 2),
                                             (torch.bfloat16, 4)])
def test_direct_moves_scattered_tokens_of_any_row_width_exactly(layout, dtype, head_dim):
    """The CPU's indexed copies move rows in the widest elements the layout allows (1, 2, 4 or 8
    bytes here: 3-byte rows, 2, 4, 8): scattered single tokens round-trip byte for byte."""
    spec = KVSpec("mha", 3, dtype, head_num=3, head_dim=head_dim)
    dev = pool_from_spec(spec, 64, 4, "cpu")
    for st in dev.stacks.values():
        st.view(torch.uint8).random_(0, 256)
    host = host_pool_for(dev, layout, host_size_tokens=64)
    eng = TransferEngine(host, "direct")
    gen = torch.Generator().manual_seed(0)
    h, d = torch.randperm(64, generator=gen)[:20], torch.randperm(32, generator=gen)[:20]
    before = {k: v.clone() for k, v in dev.stacks.items()}
    eng.backup(h, d).wait()
    out = torch.randperm(32, generator=gen)[:20] + 32
    eng.load(h, out).synchronize()
    for k, st in dev.stacks.items():
        assert torch.equal(st[:, out].view(torch.uint8), before[k][:, d].view(torch.uint8)), k
