"""The online backend chooser behind io_backend='auto' (pure logic; the GPU tests time real transfers)."""

from __future__ import annotations

import numpy as np
import torch

from kvtier.device_pool import pool_from_spec
from kvtier.host_pool import host_pool_for
from kvtier.spec import KVSpec
from kvtier.transfer.online import OnlineChooser, shape_key


def test_explores_each_candidate_in_prior_order_then_keeps_the_fastest():
    c = OnlineChooser(explore=2)
    key = ("shape",)
    seen = []
    rates = {"dma": iter([30.0, 31.0]), "kernel": iter([45.0, 47.0])}
    for _ in range(4):
        pick = c.pick(key, ["dma", "kernel"])
        seen.append(pick)
        c.record(key, pick, next(rates[pick]))
    assert seen == ["dma", "dma", "kernel", "kernel"]
    assert [c.pick(key, ["dma", "kernel"]) for _ in range(3)] == ["kernel"] * 3
    assert c.best(key) == "kernel"


def test_shapes_are_kept_apart_and_bad_samples_ignored():
    c = OnlineChooser(explore=1)
    c.record("a", "kernel", 10.0)
    c.record("a", "dma", 20.0)
    c.record("a", "dma", float("nan"))
    c.record("a", "kernel", -1.0)
    assert c.pick("a", ["kernel", "dma"]) == "dma"
    assert c.pick("b", ["kernel", "dma"]) == "kernel"  # unseen shape: prior order


def test_shape_key_separates_direction_geometry_size_and_run_length():
    spec = KVSpec("mha", 2, torch.bfloat16, head_num=2, head_dim=16)
    dev = pool_from_spec(spec, 256, 16, "cpu")
    parts_lf = host_pool_for(dev, "layer_first", host_size_tokens=256).transfer_parts()
    parts_pf = host_pool_for(dev, "page_first", host_size_tokens=256).transfer_parts()
    runs = np.arange(64)
    scattered = np.random.default_rng(0).permutation(256)[:64]
    base = shape_key(False, parts_lf, runs, 1 << 20)
    assert base == shape_key(False, parts_lf, runs + 64, 1 << 20)
    assert base != shape_key(True, parts_lf, runs, 1 << 20)
    assert base != shape_key(False, parts_pf, runs, 1 << 20)
    assert base != shape_key(False, parts_lf, scattered, 1 << 20)
    assert base != shape_key(False, parts_lf, runs, 1 << 24)
