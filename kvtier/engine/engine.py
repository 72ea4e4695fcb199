"""The reference engine: a model, a kvtier device pool, a KV manager, a scheduler.

It uses kvtier's public API only (pools, allocator, prefix cache), so it
doubles as the integration test of the library::

    from kvtier.engine import Engine, EngineConfig, tiny
    engine = Engine.build(tiny("llama"), EngineConfig(prefix_cache="tiers", device_tokens=2048))
    outputs = engine.generate([[1, 2, 3, 4]], max_new_tokens=8)
"""

from __future__ import annotations

import time

import torch

from ..device_pool import pool_from_spec
from ..host_pool import host_pool_for
from ..memory import check_host_memory
from ..cache.types import LoadFailedError
from ..validate import check_namespace, is_int
from .checkpoint import checkpoint_config, load_checkpoint, random_model
from .config import EngineConfig, ModelConfig
from .kv_manager import NoPrefixCache, PrefixCache
from .model_runner import ModelRunner
from .models import CausalLM
from .scheduler import Scheduler
from .sequence import Sequence


def _no_prefix_cache(pool, cfg: EngineConfig, engine: "Engine"):
    return NoPrefixCache(pool.size, cfg.page_size)


def _prefix_cache(pool, cfg: EngineConfig, engine: "Engine"):
    from ..cache import CacheConfig, HiCache

    host = None
    if cfg.prefix_cache == "tiers":
        host = host_pool_for(pool, cfg.layout, host_size_tokens=cfg.host_tokens)
    cache_cfg = CacheConfig(page_size=cfg.page_size, write_policy=cfg.write_policy, eviction=cfg.eviction,
                            io_backend=cfg.io_backend, model_id=cfg.model_id, storage_write=cfg.storage_write,
                            storage_prefetch=cfg.storage_prefetch)
    storage = _storage_tier(host, cfg) if cfg.storage is not None else None
    cache = HiCache(pool, host_pool=host, config=cache_cfg, storage=storage)
    return PrefixCache(cache, advise=engine.prefill_seconds_per_token if cfg.use_advisor else None)


def _storage_tier(host, cfg: EngineConfig):
    """The storage tier of ``cfg`` behind ``host``: its backend opened at ``cfg.storage_url``."""
    from ..storage import open_backend
    from ..storage.format import StorageSalt
    from ..storage.tier import StorageTier

    salt = StorageSalt(host.spec, cfg.page_size, cfg.model_id, cfg.weights_fingerprint)
    return StorageTier(open_backend(cfg.storage, cfg.storage_url, cfg.storage_bytes), salt)


def exact_mode(model_cfg: ModelConfig, config: EngineConfig) -> bool:
    """Whether the engine runs bit-exact (attention accumulated in float64): fp32 on the CPU,
    unless ``config.exact`` is off. Then a prefix hit gives the tokens recomputing does."""
    return config.exact and model_cfg.dtype == torch.float32 and torch.device(config.device).type == "cpu"


def make_model(model_cfg: ModelConfig, config: EngineConfig, seed: int = 0,
               checkpoint: str | None = None) -> CausalLM:
    """The model an engine of ``config`` runs: attention and accumulation chosen for its device."""
    dev = torch.device(config.device)
    attention = config.attention
    if attention == "auto":
        attention = "sdpa" if dev.type == "cuda" else "reference"
    acc = torch.float64 if exact_mode(model_cfg, config) else None
    if checkpoint:
        if dev.type == "cpu":  # its tensors and the model's, both held while it loads
            check_weights_fit(checkpoint_config(checkpoint, model_cfg.dtype), copies=2)
        return load_checkpoint(checkpoint, dev, model_cfg.dtype, attention=attention, acc=acc)
    if dev.type == "cpu":
        check_weights_fit(model_cfg)
    return random_model(model_cfg, seed, dev, attention=attention, acc=acc)


def weight_bytes(model_cfg: ModelConfig) -> int:
    """Bytes of a model of ``model_cfg``'s weights (:meth:`ModelConfig.n_weights`; nothing allocated)."""
    return model_cfg.n_weights() * model_cfg.dtype.itemsize


def check_weights_fit(model_cfg: ModelConfig, copies: int = 1) -> None:
    """Raise MemoryError, before anything is allocated, if ``copies`` of a model of ``model_cfg``'s
    weights cannot be held in host memory (past that, the kernel's OOM killer ends the process
    with no message). A checkpoint takes two while it loads: its tensors and the model's."""
    what = f"its {str(model_cfg.dtype).removeprefix('torch.')} weights" + (", twice while loading" if copies > 1 else "")
    check_host_memory(copies * weight_bytes(model_cfg), 0, f"this model ({what})",
                      "Run it on a GPU (device='cuda', --device cuda) or take a smaller model "
                      "(kvtier bench ttft --model tiny).")


KV_MANAGERS = {"none": _no_prefix_cache, "gpu": _prefix_cache, "tiers": _prefix_cache}


