"""Summaries, tables and plots of workload runs (used by ``kvtier demo``)."""

from __future__ import annotations

from statistics import mean

import numpy as np

from .workload import WorkloadResult

MODE_TITLES = {"none": "no prefix cache", "gpu": "GPU-only prefix cache", "tiers": "GPU + host tiers",
               "storage": "GPU + host + storage", "storage_restart": "restart: cold GPU + host, same storage"}


def summarize(result: WorkloadResult, cache_metrics: dict | None = None) -> dict:
    """Per-mode numbers: hit rates per tier, TTFT percentiles, prefill work, throughput."""
    turns = result.turns
    prompt = sum(t.prompt_tokens for t in turns)
    dev = sum(t.reused_device for t in turns)
    host = sum(t.reused_host for t in turns)
    storage = sum(t.reused_storage for t in turns)
    ttft = np.array([t.ttft_s for t in turns])
    outputs = sum(len(t.outputs) for t in turns)
    return {
        "requests": len(turns),
        "prompt_tokens": prompt,
        "hit_rate": (dev + host + storage) / prompt if prompt else 0.0,
        "hit_rate_device": dev / prompt if prompt else 0.0,
        "hit_rate_host": host / prompt if prompt else 0.0,
        "hit_rate_storage": storage / prompt if prompt else 0.0,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "ttft_mean_s": float(ttft.mean()),
        "prefill_tokens_computed": sum(t.computed for t in turns),
        "prefill_tokens_reused": dev + host + storage + sum(t.reused_on_resume for t in turns),
        "output_tokens": outputs,
        "throughput_tok_s": (prompt + outputs) / result.wall_s,
        "output_tok_s": outputs / result.wall_s,
        "wall_s": result.wall_s,
        "preemptions": sum(t.preemptions for t in turns),
        "ttft_by_round_s": ttft_by_round(result),
        "rounds": sorted({t.round for t in turns}),
        "cache": _plain(cache_metrics or {}),
    }


def ttft_by_round(result: WorkloadResult) -> list[float]:
    rounds = sorted({t.round for t in result.turns})
    return [mean(t.ttft_s for t in result.turns if t.round == r) for r in rounds]


def table(summaries: dict[str, dict]) -> str:
    """A fixed-width table, one row per mode."""
    head = ("mode", "hit GPU", "hit host", "hit storage", "TTFT p50", "TTFT p99", "prefill computed", "reused",
            "tok/s", "wall")
    rows = [head]
    for mode, s in summaries.items():
        rows.append((
            MODE_TITLES.get(mode, mode), f"{s['hit_rate_device']:.1%}", f"{s['hit_rate_host']:.1%}",
            f"{s.get('hit_rate_storage', 0.0):.1%}",
            f"{s['ttft_p50_s'] * 1e3:.0f} ms", f"{s['ttft_p99_s'] * 1e3:.0f} ms",
            f"{s['prefill_tokens_computed']:,}", f"{s['prefill_tokens_reused']:,}",
            f"{s['throughput_tok_s']:,.0f}", f"{s['wall_s']:.1f} s",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def plot(summaries: dict[str, dict], path: str, title: str) -> None:
    """Mean TTFT per conversation round, one line per mode (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, s in summaries.items():
        ys = [v * 1e3 for v in s["ttft_by_round_s"]]
        xs = [r + 1 for r in s.get("rounds", range(len(ys)))]   # (the restart serves the last round only)
        ax.plot(xs, ys, marker="o", label=MODE_TITLES.get(mode, mode))
    ax.set_xlabel("conversation round (history grows)")
    ax.set_ylabel("mean time to first token (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plain(d: dict) -> dict:
    """Cache metrics as JSON-safe scalars (nested dicts kept, anything else stringified)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = _plain(v)
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
        else:
            out[k] = str(v)
    return out
