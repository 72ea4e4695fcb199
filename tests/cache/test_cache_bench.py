"""`kvtier bench cache` runs end to end on a small tree and writes the documented JSON rows."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from kvtier.bench.cache_reference import ReferenceRadixTree
from kvtier.cli import main


def test_bench_cache_small(tmp_path):
    out = tmp_path / "cache.json"
    res = CliRunner().invoke(main, ["bench", "cache", "--sizes", "2000,6000", "--prompts", "256,1024",
                                    "--page-size", "16", "--repeats", "3", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "ref/ours" in res.output
    rows = json.loads(out.read_text())
    assert len(rows) == 4
    for r in rows:
        assert {"cached_tokens", "prompt_tokens", "page_size", "match_us", "insert_us", "reference_match_us"} <= set(r)
        assert r["match_us"] > 0 and r["page_size"] == 16


def test_bench_rejects_bad_sizes():
    res = CliRunner().invoke(main, ["bench", "cache", "--sizes", "ten"])
    assert res.exit_code != 0 and "comma-separated" in res.output


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
