"""The ``dma`` backend: copy engines move the bytes through staging, SMs only gather and scatter.

``DMABackend(DMAConfig(...))`` builds one with its own configuration (e.g. as
``TransferEngine(host, io_backend=DMABackend(DMAConfig(load_drain=0)))``).
:mod:`.plan` and :mod:`.chunked` plan the copies (numpy only), :mod:`.staging`
holds the staging ring, :mod:`.issue` queues a planned transfer, :mod:`.backend`
decides and plans.
"""

from .backend import MiB, DMABackend, DMAConfig, pool_pitch
from .issue import DMARun, drain_every, drains_at, head_chunks, issue_copies
from .staging import StagingRing

__all__ = ["DMABackend", "DMAConfig", "DMARun", "StagingRing", "MiB", "pool_pitch", "drain_every", "drains_at",
           "head_chunks", "issue_copies"]
