"""The CUDA backends, registered on first use by :func:`kvtier.transfer.base.get_backend`.

``kernel`` (zero-copy Triton kernels), ``dma`` (copy engines through staging)
and ``auto`` (the measured choice between them, per transfer part). They
share one kernel backend, so a pointer table or compiled kernel is built once.
"""

from __future__ import annotations

from .auto import AutoBackend
from .base import register_backend
from .dma import DMABackend, DMAConfig
from .kernel import KernelBackend, KernelConfig

KERNEL = register_backend(KernelBackend(KernelConfig()))
DMA = register_backend(DMABackend(DMAConfig(), fallback=KERNEL))
AUTO = register_backend(AutoBackend(KERNEL, DMA))
