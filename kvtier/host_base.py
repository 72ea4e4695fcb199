"""The host pool every kind shares: :class:`HostKVCache`, and its page interface
(:class:`HostPages`: what L3 storage backends read and write).

A page is ``page_size`` token slots starting at a multiple of ``page_size``. Its flat form
is every component's bytes of the page in the pool's layout order (DSA: latent bytes then
index-K bytes); :meth:`HostPages.get_page_buffer_meta` gives the same bytes as host pointers.

A pool is a list of components (K and V, or the latent row, plus DSA's index-K),
each with a typed tensor in the seed's shape and a :class:`~kvtier.layouts.Placement`.
Kind subclasses (:mod:`kvtier.host_pool`) only name their components and the seed's
attributes.
"""

from __future__ import annotations

import logging
import operator
import threading

import torch

from .allocator import AllocatorError, PageAllocator, tokens_to_pages
from .device_pool import as_rows, layer_attr
from .host_checks import (_as_index_tensor, _check_page_size, _check_range, _int_value, _numpy, _pool_device,
                          _size_in_pages, spec_of, synchronized)
from .layouts import HostLayout, Placement, get_layout
from .memory import (GB, HostBuffer, check_host_memory, gpu_available, huge_page_bytes, layer_objects_bytes,
                     resolve_huge_pages)
from .spec import DSA
from .transfer.base import TransferPart
from .transfer.factory import Backends
from .validate import InvariantError, device_type, is_int, require_index

logger = logging.getLogger("kvtier")


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


