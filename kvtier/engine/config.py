"""Typed, frozen configuration of the reference engine: the model and the engine."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from ..spec import MHA, MLA, KVSpec, parse_dtype
from ..validate import device_type, is_finite_number, require_positive_int

LLAMA, DEEPSEEK = "llama", "deepseek"
MODEL_KINDS = (LLAMA, DEEPSEEK)
PREFIX_MODES = ("none", "gpu", "tiers")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only model.

    ``llama``: grouped-query attention with ``n_heads`` query heads and
    ``n_kv_heads`` KV heads of ``head_dim``. ``deepseek``: multi-head latent
    attention; the KV cache holds one ``kv_lora_rank + qk_rope_head_dim`` row
    per token, and each head has ``qk_nope_head_dim + qk_rope_head_dim`` query
    and key dimensions and ``v_head_dim`` value dimensions. Both use RMSNorm,
    RoPE and a SwiGLU MLP.
    """

    kind: str = LLAMA
    vocab_size: int = 512
    hidden_size: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    kv_lora_rank: int = 64
    q_lora_rank: int = 0  # 0: queries are projected directly from the hidden state
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    tie_embeddings: bool = False
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"unknown model kind {self.kind!r}; use one of {MODEL_KINDS}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if not self.dtype.is_floating_point or self.dtype.itemsize < 2:
            raise ValueError(f"the model's dtype must be float32, bfloat16 or float16, got {self.dtype} "
                             "(FP8 is a KV cache format, not one the reference models compute in)")
        for f in ("vocab_size", "hidden_size", "n_layers", "n_heads", "intermediate_size"):
            require_positive_int(f, getattr(self, f))
        if self.kind == LLAMA:
            require_positive_int("n_kv_heads", self.n_kv_heads)
            require_positive_int("head_dim", self.head_dim)
            if self.n_heads % self.n_kv_heads:
                raise ValueError(
                    f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                    "(each KV head serves a whole group of query heads)"
                )
            if self.head_dim % 2:
                raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        else:
            for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                require_positive_int(f, getattr(self, f))
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
            if self.q_lora_rank < 0:
                raise ValueError(f"q_lora_rank must be >= 0, got {self.q_lora_rank}")
        for f in ("rope_theta", "rms_eps"):  # nan, 0 or a negative one makes every output token 0
            v = getattr(self, f)
            if not is_finite_number(v, strict=True):
                raise ValueError(f"{f} must be a finite number above 0, got {v!r}")

    def kv_spec(self) -> KVSpec:
        """The KV shape this model writes into a kvtier pool."""
        if self.kind == LLAMA:
            return KVSpec(MHA, self.n_layers, self.dtype, head_num=self.n_kv_heads, head_dim=self.head_dim)
        return KVSpec(MLA, self.n_layers, self.dtype, kv_lora_rank=self.kv_lora_rank,
                      qk_rope_head_dim=self.qk_rope_head_dim)

    def n_weights(self) -> int:
        """Parameters of a model of this shape, as the builders in ``kvtier.engine.models`` make it
        (counted from the shape: building one even on the meta device costs 1.5 s and 150 MB of
        torch's meta kernels the first time)."""
        h = self.hidden_size
        if self.kind == LLAMA:
            attn = 2 * h * self.n_heads * self.head_dim + 2 * h * self.n_kv_heads * self.head_dim
        else:
            qk, r = self.qk_nope_head_dim + self.qk_rope_head_dim, self.q_lora_rank
            q = h * r + r + r * self.n_heads * qk if r else h * self.n_heads * qk
            attn = (q + h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                    + self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)
                    + self.n_heads * self.v_head_dim * h)
        layer = attn + 3 * h * self.intermediate_size + 2 * h  # attention, SwiGLU, two norms
        return (1 if self.tie_embeddings else 2) * self.vocab_size * h + self.n_layers * layer + h

    def with_(self, **changes) -> "ModelConfig":
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def tiny(kind: str = LLAMA, **changes) -> ModelConfig:
    """The small fp32 model the demo and the tests run on a CPU."""
    return ModelConfig(kind=kind, **changes)


def llama3_8b(dtype=torch.bfloat16) -> ModelConfig:
    """Llama-3-8B's shape (random weights unless a checkpoint is loaded)."""
    return ModelConfig(
        LLAMA, vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        head_dim=128, intermediate_size=14336, rope_theta=500000.0, rms_eps=1e-5, dtype=dtype,
    )


