"""``kvtier demo``: multi-turn chat served five ways, with the tiers doing the work.

The same synthetic workload (clients x rounds, shared system prompt,
growing histories) runs on the reference engine with no prefix cache, with
a GPU-only prefix cache, with the GPU + host tiers, and with a storage tier
behind them (``storage``: a directory, or a Valkey or Mooncake store started on
loopback). The device and host pools are deliberately too small for the
working set, so old turns come back from the host tier and then from storage.
``storage_restart`` then starts a second engine process, its GPU and host
tiers cold, over the same store, and serves each conversation's last round
again. The demo prints hit rates, TTFT and prefill work per mode, checks that
every mode generated exactly the same tokens, and writes JSON and a plot.

Run as ``python -m kvtier.demo``, it is that second process: it reads its job
(the options, the store's location, the prompts) as JSON from stdin and writes
the summary and outputs as one JSON line to stdout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import click

from .commands import FIGURE_PATH, JSON_HELP, JSON_PATH, distinct_outputs, echo_for, write_json

ALL_MODES = ("none", "gpu", "tiers", "storage", "storage_restart")
STORAGE_MODES = ("storage", "storage_restart")
HOSTED_MODES = ("tiers", *STORAGE_MODES)
BUILTIN_STORES = ("file", "valkey", "valkey-cluster", "mooncake")
# Host pool of the demo: below the default workload's ~13k distinct tokens, so the storage mode serves turns
# the host tier evicted, and the GPU + host mode recomputes them.
HOST_TOKENS = 8192


def _model_config(o: dict):
    from .engine import ModelConfig

    shape = dict(vocab_size=o["vocab"], hidden_size=o["hidden"], n_layers=o["layers"], n_heads=o["heads"],
                 intermediate_size=o["intermediate"], dtype=o["dtype"])
    if o["model"] == "llama":
        return ModelConfig("llama", **shape, n_kv_heads=o["kv_heads"], head_dim=o["head_dim"])
    return ModelConfig("deepseek", **shape, kv_lora_rank=o["kv_lora_rank"], qk_rope_head_dim=o["rope_dim"],
                       qk_nope_head_dim=o["head_dim"], v_head_dim=o["head_dim"])


def _engine_config(o: dict, mode: str, location: str | None = None):
    """The engine of ``mode``; a storage mode's over the store at ``location``."""
    from .engine import EngineConfig

    storage = {}
    if mode in STORAGE_MODES:
        model_id, weights = _model_identity(o)
        storage = dict(storage=o["storage"], storage_url=location, storage_bytes=o["storage_mb"] << 20,
                       model_id=model_id, weights_fingerprint=weights, storage_write=o["storage_write"],
                       storage_prefetch=o["storage_prefetch"])
    return EngineConfig(
        prefix_cache="tiers" if mode in HOSTED_MODES else mode, device_tokens=o["device_tokens"],
        host_tokens=o["host_tokens"], page_size=o["page_size"], layout=o["layout"], io_backend=o["io_backend"],
        write_policy=o["write_policy"], eviction=o["eviction"], device=o["device"],
        max_batch_tokens=o["max_batch_tokens"], **storage,
    )


def _model_identity(o: dict) -> tuple[str, str]:
    """What the demo's stored pages are keyed under: the model id and a fingerprint of its weights
    (the checkpoint's directory and its weight files' sizes and times, or the random model's
    shape and seed)."""
    if o["checkpoint"]:
        from .engine.checkpoint import checkpoint_files

        stamps = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in checkpoint_files(Path(o["checkpoint"]))]
        return os.path.abspath(o["checkpoint"]), hashlib.sha256(",".join(stamps).encode()).hexdigest()[:16]
    shape = json.dumps([[o[k] for k in _SHAPE], o["dtype"], o["seed"]])
    return "kvtier-demo/random", hashlib.sha256(shape.encode()).hexdigest()[:16]


def _workload(o: dict, vocab_size: int):
    from .engine.workload import Workload

    return Workload(clients=o["clients"], rounds=o["rounds"], system_tokens=o["system_tokens"],
                    user_tokens=o["user_tokens"], output_tokens=o["output_tokens"], vocab_size=vocab_size,
                    seed=o["seed"])