class HostKVCache(HostPages):
    """A host pool mirroring a device pool's components in a chosen layout.

    Size, in order of precedence: ``host_size_tokens`` tokens, else
    ``host_size`` GB (1e9 bytes), else ``host_to_device_ratio`` x the device
    pool; rounded up to whole pages. The memory is checked (host and cgroup
    limits, minus ``reserve_bytes``, default 10 GiB or ``KVTIER_HOST_RESERVE_GB``)
    before anything is allocated, and pinned for the GPU when CUDA is present.
    Raises ``TypeError`` for a device pool of another kind, ``ValueError`` for a bad
    argument, and :class:`~kvtier.memory.HostMemoryError` where the pool does not fit.

    Transfers (``backup_from_device_all_layer``, ``load_to_device_per_layer``) are queued
    on the current CUDA stream and return without waiting; on the CPU they complete
    before returning. Pages (the L3 interface) come from :class:`HostPages`.
    """

    KIND = ""
    _seed_combined = False  # MHA keeps K and V in one (2, ...) kv_buffer

    def __init__(self, device_pool, host_to_device_ratio: float, host_size: float, page_size: int,
                 layout: str, device: str = "cpu", host_size_tokens: int = 0, *,
                 reserve_bytes: int | None = None, pin_memory: bool | None = None,
                 validate_indices: bool = True, huge_pages: bool | None = None):
        self.spec = spec_of(device_pool, self.KIND)
        self.layout_obj: HostLayout = get_layout(layout, self.KIND)
        _check_page_size(page_size, device_pool)
        if device_type(device) != "cpu":
            raise ValueError(f"a host pool lives in host memory: device must be 'cpu', got {device!r}")
        if pin_memory and not gpu_available():
            raise ValueError("pin_memory=True needs CUDA; CPU-only torch cannot pin memory (leave it None)")
        self.huge_pages = resolve_huge_pages(huge_pages)
        self.device_pool = device_pool
        self.page_size = page_size = int(page_size)
        self.layout = layout
        self.device = "cpu"
        self.dtype = self.spec.store_dtype
        self.layer_num = self.spec.layer_num
        self.validate_indices = validate_indices
        self._seed_attrs()  # before the hooks: the seed's overrides read head_num, kv_lora_rank ...
        self.size_per_token = self.get_size_per_token()
        if self.size_per_token != self.spec.bytes_per_token:
            raise ValueError(
                f"get_size_per_token() gives {self.size_per_token!r} bytes, but this pool lays each token out "
                f"from the device pool's shape: {self.spec.bytes_per_token} bytes ({self.spec.describe()}); "
                "a padded or other token size is not supported, leave get_size_per_token as it is")
        self.page_num = _size_in_pages(
            host_size_tokens, host_size, host_to_device_ratio, device_pool.size, page_size, self.size_per_token
        )
        self.size = self.page_num * page_size
        if self.size < device_pool.size:
            logger.warning(
                "host pool (%d tokens) is smaller than the device pool (%d tokens): "
                "the host tier cannot hold everything the GPU evicts", self.size, device_pool.size,
            )
        requested = self.size * self.size_per_token
        objects = layer_objects_bytes(self.layer_num, len(self.spec.components))  # views, pointers, transfer parts
        mem = check_host_memory(requested + objects, reserve_bytes,
                                f"this {self.KIND.upper()} host pool ({self.layer_num:,} layers)")
        logger.info(
            "allocating %.2f GB of host KV (%d tokens, %s, %d B/token); %.2f GB available",
            requested / GB, self.size, layout, self.size_per_token, mem.available / GB,
        )
        self._kept_parts: tuple[list[tuple], list[TransferPart]] | None = None
        hooked = type(self).init_kv_buffer is not HostKVCache.init_kv_buffer
        # With an init_kv_buffer of the subclass's own, this pool's buffers are pinned only once
        # the hook has said which are kept (pinning touches all of them: twice the memory else).
        self._buffers = self._allocate(False if hooked else pin_memory)
        if hooked:
            self._adopt(self.init_kv_buffer, pin_memory)
        self.allocator = PageAllocator(self.size, page_size)
        self.lock = threading.RLock()

    # -- construction ----------------------------------------------------

    def _allocate(self, pin: bool | None) -> list[HostBuffer]:
        """This pool's buffers in its layout (pinned as ``pin`` says), with their placements."""
        comps = self.spec.components
        shapes = [self.layout_obj.shape(c, self.layer_num, self.size, self.page_size) for c in comps]
        if self._seed_combined:
            buffers = [HostBuffer((2, *shapes[0]), comps[0].dtype, pin, self.huge_pages)]
        else:
            buffers = [HostBuffer(s, c.dtype, pin, self.huge_pages) for s, c in zip(shapes, comps)]
        self.placements: dict[str, Placement] = {
            c.name: self.layout_obj.placement(c, self.layer_num, self.size, self.page_size) for c in comps
        }
        self._take(buffers)
        return buffers

    def _take(self, buffers: list[HostBuffer]) -> None:
        """Point ``kv_buffer`` and each component's tensor at ``buffers`` (MHA: one, K then V)."""
        comps = self.spec.components
        self.kv_buffer = buffers[0].tensor
        tensors = [self.kv_buffer[0], self.kv_buffer[1]] if self._seed_combined else [b.tensor for b in buffers]
        self.component_tensors = dict(zip((c.name for c in comps), tensors))
        self.pinned = buffers[0].pinned

    def _seed_attrs(self) -> None:
        """The seed's attributes of each kind (``head_num``, ``kv_lora_rank`` ...): set before the
        hooks run, which the seed's subclasses write against them."""

    def _adopt(self, hook, pin: bool | None) -> None:
        """A subclass's ``init_kv_buffer`` (the seed's hook, as engines override it to place host KV in
        memory of their own: shared, registered with a store ...): the tensor it returns becomes the
        storage of ``kv_buffer``, as does an ``index_k_buffer`` it sets (DSA). Each must have the
        shape and dtype this pool's layout gives it, on the CPU and contiguous. Every buffer kept
        (given, or this pool's own) is then pinned as ``pin`` says; the others are let go."""
        # Which of this pool's buffers holds each attribute the hook may hand over.
        made = {"kv_buffer": (0, self.kv_buffer)}
        if "index_k" in self.component_tensors:
            self.index_k_buffer = self.component_tensors["index_k"]
            made["index_k_buffer"] = (len(self._buffers) - 1, self.index_k_buffer)
        kept = [b.tensor for b in self._buffers]
        given = {"kv_buffer": hook()}
        if "index_k_buffer" in made and self.index_k_buffer is not made["index_k_buffer"][1]:
            given["index_k_buffer"] = self.index_k_buffer
        for name, t in given.items():
            at, want = made[name]
            if t is want:
                continue
            if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == want.dtype
                    and t.shape == want.shape and t.is_contiguous()):
                got = (f"{t.dtype} {tuple(t.shape)} on {t.device}" + ("" if t.is_contiguous() else ", not contiguous")
                       if isinstance(t, torch.Tensor) else type(t).__name__)
                raise ValueError(f"init_kv_buffer() gave {name} as {got}; this pool's {self.layout} layout needs a "
                                 f"contiguous CPU tensor of {want.dtype} {tuple(want.shape)}")
            kept[at] = t
        self._buffers = [HostBuffer.adopt(t, pin, huge_pages=b.huge_pages and t is b.tensor)
                         for t, b in zip(kept, self._buffers)]
        self._take(self._buffers)

    def init_kv_buffer(self):
        """The seed's hook. Here the constructor builds the buffers, and this returns ``kv_buffer``;
        a subclass that overrides it to return a tensor of its own gets that adopted (:meth:`_adopt`)."""
        return self.kv_buffer

    def get_size_per_token(self) -> int:
        """Bytes of one token, every layer and component (the seed's hook; the layout fixes it)."""
        return self.spec.bytes_per_token

    def huge_page_share(self) -> float:
        """The share of this pool's bytes the kernel backs with transparent huge pages now
        (0 where that cannot be read; ``/proc/self/smaps``, a few milliseconds)."""
        tensors = [b.tensor for b in self._buffers]  # one per mapping (MHA's K and V share one)
        held = sum(t.numel() * t.element_size() for t in tensors)
        return sum(huge_page_bytes(t) for t in tensors) / held if held else 0.0

    def check(self) -> None:
        """Verify the allocator and the buffers; raise :class:`~kvtier.validate.InvariantError`
        naming the first thing broken (each component's buffer holds the bytes its placement
        addresses, the allocator covers the pool's slots)."""
        self.allocator.check()
        if self.allocator.size != self.size:
            raise InvariantError(f"the allocator hands out {self.allocator.size} slots of a pool of {self.size}")
        for c in self.spec.components:
            got, want = self.raw_bytes(c.name).numel(), self.placements[c.name].total_bytes
            if got != want:
                raise InvariantError(f"the {c.name} buffer holds {got} bytes; its {self.layout} placement addresses {want}")

    def close(self) -> None:
        """Unpin the host memory now rather than at garbage collection."""
        for b in self._buffers:
            b.release()

    # -- the parts every transfer and page operation works on ------------

    def raw_bytes(self, component: str) -> torch.Tensor:
        """``component``'s whole buffer as a flat uint8 view (no copy)."""
        t = self.component_tensors[component]
        return t.reshape(-1).view(torch.uint8)

    def transfer_parts(self, device_pool=None) -> list[TransferPart]:
        """Every component's :class:`TransferPart` against ``device_pool`` (default: the pool this
        one mirrors). Kept for the mirrored pool while its per-layer buffers are the same tensor
        objects; made again when the engine has replaced any (the seed read them at every call,
        and a kept part would move bytes to and from the old tensors)."""
        pool = self.device_pool if device_pool is None else device_pool
        if pool is not self.device_pool:
            self._check_device_pool(pool)
            return self._make_parts(pool)
        layers = [getattr(pool, layer_attr(c.name)) for c in self.spec.components]
        kept = self._kept_parts
        if kept is None or not all(len(a) == len(b) and all(map(operator.is_, a, b)) for a, b in zip(kept[0], layers)):
            if kept is not None:
                self._check_device_pool(pool)  # replaced buffers: the same shapes still
            kept = self._kept_parts = ([tuple(a) for a in layers], self._make_parts(pool))
        return kept[1]

    def _make_parts(self, pool) -> list[TransferPart]:
        # Each component's buffer says whether it is still registered (close() unregisters).
        bufs = self._buffers * len(self.spec.components) if len(self._buffers) == 1 else self._buffers
        for c in self.spec.components:
            layers = getattr(pool, layer_attr(c.name))
            widths = {as_rows(t).shape[1] for t in layers}
            if len(layers) != self.layer_num or widths != {self.placements[c.name].item_bytes}:
                raise ValueError(
                    f"the device pool's {layer_attr(c.name)} holds {len(layers)} layers of {sorted(widths)} bytes a "
                    f"slot; this host pool moves {self.layer_num} layers of {self.placements[c.name].item_bytes}")
        return [
            TransferPart(
                c.name, self.raw_bytes(c.name), self.placements[c.name],
                tuple(as_rows(t) for t in getattr(pool, layer_attr(c.name))),
                mapped=lambda b=b: b.pinned,
            )
            for c, b in zip(self.spec.components, bufs)
        ]

    def layer_ptrs(self, component: str) -> list[int]:
        """Host address of layer ``i``'s first byte of ``component`` (placement base)."""
        base = self.raw_bytes(component).data_ptr()
        pl = self.placements[component]
        return [base + layer * pl.layer_stride for layer in range(self.layer_num)]

    def _ptr_table(self, component: str) -> torch.Tensor:
        """:meth:`layer_ptrs` as a uint64 tensor on the device pool's device (the seed's ``*_data_ptrs``)."""
        dev = getattr(self.device_pool, "device", torch.device("cpu"))
        return torch.tensor(self.layer_ptrs(component), dtype=torch.uint64, device=dev)

    # -- transfers -------------------------------------------------------

    def _backend(self, io_backend, device_pool):
        """The backend for ``io_backend`` from this pool's own set (built on first use), so the
        seed-style calls below keep their pointer tables and measurements between calls."""
        backends = self.__dict__.setdefault("_backends", Backends())
        return backends.get(io_backend, _pool_device(device_pool))

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend="direct",
                                     block_quota: int | None = None) -> None:
        """Copy ``device_indices`` of every layer into ``host_indices`` (device -> host)."""
        parts = self.transfer_parts(device_pool)
        backend = self._backend(io_backend, device_pool)
        host_indices, device_indices = self._check_indices(host_indices, device_indices, device_pool, parts=parts)[:2]
        backend.backup(parts, host_indices, device_indices, block_quota)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id: int,
                                 io_backend="direct") -> None:
        """Copy ``host_indices`` of layer ``layer_id`` into ``device_indices`` (host -> device)."""
        parts = self.transfer_parts(device_pool)
        backend = self._backend(io_backend, device_pool)
        layer_id = _int_value(layer_id)
        require_index("layer_id", layer_id, self.layer_num)
        host_indices, device_indices = self._check_indices(host_indices, device_indices, device_pool, parts=parts)[:2]
        backend.load(parts, host_indices, device_indices, int(layer_id))

    def _check_indices(self, host_indices, device_indices, device_pool, want_numpy: bool = False, parts=None):
        """``(h, d, h_np, d_np)``: both as int64 tensors, checked when ``validate_indices``,
        and their host copies when the check reads them or ``want_numpy`` (else None).
        CUDA indices are read back once here, not again by whoever plans the transfer."""
        h = _as_index_tensor(host_indices, "host_indices")
        d = _as_index_tensor(device_indices, "device_indices")
        if h.numel() != d.numel():
            raise ValueError(
                f"host_indices has {h.numel()} slots but device_indices has {d.numel()}; they must pair up"
            )
        if not (self.validate_indices or want_numpy):
            return h, d, None, None
        hc, dc = _numpy(h), _numpy(d)
        if not self.validate_indices or h.numel() == 0:
            return h, d, hc, dc
        _check_range(hc, self.size, "host_indices", "host pool")
        # The device buffers' rows, not ``size``: SGLang-style pools keep ``size + page_size``
        # rows, and their allocator hands out slots in the last page too.
        rows = min(p.device_layers[0].shape[0] for p in (parts or self.transfer_parts(device_pool)))
        _check_range(dc, rows, "device_indices", "device pool")
        if self.KIND == DSA and self.page_size > 1:
            try:
                tokens_to_pages(hc, self.page_size, self.size)
                tokens_to_pages(dc, self.page_size, rows)
            except AllocatorError as e:
                raise ValueError(
                    f"DSA index-K pages are block-split and only move as whole pages: {e}"
                ) from None
        return h, d, hc, dc

    def _check_device_pool(self, pool) -> None:
        """``pool`` has this pool's shape; ``ValueError`` naming both otherwise."""
        other = spec_of(pool, self.KIND)
        if other != self.spec:
            raise ValueError(
                f"device pool shape {other.describe()} does not match this host pool's {self.spec.describe()}"
            )

    # -- slot allocation -------------------------------------------------

    # Under ``self.lock``, as the seed's were: a caller holding it holds the allocator.

    @synchronized
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Token indices of ``need_size / page_size`` free pages, or None if full."""
        return self.allocator.alloc(need_size)

    @synchronized
    def free(self, indices) -> int:
        """Give back token indices from :meth:`alloc`; returns how many tokens were freed."""
        return self.allocator.free(indices)

    @synchronized
    def available_size(self) -> int:
        """Free token slots."""
        return self.allocator.available_size()

    @property
    def free_slots(self) -> torch.Tensor:
        """The seed's list of free token slots, for tools that read it (a fresh tensor each time:
        the allocator keeps pages, not this list)."""
        return self.allocator.free_token_slots()

    @synchronized
    def clear(self) -> None:
        """Mark every slot free (the bytes are left as they are)."""
        self.allocator.clear()
