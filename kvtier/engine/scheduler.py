"""Continuous batching: each step is either a prefill of newly admitted
sequences or one decode token for every running sequence.

Works on :class:`Sequence` objects and ints only; the KV manager hands out
slots and the model runner turns a :class:`Batch` into tensors.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .sequence import Sequence, Status


@dataclass
class Batch:
    seqs: list[Sequence]
    prefill: bool

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)


class Scheduler:
    """Prefill first (admitting waiting sequences while the token budget and
    the device pool allow), otherwise decode. When a decode step needs a page
    and none is free, the most recently admitted sequence is preempted: its
    pages go to the prefix cache (and so, under pressure, to the host tier)
    and it waits at the front of the queue to be resumed.
    """

    def __init__(self, kv, max_batch_tokens: int, max_running: int):
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        # Set when the head of the queue did not fit; free space only grows when
        # a sequence finishes, so admission is not retried before that.
        self._blocked = False

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """Raise if ``seq`` could never run here. The last generated token is never fed back:
        it needs no KV slot."""
        need = slots_needed(seq.num_tokens, seq.max_new_tokens)
        if need > self.kv.capacity:
            raise ValueError(
                f"request {seq.req_id} needs {need} token slots (prompt {seq.num_tokens} + "
                f"max_new_tokens {seq.max_new_tokens} - 1: the last token is not fed back) but the device "
                f"pool holds {self.kv.capacity}; raise the device pool size or shorten the request"
            )

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        """The next step's batch, or None when nothing can run now."""
        batch = self._admit()
        if batch:
            return Batch(batch, prefill=True)
        decodes = self._grow_running()
        return Batch(decodes, prefill=False) if decodes else None

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        if self._blocked and self.running:
            return admitted
        budget = self.max_batch_tokens
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            # The whole prompt bounds what is computed (the cached part is not known yet).
            if admitted and seq.num_tokens > budget:
                break
            if not self.kv.admit(seq):
                self._blocked = True
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            budget -= seq.num_new
        return admitted

    def _grow_running(self) -> list[Sequence]:
        ready: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            while not self.kv.append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                ready.append(seq)
        return ready

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def retry(self, batch: Batch) -> None:
        """A step that did not run (a host load under it failed): its sequences give their slots
        back and wait at the front of the queue, in order; one whose own load failed is computed
        in full when admitted again (``Sequence.load_failed``)."""
        for seq in reversed(batch.seqs):
            if seq.layer_load is not None and getattr(seq.layer_load, "failed", False):
                seq.load_failed = True
            self.running.remove(seq)
            self.kv.release(seq)
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)
        self._blocked = False

    def postprocess(self, batch: Batch, next_tokens: list[int]) -> list[Sequence]:
        """Record the step's tokens; finished sequences release their KV and are returned."""
        now = time.perf_counter()
        finished = []
        for seq, token in zip(batch.seqs, next_tokens):
            if batch.prefill:
                seq.computed += seq.num_new
            seq.num_computed = seq.num_tokens
            seq.layer_load = None  # later steps run after the layers it loaded
            seq.token_ids.append(token)
            if seq.first_token_at is None:
                seq.first_token_at = now
            if seq.done:
                seq.status, seq.finished_at = Status.FINISHED, now
                self.running.remove(seq)
                self.kv.release(seq)
                finished.append(seq)
                self._blocked = False
        return finished


def slots_needed(prompt_tokens: int, max_new_tokens: int) -> int:
    """Device slots a request holds at most: its prompt and every generated token but the last,
    which is never fed back."""
    return prompt_tokens + max_new_tokens - 1
