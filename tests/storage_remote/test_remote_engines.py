"""Many engines, one store: engine processes with their own host pools and storage tiers share
one Valkey or Mooncake store. What one computed, another loads (keys carry no process
identity). Two tensor-parallel ranks as two processes on the CPU: MHA pages are keyed per rank
(each rank's heads), MLA pages are written once and read by every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from storage_remote_testlib import MooncakeStore, ValkeyStore, needs_mooncake

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "remote_engine_worker.py")


@pytest.fixture(params=["valkey", "mooncake"])
def shared(request, tmp_path):
    if request.param == "mooncake":
        needs_mooncake()
    store = (ValkeyStore if request.param == "valkey" else MooncakeStore)(tmp_path)
    config = store.backend().config
    fields = {k: v for k, v in vars(config).items() if k in type(config).__dataclass_fields__}
    if "nodes" in fields:
        fields["nodes"] = [list(n) for n in fields["nodes"]]
    yield request.param, fields
    store.stop()


def engine(shared, rank: int, *actions: str) -> list[dict]:
    """One engine process of ``rank`` doing ``actions`` (``save:<kind>:<seed>``, ``load:<kind>:<seed>``)."""
    name, fields = shared
    argv = [sys.executable, WORKER, name, json.dumps(fields), str(rank), *actions]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_engine_loads_what_the_first_computed(shared):
    (first,) = engine(shared, 0, "save:mha:100")
    assert first["found"] == 0 and first["written"] == 4
    (second,) = engine(shared, 0, "load:mha:999")
    assert second["found"] == 4 and second["digests"] == first["digests"]


def test_mha_pages_are_per_rank_and_mla_pages_are_written_once_for_every_rank(shared):
    mha0, mla0 = engine(shared, 0, "save:mha:100", "save:mla:7")
    assert mha0["written"] == 4 and mla0["written"] == 4
    mha1, mla1, loaded = engine(shared, 1, "save:mha:101", "save:mla:7", "load:mla:999")
    assert mha1["found"] == 0 and mha1["written"] == 4 and mha1["digests"] != mha0["digests"]  # its own heads
    assert mla1["found"] == 4 and mla1["skipped"] == 4 and mla1["written"] == 0  # written once, by rank 0
    assert loaded["digests"] == mla0["digests"]
