"""Host (L2) KV pools: the seed's ``*TokenToKVPoolHost`` classes, in every layout.

One implementation serves every kind and layout: a pool is a list of
components (K and V, or the latent row, plus DSA's index-K), each with a
typed tensor in the seed's shape and a :class:`~kvtier.layouts.Placement`.
Kind subclasses only name their components and the seed's attributes.

Transfers (``backup_from_device_all_layer``, ``load_to_device_per_layer``)
are queued on the current CUDA stream and return without waiting, as in
the seed; on the CPU they complete before returning. Use
:class:`kvtier.transfer.TransferEngine` for streams, events and layer-done
signals.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import operator
import threading

import numpy as np
import torch

from .allocator import AllocatorError, PageAllocator, tokens_to_pages
from .device_pool import as_rows, layer_attr
from .layouts import HostLayout, Placement, get_layout
from .memory import (GB, HostBuffer, cgroup_limit_and_usage, check_host_memory, gpu_available, host_memory,
                     huge_page_bytes, resolve_huge_pages)
from .spec import DSA, MHA, MLA, KVSpec, dsa_index_row_bytes
from .transfer.base import TransferPart, get_backend
from .transfer import direct as _direct  # noqa: F401  (registers the direct backend)
from .validate import device_type, is_int, is_int_dtype, require_index, require_positive_int

logger = logging.getLogger("kvtier")


def spec_of(device_pool, kind: str) -> KVSpec:
    """The spec of a kvtier device pool, or one read off an SGLang-style pool's attributes."""
    spec = getattr(device_pool, "spec", None)
    if spec is None and not hasattr(device_pool, "layer_num"):
        raise TypeError(f"device_pool must be a device KV pool (a kvtier pool, or an engine's with layer_num, "
                        f"{'head_num' if kind == MHA else 'kv_lora_rank'} ... and its per-layer buffers), "
                        f"got {type(device_pool).__name__}")
    if isinstance(device_pool, KVSpec):
        raise TypeError("device_pool must be a device KV pool, got a KVSpec: make the pool first, "
                        "e.g. kvtier.device_pool.pool_from_spec(spec, size, page_size, device)")
    if isinstance(spec, KVSpec):
        if spec.kind != kind:
            raise TypeError(
                f"a {kind.upper()} host pool needs a {kind.upper()} device pool, got a {spec.kind.upper()} one"
            )
        return spec
    dtype = getattr(device_pool, "dtype", None) or device_pool.store_dtype
    if kind == MHA:
        return KVSpec(MHA, device_pool.layer_num, dtype, head_num=device_pool.head_num, head_dim=device_pool.head_dim)
    extra = {}
    if kind == DSA:
        extra["index_head_dim"] = device_pool.index_head_dim
        rows = getattr(device_pool, "index_k_row_bytes", None)  # the engine's index-K format
        if rows is not None and rows != dsa_index_row_bytes(device_pool.index_head_dim):
            extra["index_k_bytes"] = rows
    return KVSpec(
        kind, device_pool.layer_num, dtype, kv_lora_rank=device_pool.kv_lora_rank,
        qk_rope_head_dim=device_pool.qk_rope_head_dim, **extra,
    )


