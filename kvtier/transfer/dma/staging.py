"""Staging buffers for the DMA backend: a small ring per device and direction.

A buffer is reused only after the event that last used it has fired, so memory
stays bounded and no buffer is overwritten while a copy reads it.
"""

from __future__ import annotations

import threading

import torch

from .. import streams


class _Slot:
    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.free = None   # event: the last use of buf is complete once it fires
        self.ready = None  # event: buf holds the chunk the other stream waits for


class StagingRing:
    """Staging buffers and a side stream for one (device, direction)."""

    def __init__(self, device: torch.device, config, priority: int):
        """``config``: the backend's :class:`~.backend.DMAConfig` (its ``buffers`` and ``staging_bytes``)."""
        self.device = device
        self.config = config
        self.priority = priority
        self._tick = None  # (stream, flag, event) for drains on the copy (DMAConfig.load_drain)
        self.aside = None  # a backup's zero-copy parts, beside its copies (DMAConfig.kernel_aside)
        streams.register(self)
        self.side = streams.fresh(device, priority)
        self.slots = [_Slot() for _ in range(config.buffers)]
        self.next = 0
        self.pool_done = torch.cuda.Event()  # after the last chunk copied straight from the pool
        self.lock = threading.Lock()

    def kvtier_streams(self):
        return (getattr(self, "side", None), self._tick and self._tick[0], getattr(self, "aside", None))

    def aside_stream(self, *others: torch.cuda.Stream) -> torch.cuda.Stream:
        """The stream a backup's zero-copy parts run on, apart from the side stream and ``others``."""
        if self.aside is None:
            self.aside = streams.fresh(self.device, self.priority, (self.side,) + others)
        self.aside = streams.apart(self.aside, self.device, self.priority, self.side, *others)
        return self.aside

    def drain(self, after: str = "copy", copies=None, done: torch.cuda.Event | None = None) -> None:
        """Make the stream of this ring's copies wait before its next copy, so its queue runs
        dry for a moment and the copy engine takes copies other streams queued meanwhile.
        ``copies``: None for a load (copies on the side stream, each done at its slot's
        ``ready``), or a backup's stream (the caller's; each copy done at its slot's ``free``).
        ``after``: ``copy`` (the default, the cheapest), a one-element kernel on another
        stream queued after the last chunk's copy; ``scatter`` (loads), the last chunk's
        scatter; ``event``, the other stream only waits and records, with no kernel (no gap:
        other streams' copies still wait for the whole load). The last two are alternatives
        for comparison by probes.
        ``done``: an event recorded on ``copies`` after its last copy, for copies that use no
        staging slot (a backup straight from the device pool); default: the last slot's."""
        if done is None:
            last = self.slots[self.next - 1]  # the chunk queued last through this ring
            if last.free is None:  # nothing queued through it yet
                return
            if after == "scatter":
                self.side.wait_event(last.free)
                return
            copies = copies or self.side
            done = last.ready if copies is self.side else last.free
        if self._tick is None:
            self._tick = (None, torch.empty(1, device=self.device), torch.cuda.Event())
        if self._tick[0] is None or streams.clashes(self._tick[0], self.side, copies):
            self._tick = (streams.fresh(self.device, 0, (self.side, copies)),) + self._tick[1:]
        stream, flag, ev = self._tick
        stream.wait_event(done)  # its copy done
        if after == "copy":
            with torch.cuda.stream(stream):
                flag.fill_(0)
        ev.record(stream)
        copies.wait_event(ev)

    def take(self, nbytes: int) -> _Slot:
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        if slot.buf is None or slot.buf.numel() < nbytes:
            if slot.free is not None:
                slot.free.synchronize()  # growing: the old buffer must be idle before it goes
            slot.buf = torch.empty(max(nbytes, self.config.staging_bytes), dtype=torch.uint8, device=self.device)
            slot.free, slot.ready = torch.cuda.Event(), torch.cuda.Event()
        return slot
