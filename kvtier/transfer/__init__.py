"""Moving KV bytes between device and host pools.

:class:`TransferEngine` orders backups and layer-by-layer loads; backends only
copy bytes. ``io_backend`` names one (:data:`IO_BACKENDS`), taken from a
:class:`Backends` set that the engine builds or is given.
"""

from .base import Backend, TransferPart
from .direct import DirectBackend
from .engine import TransferEngine
from .factory import IO_BACKENDS, Backends, check_backend, get_backend
from .handles import LayerLoad, TransferHandle

__all__ = ["IO_BACKENDS", "Backend", "Backends", "DirectBackend", "TransferPart", "check_backend", "get_backend",
           "TransferEngine", "TransferHandle", "LayerLoad"]
