"""Host layouts: where each byte of a host pool lives.

A layout is chosen once, when a host pool is built. It answers two questions
for every component (K, V, latent KV, index-K): the shape of the typed tensor
that holds it, and a :class:`Placement`, an affine map from
``(slot, layer, chunk)`` to a byte offset. Every transfer backend (direct
copies, Triton kernels, DMA) and the L3 page pointers read only the
placement, so adding a layout is adding one class here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import Component, DSA, MHA, MLA


@dataclass(frozen=True)
class Placement:
    """Byte offset of chunk ``c`` of token ``slot`` in ``layer``::

        (slot // page_size) * page + (slot % page_size) * token
            + layer * layer_stride + c * chunk

    An item (one token, one layer) is ``n_chunks`` runs of ``chunk_bytes``.
    """

    page_size: int
    page: int
    token: int
    layer_stride: int
    chunk: int
    chunk_bytes: int
    n_chunks: int
    layer_num: int
    total_bytes: int

    @property
    def item_bytes(self) -> int:
        return self.chunk_bytes * self.n_chunks

    @property
    def tokens_linear(self) -> bool:
        """True when slot ``s`` sits at ``s * token`` within a layer (no page jump)."""
        return self.page == self.page_size * self.token

    @property
    def item_contiguous(self) -> bool:
        return self.n_chunks == 1

    def offset(self, slot: int, layer: int, chunk: int = 0) -> int:
        page, tok = divmod(slot, self.page_size)
        return page * self.page + tok * self.token + layer * self.layer_stride + chunk * self.chunk

    @property
    def page_contiguous(self) -> bool:
        """Whether one page is one contiguous block of every layer's bytes."""
        return self.page == self.page_size * self.layer_num * self.item_bytes

    @property
    def pieces_per_page(self) -> int:
        """``len(page_pieces(p))``, counted without building them (a layer each, or one)."""
        return 1 if self.page_contiguous else self.layer_num

    @property
    def piece_bytes(self) -> int:
        """The size of each of a page's pieces."""
        return self.page_size * self.item_bytes * (self.layer_num if self.page_contiguous else 1)

    def page_pieces(self, page: int) -> list[tuple[int, int]]:
        """The contiguous byte ranges ``(offset, nbytes)`` that hold one page, in order.

        Their concatenation is the page's bytes in this layout's native order,
        the same order as a flat data page. One per layer where the layout
        splits a page by layer (:attr:`pieces_per_page` counts them for free).
        """
        start = page * self.page
        if self.page_contiguous:
            return [(start, self.piece_bytes)]
        return [(start + layer * self.layer_stride, self.piece_bytes) for layer in range(self.layer_num)]


class HostLayout:
    """How a host pool orders pages, tokens, layers and heads."""

    name: str = ""
    doc: str = ""

    def shape(self, comp: Component, layer_num: int, size: int, page_size: int) -> tuple[int, ...]:
        raise NotImplementedError

    def placement(self, comp: Component, layer_num: int, size: int, page_size: int) -> Placement:
        raise NotImplementedError

    # Which dimension of ``shape`` walks pages, and whether it counts pages or tokens.
    page_dim = 0
    page_dim_counts_pages = False

    def page_view(self, t, page: int, page_size: int, lead: int = 0):
        """A view of one page of a tensor of ``shape`` (after ``lead`` leading dims)."""
        if self.page_dim_counts_pages:
            return t.narrow(lead + self.page_dim, page, 1)
        return t.narrow(lead + self.page_dim, page * page_size, page_size)


class LayerFirst(HostLayout):
    name = "layer_first"
    doc = "[layer][token]: mirrors the GPU pool; per-layer loads read one run per page"
    page_dim = 1

    def shape(self, comp, layer_num, size, page_size):
        return (layer_num, size, *comp.item_shape)

    def placement(self, comp, layer_num, size, page_size):
        item = comp.item_bytes
        return Placement(
            page_size, page_size * item, item, size * item, 0, item, 1, layer_num,
            layer_num * size * item,
        )


class PageFirst(HostLayout):
    name = "page_first"
    doc = "[token][layer]: a page is one contiguous block (best for L3 and backup)"

    def shape(self, comp, layer_num, size, page_size):
        return (size, layer_num, *comp.item_shape)

    def placement(self, comp, layer_num, size, page_size):
        item = comp.item_bytes
        return Placement(
            page_size, page_size * layer_num * item, layer_num * item, item, 0, item, 1,
            layer_num, layer_num * size * item,
        )


class PageHead(HostLayout):
    name = "page_head"
    doc = "[page][head][token][layer]: a page is contiguous and split by head"
    page_dim_counts_pages = True

    def shape(self, comp, layer_num, size, page_size):
        chunk_elems = comp.item_shape[-1]
        return (size // page_size, comp.n_chunks, page_size, layer_num, chunk_elems)

    def placement(self, comp, layer_num, size, page_size):
        c = comp.chunk_bytes
        per_head = page_size * layer_num * c
        return Placement(
            page_size, comp.n_chunks * per_head, layer_num * c, c, per_head, c,
            comp.n_chunks, layer_num, layer_num * size * comp.item_bytes,
        )


LAYOUTS: dict[str, HostLayout] = {
    cls.name: cls() for cls in (LayerFirst, PageFirst, PageHead)
}

# Which host layouts each KV kind supports.
SUPPORTED = {
    MHA: ("layer_first", "page_first", "page_head"),
    MLA: ("layer_first", "page_first"),
    DSA: ("layer_first",),
}


class UnsupportedLayoutError(ValueError, NotImplementedError):
    """A host layout a kind does not support: a ValueError, and a NotImplementedError as the
    seed raised for DSA's page_first (callers that catch that to fall back still do)."""


def get_layout(name: str, kind: str) -> HostLayout:
    allowed = SUPPORTED[kind]
    if name not in allowed:
        raise UnsupportedLayoutError(
            f"host layout {name!r} is not supported for {kind.upper()} pools; "
            f"use one of {list(allowed)}"
        )
    return LAYOUTS[name]


def device_placement(comp: Component, size: int, page_size: int) -> Placement:
    """Per-layer device buffers are ``(size, *item)``: layer_first with layer stride 0.

    Device layers may be separate allocations, so the layer term is carried
    by a per-layer pointer, not by the placement.
    """
    item = comp.item_bytes
    return Placement(page_size, page_size * item, item, 0, 0, item, 1, 1, size * item)