def synchronized(method):
    """Run ``method`` holding its pool's ``lock`` (the seed's decorator, for subclasses)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return locked


def get_cgroup_memory_limit_and_current() -> tuple[int, int] | None:
    """The seed's name: ``(limit, usage)`` bytes of this process's tightest cgroup memory limit
    (:func:`kvtier.memory.cgroup_limit_and_usage`), None where none applies."""
    room = cgroup_limit_and_usage()
    return None if room is None else (int(room[0]), int(room[1]))


def get_available_host_memory_bytes(reserve_bytes: int) -> tuple[int, int, int | None]:
    """The seed's name: ``(available, host available, cgroup available or None)`` bytes, each
    after ``reserve_bytes`` (:func:`kvtier.memory.host_memory`)."""
    mem = host_memory(reserve_bytes)
    return mem.available, mem.host_available, mem.cgroup_available


class HostKVCache:
    """A host pool mirroring a device pool's components in a chosen layout.

    Size, in order of precedence: ``host_size_tokens`` tokens, else
    ``host_size`` GB (1e9 bytes), else ``host_to_device_ratio`` x the device
    pool; rounded up to whole pages. The memory is checked (host and cgroup
    limits, minus ``reserve_bytes``, default 10 GiB or ``KVTIER_HOST_RESERVE_GB``)
    before anything is allocated, and pinned for the GPU when CUDA is present.
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
        mem = check_host_memory(requested, reserve_bytes, f"this {self.KIND.upper()} host pool")
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

    def close(self) -> None:
        """Unpin the host memory now rather than at garbage collection."""
        for b in self._buffers:
            b.release()

    # -- the parts every transfer and page operation works on ------------

    def raw_bytes(self, component: str) -> torch.Tensor:
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
        dev = getattr(self.device_pool, "device", torch.device("cpu"))
        return torch.tensor(self.layer_ptrs(component), dtype=torch.uint64, device=dev)

    # -- transfers -------------------------------------------------------

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend="direct",
                                     block_quota: int | None = None) -> None:
        """Copy ``device_indices`` of every layer into ``host_indices`` (device -> host)."""
        parts = self.transfer_parts(device_pool)
        backend = get_backend(io_backend, _pool_device(device_pool))
        host_indices, device_indices = self._check_indices(host_indices, device_indices, device_pool, parts=parts)[:2]
        backend.backup(parts, host_indices, device_indices, block_quota)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id: int,
                                 io_backend="direct") -> None:
        """Copy ``host_indices`` of layer ``layer_id`` into ``device_indices`` (host -> device)."""
        parts = self.transfer_parts(device_pool)
        backend = get_backend(io_backend, _pool_device(device_pool))
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
        other = spec_of(pool, self.KIND)
        if other != self.spec:
            raise ValueError(
                f"device pool shape {other.describe()} does not match this host pool's {self.spec.describe()}"
            )

    # -- pages (the L3 interface) ----------------------------------------

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.size_per_token

    def _page_of(self, index) -> int:
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

    # -- slot allocation -------------------------------------------------

    # Under ``self.lock``, as the seed's were: a caller holding it holds the allocator.

    @synchronized
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Token indices of ``need_size / page_size`` free pages, or None if full."""
        return self.allocator.alloc(need_size)

    @synchronized
    def free(self, indices) -> int:
        return self.allocator.free(indices)

    @synchronized
    def available_size(self) -> int:
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


class MHATokenToKVPoolHost(HostKVCache):
    """Host mirror of an MHA pool: ``kv_buffer`` is ``(2, ...)``, K then V."""

    KIND = MHA
    _seed_combined = True

    def __init__(self, device_pool, host_to_device_ratio, host_size, page_size, layout,
                 device="cpu", host_size_tokens=0, **kwargs):
        super().__init__(device_pool, host_to_device_ratio, host_size, page_size, layout, device,
                         host_size_tokens, **kwargs)
        self.k_data_refs = [self.k_buffer[i] for i in range(self.layer_num)] if layout == "layer_first" else []
        self.v_data_refs = [self.v_buffer[i] for i in range(self.layer_num)] if layout == "layer_first" else []
        self.k_data_ptrs = self._ptr_table("k")
        self.v_data_ptrs = self._ptr_table("v")

    def _seed_attrs(self) -> None:
        self.head_num = self.spec.head_num
        self.head_dim = self.spec.head_dim
        self.element_dim = self.head_num * self.head_dim
        self.token_stride_size = self.element_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    def get_ksize_per_token(self) -> int:
        return self.size_per_token // 2


class MLATokenToKVPoolHost(HostKVCache):
    """Host mirror of an MLA pool: one latent row per token and layer."""

    KIND = MLA

    def __init__(self, device_pool, host_to_device_ratio, host_size, page_size, layout,
                 device="cpu", host_size_tokens=0, **kwargs):
        super().__init__(device_pool, host_to_device_ratio, host_size, page_size, layout, device,
                         host_size_tokens, **kwargs)
        self.kv_buffer = self.component_tensors["kv"]
        self.data_refs = [self.kv_buffer[i] for i in range(self.layer_num)] if layout == "layer_first" else []
        self.data_ptrs = self._ptr_table("kv")

    def _seed_attrs(self) -> None:
        self.kv_lora_rank = self.spec.kv_lora_rank
        self.qk_rope_head_dim = self.spec.qk_rope_head_dim
        self.token_stride_size = self.spec.latent_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num

    def get_ksize_per_token(self) -> int:
        """All of a token's bytes (DSA's index-K too), as the seed's MLA and DSA pools say:
        storage backends size a page as this x page_size."""
        return self.size_per_token


class DSATokenToKVPoolHost(MLATokenToKVPoolHost):
    """Host mirror of a DSA pool: MLA latent rows plus the FP8 index-K rows.

    Index-K pages keep the device's block-split byte order, so they survive a
    raw page copy; transfers therefore insist on whole pages, and flat pages
    and page pointers include the index-K bytes.
    """

    KIND = DSA

    def __init__(self, device_pool, host_to_device_ratio, host_size, page_size, layout,
                 device="cpu", host_size_tokens=0, **kwargs):
        if getattr(device_pool, "quant_method", None) == "per_token_head":
            raise NotImplementedError("DSA host pools do not support the per_token_head latent layout")
        super().__init__(device_pool, host_to_device_ratio, host_size, page_size, layout, device,
                         host_size_tokens, **kwargs)
        self.index_k_buffer = self.component_tensors["index_k"]
        self.index_k_refs = [self.index_k_buffer[i] for i in range(self.layer_num)]
        self.index_k_data_ptrs = self._ptr_table("index_k")

    def _seed_attrs(self) -> None:
        super()._seed_attrs()
        self.index_k_row_bytes = self.spec.index_k_row_bytes


HOST_POOL_CLASSES = {MHA: MHATokenToKVPoolHost, MLA: MLATokenToKVPoolHost, DSA: DSATokenToKVPoolHost}


def host_pool_for(device_pool, layout: str = "layer_first", *, host_size_tokens: int = 0,
                  host_size: float = 0, host_to_device_ratio: float = 2.0, **kwargs) -> HostKVCache:
    """The host pool class matching ``device_pool``'s kind, built with keyword arguments."""
    spec = getattr(device_pool, "spec", None)
    if not isinstance(spec, KVSpec):
        raise TypeError(f"device_pool must be a kvtier device pool (kvtier.device_pool.pool_from_spec), got "
                        f"{type(device_pool).__name__}; for an engine's own pool, call the host pool class of its "
                        "kind (MHATokenToKVPoolHost, MLATokenToKVPoolHost, DSATokenToKVPoolHost)")
    cls = HOST_POOL_CLASSES[spec.kind]
    return cls(device_pool, host_to_device_ratio, host_size, device_pool.page_size, layout,
               host_size_tokens=host_size_tokens, **kwargs)


