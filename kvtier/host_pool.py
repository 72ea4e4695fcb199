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

This module holds the kind classes and :func:`host_pool_for`, and is where every name of
the host pools is imported from; the rest lives in :mod:`kvtier.host_base`
(:class:`HostKVCache` and its page interface) and
:mod:`kvtier.host_checks` (argument and index checks, the seed's module-level helpers).
"""

from __future__ import annotations

import torch

from .host_base import HostKVCache, HostPages, logger  # noqa: F401
from .host_checks import (_as_index_tensor, _check_page_size, _check_range, _int_value, _numpy,  # noqa: F401
                          _pool_device, _size_in_pages, get_available_host_memory_bytes,
                          get_cgroup_memory_limit_and_current, spec_of, synchronized)
from .spec import DSA, MHA, MLA, KVSpec

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
        """The K half of ``kv_buffer``."""
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        """The V half of ``kv_buffer``."""
        return self.kv_buffer[1]

    def get_ksize_per_token(self) -> int:
        """Bytes of a token's K, every layer (half the token)."""
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
    """The host pool class matching ``device_pool``'s kind, built with keyword arguments (the
    rest as :class:`HostKVCache` takes them). Raises ``TypeError`` for anything but a kvtier
    device pool (an engine's own pool: call the class of its kind)."""
    spec = getattr(device_pool, "spec", None)
    if not isinstance(spec, KVSpec):
        raise TypeError(f"device_pool must be a kvtier device pool (kvtier.device_pool.pool_from_spec), got "
                        f"{type(device_pool).__name__}; for an engine's own pool, call the host pool class of its "
                        "kind (MHATokenToKVPoolHost, MLATokenToKVPoolHost, DSATokenToKVPoolHost)")
    cls = HOST_POOL_CLASSES[spec.kind]
    return cls(device_pool, host_to_device_ratio, host_size, device_pool.page_size, layout,
               host_size_tokens=host_size_tokens, **kwargs)


__all__ = [
    "HostKVCache", "HostPages", "MHATokenToKVPoolHost", "MLATokenToKVPoolHost", "DSATokenToKVPoolHost",
    "HOST_POOL_CLASSES", "host_pool_for", "spec_of", "synchronized", "get_cgroup_memory_limit_and_current",
    "get_available_host_memory_bytes",
]
