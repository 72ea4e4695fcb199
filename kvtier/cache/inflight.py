"""Transfers in flight: bounded queues of prepared operations awaiting completion.

An :class:`Op` is created when a transfer is issued (prepare: pages are
allocated and recorded on the nodes as not ready) and completed when its
handle reports done (complete: the pages become ready). The queues are
bounded; a full queue is the caller's signal to wait or skip.
"""

from __future__ import annotations

import time
from collections import deque

from ..transfer.engine import LayerLoad
from .types import LoadFailedError

BACKUP, LOAD = "backup", "load"


class Op:
    """One issued transfer and the nodes whose pages it reads or writes."""

    __slots__ = ("kind", "nodes", "handle", "nbytes", "issued", "error", "demotion")

    def __init__(self, kind: str, nodes: list, handle, nbytes: int, issued: float):
        self.kind = kind
        self.nodes = nodes      # grows when a node in flight is split
        self.handle = handle
        self.nbytes = nbytes
        self.issued = issued
        self.error: BaseException | None = None  # what stopped it (its handle raised)
        self.demotion = False   # a backup that makes room on the device (counted when it lands)

    def seconds(self) -> float:
        """Issue to completion (completion as the handle saw it, or now)."""
        end = getattr(self.handle, "finished_at", None) or time.perf_counter()
        return max(end - self.issued, 0.0)


class InFlight:
    def __init__(self, max_backups: int, max_loads: int):
        self.limits = {BACKUP: max_backups, LOAD: max_loads}
        self.queues: dict[str, deque[Op]] = {BACKUP: deque(), LOAD: deque()}

    def full(self, kind: str) -> bool:
        return len(self.queues[kind]) >= self.limits[kind]

    def depth(self, kind: str) -> int:
        return len(self.queues[kind])

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def add(self, op: Op) -> None:
        assert not self.full(op.kind)
        self.queues[op.kind].append(op)

    def take_done(self) -> list[Op]:
        """Remove and return every op whose handle reports done, or raised (the error in
        ``op.error``: a backup whose copies the background thread failed to queue, a load of
        a caller's engine that failed on the device)."""
        done: list[Op] = []
        for q in self.queues.values():
            if not q:
                continue
            pending = deque()
            for op in q:
                finished = op.error is not None  # a waiter saw it fail (CacheLoad)
                if not finished:
                    try:
                        finished = op.handle.done()
                    except Exception as err:  # noqa: BLE001 - the caller retires the op, and counts it
                        op.error, finished = err, True
                (done if finished else pending).append(op)
            if len(pending) != len(q):
                q.clear()
                q.extend(pending)
        return done

    def oldest(self, kind: str | None = None) -> Op | None:
        kinds = (kind,) if kind else (BACKUP, LOAD)
        ops = [self.queues[k][0] for k in kinds if self.queues[k]]
        return min(ops, key=lambda op: op.issued) if ops else None


class CacheLoad(LayerLoad):
    """The loads a request waits on, seen as one: layer ``i`` is there when it is in all (no
    load: every layer is there).

    Once one of them has failed (its handle raised here or to the cache), every wait and
    check raises :class:`~.types.LoadFailedError`, and ``failed`` is True: the request's
    device slots for the host part then hold no valid KV."""

    def __init__(self, ops: list[Op], layer_num: int):
        super().__init__(layer_num, sum(op.handle.nbytes for op in ops))
        self.ops = ops
        self.finished_at = None

    @property
    def failed(self) -> bool:
        return any(op.error is not None for op in self.ops)

    def _each(self, call) -> list:
        """``call(handle)`` for every load; a failure, seen now or before, as LoadFailedError."""
        out = []
        for op in self.ops:
            if op.error is None:
                try:
                    out.append(call(op.handle))
                    continue
                except Exception as err:  # noqa: BLE001 - the op's failure: the cache retires it at its next poll
                    op.error = err
            raise LoadFailedError(
                f"a load of this match's host part failed ({op.error}); its device slots hold no valid KV: "
                "unlock the match, then match_prefix again (the host copy is kept) and load it back or recompute it"
            ) from op.error
        return out

    def wait_layer(self, layer: int, stream=None) -> None:
        self._check_layer(layer)
        self._each(lambda h: h.wait_layer(layer, stream))

    def layer_done(self, layer: int) -> bool:
        self._check_layer(layer)
        return all(self._each(lambda h: h.layer_done(layer)))

    def done(self) -> bool:
        if all(self._each(lambda h: h.done())):
            if self.finished_at is None:
                self.finished_at = time.perf_counter()
            return True
        return False

    def synchronize(self) -> None:
        self._each(lambda h: h.synchronize())
        self.done()

    def settle(self) -> BaseException | None:
        errors = [op.error or settle(op.handle) for op in self.ops]
        return next((e for e in errors if e is not None), None)


def settle(handle) -> BaseException | None:
    """Block until whatever ``handle``'s transfer queued has run; its error, or None. Never
    raises (a caller's engine whose handles lack ``settle``: its ``synchronize``)."""
    own = getattr(handle, "settle", None)
    try:
        if own is not None:
            return own()
        handle.synchronize()
    except Exception as err:  # noqa: BLE001 - returned: the caller retires the transfer
        return err
    return None