# -- validation helpers --------------------------------------------------------

def _int_value(value):
    """A one-element integer tensor as its int (storage backends pass ``host_indices[i]``, a 0-d
    tensor, as SGLang's do); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and is_int_dtype(value.dtype):
        return int(value.item())
    return value


def _pool_device(pool) -> torch.device:
    return torch.device(getattr(pool, "device", "cpu"))


def _check_page_size(page_size, device_pool) -> None:
    require_positive_int("page_size", page_size)
    dev_ps = getattr(device_pool, "page_size", page_size)
    if dev_ps != page_size:
        raise ValueError(
            f"page_size={page_size} differs from the device pool's page_size={dev_ps}; "
            "host and device pools must use the same page size"
        )


def _size_in_pages(tokens, gb, ratio, device_size, page_size, per_token) -> int:
    for name, v in (("host_size_tokens", tokens), ("host_size", gb), ("host_to_device_ratio", ratio)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a non-negative finite number, got {v!r}")
    if tokens > 0:
        if int(tokens) != tokens:
            raise ValueError(f"host_size_tokens must be a whole number, got {tokens!r}")
        size = int(tokens)
    elif gb > 0:
        size = int(gb * GB // per_token)
    elif ratio > 0:
        size = int(device_size * ratio)
    else:
        raise ValueError(
            "the host pool has no size: set host_size_tokens (tokens), host_size (GB) "
            "or host_to_device_ratio (x the device pool) to a positive value"
        )
    pages = -(-size // page_size)
    if pages < 1:
        raise ValueError(
            f"the host pool would hold no page (size {size} tokens, page_size {page_size}); make it larger"
        )
    return pages


def _as_index_tensor(values, name: str) -> torch.Tensor:
    """``values`` as a contiguous 1-D int64 tensor: every backend reads an index tensor as
    packed (a strided view, read so, named other slots than its values)."""
    t = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(values))
    if t.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}")
    if not is_int_dtype(t.dtype):
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if t.dtype == torch.uint64 and t.numel() and bool((t.view(torch.int64) < 0).any()):
        raise ValueError(f"{name} holds a slot of 2**63 or more (as uint64); slots are int64 positions in the pool")
    return (t if t.dtype == torch.int64 else t.to(torch.int64)).contiguous()


def _numpy(idx: torch.Tensor) -> np.ndarray:
    if idx.device.type == "cuda":  # read back by a kernel, not queued behind bulk copies
        from .transfer.kernel import host_numpy
        return host_numpy(idx)
    return idx.numpy()


def _check_range(idx: np.ndarray, size: int, name: str, what: str) -> None:
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= size:
        raise ValueError(f"{name} holds {lo if lo < 0 else hi}, outside the {what}'s slots 0..{size - 1}")
    # Strictly increasing (runs as the allocator hands them out) is unique at O(n); else sort.
    if idx.size > 1 and not (np.diff(idx) > 0).all():
        values, counts = np.unique(idx, return_counts=True)
        if values.size != idx.size:
            raise ValueError(f"{name} names slot {int(values[counts > 1][0])} twice; each slot may appear "
                             "once per transfer")
