"""Names to backends: :class:`Backends`, the set of backends one owner uses.

``io_backend`` names a way of moving bytes: ``direct`` (plain torch copies,
everywhere), ``kernel`` (zero-copy Triton kernels), ``dma`` (copy engines
through staging) or ``auto`` (the measured choice between the last two); on a
CPU device pool every name but ``kernel`` and ``dma`` means ``direct``. A
configured backend object may stand in for a name. There are no module-level
backend instances: an owner (a :class:`~kvtier.transfer.TransferEngine`, a
host pool's seed-style calls, a benchmark run) builds its set, and the
backends' measured state (``auto``'s samples and cost model, ``dma``'s load
groups, pointer tables) lives and dies with it.
"""

from __future__ import annotations

import threading

import torch

from .base import Backend
from .direct import DirectBackend

IO_BACKENDS = ("direct", "kernel", "dma", "auto")


def check_backend(name, device: torch.device) -> None:
    """Raise ``ValueError`` unless ``name`` (an ``io_backend`` name or a :class:`Backend`)
    can move bytes for a device pool on ``device``. Builds nothing."""
    if isinstance(name, Backend):
        if device.type != "cuda" and name.name != "direct":
            _needs_cuda(f"{type(name).__name__}(...) (a {name.name!r} backend)", device)
        return
    if name not in IO_BACKENDS:
        raise ValueError(f"unknown io_backend {name!r}; use one of {list(IO_BACKENDS)}")
    if device.type != "cuda" and name in ("kernel", "dma"):
        _needs_cuda(repr(name), device)


def _needs_cuda(label: str, device: torch.device) -> None:
    raise ValueError(f"io_backend={label} needs a CUDA device pool (this one is on {device}); "
                     "use io_backend='direct', which works everywhere")


class Backends:
    """The backends one owner uses, by name, each built on first use and kept as long as this
    object. The CUDA ones share one kernel backend: ``dma`` sends it the parts that do not
    suit copies, and ``auto`` is given both. ``kernel_config`` / ``dma_config``: their
    configurations (default: :class:`~.kernel.KernelConfig` and :class:`~.dma.DMAConfig`
    defaults). Thread-safe."""

    def __init__(self, kernel_config=None, dma_config=None):
        self.kernel_config = kernel_config
        self.dma_config = dma_config
        self._made: dict[str, Backend] = {}
        self._lock = threading.Lock()

    def get(self, name: str | Backend, device: torch.device) -> Backend:
        """The backend for ``io_backend=name`` on a device pool living on ``device``; a
        :class:`Backend` given for ``name`` is used as it is. Raises ``ValueError`` for an
        unknown name, a CUDA-only backend on a CPU pool, or CUDA backends this installation
        cannot load (no Triton)."""
        check_backend(name, device)
        if isinstance(name, Backend):
            return name
        key = name if device.type == "cuda" else "direct"
        with self._lock:
            if key not in self._made:
                self._make(key)
            return self._made[key]

    def _make(self, name: str) -> None:
        if name == "direct":
            self._made[name] = DirectBackend()
            return
        try:  # the CUDA backends pull in Triton: imported on first use
            from .auto import AutoBackend
            from .dma import DMABackend, DMAConfig
            from .kernel import KernelBackend, KernelConfig
        except ImportError as err:
            raise ValueError(f"io_backend={name!r} is not available in this installation ({err}); "
                             "use 'direct'") from err
        if "kernel" not in self._made:
            self._made["kernel"] = KernelBackend(self.kernel_config or KernelConfig())
        if name in ("dma", "auto") and "dma" not in self._made:
            self._made["dma"] = DMABackend(self.dma_config or DMAConfig(), fallback=self._made["kernel"])
        if name == "auto":
            self._made["auto"] = AutoBackend(self._made["kernel"], self._made["dma"])


def get_backend(name: str | Backend, device: torch.device) -> Backend:
    """A new backend for ``io_backend=name`` on ``device`` (of a set of its own:
    :meth:`Backends.get`)."""
    return Backends().get(name, device)
