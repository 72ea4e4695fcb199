"""The page interface of a host pool (what L3 storage backends read and write).

A page is ``page_size`` token slots starting at a multiple of ``page_size``. Its flat form
is every component's bytes of the page in the pool's layout order (DSA: latent bytes then
index-K bytes); :meth:`HostPages.get_page_buffer_meta` gives the same bytes as host pointers.
"""

from __future__ import annotations

import torch

from .allocator import AllocatorError, tokens_to_pages
from .host_checks import _as_index_tensor, _int_value
from .validate import is_int


class HostPages:
    """Page reads and writes of :class:`~kvtier.host_pool.HostKVCache` (a mixin: the pool sets
    ``spec``, ``layout_obj``, ``placements``, ``component_tensors``, ``kv_buffer``, ``page_size``,
    ``size``, ``size_per_token``, ``pinned`` and provides ``raw_bytes``)."""

    @property
    def page_bytes(self) -> int:
        """Bytes of one page, every layer and component."""
        return self.page_size * self.size_per_token

    def _page_of(self, index) -> int:
        """The page that starts at token ``index``; ``ValueError`` for any other index."""
        index = _int_value(index)
        if not is_int(index):
            raise ValueError(f"index must be an integer token index, got {index!r}")
        if index % self.page_size or not 0 <= index < self.size:
            raise ValueError(
                f"index {index} is not the first slot of a page: use a multiple of "
                f"page_size={self.page_size} in 0..{self.size - self.page_size}"
            )
        return int(index) // self.page_size

    def _page_pieces(self, page: int) -> list[tuple[torch.Tensor, int, int]]:
        """(raw bytes, offset, nbytes) of every contiguous piece of a page, in flat order."""
        return [
            (raw, off, n)
            for c in self.spec.components
            for raw in (self.raw_bytes(c.name),)
            for off, n in self.placements[c.name].page_pieces(page)
        ]

    @property
    def _flat_dtype(self) -> torch.dtype:
        """The dtype of a flat page: the components' one, uint8 where they differ."""
        dtypes = {c.dtype for c in self.spec.components}
        return dtypes.pop() if len(dtypes) == 1 else torch.uint8

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        """The page starting at token ``index``.

        ``flat=True``: a 1-D tensor of the page's bytes in this layout's order,
        every component (DSA included: uint8, latent bytes then index-K bytes).
        ``flat=False``: a view into the pool (for DSA, the latent part only).
        """
        page = self._page_of(index)
        if not flat:
            return self._page_view(page)
        pieces = [raw[off : off + n] for raw, off, n in self._page_pieces(page)]
        return torch.cat(pieces).view(self._flat_dtype)

    def _page_view(self, page: int) -> torch.Tensor:
        lay = self.layout_obj
        if self._seed_combined:
            return lay.page_view(self.kv_buffer, page, self.page_size, lead=1)
        return lay.page_view(self.component_tensors[self.spec.components[0].name], page, self.page_size, lead=0)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zero page of the flat page's size and dtype (pinned when the pool is)."""
        n = self.page_bytes // self._flat_dtype.itemsize
        return torch.zeros(n, dtype=self._flat_dtype, pin_memory=self.pinned)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write a flat page (as :meth:`get_data_page` returns it) at token ``index``."""
        page = self._page_of(index)
        if not isinstance(data_page, torch.Tensor):
            raise TypeError(f"data_page must be a torch.Tensor, got {type(data_page).__name__}")
        src = data_page.detach().reshape(-1).to("cpu")
        flat = self._flat_dtype
        if src.dtype not in (flat, torch.uint8) and not (flat == torch.uint8 and src.element_size() == 1):
            # Values of another float type are converted, as the seed's copy did; its bytes read as
            # this pool's dtype would be garbage of the right size.
            if not (src.is_floating_point() and flat.is_floating_point):
                raise ValueError(
                    f"data_page has dtype {src.dtype}; a page of this pool is {flat} (its values), or uint8 "
                    "(its raw bytes, as get_data_page(...).view(torch.uint8) gives them)")
            src = src.to(flat)
        nbytes = src.numel() * src.element_size()
        if nbytes != self.page_bytes:
            raise ValueError(
                f"data_page holds {nbytes} bytes but a page of this pool is {self.page_bytes} "
                f"({self.page_size} tokens x {self.size_per_token} B)"
            )
        src = src.contiguous().view(torch.uint8)
        pos = 0
        for raw, off, n in self._page_pieces(page):
            raw[off : off + n].copy_(src[pos : pos + n])
            pos += n

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        """Host pointers and byte sizes covering exactly the pages in ``indices``.

        For each page (in order), every contiguous piece of it, in the same
        order as the flat page's bytes: reading the pieces back to back gives
        :meth:`get_data_page`. Zero-copy L3 backends read and write these.
        """
        tokens = _as_index_tensor(indices, "indices").to("cpu").numpy()
        try:
            pages = tokens_to_pages(tokens, self.page_size, self.size) if tokens.size else tokens
        except AllocatorError as e:
            raise ValueError(f"indices must be whole pages of this pool: {e}") from None
        ptrs: list[int] = []
        sizes: list[int] = []
        for page in pages.tolist():
            for raw, off, n in self._page_pieces(page):
                ptrs.append(raw.data_ptr() + off)
                sizes.append(n)
        return ptrs, sizes
