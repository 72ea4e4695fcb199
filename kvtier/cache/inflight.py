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
        ``op.error``: a backup whose copies the background thread failed to queue)."""
        done: list[Op] = []
        for q in self.queues.values():
            if not q:
                continue
            pending = deque()
            for op in q:
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


class CombinedLayerLoad(LayerLoad):
    """Several layer-by-layer loads seen as one: layer ``i`` is there when it is in all."""

    def __init__(self, loads: list[LayerLoad]):
        super().__init__(loads[0].layer_num, sum(x.nbytes for x in loads))
        self.loads = loads
        self.finished_at = None

    def wait_layer(self, layer: int, stream=None) -> None:
        for x in self.loads:
            x.wait_layer(layer, stream)

    def layer_done(self, layer: int) -> bool:
        return all(x.layer_done(layer) for x in self.loads)

    def done(self) -> bool:
        if all(x.done() for x in self.loads):
            if self.finished_at is None:
                self.finished_at = time.perf_counter()
            return True
        return False

    def synchronize(self) -> None:
        for x in self.loads:
            x.synchronize()
        self.done()

    def settle(self) -> BaseException | None:
        errors = [x.settle() for x in self.loads]
        return next((e for e in errors if e is not None), None)
