"""What a model's KV cache looks like, in one place.

Pools, transfers, sizing, the CLI and (later) L3 keys all derive from a
:class:`KVSpec`. A spec is a frozen value: build it once, pass it around.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from .validate import require_int_at_least, require_positive_int

MHA, MLA, DSA = "mha", "mla", "dsa"
KINDS = (MHA, MLA, DSA)

FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)

DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

# One FP32 scale per 128 FP8 values in a DSA index-K row.
DSA_INDEX_GROUP = 128


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Accept a torch dtype or one of :data:`DTYPE_NAMES`."""
    if isinstance(value, torch.dtype):
        return value
    try:
        return DTYPE_NAMES[str(value).lower()]
    except KeyError:
        raise ValueError(
            f"unknown KV dtype {value!r}; use one of {sorted(DTYPE_NAMES)}"
        ) from None


def store_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """FP8 values are kept as raw bytes: many torch ops cannot index FP8 tensors."""
    return torch.uint8 if dtype in FP8_DTYPES else dtype


def dsa_index_row_bytes(index_head_dim: int) -> int:
    """FP8 bytes of one index-K row plus its FP32 scales."""
    return index_head_dim + (index_head_dim // DSA_INDEX_GROUP) * 4


@dataclass(frozen=True)
class Component:
    """One family of per-layer buffers of a KV kind (K, V, latent KV, index-K).

    ``item_bytes`` is what one token occupies in one layer; ``chunk_bytes`` is
    the largest piece of an item that every layout keeps contiguous (one head
    for MHA, so that ``page_head`` can split heads apart).
    """

    name: str
    item_bytes: int
    chunk_bytes: int
    item_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def n_chunks(self) -> int:
        return self.item_bytes // self.chunk_bytes


@dataclass(frozen=True)
class KVSpec:
    """The KV shape of one model: kind, layers, per-token dimensions, dtype.

    ``mha``: ``head_num`` x ``head_dim`` for K and again for V.
    ``mla``: one latent row of ``kv_lora_rank + qk_rope_head_dim`` values.
    ``dsa``: the MLA row plus an index-K row of ``index_head_dim`` FP8 bytes
    and ``index_head_dim / 128`` FP32 scales; ``index_k_bytes`` names another
    row width where an engine keeps index-K in another format (its device pool's
    ``index_k_row_bytes``, e.g. 256 for 128 bf16 values; 0: the FP8 format's).
    """

    kind: str
    layer_num: int
    dtype: torch.dtype = torch.bfloat16
    head_num: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    index_head_dim: int = 0
    name: str = field(default="", compare=False)
    index_k_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown KV kind {self.kind!r}; use one of {KINDS}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.dtype == torch.bool or self.dtype.is_complex:
            raise ValueError(f"dtype {self.dtype} cannot hold KV values; use one of bf16, fp16, fp32, fp8 "
                             "(or the integer type an engine stores FP8 in)")
        require_positive_int("layer_num", self.layer_num)
        if self.kind == MHA:
            require_positive_int("head_num", self.head_num)
            require_positive_int("head_dim", self.head_dim)
        else:
            require_positive_int("kv_lora_rank", self.kv_lora_rank)
            require_int_at_least("qk_rope_head_dim", self.qk_rope_head_dim, 0)
        require_int_at_least("index_k_bytes", self.index_k_bytes, 0)
        if self.index_k_bytes and self.kind != DSA:
            raise ValueError(f"index_k_bytes is for DSA specs only (index-K rows); got {self.index_k_bytes} "
                             f"for a {self.kind.upper()} spec: leave it 0")
        if self.kind == DSA:
            require_positive_int("index_head_dim", self.index_head_dim)
            if self.index_head_dim % DSA_INDEX_GROUP and not self.index_k_bytes:
                raise ValueError(
                    f"index_head_dim must be a multiple of {DSA_INDEX_GROUP} "
                    f"(one FP32 scale per {DSA_INDEX_GROUP} FP8 values), "
                    f"got {self.index_head_dim}"
                )
        for name in ("layer_num", "head_num", "head_dim", "kv_lora_rank", "qk_rope_head_dim", "index_head_dim",
                     "index_k_bytes"):
            object.__setattr__(self, name, int(getattr(self, name)))  # numpy integers as ints

    @property
    def store_dtype(self) -> torch.dtype:
        return store_dtype_of(self.dtype)

    @property
    def itemsize(self) -> int:
        return self.store_dtype.itemsize

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def index_k_row_bytes(self) -> int:
        if self.kind != DSA:
            return 0
        return self.index_k_bytes or dsa_index_row_bytes(self.index_head_dim)

    @property
    def components(self) -> tuple[Component, ...]:
        e, sd = self.itemsize, self.store_dtype
        if self.kind == MHA:
            shape = (self.head_num, self.head_dim)
            item = self.head_num * self.head_dim * e
            return (
                Component("k", item, self.head_dim * e, shape, sd),
                Component("v", item, self.head_dim * e, shape, sd),
            )
        latent = Component(
            "kv", self.latent_dim * e, self.latent_dim * e, (1, self.latent_dim), sd
        )
        if self.kind == MLA:
            return (latent,)
        row = self.index_k_row_bytes
        return (latent, Component("index_k", row, row, (row,), torch.uint8))

    @property
    def bytes_per_token_per_layer(self) -> int:
        return sum(c.item_bytes for c in self.components)

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_per_layer * self.layer_num

    def describe(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        if self.kind == MHA:
            dims = f"{self.head_num} KV heads x {self.head_dim}"
        else:
            dims = f"latent {self.kv_lora_rank}+{self.qk_rope_head_dim}"
            if self.kind == DSA:
                dims += f", index-K {self.index_head_dim}"
                if self.index_k_bytes:
                    dims += f" in {self.index_k_bytes} B rows"
        return f"{self.kind.upper()}, {self.layer_num} layers, {dims}, {dt}"

    def salt(self, layout: str, page_size: int) -> bytes:
        """Bytes that make page hashes differ for anything that changes page bytes."""
        fields = (
            self.kind, self.layer_num, str(self.dtype), self.head_num, self.head_dim,
            self.kv_lora_rank, self.qk_rope_head_dim, self.index_head_dim,
            layout, page_size,
        ) + ((f"index_k_bytes={self.index_k_bytes}",) if self.index_k_bytes else ())  # earlier keys unchanged
        return "|".join(map(str, fields)).encode()


# Shapes as the models publish them (KV heads after grouping).
PRESETS: dict[str, KVSpec] = {
    "llama-3-8b": KVSpec(MHA, 32, torch.bfloat16, head_num=8, head_dim=128, name="llama-3-8b"),
    "llama-3-70b": KVSpec(MHA, 80, torch.bfloat16, head_num=8, head_dim=128, name="llama-3-70b"),
    "qwen-2.5-7b": KVSpec(MHA, 28, torch.bfloat16, head_num=4, head_dim=128, name="qwen-2.5-7b"),
    "deepseek-v3": KVSpec(
        MLA, 61, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, name="deepseek-v3"
    ),
    "glm-dsa": KVSpec(
        DSA, 78, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
        index_head_dim=128, name="glm-dsa",
    ),
}


def preset(name: str) -> KVSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; use one of {sorted(PRESETS)}"
        ) from None
