"""`kvtier bench cache` runs end to end on a small tree and writes the documented JSON rows."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from kvtier.bench.cache import ReferenceRadixTree
from kvtier.cli import main


def test_bench_cache_small(tmp_path):
    out = tmp_path / "cache.json"
    res = CliRunner().invoke(main, ["bench", "cache", "--sizes", "3000,9000", "--prompt", "1024", "--hit", "768",
                                    "--system", "128", "--page-size", "1", "--page-size", "16", "--repeats", "2",
                                    "--no-sglang", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "tree/list" in res.output and "bytes per cached token" in res.output
    rows = json.loads(out.read_text())
    assert [(r["page_size"], r["cached_tokens"] >= s) for r, s in zip(rows, [3000, 9000] * 2)] == \
        [(1, True), (1, True), (16, True), (16, True)]
    for r in rows:
        assert r["matched_tokens"] == 768 and r["sglang_match_us"] is None
        for op in ("match", "insert", "insert_hit"):
            assert r[f"{op}_us"] > 0 and r[f"{op}_list_us"] > 0 and r[f"reference_{op}_us"] > 0
        assert 0 < r["tensor_bytes_per_token"] < r["bytes_per_token"] < r["reference_bytes_per_token"]


def test_bench_rejects_bad_sizes():
    res = CliRunner().invoke(main, ["bench", "cache", "--sizes", "ten"])
    assert res.exit_code != 0 and "comma-separated" in res.output
    res = CliRunner().invoke(main, ["bench", "cache", "--hit", "64", "--system", "128"])
    assert res.exit_code != 0 and "--system < --hit" in res.output


def test_reference_tree_matches_a_brute_force_scan():
    rng = np.random.default_rng(0)
    tree, seqs = ReferenceRadixTree(), []
    for i in range(30):
        base = seqs[rng.integers(len(seqs))][: rng.integers(0, 20)] if seqs else []
        seq = list(base) + rng.integers(0, 3, rng.integers(1, 12)).tolist()
        tree.insert(seq, [i * 100 + j for j in range(len(seq))])
        seqs.append(seq)
    for _ in range(50):
        q = rng.integers(0, 3, rng.integers(0, 25)).tolist()
        best = max(next((k for k, (a, b) in enumerate(zip(q, s)) if a != b), min(len(q), len(s))) for s in seqs)
        assert len(tree.match(q)) == best
