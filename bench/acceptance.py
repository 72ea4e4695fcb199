"""Issue 3's acceptance, read from `kvtier bench transfer --json` rows.

Usage: python bench/acceptance.py [--readme] [--plot PNG] bench/results/h200/transfer.json [more.json ...]
(an unknown option is a usage error, not a file name)
Later files replace earlier ones' rows of the same (kind, layout, page, direction, slots, backend).
Prints, for every acceptance row, each backend's GB/s and ratio, the target, how far the
best is from it (ratios cut, not rounded, to three decimals), and whether auto is within 5% of the
best, as a markdown table; with --readme, the README's table instead (the acceptance rows on
host slots as the allocator hands them out); with --plot, also a figure
of every row (kvtier.bench.transfer_plot).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys


def _targets():
    """The targets in kvtier/bench/transfer_plot.py, read from this checkout's file: the tables need no
    torch (importing the kvtier package would load it); only --plot imports kvtier itself."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kvtier", "bench", "transfer_plot.py")
    spec = importlib.util.spec_from_file_location("kvtier_bench_targets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_T = _targets()
TARGET_95, ratio_text, target = _T.TARGET_95, _T.ratio_text, _T.target
PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".svgz", ".eps", ".ps", ".jpg", ".jpeg", ".tif", ".tiff", ".webp", ".pgf",
                 ".raw", ".rgba")  # kvtier.commands.FIGURE_SUFFIXES (a test keeps the two alike)

# One way, the same backend timed twice in one process differs by a median of 0.005x and by
# 0.02x or more in a sixth of the rows (H200): rows this close to their target can flip.
NEAR = 0.02
SHOWN = ("kernel", "dma", "auto")  # the README's columns; any other backend in the rows gets one after them
DIRECTION = {"backup": "backup", "load": "per-layer load", "both": "both at once (sum)"}


def exact(r) -> float:
    """A row's ratio from its GB/s and limit (the JSON's ``ratio`` is rounded to 3 decimals)."""
    return r["gbps"] / r["limit_gbps"]


def cell(by: dict, b: str) -> str:
    """``b``'s GB/s and ratio in a row, the ratio cut to three decimals (a miss never shows as
    its target), or ``-``."""
    return f"{by[b]['gbps']:.1f} ({ratio_text(exact(by[b]))}x)" if b in by else "-"


def columns(cells: dict) -> list[str]:
    """kernel, dma and auto, then any other backend the acceptance rows have (direct, kernel@N):
    the best of a row is taken over every backend, so every one is shown."""
    others = dict.fromkeys(b for key, by in cells.items() if target(next(iter(by.values()))) is not None
                           for b in by if b not in SHOWN)
    return list(SHOWN) + list(others)


def readme_table(cells) -> str:
    """The README's table: the acceptance rows on host slots as the allocator hands them out."""
    names = columns(cells)
    head = ["kernel (32 SMs)" if b == "kernel" else b for b in names]
    lines = ["| kind, layout | page | direction | " + " | ".join(head) + " |",
             "|---|---:|---|" + "---:|" * len(names)]
    for (k, lay, ps, d, s), by in cells.items():
        if s == "allocator" and target(next(iter(by.values()))) is not None:
            lines.append(f"| {k.upper()} {lay} | {ps} | {DIRECTION[d]} | " + " | ".join(cell(by, b) for b in names) + " |")
    return "\n".join(lines)


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python bench/acceptance.py", allow_abbrev=False, description="Issue 3's acceptance rows from "
                                 "`kvtier bench transfer --json` files (later files replace earlier ones' rows).")
    ap.add_argument("--readme", action="store_true", help="print the README's table instead")
    ap.add_argument("--plot", metavar="PNG", help="also draw every row here (a .png, .svg or .pdf file)")
    ap.add_argument("json", nargs="+", help="rows written by kvtier bench transfer --json")
    args = ap.parse_args(argv)
    if missing := [p for p in args.json if not os.path.isfile(p)]:
        ap.error(f"no such file: {', '.join(map(repr, missing))} (the JSON that kvtier bench transfer --json wrote)")
    if args.plot and not args.plot.lower().endswith(PLOT_SUFFIXES):
        ap.error(f"--plot {args.plot!r}: cannot draw that; name e.g. transfer.png, .svg or .pdf (any of "
                 f"{' '.join(PLOT_SUFFIXES)})")
    return args


def main(argv):
    args = parse(argv)
    rows = {}
    for p in args.json:
        for r in json.load(open(p)):
            rows[(r["kind"], r["layout"], r["page_size"], r["direction"], r["host_slots"], r["backend"])] = r
    if args.plot:
        from kvtier.bench.transfer_plot import plot_transfer
        n = plot_transfer(list(rows.values()), args.plot, "kvtier bench transfer: " + ", ".join(args.json))
        print(f"wrote {n} bars to {args.plot}", file=sys.stderr)
    cells = {}
    for (k, lay, ps, d, s, b), r in rows.items():
        if k != "all":
            cells.setdefault((k, lay, ps, d, s), {})[b] = r
    if args.readme:
        print(readme_table(cells))
        return
    names = columns(cells)
    met = auto_ok = auto_rows = near = targeted = 0
    lines = ["| kind, layout | page | slots | direction | " + " | ".join(names) + " | target | best - target | met |",
             "|---|---:|---|---|" + "---:|" * len(names) + "---:|---:|---|"]
    for key, by in cells.items():
        t = target(next(iter(by.values())))
        best = max(by.values(), key=exact)
        # From GB/s over the limit, not the JSON's ratio rounded to 3 decimals: 1.4997x is not 1.5x.
        ok = t is not None and exact(best) >= t
        a = by.get("auto")
        close = a is None or a["gbps"] >= 0.95 * best["gbps"]
        met += ok
        targeted += t is not None
        auto_rows += t is not None and a is not None
        auto_ok += t is not None and a is not None and close
        margin = None if t is None else exact(best) - t
        near += margin is not None and abs(margin) <= NEAR
        lines.append(f"| {key[0].upper()} {key[1]} | {key[2]} | {key[4]} | {key[3]} | "
                     + " | ".join(cell(by, b) for b in names)
                     + f" | {'-' if t is None else f'{t}x'} | {'-' if margin is None else f'{margin:+.3f}'} | "
                     f"{'yes' if ok else 'no' if t is not None else '-'}{'' if close else ' (auto >5% below)'} |")
    print("\n".join(lines))
    print(f"\nrows meeting their target: {met}/{targeted}; auto within 5% of the best: {auto_ok}/{auto_rows}; "
          f"rows within {NEAR}x of their target, either side (they can flip between runs): {near}")


if __name__ == "__main__":
    main(sys.argv[1:])