def run_modes(o: dict, modes: tuple[str, ...], progress: bool = True) -> tuple[dict, dict]:
    """Run the workload once per mode on one model; returns (summaries, outputs per mode).
    The storage modes share one store, opened here and closed at the end."""
    from .engine.engine import make_model

    model = make_model(_model_config(o), _engine_config(o, "none"), o["seed"], o["checkpoint"])
    wl = _workload(o, model.config.vocab_size)
    _warm_up(model, o)
    summaries, outputs = {}, {}
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as workdir, _store(o, modes, workdir) as location:
        for mode in modes:
            if mode == "storage_restart":
                summaries[mode], outputs[mode] = _restart(o, location, wl, outputs["storage"], progress)
            else:
                summaries[mode], outputs[mode] = _serve_mode(model, o, mode, location, wl, progress)
    return summaries, outputs


def _serve_mode(model, o: dict, mode: str, location, wl, progress: bool) -> tuple[dict, dict]:
    from tqdm import tqdm

    from .engine import Engine
    from .engine.report import summarize
    from .engine.workload import run_workload

    engine = Engine(model, _engine_config(o, mode, location))
    bar = tqdm(total=wl.total_turns(), desc=f"{mode:>7}", unit="req", disable=not progress, file=sys.stderr)
    result = run_workload(engine, wl, on_turn=lambda _t: bar.update())
    bar.close()
    summary = summarize(result, engine.stats()["cache"])
    engine.close()  # a storage tier's queued writes land before the restart reads them
    return summary, result.outputs()


@contextlib.contextmanager
def _store(o: dict, modes, workdir: str):
    """The storage modes' store, as its location: ``--storage-url``, else a directory under
    ``workdir`` or a server started on loopback (stopped on exit), or one the environment names."""
    if not set(modes) & set(STORAGE_MODES) or o["storage_url"]:
        yield o["storage_url"]
        return
    from .storage.servers import StoreFor

    try:
        store = StoreFor(o["storage"], workdir, o["storage_mb"] << 20)
    except ValueError as e:
        raise click.ClickException(f"--storage {o['storage']}: {e}") from None
    try:
        yield store.location
    finally:
        store.close()


def _restart(o: dict, location, wl, answers: dict, progress: bool) -> tuple[dict, dict]:
    """``storage_restart``: a second engine process over the same store, its GPU and host cold,
    serving each conversation's last round again (the prompts from the storage run's answers)."""
    last = wl.rounds - 1
    job = {"options": o, "location": location,
           "prompts": [[c, last, wl.prompt(c, last, answers)] for c in range(wl.clients)]}
    if progress:
        click.echo(f"restart: a new engine process over the same store serves {wl.clients} last rounds", err=True)
    run = subprocess.run([sys.executable, "-m", "kvtier.demo"], input=json.dumps(job), capture_output=True,
                         text=True, timeout=3600)
    if run.returncode:
        raise click.ClickException(f"the restarted engine's process failed:\n{run.stderr[-3000:]}")
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    return doc["summary"], {(c, r): toks for c, r, toks in doc["outputs"]}


def serve_restart(job: dict) -> dict:
    """The second process of ``storage_restart`` (see the module's doc): ``job`` in, the summary
    and every ``[client, round, outputs]`` out."""
    from .engine import Engine
    from .engine.engine import make_model
    from .engine.report import summarize
    from .engine.workload import run_requests

    o = job["options"]
    cfg = _engine_config(o, "storage_restart", job["location"])
    model = make_model(_model_config(o), cfg, o["seed"], o["checkpoint"])
    _warm_up(model, o)
    engine = Engine(model, cfg)
    result = run_requests(engine, {(c, r): p for c, r, p in job["prompts"]}, o["output_tokens"])
    summary = summarize(result, engine.stats()["cache"])
    engine.close()
    return {"summary": summary, "outputs": [[t.client, t.round, t.outputs] for t in result.turns]}


