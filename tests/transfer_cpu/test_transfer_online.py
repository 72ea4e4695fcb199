"""The online backend chooser behind io_backend='auto' (pure logic; the GPU tests time real transfers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.device_pool import pool_from_spec
from kvtier.host_pool import host_pool_for
from kvtier.spec import KVSpec
from kvtier.transfer.online import DUPLEX, OnlineChooser, score, shape_key


def test_explores_each_candidate_in_prior_order_then_keeps_the_fastest():
    c = OnlineChooser(explore=2)
    key = ("shape",)
    seen = []
    rates = {"dma": iter([30.0, 31.0]), "kernel": iter([45.0, 47.0])}
    for _ in range(4):
        pick = c.pick(key, ["dma", "kernel"])
        seen.append(pick)
        c.record(key, pick, next(rates[pick]))
    assert seen == ["dma", "dma", "kernel", "kernel"]
    assert [c.pick(key, ["dma", "kernel"]) for _ in range(3)] == ["kernel"] * 3
    assert c.best(key) == "kernel"


def _explored(c: OnlineChooser, key, rates: dict) -> str:
    """Let ``c`` explore ``rates`` (candidate -> samples, in the prior's order); its pick after."""
    order, rates = list(rates), {k: iter(v) for k, v in rates.items()}
    for _ in range(c.explore * len(order)):
        pick = c.pick(key, order)
        c.record(key, pick, next(rates[pick]))
    return c.pick(key, order)


def test_the_score_leaves_out_one_inflated_sample_so_it_does_not_condemn_a_path():
    # H200 run 14: DMA's first backup of a shape ran slow once (kernel compile, staging
    # allocation), and by median of one sample auto kept the kernel at 0.88x where DMA gave 0.94x.
    c = OnlineChooser()
    assert _explored(c, ("shape",), {"dma": [30.0, 52.0, 51.5], "kernel": [48.0, 48.5, 48.2]}) == "dma"
    assert c.best(("shape",)) == "dma"


def test_the_score_leaves_out_one_lucky_sample_too():
    # H200 run 27, MHA page_head page-1 scattered backup: DMA's best sample 49.5 GB/s beat the
    # kernel's 49.1, and DMA then ran at 46.5 where the kernel runs at 49.4.
    c = OnlineChooser()
    assert _explored(c, ("shape",), {"dma": [49.5, 46.5, 46.6], "kernel": [49.1, 49.0, 48.9]}) == "kernel"
    assert score([49.5, 46.5, 46.6]) == 46.6 and score([49.5, 46.5]) == 49.5


def test_scores_within_the_tie_keep_the_priors_order():
    # H200 run 27, MLA layer_first page-64 allocator backup: DMA (the prior's first) sampled
    # best 47.8 GB/s, the kernel 48.2; on the kernel auto ran at 0.86x where DMA runs at 0.95x.
    c = OnlineChooser()
    assert _explored(c, ("a",), {"dma": [47.8, 47.5, 52.6], "kernel": [48.2, 48.0, 48.1]}) == "dma"
    assert _explored(c, ("b",), {"kernel": [48.2, 48.0, 48.1], "dma": [47.8, 47.5, 52.6]}) == "kernel"
    assert _explored(c, ("c",), {"dma": [45.0, 45.1, 45.2], "kernel": [48.2, 48.0, 48.1]}) == "kernel"  # 6% apart
    strict = OnlineChooser(tie=0.0)
    assert _explored(strict, ("a",), {"dma": [47.8, 47.5, 52.6], "kernel": [48.2, 48.0, 48.1]}) == "kernel"


def test_a_shared_transfer_takes_dma_unless_dma_alone_was_far_slower():
    c = OnlineChooser()
    solo = ("shape",)
    shared = solo + (DUPLEX,)
    assert c.pick(shared, ["kernel", "dma"]) == "dma"          # nothing timed alone yet
    c.record(solo, "kernel", 50.0)
    c.record(solo, "dma", 41.0)                                # 0.82 of the kernel: still dma
    assert c.pick(shared, ["kernel", "dma"]) == "dma"
    c.record(solo + ("m",), "kernel", 49.6)
    c.record(solo + ("m",), "dma", 38.8)                       # 0.78: still dma (run 123, MLA page 64)
    assert c.pick(solo + ("m", DUPLEX), ["kernel", "dma"]) == "dma"
    c.record(solo + ("b",), "kernel", 50.0)
    c.record(solo + ("b",), "dma", 33.0)                       # 0.66 (scattered single tokens, run 15)
    assert c.pick(solo + ("b", DUPLEX), ["kernel", "dma"]) == "kernel"
    assert c.pick(solo + ("b", DUPLEX), ["dma"]) == "dma"       # only candidate


def test_a_shared_transfer_keeps_its_best_alone_when_the_other_way_can_only_use_the_kernel():
    c = OnlineChooser()
    solo = ("shape",)
    c.record(solo, "kernel", 50.0)
    c.record(solo, "dma", 45.0)
    shared = solo + (DUPLEX,)
    assert c.pick(shared, ["kernel", "dma"]) == "dma"
    assert c.pick(shared, ["kernel", "dma"], partner_kernel_only=True) == "kernel"  # the pair gains nothing
    assert c.pick(shared, ["dma", "kernel"], partner_kernel_only=True) == "kernel"  # whatever the prior's order


def test_shapes_are_kept_apart_and_bad_samples_ignored():
    c = OnlineChooser(explore=1)
    c.record("a", "kernel", 10.0)
    c.record("a", "dma", 20.0)
    c.record("a", "dma", float("nan"))
    c.record("a", "kernel", -1.0)
    assert c.pick("a", ["kernel", "dma"]) == "dma"
    assert c.pick("b", ["kernel", "dma"]) == "kernel"  # unseen shape: prior order


def test_shape_key_separates_direction_geometry_size_and_run_length():
    spec = KVSpec("mha", 2, torch.bfloat16, head_num=2, head_dim=16)
    dev = pool_from_spec(spec, 256, 16, "cpu")
    parts_lf = host_pool_for(dev, "layer_first", host_size_tokens=256).transfer_parts()
    parts_pf = host_pool_for(dev, "page_first", host_size_tokens=256).transfer_parts()
    runs = np.arange(64)
    scattered = np.random.default_rng(0).permutation(256)[:64]
    base = shape_key(False, parts_lf, runs, 1 << 20)
    assert base == shape_key(False, parts_lf, runs + 64, 1 << 20)
    assert base != shape_key(True, parts_lf, runs, 1 << 20)
    assert base != shape_key(False, parts_pf, runs, 1 << 20)
    assert base != shape_key(False, parts_lf, scattered, 1 << 20)
    assert base != shape_key(False, parts_lf, runs, 1 << 24)


class _Clock:
    """Stands in for CUDA events (which need a GPU) in the pure bookkeeping below: a time and a fired flag."""

    def __init__(self, t: float, fired: bool = True):
        self.t, self.fired = t, fired

    def query(self) -> bool:
        return self.fired

    def elapsed_time(self, other) -> float:
        return other.t - self.t


def test_samples_that_shared_the_link_with_the_other_direction_are_filed_apart():
    from kvtier.transfer.online import DUPLEX, PendingTimings
    c, t = OnlineChooser(explore=1), PendingTimings()
    load, backup = (False, "geom"), (True, "geom")
    t.add(load, "dma", 10**9, _Clock(0), _Clock(20))        # alone: 50 GB/s
    t.harvest(c)
    t.add(backup, "dma", 10**9, _Clock(30), _Clock(60))
    late = _Clock(70, fired=False)
    t.add(load, "dma", 10**9, _Clock(40), late)              # starts while the backup runs
    assert t.busy(False) and not t.busy(True)
    t.harvest(c)
    late.fired = True
    t.harvest(c)
    assert c.samples[load]["dma"] == [50.0]                   # the solo sample is untouched
    assert c.samples[load + (DUPLEX,)]["dma"] == [pytest.approx(1e9 / 0.030 / 1e9)]
    assert c.samples[backup + (DUPLEX,)]["dma"] == [pytest.approx(1e9 / 0.030 / 1e9)]
    # A sample picked under the duplex key that ran alone goes back to the solo key.
    t.add(load + (DUPLEX,), "kernel", 10**9, _Clock(100), _Clock(125))
    t.harvest(c)
    assert c.samples[load]["kernel"] == [40.0]


def test_a_transfer_after_one_that_shared_the_link_is_chosen_as_sharing_it():
    """In a stream of backup+load pairs the backup is issued while no load runs yet; it is
    still chosen from duplex samples when the previous backup shared the link."""
    from kvtier.transfer.online import PendingTimings
    c, t = OnlineChooser(explore=1), PendingTimings()
    backup, load = (True, "geom"), (False, "geom")
    assert not t.sharing(True)
    t.add(backup, "kernel", 10**9, _Clock(0), _Clock(20))
    t.add(load, "dma", 10**9, _Clock(5), _Clock(25))
    t.harvest(c)
    assert t.sharing(True) and t.sharing(False)      # both last ran together
    t.add(backup, "kernel", 10**9, _Clock(100), _Clock(120))   # then a backup alone
    t.harvest(c)
    assert not t.sharing(True) and t.sharing(False)
    pending = _Clock(200, fired=False)
    t.add(load, "dma", 10**9, _Clock(150), pending)
    assert t.sharing(True)                            # a load is in flight right now


def test_a_transfer_counts_as_in_flight_from_when_it_is_opened():
    """A backup prepared but still being queued (by the engine's background thread) already
    makes a load issued now share the link; one that failed stops counting, with no sample."""
    from kvtier.transfer.online import PendingTimings
    c, t = OnlineChooser(explore=1), PendingTimings()
    backup = (True, "geom")
    opened = t.open(backup, "dma", _Clock(0))
    assert t.busy(True) and t.sharing(False)
    t.harvest(c)                                       # nothing to harvest before it closes
    assert not c.samples[backup]
    t.close(opened, 10**9, _Clock(20))
    t.harvest(c)
    assert c.samples[backup]["dma"] == [50.0] and not t.busy(True)
    failed = t.open(backup, "dma", _Clock(30))
    t.drop(failed)
    t.harvest(c)
    assert not t.busy(True) and c.samples[backup]["dma"] == [50.0]


def test_a_transfer_sharing_the_link_goes_by_dma_where_it_can():
    """Samples time one direction only; a zero-copy kernel's cost lands on the other one."""
    from kvtier.transfer.online import DUPLEX
    c = OnlineChooser(explore=1)
    shared = (True, "geom", DUPLEX)
    c.record(shared, "kernel", 50.0)
    c.record(shared, "dma", 40.0)          # looks slower from its own side
    assert c.pick(shared, ["kernel", "dma"]) == "dma"
    assert c.pick(shared, ["kernel"]) == "kernel"          # where DMA is no candidate (e.g. one slot per run)
    assert c.pick(shared[:-1], ["kernel", "dma"]) == "kernel"  # alone: unexplored kernel first, by the prior
    assert OnlineChooser(when_shared=None).pick(shared, ["kernel", "dma"]) == "kernel"


def test_bench_sample_note_names_the_shapes_a_row_added_to_with_counts_and_scores():
    from types import SimpleNamespace

    from kvtier.bench.transfer import sample_counts, sample_note
    chooser = OnlineChooser(explore=2)
    backend = SimpleNamespace(chooser=chooser)
    solo, shared, other = (True, "g", 20, 3), (True, "g", 20, 3, DUPLEX), (False, "g", 20, 3)
    chooser.record(other, "kernel", 40.0)
    before = sample_counts(backend)
    for key, cand, rate in ((solo, "dma", 41.25), (solo, "dma", 44.0), (solo, "dma", 47.5), (solo, "kernel", 49.8),
                            (shared, "dma", 30.0)):
        chooser.record(key, cand, rate)
    note = sample_note(backend, before)
    # dma: the second best of three; the load shape did not change
    assert note == "backup dma:3@44.0 kernel:1@49.8; backup/duplex dma:1@30.0"
    assert sample_note(backend, sample_counts(backend)) == ""
    assert sample_note(SimpleNamespace(), {}) == "" and sample_counts(object()) == {}


def test_the_prior_tries_dma_unless_it_is_predicted_far_slower():
    """H200 run 20: the prior put DMA at about 2.3x the kernel for MLA page-64 loads from
    scattered host pages, which DMA then moved at 0.95x against the kernel's 0.85x."""
    pytest.importorskip("triton")
    from kvtier.transfer.auto import EXPLORE_WITHIN, rank
    assert rank({"kernel": 0.84e-3, "dma": 1.94e-3}) == ["kernel", "dma"]
    assert rank({"kernel": 1.0, "dma": 0.5}) == ["dma", "kernel"]
    assert rank({"kernel": 1.0, "dma": 1.01 * EXPLORE_WITHIN}) == ["kernel"]


def _pairs(c: OnlineChooser, load, backup, pair_rates: dict) -> str:
    """Let ``c`` explore a shared load (key ``load``) in pairs: ``pair_rates[candidate]`` is
    ``(load GB/s alone in its own timing, the pair's GB/s)`` when the load goes by that
    candidate; the backup is ``c.pick``-ed too, as auto does. The load's pick after exploring."""
    for _ in range(2 * c.explore):
        lc, bc = c.pick(load, ["dma", "kernel"]), c.pick(backup, ["dma", "kernel"])
        assert bc == "dma"                                 # backups keep the DMA-when-shared rule
        own, both = pair_rates[lc]
        c.record(load, lc, own)
        c.record_pair(load, lc, both)
    return c.pick(load, ["dma", "kernel"])


def test_a_shared_load_is_chosen_by_what_its_pairs_moved():
    """H200 runs 113 and 115 (probe_pair_mix_h200_run11*.json): single scattered tokens, a DMA
    load timed 50 GB/s on its own in pairs that moved 60 GB/s, a kernel load 37 GB/s in pairs
    that moved 71; scattered page-64 pages, DMA 49.5 in pairs of 83, the kernel 41 in 64."""
    c = OnlineChooser()
    single, pages = (False, "p1", DUPLEX), (False, "p64", DUPLEX)
    assert _pairs(c, single, (True, "p1", DUPLEX), {"dma": (50.0, 60.0), "kernel": (37.0, 71.0)}) == "kernel"
    assert _pairs(c, pages, (True, "p64", DUPLEX), {"dma": (49.5, 83.0), "kernel": (41.0, 64.0)}) == "dma"
    # Without pair samples for every candidate, the load's own samples decide.
    lone = (False, "lone", DUPLEX)
    for cand, rate in (("dma", 30.0), ("kernel", 35.0)) * 3:
        c.record(lone, cand, rate)
    c.record_pair(lone, "dma", 80.0)
    assert c.pick(lone, ["dma", "kernel"]) == "kernel"
    # Off, or where the backups can only use the kernel: the rules for a transfer sharing the link.
    assert OnlineChooser(pair_loads=False).pick(single, ["kernel", "dma"]) == "dma"
    c.record(single[:-1], "kernel", 45.0)
    c.record(single[:-1], "dma", 50.0)
    assert c.pick(single, ["kernel", "dma"], partner_kernel_only=True) == "dma"  # the best alone
    assert c.pick(single, ["dma"]) == "dma"


def test_pick_by_pairs_keeps_the_candidate_whose_pairs_moved_most_not_its_own_rate():
    """H200 run 122 (MLA layer_first single tokens): a zero-copy backup on 8 blocks timed
    itself at 43.6 GB/s against 46.8 on 32, in pairs that moved 63.4 GB/s against 56.1."""
    c = OnlineChooser()
    key = (True, "p1", DUPLEX)
    rates = {"kernel": (46.8, 56.1), "kernel@8": (43.6, 63.4)}
    seen = []
    for _ in range(2 * c.explore):
        pick = c.pick_by_pairs(key, ["kernel", "kernel@8"])
        seen.append(pick)
        c.record(key, pick, rates[pick][0])
        c.record_pair(key, pick, rates[pick][1])
    assert seen == ["kernel"] * 3 + ["kernel@8"] * 3
    assert c.pick_by_pairs(key, ["kernel", "kernel@8"]) == "kernel@8"
    c.record_pair(key, "kernel", 90.0)  # where the pairs say otherwise, the other one
    c.record_pair(key, "kernel", 90.0)
    assert c.pick_by_pairs(key, ["kernel", "kernel@8"]) == "kernel"


def test_auto_names_its_fewer_block_backup_only_where_it_has_fewer_blocks():
    pytest.importorskip("triton")
    from kvtier.transfer.auto import SHARED_BACKUP_BLOCKS, AutoBackend
    from kvtier.transfer.dma import DMABackend
    from kvtier.transfer.kernel import KernelBackend, KernelConfig
    auto = AutoBackend(KernelBackend(KernelConfig(max_blocks=32)), DMABackend())
    assert auto._throttled(None) == f"kernel@{SHARED_BACKUP_BLOCKS}"
    assert auto._throttled(SHARED_BACKUP_BLOCKS) is None and auto._throttled(4) is None
    assert AutoBackend(KernelBackend(), DMABackend(), shared_backup_blocks=None)._throttled(None) is None
    with pytest.raises(ValueError, match="shared_backup_blocks"):
        AutoBackend(KernelBackend(), DMABackend(), shared_backup_blocks=0)


def test_harvest_files_what_a_transfer_and_those_beside_it_moved_once_all_have_finished():
    from kvtier.transfer.online import PendingTimings
    c, t = OnlineChooser(explore=1), PendingTimings()
    backup, load = (True, "geom"), (False, "geom")
    b_end = _Clock(40, fired=False)
    t.add(backup, "dma", 10**9, _Clock(0), b_end)                  # 1 GB from 0 to 40 ms
    t.add(load + (DUPLEX,), "kernel", 10**9, _Clock(5), _Clock(25))  # 1 GB from 5 to 25 ms
    t.harvest(c)
    assert c.samples[load + (DUPLEX,)]["kernel"] == [50.0]
    assert not c.pairs                                             # the backup is still running
    b_end.fired = True
    t.add(load, "dma", 10**9, _Clock(100), _Clock(120))            # alone: no pair
    t.harvest(c)
    assert c.samples[load]["dma"] == [50.0]
    assert c.pairs[load + (DUPLEX,)] == {"kernel": [50.0]}         # 2 GB over 0-40 ms
    assert c.pairs[backup + (DUPLEX,)] == {"dma": [50.0]}
    t.harvest(c)
    assert c.pairs[load + (DUPLEX,)] == {"kernel": [50.0]}         # filed once
    # A transfer that finished before one the other way started is not in a pair with it.
    t.add(backup, "kernel", 10**9, _Clock(130), _Clock(150))
    t.harvest(c)
    assert not c.pairs[backup + (DUPLEX,)].get("kernel") and c.samples[backup]["kernel"] == [50.0]


def test_a_pair_whose_other_half_failed_is_not_filed():
    """A load that ran beside a backup which then failed (dropped: no sample) gets no pair sample."""
    from kvtier.transfer.online import PendingTimings
    c, t = OnlineChooser(explore=1), PendingTimings()
    failed = t.open((True, "geom"), "dma", _Clock(0))
    t.add((False, "geom"), "kernel", 10**9, _Clock(5), _Clock(25))
    t.harvest(c)
    assert c.samples[(False, "geom", DUPLEX)]["kernel"] == [50.0] and t._paired
    t.drop(failed)
    t.harvest(c)
    assert not c.pairs and not t._paired


def test_explore_must_be_positive():
    with pytest.raises(ValueError, match=r"OnlineChooser.explore must be a positive integer, got 0"):
        OnlineChooser(explore=0)


def test_each_candidate_keeps_its_latest_samples_only():
    """A server times a shape millions of times; every pick scores every sample kept (all
    of them: 39 ms of host time a pick after 100k transfers)."""
    from kvtier.transfer.online import WINDOW
    c = OnlineChooser(explore=1)
    key = ("shape",)
    for i in range(10 * WINDOW):
        c.record(key, "dma", 10.0 + i)
        c.record_pair(key + (DUPLEX,), "dma", 10.0 + i)
    kept = c.samples[key]["dma"]
    assert kept == [10.0 + i for i in range(9 * WINDOW, 10 * WINDOW)]
    assert len(c.pairs[key + (DUPLEX,)]["dma"]) == WINDOW
    assert score(kept) == 10.0 + 10 * WINDOW - 2


def test_with_a_kernel_only_partner_a_candidate_never_timed_alone_is_still_tried():
    """The other way can only use the kernel and this shape was timed alone by DMA only: the
    kernel is explored under the shared key rather than DMA kept for good, then the better of
    the two there is taken."""
    c = OnlineChooser(explore=1)
    solo = ("shape",)
    shared = solo + (DUPLEX,)
    c.record(solo, "dma", 45.0)
    assert c.pick(shared, ["dma", "kernel"], partner_kernel_only=True) == "dma"  # explored first, in prior order
    c.record(shared, "dma", 30.0)
    assert c.pick(shared, ["dma", "kernel"], partner_kernel_only=True) == "kernel"
    c.record(shared, "kernel", 40.0)
    assert c.pick(shared, ["dma", "kernel"], partner_kernel_only=True) == "kernel"
    c.record(solo, "kernel", 50.0)  # now both timed alone: the best alone, as before
    assert c.pick(shared, ["dma", "kernel"], partner_kernel_only=True) == "kernel"


def test_transfers_on_different_gpus_do_not_share_a_link():
    """A backup on one GPU and a load on another were filed as sharing one link (a pair sample
    formed from them, and both directions predicted shared); their events cannot even be
    compared on a real GPU. Timings are kept apart by device."""
    from kvtier.transfer.online import DUPLEX, PendingTimings
    c, t = OnlineChooser(explore=1), PendingTimings()
    backup, load = (True, "geom", 0), (False, "geom", 1)
    t.add(backup, "dma", 10**9, _Clock(0), _Clock(20), device=0)
    opened = t.open(load, "kernel", _Clock(5), device=1)          # in flight on GPU 1 beside the backup
    assert t.busy(False, 1) and not t.busy(False, 0)
    assert not t.sharing(True, 0) and t.sharing(True, 1)
    t.close(opened, 10**9, _Clock(25))
    t.harvest(c)
    assert not c.pairs and not c.samples[backup + (DUPLEX,)] and not c.samples[load + (DUPLEX,)]
    assert c.samples[backup]["dma"] == [50.0]
    assert not t.sharing(True, 0) and not t.sharing(False, 1)


def test_a_transfer_in_flight_is_seen_by_shape_and_candidate():
    """``auto`` keeps DMA for a shape that a DMA transfer is moving now, before its sample is in."""
    from kvtier.transfer.online import DUPLEX, PendingTimings
    t = PendingTimings()
    base = (True, "geom", 24, 3, 0)
    opened = t.open(base + (DUPLEX,), "dma", _Clock(0), device=0)
    assert t.pending(base, "dma") and not t.pending(base, "kernel") and not t.pending((False,) + base[1:], "dma")
    t.drop(opened)
    assert not t.pending(base, "dma")
