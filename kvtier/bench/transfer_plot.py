"""The acceptance targets of ``kvtier bench transfer`` rows (each transfer's ratio to the
contiguous-copy limit it must reach), how ratios are shown against them, and a figure of the
rows: every backend's ratio to the limit, against the targets. Imports nothing of kvtier's, so
``bench/acceptance.py`` reads this file without importing the package (or torch).

Columns are the host slots (as the allocator hands them out, scattered); rows
of panels are one-way transfers (backup, per-layer load) and both at once.
Each bar is one backend's GB/s over the run's contiguous limit; a red tick across
each row marks its own acceptance target (:func:`target`: 0.95x or
0.9x one way, 1.5x both at once; none for page 16 or spread pools), solid lines
the limit itself and dotted the contiguous copies both ways at once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, is_dataclass

# The acceptance targets: 0.95x one way for these on host slots as the allocator hands them
# out, 0.9x for the other one-way rows (page_head, DSA, scattered slots), 1.5x both at once;
# page sizes 1 and 64 only.
TARGET_95 = {("mha", "layer_first"), ("mha", "page_first"), ("mla", "layer_first"), ("mla", "page_first")}


def target(r: dict) -> float | None:
    """A row's target (``r``: a JSON row), or None where it is not one of the 72 acceptance
    rows (page 16, spread pools, the contiguous limit's own rows)."""
    if r["kind"] == "all" or r["host_slots"] not in ("allocator", "scattered") or r["page_size"] not in (1, 64):
        return None
    if r["direction"] == "both":
        return 1.5
    return 0.95 if r["host_slots"] == "allocator" and (r["kind"], r["layout"]) in TARGET_95 else 0.9


def ratio_text(ratio: float) -> str:
    """``ratio`` cut (not rounded) to three decimals: 0.9497 shows as 0.949, never as the 0.95
    it misses."""
    return f"{math.floor(ratio * 1000 + 1e-9) / 1000:.3f}"


COLORS = {"kernel": "#4c72b0", "dma": "#dd8452", "auto": "#55a868", "direct": "#8172b2"}
ONE_WAY = ("backup", "load")


def _plain(rows) -> list[dict]:
    return [asdict(r) if is_dataclass(r) else dict(r) for r in rows]


def plot_transfer(rows, path: str, title: str) -> int:
    """Write the figure of ``rows`` (``Row`` or their JSON dicts) to ``path`` (PNG);
    returns how many bars it drew. Rows of the contiguous limit itself are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _plain(rows)
    duplex = [r["ratio"] for r in rows if r["kind"] == "all" and r["direction"] == "both"]
    rows = [r for r in rows if r["kind"] != "all"]
    if not rows:
        raise ValueError("no transfer rows to plot (only the contiguous limit, or nothing)")
    slots = [s for s in ("allocator", "scattered", "spread") if any(r["host_slots"] == s for r in rows)]
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    groups = (("one way", ONE_WAY), ("both at once", ("both",)))
    labels = {name: list(dict.fromkeys((r["kind"], r["layout"], r["page_size"], r["direction"])
                                       for r in rows if r["direction"] in dirs))
              for name, dirs in groups}
    heights = [max(1, len(labels[name])) for name, _ in groups]
    fig, axes = plt.subplots(2, len(slots), figsize=(6.5 * len(slots), 0.19 * sum(heights) + 2.5),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    drawn = 0
    drawn_target = False  # labelled once, for the legend
    for col, slot in enumerate(slots):
        for row, (name, dirs) in enumerate(groups):
            n, drawn_target = _panel(axes[row][col], name, dirs, slot, labels[name], rows, backends, duplex,
                                     drawn_target)
            drawn += n
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def _panel(ax, name: str, dirs, slot: str, keys: list[tuple], rows: list[dict], backends: list[str],
           duplex: list[float], drawn_target: bool) -> tuple[int, bool]:
    """Draw the panel of directions ``dirs`` (titled ``name``) on host slots ``slot`` into ``ax``:
    a bar per backend for each of ``keys`` (kind, layout, page size, direction), each row's
    target, and the limits. Returns the bars drawn, and whether a target is labelled now."""
    bar = 0.8 / len(backends)
    drawn = 0
    by = {(r["kind"], r["layout"], r["page_size"], r["direction"], r["backend"]): r["ratio"]
          for r in rows if r["host_slots"] == slot and r["direction"] in dirs}
    for b, backend in enumerate(backends):
        ys = [i + (b - (len(backends) - 1) / 2) * bar for i, k in enumerate(keys) if k + (backend,) in by]
        xs = [by[k + (backend,)] for k in keys if k + (backend,) in by]
        ax.barh(ys, xs, height=bar, color=COLORS.get(backend), label=backend)
        drawn += len(xs)
    ax.axvline(1.0, color="black", lw=0.8)
    for i, (k, lay, ps, d) in enumerate(keys):  # each row's own target, across its bars
        t = target({"kind": k, "layout": lay, "page_size": ps, "direction": d, "host_slots": slot})
        if t is not None:
            ax.plot([t, t], [i - 0.45, i + 0.45], color="red", lw=1.2,
                    label=None if drawn_target else "target")
            drawn_target = True
    if name != "one way" and duplex:  # what the link gives both ways at once
        ax.axvline(duplex[0], color="black", lw=0.8, ls=":")
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"{k.upper()} {lay} p{ps} {d}" for k, lay, ps, d in keys], fontsize=7)
    ax.invert_yaxis()
    # From 0.5 where every bar reaches it (the GPU's rows); from 0 where some do not
    # (the CPU's direct copies run at a few hundredths of memcpy), so no bar is cut off.
    low = 0.5 if all(r["ratio"] >= 0.5 for r in rows) else 0.0
    ax.set_xlim(*((low, 1.05) if name == "one way" else (low, 1.95)))
    ax.set_title(f"{name}, host slots {slot}", fontsize=9)
    ax.set_xlabel("ratio to the contiguous limit", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return drawn, drawn_target
