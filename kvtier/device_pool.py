"""Device (L1) KV pools with the constructors SGLang-style engines use.

A pool holds, for every component of its :class:`~kvtier.spec.KVSpec`, one
``(layer_num, size, *item)`` tensor; the per-layer buffers the seed reads
(``k_buffer[i]``, ``kv_buffer[i]``, ``index_k_buffer[i]``) are views of it,
and ``*_data_ptrs`` hold their addresses on the pool's device. Token slots
``0 .. size-1`` are addressable in every layer.
"""

from __future__ import annotations

import math

import torch

from .memory import check_host_memory, layer_objects_bytes
from .spec import DSA, MHA, MLA, KVSpec
from .validate import InvariantError, device_type, require_positive_int

_LAYER_ATTR = {"k": "k_buffer", "v": "v_buffer", "kv": "kv_buffer", "index_k": "index_k_buffer"}


def layer_attr(component: str) -> str:
    """Name of the per-layer buffer list that holds ``component`` on a device pool."""
    return _LAYER_ATTR[component]


class KVPool:
    """Common part of the device pools; build one through a subclass."""

    def __init__(self, spec: KVSpec, size: int, page_size: int, device: str | torch.device):
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"size must be a positive number of token slots, got {size!r}")
        require_positive_int("page_size", page_size)
        if size < page_size:
            raise ValueError(f"size={size} holds no whole page of page_size={page_size}")
        if device_type(device) not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: a kvtier device pool lives on 'cpu' or 'cuda' (or 'cuda:N')")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available; use device='cpu'")
        self.spec = spec
        self.size = size
        self.page_size = page_size
        self.dtype = spec.dtype
        self.store_dtype = spec.store_dtype
        self.layer_num = spec.layer_num
        nbytes = spec.bytes_per_token * size
        # Its per-layer views and pointers live in host memory whatever the device.
        objects = layer_objects_bytes(spec.layer_num, len(spec.components))
        what = f"a {spec.kind.upper()} device pool of {spec.layer_num:,} layers"
        if self.device.type == "cpu":
            check_host_memory(nbytes + objects, 0, f"{what} on the CPU",
                              f"Lower size={size} (the device pool's token slots), or layer_num.")
        elif self.device.type == "cuda":
            check_host_memory(objects, 0, f"the per-layer objects of {what}", "Lower layer_num.")
            free, _ = torch.cuda.mem_get_info(self.device)
            if nbytes > free:
                raise MemoryError(
                    f"the device pool needs {nbytes / 1e9:.2f} GB but {self.device} has "
                    f"{free / 1e9:.2f} GB free; lower size={size}"
                )
        self.stacks: dict[str, torch.Tensor] = {}
        for comp in spec.components:
            stack = torch.zeros((self.layer_num, size, *comp.item_shape), dtype=comp.dtype, device=self.device)
            self.stacks[comp.name] = stack
            layers = list(stack.unbind(0))
            setattr(self, layer_attr(comp.name), layers)
            setattr(self, _ptr_attr(comp.name), _ptr_table(layers, self.device))

    @property
    def mem_usage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stacks.values())

    def _stored(self, component: str, x: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
        """``x``, values for slots ``loc`` of one layer of ``component``, as the pool stores them:
        converted to the pool's dtype first (bf16 into an FP8 pool is cast, not reinterpreted),
        then FP8 as its bytes; shaped ``(len(loc), *item)``, checked before anything is written."""
        item = next(c.item_shape for c in self.spec.components if c.name == component)
        n = loc.numel() if isinstance(loc, torch.Tensor) else len(loc)
        if x.numel() != n * math.prod(item):
            raise ValueError(f"{component} has shape {tuple(x.shape)}; {n} slots of this pool take "
                             f"{(n, *item)} ({self.spec.describe()})")
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if self.store_dtype != self.dtype:
            x = x.view(self.store_dtype)
        return x.reshape(n, *item)

    def check(self) -> None:
        """Verify the buffers; raise :class:`~kvtier.validate.InvariantError` naming the first
        thing broken: each component's stack has the spec's shape and dtype, its per-layer
        buffers are its ``layer_num`` layers in order, and its pointer table holds their addresses."""
        for comp in self.spec.components:
            stack, attr = self.stacks[comp.name], layer_attr(comp.name)
            if tuple(stack.shape) != (self.layer_num, self.size, *comp.item_shape) or stack.dtype != comp.dtype:
                raise InvariantError(f"the {comp.name} stack is {stack.dtype} {tuple(stack.shape)}, not {comp.dtype} "
                                     f"{(self.layer_num, self.size, *comp.item_shape)}")
            layers = getattr(self, attr)
            bad = next((i for i, t in enumerate(layers) if t.data_ptr() != stack[i].data_ptr()
                        or t.shape != stack.shape[1:]), None) if len(layers) == self.layer_num else len(layers)
            if bad is not None:
                raise InvariantError(f"{attr}[{bad}] is not layer {bad} of the {comp.name} stack "
                                     f"({len(layers)} buffers for {self.layer_num} layers)")
            if getattr(self, _ptr_attr(comp.name)).cpu().tolist() != [t.data_ptr() for t in layers]:
                raise InvariantError(f"{_ptr_attr(comp.name)} does not hold the addresses of {attr}")

    def layer_bytes(self, component: str, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id`` of ``component`` as a ``(size, item_bytes)`` uint8 view."""
        return as_rows(getattr(self, layer_attr(component))[layer_id])


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """A ``(slots, *item)`` buffer as ``(slots, item_bytes)`` bytes, without copying."""
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def _ptr_attr(component: str) -> str:
    return {"k": "k_data_ptrs", "v": "v_data_ptrs", "kv": "data_ptrs", "index_k": "index_k_data_ptrs"}[component]


def _ptr_table(layers: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64, device=device)


class MHATokenToKVPool(KVPool):
    """Multi-head (or grouped-query) attention: K and V of ``head_num x head_dim``."""

    def __init__(self, size, page_size, dtype, head_num, head_dim, layer_num, device="cpu"):
        spec = KVSpec(MHA, layer_num, dtype, head_num=head_num, head_dim=head_dim)
        super().__init__(spec, size, page_size, device)
        self.head_num = head_num
        self.head_dim = head_dim

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V of new tokens into slots ``loc`` of one layer."""
        k, v = self._stored("k", k, loc), self._stored("v", v, loc)
        self.k_buffer[layer_id][loc] = k
        self.v_buffer[layer_id][loc] = v


class MLATokenToKVPool(KVPool):
    """Multi-head latent attention: one ``kv_lora_rank + qk_rope_head_dim`` row per token."""

    def __init__(self, size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num, device="cpu"):
        spec = self._spec(dtype, kv_lora_rank, qk_rope_head_dim, layer_num)
        super().__init__(spec, size, page_size, device)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.head_num = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim

    @staticmethod
    def _spec(dtype, kv_lora_rank, qk_rope_head_dim, layer_num) -> KVSpec:
        return KVSpec(MLA, layer_num, dtype, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, kv: torch.Tensor) -> None:
        """Write latent rows ``(n, 1, kv_lora_rank + qk_rope_head_dim)`` into slots ``loc``."""
        self.kv_buffer[layer_id][loc] = self._stored("kv", kv, loc)


class DSATokenToKVPool(MLATokenToKVPool):
    """MLA latent rows plus the DSA indexer's FP8 index-K rows.

    ``index_k_buffer[layer]`` is ``(size, index_k_row_bytes)`` uint8. Within a
    page the bytes are block-split: all ``page_size * index_head_dim`` FP8
    values of the page, then all its ``page_size * index_head_dim / 128``
    FP32 scales. A page therefore only moves intact as a whole page, which is
    why transfers of DSA pools check that indices are whole pages.
    """

    quant_method = "per_tensor"

    def __init__(self, size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num, device="cpu", index_head_dim=128,
                 index_k_bytes: int = 0):
        self._index_head_dim, self._index_k_bytes = index_head_dim, index_k_bytes
        super().__init__(size, page_size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num, device)
        self.index_head_dim = index_head_dim
        self.index_k_row_bytes = self.spec.index_k_row_bytes

    def _spec(self, dtype, kv_lora_rank, qk_rope_head_dim, layer_num) -> KVSpec:
        return KVSpec(
            DSA, layer_num, dtype, kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim, index_head_dim=self._index_head_dim, index_k_bytes=self._index_k_bytes,
        )

    def page_index_k(self, layer_id: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 values ``(page_size, index_head_dim)``, FP32 scales ``(page_size, groups)``) of one page."""
        if self.spec.index_k_bytes:
            raise ValueError(f"page_index_k reads the FP8 index-K format; this pool keeps {self.spec.index_k_bytes} B "
                             "rows of another (index_k_bytes): read index_k_buffer directly")
        p, d = self.page_size, self.index_head_dim
        raw = self.index_k_buffer[layer_id][page * p : (page + 1) * p].reshape(-1)
        values = raw[: p * d].view(p, d)
        scales = raw[p * d :].view(torch.float32).view(p, -1)
        return values, scales


POOL_CLASSES = {MHA: MHATokenToKVPool, MLA: MLATokenToKVPool, DSA: DSATokenToKVPool}


def pool_from_spec(spec: KVSpec, size: int, page_size: int, device="cpu") -> KVPool:
    """Build the device pool for ``spec`` (any kind) with ``size`` token slots."""
    if spec.kind == MHA:
        return MHATokenToKVPool(size, page_size, spec.dtype, spec.head_num, spec.head_dim, spec.layer_num, device)
    if spec.kind == MLA:
        return MLATokenToKVPool(size, page_size, spec.dtype, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.layer_num, device)
    return DSATokenToKVPool(
        size, page_size, spec.dtype, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.layer_num, device,
        index_head_dim=spec.index_head_dim, index_k_bytes=spec.index_k_bytes,
    )
