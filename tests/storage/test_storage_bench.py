"""``kvtier bench storage`` end to end on tiny pages: its rows, its table, its files; and its
refusals of bad flags before any work."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from click.testing import CliRunner

from kvtier.bench.storage import _seconds_busy
from kvtier.cli import main


def test_the_bench_writes_a_row_per_op_with_its_ratio(tmp_path):
    out, fig = tmp_path / "rows.json", tmp_path / "ratios.png"
    run = CliRunner().invoke(main, ["bench", "storage", "--backend", "file", "--dir", str(tmp_path), "--model",
                                    "qwen-2.5-7b", "--page-size", "2", "--pages", "3", "--repeats", "1",
                                    "--json", str(out), "--plot", str(fig)])
    assert run.exit_code == 0, run.output
    rows = json.loads(out.read_text())
    ops = [(r["backend"], r["op"]) for r in rows]
    assert ops == [("file", "put"), ("file", "get"), ("file", "save"), ("file", "prefetch"), ("cpu", "encode"),
                   ("cpu", "checksum"), ("cpu", "crc32")]
    for r in rows:
        assert set(r) >= {"backend", "op", "page_bytes", "pages", "gbps", "raw_gbps", "ratio"}
        assert r["pages"] == 3 and r["gbps"] > 0 and r["raw_gbps"] > 0 and r["ratio"] > 0
        busy = r["raw_cpu_busy"]   # None for the CPU rows, and where the raw side ran under a clock tick
        assert busy is None if r["backend"] == "cpu" else (busy is None or 0 <= busy <= 1)
    assert "ratio" in run.output and fig.stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ratios.png", "rows.json"]   # its stores removed


def test_the_bench_refuses_bad_flags_by_name(tmp_path):
    for args, words in ((["--backend", "nope"], "unknown storage backend"), (["--dir", str(tmp_path / "x")], "--dir"),
                        (["--pages", "0"], "--pages"), (["--plot", str(tmp_path / "f.txt")], "--plot")):
        run = CliRunner().invoke(main, ["bench", "storage", *args])
        assert run.exit_code == 2 and words in run.output, (args, run.output)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_the_raw_sides_cpu_share_counts_a_busy_thread():
    def spin():
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
    seconds, busy = _seconds_busy(spin)
    assert seconds >= 0.3 and busy is not None and 0.7 / os.cpu_count() <= busy <= 1
