"""Backups whose copies are still to be queued, queued in order by whichever thread gets there first.

The transfer engine hands a backup's chunk loop (milliseconds of host work for a 32k-token
backup) to a background thread, so that ``backup()`` returns at once and a load issued next
is queued first. But that thread needs the GIL between every call into CUDA, and a caller's
thread that keeps running Python gives it up only every ``sys.getswitchinterval()`` (5 ms),
which starves the copy engine. So the caller's thread queues whatever is still pending when
it waits for a backup (``wait``, ``synchronize``, a transfer ordered after it), and when it
asks ``done`` while the thread has queued nothing for ``STALL_S``: the backup then never waits
long for the thread to get a turn, and a caller that polls right after ``backup()`` (then
issues a load) does not take the queueing on itself while the thread is getting on with it.

Jobs run exactly once and in the order they were added; a job that raises fails its own
future only.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable

# ``done`` queues a backup's pending copies itself once the thread has queued nothing for this
# long: a 128 MiB chunk is ~2.4 ms of copying on an H200 and the thread queues one in ~0.2 ms.
STALL_S = 0.001
# How often a caller waiting for another thread's job looks whether its own is done (the wait
# itself holds no GIL).
WAIT_POLL_S = 0.0005


class Backlog:
    """Jobs queued in order by :meth:`pump`, from the worker (``start_worker``) or any caller."""

    def __init__(self, start_worker: Callable[[Callable[[], None]], object]):
        self._start_worker = start_worker  # runs its argument in another thread, some time
        self._jobs: deque[tuple[Callable[[], None], Future]] = deque()
        self._lock = threading.Lock()  # held while a job runs: one at a time, in order
        self._progress = time.perf_counter()  # when a job last started, was added, or moved on

    def add(self, job: Callable[[], None]) -> Future:
        """Queue ``job`` after every job added before it; its future is set once it has run."""
        fut: Future = Future()
        if not self._jobs:
            self._progress = time.perf_counter()
        entry = (job, fut)
        self._jobs.append(entry)
        try:
            self._start_worker(self.pump)
        except BaseException:
            # Not left behind for a later pump to run: the caller gets the error, not the job.
            # (Unless a pump in another thread already took it: then it has run, and counts.)
            with self._lock:
                if any(e is entry for e in self._jobs):
                    self._jobs.remove(entry)
                    raise
        return fut

    def progress(self) -> None:
        """A job calls this as it gets on (between its chunks)."""
        self._progress = time.perf_counter()

    def stalled(self, for_s: float = STALL_S) -> bool:
        """Whether no job has started or moved on for ``for_s`` seconds."""
        return time.perf_counter() - self._progress >= for_s

    def pump(self, upto: Future | None = None, if_stalled: bool = False) -> None:
        """Run pending jobs in this thread, in order: all of them, or until ``upto`` is done.
        If another thread is running one, wait for it (that releases the GIL, so it finishes
        at full speed) and go on. ``if_stalled``: only if :meth:`stalled`, else return at once."""
        if if_stalled and not self.stalled():
            return
        while upto is None or not upto.done():
            if upto is None:
                self._lock.acquire()
            else:
                # Waiting for another thread's job: ``upto`` may finish meanwhile, and then the
                # job after it is not this caller's to wait for (the lock is not fair: the worker
                # may take it again first, and a wait on one backup waited for the next one's
                # queueing too).
                while not self._lock.acquire(timeout=WAIT_POLL_S):
                    if upto.done():
                        return
            try:
                if not self._jobs or (upto is not None and upto.done()):
                    return
                job, fut = self._jobs.popleft()
                self._progress = time.perf_counter()
                try:
                    job()
                except BaseException as err:  # noqa: BLE001 - handed to the job's future
                    fut.set_exception(err)
                    if not isinstance(err, Exception):  # KeyboardInterrupt, SystemExit: not swallowed
                        raise
                else:
                    fut.set_result(None)
            finally:
                self._lock.release()

    def __len__(self) -> int:
        """Jobs not yet started."""
        return len(self._jobs)
