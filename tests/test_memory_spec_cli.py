"""Host-memory accounting (cgroup v1 and v2), KV specs, and the CLI as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from kvtier import memory
from kvtier.cli import main
from kvtier.spec import PRESETS, KVSpec, preset


def write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_cgroup_limit_is_read_from_either_version(tmp_path, version, monkeypatch):
    limit, usage = 6 << 30, 2 << 30
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: type("VM", (), {"total": 64 << 30, "available": 60 << 30})())
    paths = (write(tmp_path / "max", str(limit)), write(tmp_path / "cur", str(usage)))
    missing = (tmp_path / "nope1", tmp_path / "nope2")
    v2, v1 = (paths, missing) if version == "v2" else (missing, paths)
    assert memory.cgroup_limit_and_usage(v2, v1) == (limit, usage)
    monkeypatch.setattr(memory, "CGROUP_V2", v2)
    monkeypatch.setattr(memory, "CGROUP_V1", v1)
    monkeypatch.setattr(memory, "cgroup_limit_and_usage", lambda: (limit, usage))
    mem = memory.host_memory(1 << 30)
    assert mem.cgroup_available == limit - usage - (1 << 30)
    assert mem.available == min(mem.host_available, mem.cgroup_available)


@pytest.mark.parametrize("content", ["max", "", "garbage", str(1 << 62)])
def test_unlimited_cgroup_is_ignored(tmp_path, content):
    v2 = (write(tmp_path / "max", content), write(tmp_path / "cur", "100"))
    assert memory.cgroup_limit_and_usage(v2, (tmp_path / "a", tmp_path / "b")) is None


def test_reserve_from_environment(monkeypatch):
    monkeypatch.setenv(memory.RESERVE_ENV, "2.5")
    assert memory.default_reserve_bytes() == int(2.5e9)
    monkeypatch.setenv(memory.RESERVE_ENV, "lots")
    with pytest.raises(ValueError, match="KVTIER_HOST_RESERVE_GB='lots'"):
        memory.default_reserve_bytes()


@pytest.mark.parametrize("name, per_token", [
    ("llama-3-8b", 32 * 2 * 8 * 128 * 2),          # 128 KiB, as ANCHORS.md says
    ("deepseek-v3", 61 * 576 * 2),
    ("glm-dsa", 78 * (576 * 2 + 128 + 4)),
])
def test_preset_bytes_per_token(name, per_token):
    assert preset(name).bytes_per_token == per_token


def test_fp8_is_stored_as_bytes_and_spec_validates():
    spec = KVSpec("mla", 2, "fp8", kv_lora_rank=512, qk_rope_head_dim=64)
    assert spec.store_dtype == torch.uint8 and spec.bytes_per_token_per_layer == 576
    with pytest.raises(ValueError, match="unknown KV kind"):
        KVSpec("gqa", 2)
    with pytest.raises(ValueError, match="unknown model preset 'llama'.*llama-3-8b"):
        preset("llama")
    assert spec.salt("layer_first", 64) != spec.salt("page_first", 64)


def test_info_for_every_preset():
    runner = CliRunner()
    for name in PRESETS:
        res = runner.invoke(main, ["info", "-m", name, "--page-size", "16"])
        assert res.exit_code == 0, res.output
        assert "host tier capacity here" in res.output and "layer_first" in res.output


def test_info_round_trip_and_json(tmp_path):
    out = tmp_path / "info.json"
    res = CliRunner().invoke(main, ["info", "--kind", "mha", "--layers", "3", "--heads", "3", "--head-dim", "40",
                                    "--page-size", "16", "--roundtrip", "--roundtrip-tokens", "128", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["bytes_per_token"] == 3 * 2 * 3 * 40 * 2
    assert set(data["roundtrip"]["layouts"]) == {"layer_first", "page_first", "page_head"}
    assert all(r["identical"] for r in data["roundtrip"]["layouts"].values())


def test_info_bad_shape_is_a_usage_error():
    res = CliRunner().invoke(main, ["info", "--kind", "dsa", "--layers", "2", "--kv-lora-rank", "64",
                                    "--index-head-dim", "200"])
    assert res.exit_code == 2 and "multiple of 128" in res.output


def test_bench_alloc_prints_a_ratio(tmp_path):
    out = tmp_path / "alloc.json"
    res = CliRunner().invoke(main, ["bench", "alloc", "--size", "65536", "--page-size", "1",
                                    "--iters", "50", "--repeats", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())
    assert rows and all(r["speedup"] > 0 for r in rows) and "x" in res.output


def test_console_script_help_everywhere():
    for args in (["--help"], ["info", "--help"], ["bench", "--help"], ["bench", "alloc", "--help"]):
        res = subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True)
        assert res.returncode == 0 and "Usage:" in res.stdout, res.stderr
