"""``kvtier demo``: multi-turn chat served three ways, with the tiers doing the work.

The same synthetic workload (clients x rounds, shared system prompt,
growing histories) runs on the reference engine with no prefix cache, with
a GPU-only prefix cache, and with the GPU + host tiers. The device pool is
deliberately too small for the working set, so only the host tier keeps old
turns. The demo prints hit rates, TTFT and prefill work per mode, checks
that every mode generated exactly the same tokens, and writes JSON and a plot.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

import click

from .commands import FIGURE_PATH, JSON_HELP, JSON_PATH, distinct_outputs, echo_for, write_json

ALL_MODES = ("none", "gpu", "tiers")


def _model_config(o: dict):
    from .engine import ModelConfig

    shape = dict(vocab_size=o["vocab"], hidden_size=o["hidden"], n_layers=o["layers"], n_heads=o["heads"],
                 intermediate_size=o["intermediate"], dtype=o["dtype"])
    if o["model"] == "llama":
        return ModelConfig("llama", **shape, n_kv_heads=o["kv_heads"], head_dim=o["head_dim"])
    return ModelConfig("deepseek", **shape, kv_lora_rank=o["kv_lora_rank"], qk_rope_head_dim=o["rope_dim"],
                       qk_nope_head_dim=o["head_dim"], v_head_dim=o["head_dim"])


def _engine_config(o: dict, mode: str):
    from .engine import EngineConfig

    return EngineConfig(
        prefix_cache=mode, device_tokens=o["device_tokens"], host_tokens=o["host_tokens"],
        page_size=o["page_size"], layout=o["layout"], io_backend=o["io_backend"],
        write_policy=o["write_policy"], eviction=o["eviction"], device=o["device"],
        max_batch_tokens=o["max_batch_tokens"],
    )


def run_modes(o: dict, modes: tuple[str, ...], progress: bool = True) -> tuple[dict, dict]:
    """Run the workload once per mode on one model; returns (summaries, outputs per mode)."""
    from tqdm import tqdm

    from .engine import Engine
    from .engine.engine import make_model
    from .engine.report import summarize
    from .engine.workload import Workload, run_workload

    model = make_model(_model_config(o), _engine_config(o, modes[0]), o["seed"], o["checkpoint"])
    wl = Workload(clients=o["clients"], rounds=o["rounds"], system_tokens=o["system_tokens"],
                  user_tokens=o["user_tokens"], output_tokens=o["output_tokens"],
                  vocab_size=model.config.vocab_size, seed=o["seed"])
    _warm_up(model, o)
    summaries, outputs = {}, {}
    for mode in modes:
        engine = Engine(model, _engine_config(o, mode))
        bar = tqdm(total=wl.total_turns(), desc=f"{mode:>5}", unit="req", disable=not progress, file=sys.stderr)
        result = run_workload(engine, wl, on_turn=lambda _t: bar.update())
        bar.close()
        summaries[mode] = summarize(result, engine.stats()["cache"])
        outputs[mode] = result.outputs()
    return summaries, outputs


def _warm_up(model, o: dict) -> None:
    """One throwaway prefill and decode, so the first mode does not pay for library start-up."""
    from .engine import Engine

    from .engine.scheduler import slots_needed

    cfg = _engine_config(o, "none")
    n = max(1, min(512, cfg.device_tokens // 2))
    new = 2 if slots_needed(n, 2) <= cfg.device_tokens // cfg.page_size * cfg.page_size else 1
    Engine(model, cfg).generate([[i % model.config.vocab_size for i in range(n)]], max_new_tokens=new)


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
    try:
        mcfg = _model_config(o)
        if o["checkpoint"]:
            mcfg = checkpoint_config(o["checkpoint"], mcfg.dtype, tensors=True)
    except (ValueError, FileNotFoundError) as e:
        raise click.UsageError(str(e)) from None
    # Before the engine configs, which would refuse them too but name no flag.
    check_engine_flags(o["device"], o["layout"] if "tiers" in modes else None, mcfg.kv_spec().kind,
                       [o["io_backend"]] if set(modes) - {"none"} else [])
    try:
        cfgs = [_engine_config(o, m) for m in modes]
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
        if "tiers" in modes:
            resolve_huge_pages(None)  # KVTIER_HOST_HUGE_PAGES, read now rather than at the last mode
            check_host_memory(o["host_tokens"] * kv.bytes_per_token, None, "the host pool",
                              "Lower --host-tokens.")
    except MemoryError as e:
        raise click.ClickException(str(e)) from None
    return mcfg


def compare_outputs(outputs: dict) -> tuple[bool, str]:
    """Whether every mode generated the same tokens for every (client, round)."""
    modes = list(outputs)
    base = outputs[modes[0]]
    for mode in modes[1:]:
        for key, toks in base.items():
            if outputs[mode].get(key) != toks:
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
@click.option("--host-tokens", type=click.IntRange(min=1), default=32768, show_default=True, help="host pool size (token slots)")
@click.option("--page-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--layout", default="layer_first", show_default=True)
@click.option("--io-backend", default=None, help="direct | kernel | dma | auto (default: direct on CPU, auto on CUDA)")
@click.option("--write-policy", type=click.Choice(["write_through", "write_through_selective", "write_back"]),
              default="write_through", show_default=True)
@click.option("--eviction", type=click.Choice(["lru", "lfu"]), default="lru", show_default=True)
@click.option("--max-batch-tokens", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda")
@click.option("--modes", default=",".join(ALL_MODES), show_default=True, help="comma-separated subset of none,gpu,tiers")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--json", "json_path", type=JSON_PATH, default=None, help=JSON_HELP)
@click.option("--plot", "plot_path", type=FIGURE_PATH, default="kvtier-demo-ttft.png",
              show_default=True, help="figure of TTFT by round per mode: .png, .svg or .pdf ('' for none)")
@click.option("--engine", type=click.Choice(["kvtier", "vllm"]), default="kvtier", show_default=True,
              help="kvtier: its reference engine; vllm: stock vLLM's offline LLM, kvtier's offloading spec in tiers")
@click.option("--no-progress", is_flag=True, help="no progress bar")
def demo(**o) -> None:
    """Serve a multi-turn chat workload three ways and compare (CPU, 1-2 minutes)."""
    from .engine.engine import exact_mode
    from .engine.report import MODE_TITLES, plot, table

    named = [m.strip() for m in o["modes"].split(",") if m.strip()]
    modes = tuple(dict.fromkeys(named))  # a mode named twice runs once
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes:
        raise click.BadParameter(f"unknown mode(s) {bad}; use a subset of {','.join(ALL_MODES)}" if bad else
                                 f"no mode given; use a subset of {','.join(ALL_MODES)}", param_hint="--modes")
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
    if o["device"] == "cpu" and not exact_mode(mcfg, _engine_config(o, modes[0])) and len(modes) > 1:
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
