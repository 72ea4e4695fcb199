"""The ``kernel`` backend: Triton kernels that read and write host memory directly.

Host pools are registered with the GPU (portable and mapped), so their
address is valid on the device and a kernel moves the bytes over PCIe with
no staging and no copy engine. The cost is SMs: a transfer occupies at most
``max_blocks`` of them (the seed's ``block_quota``), one block per SM.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..layouts import Placement
from ..validate import require_positive_int
from .base import Backend, TransferPart
from .cuda_common import PartTables, check_mapped, numpy_if_host, on_device
from .slots import ascending, whole_pages as slots_whole
from .triton_kernels import copy_items

# Blocks a transfer may occupy when the caller names no quota: fewer leave zero-copy loads
# short of the PCIe limit on an H200, more take SMs for no gain (docs/performance.md).
DEFAULT_MAX_BLOCKS = 32


@dataclass(frozen=True)
class KernelConfig:
    """``max_blocks``: SMs a transfer may occupy when the caller names no quota.

    ``page_rows``: where a transfer moves whole pages (every ``page_size`` consecutive slot
    pairs one aligned page on both sides, as allocators hand them out and as DSA always
    moves them) and the layout keeps a page's tokens together within a layer
    (``layer_first``), the kernel copies each page's run as one row, cut into chunks of at
    most ``page_chunk_bytes`` (a power of two dividing the run; 0: the whole run), instead
    of one row per token. Rows of 132 bytes (DSA's index-K) then move in 16-byte words,
    not 4-byte ones, and the kernel reads one slot number per page.

    ``host_order``: a backup moves its slot pairs in host-slot order (where the caller's
    host slots, read back anyway, are not already ascending): the GPU writes host memory
    slower the more 2 MiB host pages the rows in flight are spread over (single tokens to
    random slots of a large pool: 0.47x of the link as drawn, 0.90x sorted, on an H200).
    Loads read at the same rate in any order and keep the caller's. The sort runs on the
    device, queued with the copy; slots already ascending cost one comparison on the host.
    """

    max_blocks: int = DEFAULT_MAX_BLOCKS
    page_rows: bool = True
    page_chunk_bytes: int = 8192
    host_order: bool = True

    def __post_init__(self) -> None:
        require_positive_int("max_blocks", self.max_blocks)
        for name in ("page_rows", "host_order"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelConfig.{name} must be True or False, got {getattr(self, name)!r}")
        c = self.page_chunk_bytes
        if isinstance(c, bool) or not isinstance(c, int) or c < 0 or (c and c & (c - 1)):
            raise ValueError(
                f"KernelConfig.page_chunk_bytes must be 0 (a whole page run per row) or a power of two, got {c!r}"
            )


def whole_pages(host_np, dev_np, page_size: int) -> bool:
    """True when the slot pairs come as whole pages: every ``page_size`` consecutive entries of
    ``host_np`` and of ``dev_np`` are the slots of one page, first to last (False without both)."""
    if page_size <= 1 or host_np is None or dev_np is None or len(host_np) == 0 or len(dev_np) != len(host_np):
        return False
    return all(slots_whole(np.asarray(s), page_size) for s in (host_np, dev_np))


def page_part(part: TransferPart, chunk_cap: int) -> TransferPart | None:
    """``part`` seen one page per slot: a page's tokens of one layer as one row, on the host
    and on the device; None where the layout does not keep them together (page_first,
    page_head) or a device layer is not a plain ``(slots, item_bytes)`` array.
    The row is cut into chunks: the largest power of two dividing it, at most ``chunk_cap``
    (0: no cut), or the whole row where that power is under 16 bytes."""
    pl = part.host
    ps, item = pl.page_size, pl.item_bytes
    if ps <= 1 or pl.n_chunks != 1 or pl.token != item:
        return None
    layers = []
    for t in part.device_layers:
        if t.dim() != 2 or t.stride() != (item, 1):
            return None
        layers.append(t[: t.shape[0] - t.shape[0] % ps].view(-1, ps * item))
    run = ps * item
    chunk = run & -run
    chunk = run if chunk < 16 or not chunk_cap else min(chunk, chunk_cap)
    paged = Placement(1, pl.page, pl.page, pl.layer_stride, chunk, chunk, run // chunk, pl.layer_num, pl.total_bytes)
    return replace(part, host=paged, device_layers=tuple(layers))


class KernelBackend(Backend):
    """Zero-copy Triton kernels between the device pool and mapped host memory. Owns its
    per-part pointer tables."""

    name = "kernel"

    def __init__(self, config: KernelConfig = KernelConfig()):
        self.config = config
        self.tables = PartTables()
        self.last_blocks = 0

    def _blocks(self, block_quota: int | None) -> int:
        if block_quota is None:
            return self.config.max_blocks
        require_positive_int("block_quota", block_quota)
        return block_quota

    def backup(self, parts, host_idx, dev_idx, block_quota=None):
        self._run(parts, host_idx, dev_idx, None, self._blocks(block_quota))

    def load(self, parts, host_idx, dev_idx, layer, block_quota=None):
        self._run(parts, host_idx, dev_idx, layer, self._blocks(block_quota))

    def _run(self, parts, host_idx, dev_idx, layer, blocks) -> None:
        self.prepare(parts, host_idx, dev_idx, layer is None, blocks)(layer)

    def prepare(self, parts, host_idx, dev_idx, to_host: bool, block_quota: int | None = None, host_np=None,
                dev_np=None):
        """Checks and index copies done once; returns ``run(layer)`` (``layer=None`` for a backup).
        ``host_np`` and ``dev_np``: the indices read back, if the caller has them (else read
        here from host tensors, never from device ones): whole pages then move a page per row
        (:attr:`KernelConfig.page_rows`)."""
        for part in parts:
            check_mapped(part)
        blocks = self._blocks(block_quota)
        device = parts[0].device_layers[0].device
        h, d = on_device(host_idx, device), on_device(dev_idx, device)
        todo = self.moves(parts, h, d, numpy_if_host(host_idx, host_np), numpy_if_host(dev_idx, dev_np), to_host)

        def run(layer):
            self.last_blocks = max(self.copy_part(part, ph, pd, layer, blocks) for part, ph, pd in todo)
        return run

    def moves(self, parts, h: torch.Tensor, d: torch.Tensor, host_np=None, dev_np=None, to_host: bool = False) -> list:
        """``(part, host slots, device slots)`` for each part, the slots on the device: as
        given, or, where the pairs (``host_np``, ``dev_np``: the same in numpy) are whole
        pages and the part's layout allows (:func:`page_part`), the part seen a page per
        slot and the page numbers. A backup (``to_host``) whose ``host_np`` is known moves the
        pairs in host-slot order (:attr:`KernelConfig.host_order`)."""
        if to_host and self.config.host_order and host_np is not None and not ascending(np.asarray(host_np)):
            # Sorted where the slots already are, queued on the stream (no host time). A
            # backup's host slots are distinct, so whole pages stay whole: the check below
            # reads the caller's order, and page rows still apply.
            h, order = torch.sort(h, stable=True)
            d = d[order]
        pages = {}
        if self.config.page_rows and whole_pages(host_np, dev_np, parts[0].host.page_size):
            cap = self.config.page_chunk_bytes
            pages = {i: q for i, p in enumerate(parts)
                     if (q := self.tables.memo(p, ("paged", cap), lambda part: page_part(part, cap)))}
        if not pages:
            return [(p, h, d) for p in parts]
        ps = parts[0].host.page_size
        hp, dp = (torch.div(t[::ps], ps, rounding_mode="floor") for t in (h, d))
        return [(pages[i], hp, dp) if i in pages else (p, h, d) for i, p in enumerate(parts)]

    def copy_part(self, part: TransferPart, h: torch.Tensor, d: torch.Tensor, layer: int | None,
                  blocks: int) -> int:
        """One part, all layers (``layer=None``, device -> host) or one layer (host -> device)."""
        ptrs = self.tables.get(part, d.device)
        pl = part.host
        if layer is None:
            return copy_items(pl, part.host_raw, part.device_layers, ptrs, h, d, 0, h.numel(), 0,
                              part.layer_num, True, blocks, self.tables.words(part, pl, part.host_raw))
        buf = part.host_raw[layer * pl.layer_stride:]
        return copy_items(pl, buf, part.device_layers, ptrs, h, d, 0, h.numel(), layer, 1, False, blocks,
                          self.tables.words(part, pl, buf))
