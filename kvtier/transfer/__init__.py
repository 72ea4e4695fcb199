"""Moving KV bytes between device and host pools."""

from .base import IO_BACKENDS, Backend, TransferPart, get_backend, register_backend
from .direct import DIRECT
from .engine import LayerLoad, TransferEngine, TransferHandle

__all__ = ["IO_BACKENDS", "Backend", "TransferPart", "get_backend", "register_backend", "DIRECT", "TransferEngine", "TransferHandle", "LayerLoad"]