INPUT_COPIES = ("sms", "pinned", "pageable")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine serves.

    ``prefix_cache``: ``none`` (slots straight from a page allocator, every
    prompt recomputed), ``gpu`` (prefix cache on the device pool only) or
    ``tiers`` (device pool plus a host pool). ``device_tokens`` and
    ``host_tokens`` size the pools in token slots. ``max_batch_tokens`` bounds
    the prefill tokens of one step (a prompt longer than it runs alone).
    ``exact``: accumulate matmuls in float64 and round back, so a row's result
    does not depend on the batch it was computed in (greedy outputs are then
    identical whatever the cache reused); meant for fp32 on the CPU.
    ``attention``: ``reference``, ``sdpa``, or ``auto`` (sdpa on CUDA, else
    reference). ``use_advisor``: ask the cache whether loading a host hit
    beats recomputing it (from the measured prefill rate) before loading.
    ``inputs``: how each step's inputs (token ids, positions, slot tables) reach
    a CUDA device: ``sms`` reads them by SMs (``kvtier.transfer.kernel.on_device``),
    ``pinned`` copies them from pinned memory without blocking (as vLLM and
    SGLang do), ``pageable`` with a plain ``.to``. A copy-engine copy issued
    during a DMA load waits for up to ``DMAConfig.load_drain`` layers of the load
    to land. ``sms`` is the quickest; the other two are there to measure what an
    engine that copies its inputs that way gets.

    A storage tier behind the host tier (``tiers`` only): ``storage`` names its backend
    (``file``, ``valkey``, ``valkey-cluster``, ``mooncake`` or ``module:Class``; None: none),
    ``storage_url`` where its store is (``kvtier.storage.open_backend``: for ``file`` a
    directory; None for a remote store named by the environment), ``storage_bytes`` the most
    a file store holds. ``model_id`` (required with storage) and ``weights_fingerprint`` salt
    the stored pages' keys: engines share pages only under the same model and weights.
    ``storage_write`` and ``storage_prefetch`` are ``CacheConfig``'s.
    """

    prefix_cache: str = "tiers"
    device_tokens: int = 4096
    host_tokens: int = 65536
    page_size: int = 16
    layout: str = "layer_first"
    io_backend: str | None = None
    write_policy: str = "write_through"
    eviction: str = "lru"
    max_batch_tokens: int = 4096
    max_running: int = 64
    device: str = "cpu"
    exact: bool = True
    attention: str = "auto"
    use_advisor: bool = False
    inputs: str = "sms"
    storage: str | None = None
    storage_url: str | None = None
    storage_bytes: int = 10 << 30
    model_id: str = ""
    weights_fingerprint: str | None = None
    storage_write: str = "write_back"
    storage_prefetch: str = "timeout"

    def __post_init__(self) -> None:
        if self.prefix_cache not in PREFIX_MODES:
            raise ValueError(f"unknown prefix_cache {self.prefix_cache!r}; use one of {PREFIX_MODES}")
        for f in ("device_tokens", "page_size", "max_batch_tokens", "max_running"):
            require_positive_int(f, getattr(self, f))
        if self.device_tokens < self.page_size:
            raise ValueError(f"device_tokens={self.device_tokens} holds no page of page_size={self.page_size}")
        if self.prefix_cache == "tiers":
            require_positive_int("host_tokens", self.host_tokens)
        if self.attention not in ("auto", "reference", "sdpa"):
            raise ValueError(f"unknown attention {self.attention!r}; use auto, reference or sdpa")
        if self.inputs not in INPUT_COPIES:
            raise ValueError(f"unknown inputs {self.inputs!r}; use one of {INPUT_COPIES}")
        for f in ("exact", "use_advisor"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be True or False, got {getattr(self, f)!r}")
        if device_type(self.device) not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {self.device!r}")
        if device_type(self.device) == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r}, but this torch has no CUDA device; use device='cpu'")
        from ..cache.config import EVICTION_POLICIES, WRITE_POLICIES
        from ..layouts import SUPPORTED
        from ..transfer.base import Backend
        from ..transfer.factory import IO_BACKENDS
        layouts = sorted({lay for kinds in SUPPORTED.values() for lay in kinds})
        for f, allowed in (("layout", layouts), ("write_policy", WRITE_POLICIES), ("eviction", EVICTION_POLICIES)):
            if getattr(self, f) not in allowed:
                raise ValueError(f"unknown {f} {getattr(self, f)!r}; use one of {tuple(allowed)}")
        if not (self.io_backend is None or self.io_backend in IO_BACKENDS or isinstance(self.io_backend, Backend)):
            raise ValueError(f"unknown io_backend {self.io_backend!r}; use one of {IO_BACKENDS}, a configured "
                             "backend, or None (the transfer engine's choice)")
        self._check_storage()

    def _check_storage(self) -> None:
        from ..cache.config import PREFETCH_POLICIES, STORAGE_WRITES
        from ..storage import backend_class

        for f, allowed in (("storage_write", STORAGE_WRITES), ("storage_prefetch", PREFETCH_POLICIES)):
            if getattr(self, f) not in allowed:
                raise ValueError(f"unknown {f} {getattr(self, f)!r}; use one of {allowed}")
        if not isinstance(self.model_id, str):
            raise ValueError(f"model_id must be a string, got {self.model_id!r}")
        if self.storage is None:
            return
        if self.prefix_cache != "tiers":
            raise ValueError(f"storage={self.storage!r} needs prefix_cache='tiers' (the storage tier sits behind the "
                             f"host tier), got prefix_cache={self.prefix_cache!r}")
        backend_class(self.storage)
        if self.storage == "file" and not self.storage_url:
            raise ValueError("storage='file' needs storage_url: the directory its pages go to")
        require_positive_int("storage_bytes", self.storage_bytes)
        if not self.model_id:
            raise ValueError("model_id must name the model's weights where storage is on (e.g. 'meta-llama/"
                             "Llama-3.1-8B'): engines of one model_id share stored pages")
        if self.weights_fingerprint is not None and not (isinstance(self.weights_fingerprint, str)
                                                         and self.weights_fingerprint):
            raise ValueError(f"weights_fingerprint must be a non-empty string or None, got {self.weights_fingerprint!r}")
