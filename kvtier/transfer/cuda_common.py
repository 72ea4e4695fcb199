"""What the CUDA backends share: index tensors on the device, host-mapping checks, numpy
views of indices, per-part device pointer tables, and timing queued work by device events."""

from __future__ import annotations

import functools
import threading
import weakref

import numpy as np
import torch

from . import triton_kernels as tk
from .base import TransferPart
from .triton_kernels import WordPlan, fetch_index, interpreting, layer_ptr_table, layers_gcd
from ..layouts import Placement


class PartTables:
    """Per-part device pointer tables and the gcd of those pointers, built once per part and
    dropped with it. Parts are held weakly: a part holds its pools' memory, and a backend may
    outlive the pools it moved."""

    def __init__(self):
        self._tables: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}
        self._lock = threading.Lock()  # one table per part, whichever thread asks first

    def _hit(self, part: TransferPart, device: torch.device):
        key = id(part)
        hit = self._tables.get(key)
        if hit is None or hit[0]() is not part:
            with self._lock:
                hit = self._tables.get(key)
                if hit is None or hit[0]() is not part:
                    hit = (weakref.ref(part, functools.partial(_forget, self._tables, key)),
                           layer_ptr_table(part.device_layers, device), layers_gcd(part.device_layers), {})
                    self._tables[key] = hit
        return hit

    def memo(self, part: TransferPart, key, make):
        """``make(part)``, made once per part and ``key`` and dropped with the part (e.g. the
        kernel's page-per-row view of a part)."""
        seen = self._hit(part, part.device_layers[0].device)[3]
        if key not in seen:
            seen[key] = make(part)
        return seen[key]

    def get(self, part: TransferPart, device: torch.device) -> torch.Tensor:
        return self._hit(part, device)[1]

    def gcd(self, part: TransferPart, device: torch.device) -> int:
        """The gcd of the part's device layer addresses (what :meth:`WordPlan.for_copy` needs)."""
        return self._hit(part, device)[2]

    def words(self, part: TransferPart, pl: Placement, buf: torch.Tensor) -> WordPlan:
        """The word plan for a copy between ``part``'s device layers and ``buf`` placed by ``pl``."""
        return WordPlan.for_copy(pl, buf, part.device_layers, self.gcd(part, part.device_layers[0].device))


def _forget(tables: dict, key: int, ref: weakref.ref) -> None:
    """A part's table goes with the part (only its own entry: the id may be taken again)."""
    hit = tables.get(key)
    if hit is not None and hit[0] is ref:
        tables.pop(key, None)


def numpy_if_host(idx: torch.Tensor, known):
    """``known`` if given, else ``idx`` as numpy where that needs no device read (else None)."""
    if known is not None or idx.device.type != "cpu":
        return known
    return idx.numpy()


def on_device(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``idx`` as int64 on ``device``; a host tensor is copied by a kernel on the current stream
    (:func:`~.triton_kernels.fetch_index`: never queued behind bulk copies, never blocking the host)."""
    idx = idx.to(torch.int64).contiguous()  # the kernels read an index as packed int64s
    if idx.device == device:
        return idx
    if device.type != "cuda" or interpreting():
        return idx.to(device)
    return fetch_index(idx, device)


def host_numpy(idx: torch.Tensor):
    """``idx`` as a numpy array; a CUDA tensor is read back without queueing behind bulk copies."""
    if idx.device.type == "cuda" and not interpreting():
        return tk.fetch_index_to_host(idx)
    return idx.to("cpu").numpy()


def check_mapped(part: TransferPart) -> None:
    """Raise unless ``part``'s host bytes are registered with CUDA (a zero-copy kernel or a
    copy into them would otherwise fault). By the part's own record where it has one
    (``TransferPart.mapped``), else by asking the runtime (``is_pinned``)."""
    if part.host_raw.device.type != "cpu" or not (part.mapped() if part.mapped is not None
                                                  else part.host_raw.is_pinned()):
        raise ValueError(
            f"component {part.name!r}: zero-copy kernels need host memory registered with CUDA "
            "(build the host pool on a machine with CUDA, pin_memory=None or True); "
            "use io_backend='direct' otherwise"
        )


def event_seconds(fn, reps: int = 3, best: bool = False) -> float:
    """Median device time of ``fn`` (which queues work on the current stream), after one warm-up call;
    ``best``: the shortest instead (what ``fn`` can do, when other work may disturb a sample).

    Blocks the host until each timed call's work is done.
    """
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return float(min(times) if best else np.median(times))
