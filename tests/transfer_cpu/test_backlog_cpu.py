"""Backlog: jobs run once each and in order, whichever thread pumps them."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.transfer.backlog import STALL_S, Backlog


class Boom(Exception):
    pass


class BacklogMachine(RuleBasedStateMachine):
    """The worker's turns are rules too, so every interleaving of adds, worker turns and
    callers' pumps (all of a pump's jobs, or up to one job) is tried."""

    def __init__(self):
        super().__init__()
        self.turns = []  # pumps handed to the worker, not yet run
        self.backlog = Backlog(self.turns.append)
        self.ran: list[int] = []
        self.futures = []
        self.fails: set[int] = set()

    @rule(fail=st.booleans())
    def add(self, fail):
        i = len(self.futures)

        def job():
            self.ran.append(i)
            if fail:
                raise Boom(i)
        if fail:
            self.fails.add(i)
        self.futures.append(self.backlog.add(job))

    @precondition(lambda self: self.turns)
    @rule()
    def worker_turn(self):
        self.turns.pop(0)()

    @rule()
    def pump_all(self):
        self.backlog.pump()

    @precondition(lambda self: self.futures)
    @rule(data=st.data())
    def pump_upto(self, data):
        k = data.draw(st.integers(0, len(self.futures) - 1))
        self.backlog.pump(self.futures[k])
        assert self.futures[k].done()
        # no job after k was run for it
        assert all(j <= k or not f.done() or j in self.ran for j, f in enumerate(self.futures))

    @invariant()
    def in_order_once(self):
        assert self.ran == list(range(len(self.ran)))  # in order, none twice, none skipped
        assert len(self.backlog) == len(self.futures) - len(self.ran)
        for i, f in enumerate(self.futures):
            assert f.done() == (i < len(self.ran))
            if f.done():
                assert isinstance(f.exception(), Boom) == (i in self.fails)


TestBacklogMachine = BacklogMachine.TestCase
TestBacklogMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_pump_upto_stops_after_that_job():
    backlog = Backlog(lambda pump: None)  # a worker that never gets a turn
    ran = []
    futs = [backlog.add(lambda i=i: ran.append(i)) for i in range(5)]
    backlog.pump(futs[2])
    assert ran == [0, 1, 2] and [f.done() for f in futs] == [True, True, True, False, False]
    backlog.pump()
    assert ran == [0, 1, 2, 3, 4] and len(backlog) == 0


def test_caller_waits_for_the_job_the_worker_runs_then_goes_on():
    """The worker is inside job 0 (slow) when the caller pumps up to job 2: the caller waits
    for job 0 (not failing, not skipping it), and jobs 1 and 2 then run in order, by
    whichever thread takes the lock first."""
    started, release = threading.Event(), threading.Event()
    ran = []

    def slow():
        started.set()
        release.wait(5)
        ran.append(("slow", threading.current_thread().name))

    with ThreadPoolExecutor(1, thread_name_prefix="worker") as pool:
        worker_turns = []
        backlog = Backlog(worker_turns.append)
        f0 = backlog.add(slow)
        t = pool.submit(worker_turns.pop())
        started.wait(5)
        f1 = backlog.add(lambda: ran.append(("1", threading.current_thread().name)))
        f2 = backlog.add(lambda: ran.append(("2", threading.current_thread().name)))
        threading.Timer(0.05, release.set).start()
        backlog.pump(f2)
        t.result(5)
    assert [r[0] for r in ran] == ["slow", "1", "2"] and ran[0][1].startswith("worker")
    assert f0.done() and f1.done() and f2.done()


def test_real_worker_and_caller_race():
    """A real worker thread and the caller pump 300 jobs at once: each runs once, in order."""
    ran = []
    with ThreadPoolExecutor(1) as pool:
        backlog = Backlog(pool.submit)
        futs = []
        for i in range(300):
            futs.append(backlog.add(lambda i=i: (ran.append(i), time.sleep(0) if i % 7 else None)))
            if i % 11 == 0:
                backlog.pump(futs[i // 2])
        backlog.pump()
    assert ran == list(range(300)) and all(f.done() and f.exception() is None for f in futs)


def test_an_error_fails_its_own_job_only():
    backlog = Backlog(lambda pump: None)
    ran = []
    ok1 = backlog.add(lambda: ran.append(1))
    bad = backlog.add(lambda: 1 / 0)
    ok2 = backlog.add(lambda: ran.append(2))
    backlog.pump()
    assert ran == [1, 2] and ok1.exception() is None and ok2.exception() is None
    assert isinstance(bad.exception(), ZeroDivisionError)


def test_keyboard_interrupt_is_not_swallowed():
    backlog = Backlog(lambda pump: None)

    def stop():
        raise KeyboardInterrupt
    f = backlog.add(stop)
    with pytest.raises(KeyboardInterrupt):
        backlog.pump()
    assert isinstance(f.exception(), KeyboardInterrupt)


def test_pump_if_stalled_leaves_a_job_that_is_getting_on_to_the_worker():
    backlog = Backlog(lambda pump: None)
    ran = []
    f = backlog.add(lambda: ran.append(0))
    backlog.pump(f, if_stalled=True)  # just added: the worker is given its turn
    assert ran == [] and not f.done()
    time.sleep(2 * STALL_S)
    backlog.progress()  # the job moved on just now (a chunk queued)
    backlog.pump(f, if_stalled=True)
    assert ran == []
    time.sleep(2 * STALL_S)
    assert backlog.stalled()
    backlog.pump(f, if_stalled=True)
    assert ran == [0] and f.done()


def test_add_whose_worker_cannot_start_leaves_no_job_behind():
    """A worker that cannot start (its executor shut down: the engine going away) raises from
    ``add``; the job used to stay queued all the same and run at some later, unrelated pump."""
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    b = Backlog(pool.submit)
    ran = []
    with pytest.raises(RuntimeError, match="shutdown"):
        b.add(lambda: ran.append("a"))
    assert len(b) == 0
    b.pump()
    assert ran == []


def test_a_wait_for_one_job_does_not_also_wait_for_the_next():
    """pump(upto) checked ``upto`` only before waiting for the lock: a caller that waited while
    the worker ran ``upto`` then waited for the next job as well (a review: 0.25 s for a 0.05 s
    job, the next taking 0.2 s), so a wait on one backup waited for the next one's queueing."""
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(5)

    with ThreadPoolExecutor(1) as pool:
        turns = []
        b = Backlog(turns.append)
        f0 = b.add(slow)
        worker = pool.submit(turns.pop())
        assert started.wait(5)
        f1 = b.add(lambda: time.sleep(0.3))
        threading.Timer(0.05, release.set).start()
        t0 = time.perf_counter()
        b.pump(f0)
        waited = time.perf_counter() - t0
        assert f0.done() and waited < 0.25, waited
        worker.result(5)
        assert f1.done()
