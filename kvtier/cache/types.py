"""What the cache hands back: match and load results, and the storage hook it calls."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..transfer.engine import LayerLoad
from .radix import Node


@dataclass(frozen=True)
class MatchResult:
    """What the cache holds of a prompt.

    ``device_indices``: device slots of the device-resident prefix (whole
    pages). ``host_len``: further tokens :meth:`HiCache.load_back` can bring
    from the host right after it. ``node``: opaque handle of the deepest
    matched node (covering the host part too), for lock/unlock/load_back.
    """

    device_indices: torch.Tensor
    host_len: int
    node: Node
    namespace: str

    @property
    def device_len(self) -> int:
        return len(self.device_indices)

    @property
    def total_len(self) -> int:
        return len(self.device_indices) + self.host_len


@dataclass(frozen=True)
class LoadResult:
    """Device slots of the whole matched prefix; attention for layer ``i`` calls ``layer_load.wait_layer(i)``."""

    device_indices: torch.Tensor
    layer_load: LayerLoad
    loaded_tokens: int


class StorageHook:
    """Where host eviction offers pages before freeing them (the L3 tier implements this)."""

    def offer(self, page_hashes: list[bytes], host_indices: torch.Tensor) -> None:
        """Called with the node's chained page hashes and host slots; the slots are freed on return."""
        raise NotImplementedError
