"""``kvtier demo --engine vllm``: the demo's multi-turn workload through stock ``vllm.LLM`` in its
three modes (no prefix cache, vLLM's own, vLLM's own with kvtier's spec), the demo's table and
JSON with vLLM's own cached-token counts; flags vLLM cannot serve refused by name first."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_testlib import ROOT, child_env, needs_vllm

pytestmark = needs_vllm

SMALL = ["--clients", "3", "--rounds", "3", "--system-tokens", "128", "--user-tokens", "64", "--output-tokens", "8",
         "--device-tokens", "512", "--host-tokens", "4096", "--no-progress", "--plot", ""]


def _demo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--engine", "vllm", *args],
                          capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=ROOT)


@pytest.mark.parametrize("args,named", [
    (["--layout", "page_first"], "--layout"),
    (["--page-size", "16"], "--page-size 16"),
    (["--head-dim", "48"], "--head-dim 48"),
    (["--model", "deepseek"], "--model llama"),
])
def test_flags_vllm_cannot_serve_are_refused_before_any_work(args, named):
    from click.testing import CliRunner

    from kvtier.demo import demo

    run = CliRunner().invoke(demo, ["--engine", "vllm", *args, "--plot", ""])
    assert run.exit_code == 2 and named in run.output, run.output[-2000:]
    assert "clients x" not in run.output  # refused before the model line, before any work


@pytest.mark.slow
def test_the_three_modes_give_identical_outputs_and_the_host_tier_serves_hits(tmp_path):
    run = _demo(*SMALL, "--json", str(tmp_path / "demo.json"))
    assert run.returncode == 0, run.stderr[-4000:]
    assert "GPU + host tiers" in run.stdout and "outputs identical: yes" in run.stdout
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert doc["config"]["engine"] == "vllm" and doc["outputs_identical"]
    modes = doc["modes"]
    assert set(modes) == {"none", "gpu", "tiers"}
    assert modes["none"]["hit_rate"] == 0 and modes["none"]["vllm_cached_tokens"].get("device", 0) == 0
    assert modes["tiers"]["vllm_cached_tokens"]["host"] > 0 and modes["tiers"]["hit_rate_host"] > 0
    assert modes["tiers"]["prefill_tokens_computed"] < modes["gpu"]["prefill_tokens_computed"]
    for s in modes.values():
        assert s["requests"] == 9 and s["prompt_tokens"] > 0 and s["ttft_p50_s"] > 0