def check_engine(model_cfg: ModelConfig, config: EngineConfig) -> None:
    """Raise what an engine of ``config`` for a model of ``model_cfg`` would refuse, before
    anything is built (the weights alone take seconds, a checkpoint a whole load): a ``config``
    that is not an :class:`EngineConfig` (``TypeError``), the host layout for the model's KV
    kind, the io backend for the device, the host-memory settings (``ValueError``), and pools
    that do not fit in host memory (``MemoryError``)."""
    from ..layouts import get_layout
    from ..memory import resolve_huge_pages
    from ..transfer.factory import get_backend

    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, got {type(config).__name__} "
                        "(e.g. EngineConfig(device_tokens=4096))")
    spec = model_cfg.kv_spec()
    dev = torch.device(config.device)
    if dev.type == "cpu":
        check_host_memory(config.device_tokens * spec.bytes_per_token, 0, "the device pool (on the CPU)",
                          "Lower device_tokens.")
    if config.prefix_cache == "tiers":
        get_layout(config.layout, spec.kind)
        resolve_huge_pages(None)
        check_host_memory(config.host_tokens * spec.bytes_per_token, None, "the host pool", "Lower host_tokens.")
    if config.prefix_cache == "tiers" and isinstance(config.io_backend, str):  # the only mode that transfers
        get_backend(config.io_backend, dev)


class Engine:
    """Serves greedy generation requests with continuous batching.

    ``step()`` is: schedule, run, postprocess. Requests are added with
    :meth:`add_request`; each returned :class:`Sequence` records its outputs,
    its time to first token and what it reused from which tier.
    """

    def __init__(self, model: CausalLM, config: EngineConfig = EngineConfig()):
        check_engine(model.config, config)
        self.config = config
        self.model = model
        spec = model.config.kv_spec()
        self.pool = pool_from_spec(spec, config.device_tokens, config.page_size, config.device)
        self.kv = KV_MANAGERS[config.prefix_cache](self.pool, config, self)
        self.scheduler = Scheduler(self.kv, config.max_batch_tokens, config.max_running)
        self.runner = ModelRunner(model, self.pool, config.inputs)
        self.steps = 0
        self._prefill_time = 0.0
        self._prefill_tokens = 0

    @classmethod
    def build(cls, model_cfg: ModelConfig, config: EngineConfig = EngineConfig(), seed: int = 0,
              checkpoint: str | None = None) -> "Engine":
        """An engine around a model of ``model_cfg`` with random weights from ``seed``, or a local
        checkpoint; ``config`` is checked against the model's shape before the weights are made."""
        check_engine(checkpoint_config(checkpoint, model_cfg.dtype) if checkpoint else model_cfg, config)
        return cls(make_model(model_cfg, config, seed, checkpoint), config)

    def add_request(self, prompt: list[int], max_new_tokens: int, namespace: str = "default") -> Sequence:
        seq = self._request(prompt, max_new_tokens, namespace)
        self.scheduler.add(seq)
        return seq

    def _request(self, prompt: list[int], max_new_tokens: int, namespace: str = "default") -> Sequence:
        """A checked request, not yet queued: a clear error for a bad one, nothing changed."""
        if getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist"):  # a 1-D tensor or array
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple, range)):
            raise ValueError(f"a prompt is a sequence of token ids (a list, or a 1-D tensor or array), "
                             f"got {type(prompt).__name__}")
        if not len(prompt):
            raise ValueError("a prompt needs at least one token")
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        check_namespace(namespace)
        if wrong := [t for t in prompt if not is_int(t)]:
            raise ValueError(f"token ids must be integers, got {wrong[0]!r} ({type(wrong[0]).__name__})")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
        prompt = [int(t) for t in prompt]
        seq = Sequence(prompt, max_new_tokens, namespace)
        self.scheduler.check(seq)
        return seq

    def step(self) -> list[Sequence]:
        """One forward pass; returns the sequences that finished in it."""
        self.kv.poll()
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.has_work() and not self.scheduler.running:
                raise RuntimeError("no request can be admitted although none is running (device pool too small?)")
            return []
        loads = any(s.layer_load is not None for s in batch.seqs)
        t0 = time.perf_counter()
        try:
            tokens = self.runner.run(batch)
        except LoadFailedError:  # a host load under the batch failed: its requests are computed again
            self.scheduler.retry(batch)
            return []
        if batch.prefill and not loads:  # a step that loaded waited for its loads too
            self._prefill_time += time.perf_counter() - t0
            self._prefill_tokens += batch.num_tokens
        self.steps += 1
        return self.scheduler.postprocess(batch, tokens)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy outputs of ``prompts``, in order (all run together, continuously batched)."""
        seqs = [self._request(p, max_new_tokens) for p in prompts]  # all checked before any is queued
        for seq in seqs:
            self.scheduler.add(seq)
        self.run_until_done()
        return [s.output_ids for s in seqs]

    def prefill_seconds_per_token(self) -> float:
        """Measured so far, over the prefill steps that loaded nothing (a step that loaded
        waited for its loads too); a rough default before the first such step."""
        return self._prefill_time / self._prefill_tokens if self._prefill_tokens else 1e-4

    def close(self) -> None:
        """Finish what the cache has in flight, write what its storage tier has queued, and close
        that tier (the engine serves no more requests)."""
        self.kv.close()

    def stats(self) -> dict:
        return {"steps": self.steps, "preemptions": self.scheduler.preemptions,
                "prefill_seconds_per_token": self.prefill_seconds_per_token(), "cache": self.kv.metrics()}
