"""Issue 3's acceptance, read from `kvtier bench transfer --json` rows.

Usage: python bench/acceptance.py [--readme] [--plot PNG] bench/results/transfer_h200.json [more.json ...]
Later files replace earlier ones' rows of the same (kind, layout, page, direction, slots, backend).
Prints, for every acceptance row, each backend's GB/s and ratio, the target, how far the
best is from it, and whether auto is within 5% of the best, as a markdown table; with --readme, the README's
table instead (host slots as the allocator hands them out); with --plot, also a figure
of every row (kvtier.bench.transfer_plot).
"""

from __future__ import annotations

import json
import sys

# One way, the same backend timed twice in one H200 run differed by a median of 0.005x and by
# 0.02x or more in a sixth of the rows (run 30): rows this close to their target can flip.
NEAR = 0.02
TARGET_95 = {("mha", "layer_first"), ("mha", "page_first"), ("mla", "layer_first"), ("mla", "page_first")}


def target(r) -> float | None:
    """The row's target, or None where it is not one of the issue's 72 (page 16, spread pools)."""
    if r["host_slots"] not in ("allocator", "scattered"):  # spread: a larger pool, not in the issue
        return None
    if r["page_size"] not in (1, 64):
        return None
    if r["direction"] == "both":
        return 1.5
    if r["host_slots"] == "allocator" and (r["kind"], r["layout"]) in TARGET_95:
        return 0.95
    return 0.9


DIRECTION = {"backup": "backup", "load": "per-layer load", "both": "both at once (sum)"}


def exact(r) -> float:
    """A row's ratio from its GB/s and limit (the JSON's ``ratio`` is rounded to 3 decimals)."""
    return r["gbps"] / r["limit_gbps"]


def readme_table(cells) -> str:
    lines = ["| kind, layout | page | direction | kernel (32 SMs) | dma | auto |", "|---|---:|---|---:|---:|---:|"]
    for (k, lay, ps, d, s), by in cells.items():
        if s == "allocator":
            f = lambda b: f"{by[b]['gbps']:.1f} ({by[b]['ratio']:.2f}x)" if b in by else "-"  # noqa: E731
            lines.append(f"| {k.upper()} {lay} | {ps} | {DIRECTION[d]} | {f('kernel')} | {f('dma')} | {f('auto')} |")
    return "\n".join(lines)


def main(paths):
    readme = "--readme" in paths
    plot_path = None
    if "--plot" in paths:
        i = paths.index("--plot")
        if i + 1 >= len(paths) or not paths[i + 1].endswith(".png"):
            sys.exit("--plot needs the PNG file to write next, e.g. --plot transfer.png")
        plot_path = paths[i + 1]
        paths = paths[:i] + paths[i + 2:]
    paths = [p for p in paths if p != "--readme"]
    rows = {}
    for p in paths:
        for r in json.load(open(p)):
            rows[(r["kind"], r["layout"], r["page_size"], r["direction"], r["host_slots"], r["backend"])] = r
    if plot_path:
        from kvtier.bench.transfer_plot import plot_transfer
        n = plot_transfer(list(rows.values()), plot_path, "kvtier bench transfer: " + ", ".join(paths))
        print(f"wrote {n} bars to {plot_path}", file=sys.stderr)
    cells = {}
    for (k, lay, ps, d, s, b), r in rows.items():
        if k != "all":
            cells.setdefault((k, lay, ps, d, s), {})[b] = r
    if readme:
        print(readme_table(cells))
        return
    met = auto_ok = auto_rows = near = targeted = 0
    lines = ["| kind, layout | page | slots | direction | kernel | dma | auto | target | best - target | met |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for key, by in cells.items():
        t = target(next(iter(by.values())))
        best = max(by.values(), key=exact)
        # From GB/s over the limit, not the rounded ratio: 1.4997x is not 1.5x (run 124 counted
        # one such row met, runs 12-98 thirteen).
        ok = t is not None and exact(best) >= t
        a = by.get("auto")
        close = a is None or a["gbps"] >= 0.95 * best["gbps"]
        met += ok
        targeted += t is not None
        auto_rows += t is not None and a is not None
        auto_ok += t is not None and a is not None and close
        margin = None if t is None else exact(best) - t
        near += margin is not None and abs(margin) <= NEAR
        f = lambda b: f"{by[b]['gbps']:.1f} ({by[b]['ratio']:.2f}x)" if b in by else "-"  # noqa: E731
        lines.append(f"| {key[0].upper()} {key[1]} | {key[2]} | {key[4]} | {key[3]} | {f('kernel')} | {f('dma')} | "
                     f"{f('auto')} | {t}x | {'-' if margin is None else f'{margin:+.3f}'} | "
                     f"{'yes' if ok else 'no' if t is not None else '-'}{'' if close else ' (auto >5% below)'} |")
    print("\n".join(lines))
    print(f"\nrows meeting their target: {met}/{targeted}; auto within 5% of the best: {auto_ok}/{auto_rows}; "
          f"rows within {NEAR}x of their target, either side (they can flip between runs): {near}")


if __name__ == "__main__":
    main(sys.argv[1:])