def _warm_up(model, o: dict) -> None:
    """One throwaway prefill and decode, so the first mode does not pay for library start-up."""
    from .engine import Engine

    from .engine.scheduler import slots_needed

    cfg = _engine_config(o, "none")
    n = max(1, min(512, cfg.device_tokens // 2))
    new = 2 if slots_needed(n, 2) <= cfg.device_tokens // cfg.page_size * cfg.page_size else 1
    Engine(model, cfg).generate([[i % model.config.vocab_size for i in range(n)]], max_new_tokens=new)


def _modes(o: dict) -> tuple[str, ...]:
    """``--modes``, each once, the restart last; --engine vllm serves the first three only."""
    named = [m.strip() for m in o["modes"].split(",") if m.strip()]
    vllm = o["engine"] == "vllm"
    if vllm and click.get_current_context().get_parameter_source("modes") is click.core.ParameterSource.DEFAULT:
        named = [m for m in named if m not in STORAGE_MODES]
    modes = tuple(dict.fromkeys(named))  # a mode named twice runs once
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes:
        raise click.BadParameter(f"unknown mode(s) {bad}; use a subset of {','.join(ALL_MODES)}" if bad else
                                 f"no mode given; use a subset of {','.join(ALL_MODES)}", param_hint="--modes")
    if vllm and set(modes) & set(STORAGE_MODES):
        raise click.BadParameter(f"{', '.join(m for m in modes if m in STORAGE_MODES)} run on kvtier's engine: "
                                 "leave them out with --engine vllm", param_hint="--modes")
    return tuple(sorted(modes, key=lambda m: m == "storage_restart"))


# Model flags that only one --model reads, and those a checkpoint's config.json replaces.
_ONLY = {"llama": ("kv_heads",), "deepseek": ("kv_lora_rank", "rope_dim")}
_SHAPE = ("model", "hidden", "layers", "heads", "kv_heads", "head_dim", "kv_lora_rank", "rope_dim", "intermediate",
          "vocab")


def _refuse_flags_that_do_not_apply(o: dict) -> None:
    """A shape flag given where nothing reads it (``--kv-heads`` for deepseek, any shape flag
    beside ``--checkpoint``) is refused by name rather than ignored."""
    ctx = click.get_current_context()
    given = [n for n in o if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT]

    def flag(n):
        return "--" + n.replace("_", "-")
    if o["checkpoint"] and (shape := [flag(n) for n in _SHAPE if n in given]):
        raise click.UsageError(f"{', '.join(shape)} {'does' if len(shape) == 1 else 'do'} not apply beside "
                               f"--checkpoint (the model's shape comes from its config.json); leave "
                               f"{'it' if len(shape) == 1 else 'them'} out")
    for model, names in _ONLY.items():
        if o["model"] != model and (wrong := [flag(n) for n in names if n in given]):
            raise click.UsageError(f"{', '.join(wrong)} only {'applies' if len(wrong) == 1 else 'apply'} to "
                                   f"--model {model}, not {o['model']}; leave {'it' if len(wrong) == 1 else 'them'} out")


def _checked(o: dict, modes: tuple[str, ...]):
    """The model's config (the checkpoint's, where one is given), once every flag has been
    checked: shapes, workload, device, layout and io backend, and that the weights and pools
    fit in host memory; a click error names what is wrong, before anything is built."""
    from .commands import check_device_flag, check_engine_flags
    from .engine.checkpoint import checkpoint_config
    from .engine.engine import check_weights_fit
    from .engine.scheduler import slots_needed
    from .engine.workload import Workload
    from .memory import check_host_memory, resolve_huge_pages

    check_device_flag(o["device"])  # before the engine configs, which would name no flag
    _check_storage_flags(o, modes)
    try:
        mcfg = _model_config(o)
        if o["checkpoint"]:
            mcfg = checkpoint_config(o["checkpoint"], mcfg.dtype, tensors=True)
    except (ValueError, FileNotFoundError) as e:
        raise click.UsageError(str(e)) from None
    # Before the engine configs, which would refuse them too but name no flag.
    hosted = bool(set(modes) & set(HOSTED_MODES))
    check_engine_flags(o["device"], o["layout"] if hosted else None, mcfg.kv_spec().kind,
                       [o["io_backend"]] if set(modes) - {"none"} else [])
    try:
        cfgs = [_engine_config(o, m, o["storage_url"] or "(a directory made for the run)") for m in modes]
        wl = Workload(clients=o["clients"], rounds=o["rounds"], system_tokens=o["system_tokens"],
                      user_tokens=o["user_tokens"], output_tokens=o["output_tokens"], vocab_size=mcfg.vocab_size)
    except (ValueError, FileNotFoundError) as e:
        raise click.UsageError(str(e)) from None
    # The last round's request (every earlier turn in its prompt) must fit the device pool alone.
    need = slots_needed(wl.longest_prompt(), o["output_tokens"])
    holds = o["device_tokens"] // o["page_size"] * o["page_size"]
    if need > holds:
        raise click.UsageError(
            f"the workload's longest request needs {need} token slots (its prompt of {wl.longest_prompt()} tokens "
            f"+ --output-tokens {o['output_tokens']} - 1) but --device-tokens {o['device_tokens']} holds {holds} "
            f"at --page-size {o['page_size']}; raise --device-tokens, or lower --rounds or the turn lengths")
    kv = mcfg.kv_spec()
    try:
        if o["device"] == "cpu":
            check_weights_fit(mcfg, copies=2 if o["checkpoint"] else 1)
            check_host_memory(o["device_tokens"] * kv.bytes_per_token, 0, "the device pool (on the CPU)",
                              "Lower --device-tokens.")
        if hosted:
            resolve_huge_pages(None)  # KVTIER_HOST_HUGE_PAGES, read now rather than at the last mode
            check_host_memory(o["host_tokens"] * kv.bytes_per_token, None, "the host pool",
                              "Lower --host-tokens.")
    except MemoryError as e:
        raise click.ClickException(str(e)) from None
    return mcfg


def _check_storage_flags(o: dict, modes) -> None:
    """The storage modes' flags: a click error naming the flag, before any work."""
    from .storage import backend_class, open_backend

    if "storage_restart" in modes and "storage" not in modes:
        raise click.BadParameter("storage_restart restarts over the store the storage mode filled: name storage "
                                 "too", param_hint="--modes")
    if not set(modes) & set(STORAGE_MODES):
        return
    try:
        backend_class(o["storage"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--storage") from None
    if o["storage"] not in BUILTIN_STORES and not o["storage_url"]:
        raise click.BadParameter(f"--storage {o['storage']} needs --storage-url: kvtier starts only "
                                 f"{', '.join(BUILTIN_STORES)} stores itself", param_hint="--storage-url")
    if o["storage_url"]:
        try:
            open_backend(o["storage"], o["storage_url"], o["storage_mb"] << 20).close()
        except (ValueError, TypeError) as e:
            raise click.BadParameter(str(e), param_hint="--storage-url") from None


def compare_outputs(outputs: dict) -> tuple[bool, str]:
    """Whether every mode generated the same tokens for every (client, round) it served (the
    restart serves each conversation's last round only; the other modes every round)."""
    modes = list(outputs)
    base = outputs[modes[0]]
    for mode in modes[1:]:
        if mode != "storage_restart" and len(outputs[mode]) != len(base):
            return False, f"{mode} answered {len(outputs[mode])} requests, {modes[0]} {len(base)}"
        for key, toks in outputs[mode].items():
            if base.get(key) != toks:
                return False, f"client {key[0]} round {key[1]}: {modes[0]} and {mode} differ"
    n = sum(len(v) for v in base.values())
    if len(modes) == 1:
        return True, f"{len(base)} requests, {n} generated tokens, one mode: nothing to compare"
    return True, f"{len(base)} requests, {n} generated tokens, identical in all {len(modes)} modes"


@click.command()
@click.option("--model", type=click.Choice(["llama", "deepseek"]), default="llama", show_default=True,
              help="llama: GQA + RoPE (MHA pools); deepseek: MLA (MLA pools)")
@click.option("--hidden", type=click.IntRange(min=1), default=192, show_default=True)
@click.option("--layers", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--heads", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--kv-heads", type=click.IntRange(min=1), default=2, show_default=True, help="llama only")
@click.option("--head-dim", type=click.IntRange(min=1), default=48, show_default=True, help="llama head dim; deepseek nope/v head dim")
@click.option("--kv-lora-rank", type=click.IntRange(min=1), default=64, show_default=True, help="deepseek only")
@click.option("--rope-dim", type=click.IntRange(min=0), default=16, show_default=True, help="deepseek only: decoupled RoPE dims")
@click.option("--intermediate", type=click.IntRange(min=1), default=384, show_default=True)
@click.option("--vocab", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--dtype", default="fp32", show_default=True, help="fp32 on CPU (exact); bf16 on GPU")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False), default=None,
              help="local Hugging Face-format directory (config.json + safetensors) instead of random weights")
@click.option("--clients", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--system-tokens", type=click.IntRange(min=0), default=384, show_default=True)
@click.option("--user-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--device-tokens", type=click.IntRange(min=1), default=4096, show_default=True, help="device pool size (token slots)")
@click.option("--host-tokens", type=click.IntRange(min=1), default=HOST_TOKENS, show_default=True,
              help="host pool size (token slots): below the conversations' size, so storage serves old turns")
@click.option("--page-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--layout", default="layer_first", show_default=True)
@click.option("--io-backend", default=None, help="direct | kernel | dma | auto (default: direct on CPU, auto on CUDA)")
@click.option("--write-policy", type=click.Choice(["write_through", "write_through_selective", "write_back"]),
              default="write_through", show_default=True)
@click.option("--eviction", type=click.Choice(["lru", "lfu"]), default="lru", show_default=True)
@click.option("--max-batch-tokens", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda")
@click.option("--modes", default=",".join(ALL_MODES), show_default=True,
              help=f"comma-separated subset of {','.join(ALL_MODES)} (--engine vllm: of none,gpu,tiers)")
@click.option("--storage", default="file", show_default=True,
              help="the storage modes' store: file (a directory), valkey, valkey-cluster, mooncake, or module:Class")
@click.option("--storage-url", default=None,
              help="where that store is (file: a directory; valkey://host:port; host:port,... for a cluster; "
                   "mooncake://host:port?metadata=URL); default: a directory or a server started here, on loopback")
@click.option("--storage-mb", type=click.IntRange(min=1), default=256, show_default=True,
              help="the store's capacity (MiB)")
@click.option("--storage-write", type=click.Choice(["write_through", "write_back"]), default="write_through",
              show_default=True, help="pages reach the store once backed up to the host, or once the host evicts them")
@click.option("--storage-prefetch", type=click.Choice(["timeout", "wait_complete", "best_effort"]), default="timeout",
              show_default=True, help="how long a request waits for its pages from the store")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--json", "json_path", type=JSON_PATH, default=None, help=JSON_HELP)
@click.option("--plot", "plot_path", type=FIGURE_PATH, default="kvtier-demo-ttft.png",
              show_default=True, help="figure of TTFT by round per mode: .png, .svg or .pdf ('' for none)")
@click.option("--engine", type=click.Choice(["kvtier", "vllm"]), default="kvtier", show_default=True,
              help="kvtier: its reference engine; vllm: stock vLLM's offline LLM, kvtier's offloading spec in tiers")
@click.option("--no-progress", is_flag=True, help="no progress bar")
def demo(**o) -> None:
    """Serve a multi-turn chat workload five ways and compare (CPU, a few minutes)."""
    from .engine.engine import exact_mode
    from .engine.report import MODE_TITLES, plot, table

    modes = _modes(o)
    distinct_outputs(json=o["json_path"], plot=o["plot_path"])
    _refuse_flags_that_do_not_apply(o)
    if o["engine"] == "vllm":  # vLLM's block and head sizes, before the checks below
        from .integrations.vllm import demo_flags
        o = demo_flags(o)
    mcfg = _checked(o, modes)  # every bad flag fails here, before any work
    source = f"checkpoint {o['checkpoint']}" if o["checkpoint"] else o["model"]
    echo = echo_for(o["json_path"])
    echo(f"model: {source} ({mcfg.kv_spec().describe()}), {o['clients']} clients x {o['rounds']} rounds, "
               f"device pool {o['device_tokens']} tokens, host pool {o['host_tokens']} tokens")
    if set(modes) & set(STORAGE_MODES):
        where = o["storage_url"] or ("a directory made for the run" if o["storage"] == "file" else
                                     "the environment's store, or one started here on loopback")
        echo(f"storage: {o['storage']} at {where}, {o['storage_mb']} MiB, {o['storage_write']}")
    if o["device"] == "cpu" and not exact_mode(mcfg, _engine_config(o, "none")) and len(modes) > 1:
        echo(f"note: {mcfg.dtype} on the CPU is not exact (fp32 is: its attention accumulates in float64), "
                   "so a prefix hit may round differently from recomputing and the modes' outputs may differ")
    t0 = time.perf_counter()
    if o["engine"] == "vllm":
        from .integrations.vllm import demo_modes
        summaries, outputs = demo_modes(o, modes, mcfg, progress=not o["no_progress"])
    else:
        summaries, outputs = run_modes(o, modes, progress=not o["no_progress"])
    same, detail = compare_outputs(outputs)
    echo("")
    echo(table(summaries))
    echo("")
    echo(f"outputs identical: {'yes' if same else 'NO'} ({detail})")
    if o["json_path"]:  # first: the results are kept whatever becomes of the figure
        doc = {"config": {k: v for k, v in o.items() if k not in ("json_path", "plot_path")},
               "model": {k: str(v) for k, v in asdict(mcfg).items()},
               "modes": summaries, "mode_titles": {m: MODE_TITLES[m] for m in modes},
               "outputs_identical": same, "outputs_detail": detail,
               "wall_s": time.perf_counter() - t0}
        write_json(o["json_path"], doc, said="json: {}", indent=2)
    if o["plot_path"]:
        plot(summaries, o["plot_path"], f"kvtier demo: {o['model']}, {o['clients']} clients")
        echo(f"plot: {o['plot_path']}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    print(json.dumps(serve_restart(json.load(sys.stdin))))
