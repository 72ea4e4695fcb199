"""CUDA streams that do not alias one another.

``torch.cuda.Stream()`` does not create a stream: PyTorch keeps 32 streams per
priority level and device and hands them out in turn (pytorch/pytorch#173729).
The 33rd stream asked for at one priority is the first one again. Two stream
objects that share a CUDA stream run one after the other, however the code
that uses them meant them to overlap. For kvtier that means:

- A DMA backup whose staging ring's side stream (the gathers) is the engine's
  backup stream (the copies) gathers and copies in turn, at a fraction of the
  link's speed.
- A kvtier stream that is the caller's compute stream holds the forward pass
  behind the transfer.

So kvtier's streams come from :func:`fresh`, which draws until it gets a
stream that is none of kvtier's own and none of those it has seen callers
use. Before each transfer their users keep them apart from the caller's stream:
:func:`apart` draws again where one has come to share it. Where every stream
of the pool is taken, :func:`fresh` returns an aliased stream and warns once:
correct, only slower.
"""

from __future__ import annotations

import warnings
import weakref

import torch

POOL = 32  # streams PyTorch hands out per priority level and device, in turn

# Owners of kvtier streams (engines, staging rings): each lists its streams in
# ``kvtier_streams()``. Held weakly, so a dropped engine gives its streams back. (Not a
# weak reference to each stream: PyTorch's stream objects do not clear theirs when freed,
# and Python's exit handler then crashes on them.)
_owners: weakref.WeakSet = weakref.WeakSet()
_callers: set[int] = set()  # handles of callers' current streams seen by TransferEngine
repair = True  # False: keep streams as drawn, aliased or not (to measure what aliasing costs)
_warned = False


def register(owner) -> None:
    """Count ``owner.kvtier_streams()`` as taken while ``owner`` lives."""
    _owners.add(owner)


def _taken() -> set[int]:
    return {s.cuda_stream for o in list(_owners) for s in o.kvtier_streams() if s is not None}


def pick_distinct(draw, avoid: set[int], tries: int = POOL + 1):
    """Call ``draw()`` (which returns ``(item, handle)``) until a handle is not in ``avoid``;
    at most ``tries`` times. Returns ``(item, handle, distinct)``; the last draw if none was."""
    for _ in range(tries):
        item, handle = draw()
        if handle not in avoid:
            return item, handle, True
    return item, handle, False


def fresh(device, priority: int = 0, avoid=()) -> torch.cuda.Stream:
    """A pooled stream on ``device`` that is none of kvtier's other streams, none of the
    callers' streams seen so far and none of ``avoid`` (streams)."""
    global _warned
    taken = _taken() | _callers | {s.cuda_stream for s in avoid}

    def draw():
        s = torch.cuda.Stream(device, priority=priority)
        return s, s.cuda_stream
    stream, _, distinct = pick_distinct(draw, taken)
    if not distinct and not _warned:
        _warned = True
        warnings.warn(f"kvtier: every CUDA stream PyTorch pools at priority {priority} is in use; "
                      "a kvtier stream now shares one with other work, which runs in turn with it "
                      "(correct, but without overlap)", RuntimeWarning, stacklevel=2)
    return stream


def note_caller(stream: torch.cuda.Stream) -> None:
    """Remember a caller's current stream, so kvtier's streams keep off it."""
    _callers.add(stream.cuda_stream)


def clashes(stream: torch.cuda.Stream, *others: torch.cuda.Stream) -> bool:
    """True if ``stream`` shares its CUDA stream with one of ``others`` or with a caller's
    stream seen so far (and :data:`repair` is on): its user should draw a :func:`fresh` one."""
    if not repair:
        return False
    h = stream.cuda_stream
    return h in _callers or any(h == o.cuda_stream for o in others)


def apart(stream: torch.cuda.Stream, device, priority: int, *others: torch.cuda.Stream) -> torch.cuda.Stream:
    """``stream`` if it :func:`clashes` with none of ``others``; else a :func:`fresh` stream in
    its place, ordered after what ``stream`` holds so far."""
    if not clashes(stream, *others):
        return stream
    new = fresh(device, priority, (stream,) + others)
    new.wait_stream(stream)
    return new
