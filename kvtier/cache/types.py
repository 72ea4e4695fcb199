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
    ``load_len``: how many of ``host_len`` are on the host only, which a load
    moves (the others are on the device already, behind a page another
    request is loading); None: all of them.
    """

    device_indices: torch.Tensor
    host_len: int
    node: Node
    namespace: str
    load_len: int | None = None

    @property
    def host_only_len(self) -> int:
        """Tokens of the host part a load would move (``load_len``, else ``host_len``)."""
        return self.host_len if self.load_len is None else self.load_len

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
