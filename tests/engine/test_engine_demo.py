"""``kvtier demo`` and ``kvtier bench ttft`` end to end on tiny settings (outputs, JSON, plot; no timings asserted)."""

from __future__ import annotations

import json

import psutil
import pytest
from click.testing import CliRunner

from kvtier.cli import main

TINY = ["--hidden", "64", "--layers", "2", "--intermediate", "96", "--clients", "3", "--rounds", "3",
        "--system-tokens", "48", "--user-tokens", "24", "--output-tokens", "6",
        "--device-tokens", "192", "--host-tokens", "2048", "--page-size", "8", "--no-progress"]


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_demo_runs_five_modes_and_writes_json_and_plot(tmp_path, model):
    out_json, out_png = tmp_path / "demo.json", tmp_path / "ttft.png"
    res = CliRunner().invoke(main, ["demo", "--model", model, *TINY, "--host-tokens", "192", "--json", str(out_json),
                                    "--plot", str(out_png)])
    assert res.exit_code == 0, res.output
    assert "outputs identical: yes" in res.output
    for title in ("no prefix cache", "GPU-only prefix cache", "GPU + host tiers", "GPU + host + storage",
                  "restart: cold GPU + host, same storage"):
        assert title in res.output
    doc = json.loads(out_json.read_text())
    assert doc["outputs_identical"] is True
    assert set(doc["modes"]) == {"none", "gpu", "tiers", "storage", "storage_restart"}
    for mode, s in doc["modes"].items():
        for field in ("hit_rate", "hit_rate_storage", "ttft_p50_s", "ttft_p99_s", "prefill_tokens_computed",
                      "prefill_tokens_reused"):
            assert field in s, (mode, field)
        assert s["requests"] == (3 if mode == "storage_restart" else 9)
    modes = doc["modes"]
    assert modes["none"]["hit_rate"] == 0
    assert modes["tiers"]["hit_rate_host"] > 0 and modes["tiers"]["hit_rate_storage"] == 0
    assert modes["tiers"]["prefill_tokens_computed"] < modes["none"]["prefill_tokens_computed"]
    assert modes["storage"]["prefill_tokens_reused"] > modes["tiers"]["prefill_tokens_reused"]
    assert modes["storage_restart"]["hit_rate_storage"] > 0.5
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_storage_modes_run_over_a_directory_given_and_leave_it_filled(tmp_path):
    store = tmp_path / "store"
    res = CliRunner().invoke(main, ["demo", *TINY, "--host-tokens", "192", "--modes", "storage,storage_restart",
                                    "--storage-url", str(store), "--storage-write", "write_back", "--plot", ""])
    assert res.exit_code == 0 and "outputs identical: yes" in res.output, res.output
    assert list(store.rglob("*.kvp"))


@pytest.mark.parametrize("args, match", [
    (["--modes", "none,storage_restart"], "name storage too"),
    (["--modes", "storage", "--storage", "tape"], "unknown storage backend 'tape'"),
    (["--modes", "storage", "--storage", "valkey", "--storage-url", "http://x"], "must look like 'valkey://host:port'"),
    (["--modes", "storage", "--storage", "mooncake", "--storage-url", "127.0.0.1:1"], "mooncake://"),
    (["--modes", "storage", "--storage", "kvtier.storage.file:FileBackend"], "needs --storage-url"),
])
def test_bad_storage_flags_fail_before_any_work(args, match):
    res = CliRunner().invoke(main, ["demo", *TINY, *args])
    assert res.exit_code == 2 and match in res.output, res.output
    assert "model:" not in res.output


def test_demo_rejects_bad_flags_before_running(tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["demo", "--modes", "none,disk", "--no-progress"])
    assert res.exit_code != 0 and "disk" in res.output
    res = runner.invoke(main, ["demo", "--device-tokens", "8", "--page-size", "16", "--no-progress"])
    assert res.exit_code == 2 and "device_tokens=8" in res.output
    res = runner.invoke(main, ["demo", "--heads", "3", "--kv-heads", "2", "--no-progress"])
    assert res.exit_code == 2 and "multiple of n_kv_heads" in res.output


@pytest.mark.parametrize("args, match", [
    (["--layout", "bogus"], "Invalid value for --layout: host layout 'bogus' is not supported for MHA"),
    (["--io-backend", "kernel"], "Invalid value for --io-backend: io_backend='kernel' needs a CUDA device pool"),
    (["--io-backend", "bogus"], "unknown io backend 'bogus'"),
    (["--device", "bogus"], "'bogus' is no device; use cpu or cuda"),
    (["--clients", "0"], "'--clients': 0 is not in the range x>=1"),
    (["--system-tokens", "-1"], "'--system-tokens': -1 is not in the range x>=0"),
    (["--json", "/nonexistent-dir/x.json"], "'/nonexistent-dir' does not exist"),
    (["--plot", "/nonexistent-dir/x.png"], "'/nonexistent-dir' does not exist"),
    (["--host-tokens", str(10**12)], "the host pool needs"),
    (["--device-tokens", str(10**11)], "Lower --device-tokens."),
    (["--rounds", "40"], "the workload's longest request needs"),
    (["--device-tokens", "1", "--page-size", "1"], "raise --device-tokens"),
    (["--dtype", "fp8"], "FP8 is a KV cache format"),
    # A review of every command's bad input (2026-12-05):
    (["--model", "deepseek", "--kv-heads", "4"], "--kv-heads only applies to --model llama, not deepseek"),
    (["--model", "llama", "--kv-lora-rank", "8", "--rope-dim", "8"], "only apply to --model deepseek"),
    (["--modes", ","], "no mode given"),
    (["--plot", "/tmp/kvtier-demo.svgx"], "cannot draw"),
    (["--plot", "/tmp/kvtier-demo"], "cannot draw"),
    (["--json", "/tmp/kvtier-demo-both.png", "--plot", "/tmp/kvtier-demo-both.png"], "both name"),
])
def test_every_bad_demo_flag_fails_before_any_work(args, match):
    """A review found these ran the first mode in full (or built the model) before a traceback."""
    res = CliRunner().invoke(main, ["demo", *TINY, *args])
    assert res.exit_code in (1, 2) and match in res.output, res.output
    assert "model:" not in res.output and "Traceback" not in res.output and res.exception.__class__ is SystemExit


def test_demo_names_the_checkpoints_model_and_checks_it_fits_first(tmp_path, monkeypatch):
    """With --checkpoint the demo printed the flags' model (llama, 3 layers) and recorded it in its
    JSON; and the weights-fit check, done for random weights, was skipped for a checkpoint."""
    import torch

    from kvtier.engine import random_model, save_checkpoint, tiny
    cfg = tiny("deepseek", hidden_size=64, n_layers=2, n_heads=2, intermediate_size=96, vocab_size=512,
               kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, dtype=torch.float32)
    ckpt = save_checkpoint(random_model(cfg, 0), tmp_path / "ckpt")
    out = tmp_path / "demo.json"
    small = [a for a in TINY if a not in ("--hidden", "64", "--layers", "2", "--intermediate", "96")]
    res = CliRunner().invoke(main, ["demo", *small, "--modes", "none,tiers", "--checkpoint", str(ckpt),
                                    "--json", str(out), "--plot", ""])
    assert res.exit_code == 0, res.output
    assert f"model: checkpoint {ckpt} (MLA, 2 layers, latent 32+8, float32)" in res.output
    assert json.loads(out.read_text())["model"]["kind"] == "deepseek"
    monkeypatch.setenv("KVTIER_HOST_LIMIT_GB", "0.0001")   # the machine holds less than its weights
    res = CliRunner().invoke(main, ["demo", *small, "--checkpoint", str(ckpt), "--plot", ""])
    assert res.exit_code == 1 and "twice while loading" in res.output and "model:" not in res.output, res.output


def test_a_checkpoint_whose_tensors_do_not_match_its_config_fails_before_any_work(tmp_path):
    """The tensors were checked only as they loaded, after the demo's header (a review's note):
    now their names and shapes are read from the files' headers with the other checks."""
    from safetensors.torch import load_file, save_file

    from kvtier.engine import random_model, save_checkpoint, tiny
    cfg = tiny("llama", hidden_size=64, n_layers=2, n_heads=2, intermediate_size=96, vocab_size=512)
    ckpt = save_checkpoint(random_model(cfg, 0), tmp_path / "ckpt")
    small = [a for a in TINY if a not in ("--hidden", "64", "--layers", "2", "--intermediate", "96")]
    (f,) = ckpt.glob("*.safetensors")
    state = load_file(str(f))
    state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:-1].contiguous()
    del state["model.norm.weight"]
    save_file(state, str(f))
    res = CliRunner().invoke(main, ["demo", *small, "--checkpoint", str(ckpt), "--plot", ""])
    assert res.exit_code == 2 and "model:" not in res.output and "Traceback" not in res.output, res.output
    assert "missing ['model.norm.weight']" in res.output and "model.layers.1.mlp.up_proj.weight (95, 64)" in res.output


def test_bench_flags_fail_before_any_work(tmp_path):
    runner = CliRunner()
    for args, match in ((["bench", "ttft", "--model", "tiny", "--page-size", "0"], "'--page-size': 0 is not in"),
                        (["bench", "ttft", "--model", "tiny", "--repeats", "0"], "'--repeats': 0 is not in"),
                        (["bench", "ttft", "--model", "tiny", "--device", "cpu", "--io-backends", "kernel"], "--io-backends"),
                        (["bench", "transfer", "--page-size", "0"], "'--page-size': 0 is not in"),
                        (["bench", "transfer", "--backend", "foo"], "unknown backend 'foo'"),
                        (["bench", "alloc", "--json", str(tmp_path)], "is a directory"),
                        (["bench", "cache", "--json", "/nonexistent-dir/c.json"], "does not exist"),
                        (["info", "--json", "/nonexistent-dir/i.json"], "does not exist"),
                        (["bench", "ttft", "--model", "tiny", "--io-backends", ","], "names no io backend"),
                        (["bench", "ttft", "--model", "tiny", "--seed", str(10**23)], "'--seed'"),
                        (["bench", "cache", "--seed", "-1"], "'--seed'"),
                        (["demo", "--seed", str(10**23)], "'--seed'")):
        res = runner.invoke(main, args)
        assert res.exit_code == 2 and match in res.output, (args, res.output)


def test_bench_ttft_runs_on_cpu(tmp_path):
    out = tmp_path / "ttft.json"
    res = CliRunner().invoke(main, ["bench", "ttft", "--model", "tiny", "--contexts", "128,256", "--new-tokens", "16",
                                    "--repeats", "1", "--page-size", "16", "--device", "cpu", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert [r["context_tokens"] for r in doc["rows"]] == [128, 256]
    for r in doc["rows"]:
        assert r["first_tokens_equal"] == 1
        assert r["recompute_ttft_s"] > 0 and r["host_hit_ttft_s"] > 0 and r["copy_limit_gbps"] > 0
    assert doc["cache_metrics"]["direct"]["hit_tokens_total.host"] >= 128 + 256


def test_bench_ttft_times_a_cold_storage_hit_and_the_advisors_split_beside_the_disk(tmp_path):
    out = tmp_path / "ttft.json"
    res = CliRunner().invoke(main, ["bench", "ttft", "--model", "tiny", "--contexts", "256", "--new-tokens", "16",
                                    "--repeats", "1", "--page-size", "16", "--device", "cpu", "--storage-dir",
                                    str(tmp_path), "--json", str(out)])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(out.read_text())["rows"]
    assert row["storage_hit_ttft_s"] > 0 and row["advisor_ttft_s"] > 0 and row["disk_read_gbps"] > 0
    assert row["storage_loaded_tokens"] == 256 and 0 <= row["advisor_loaded_tokens"] <= 256
    assert row["storage_first_tokens_equal"] == 2   # the storage hit's and the advisor's, as recomputed
    assert "storage-hit TTFT (loaded)" in res.output and "disk read" in res.output
    assert not list(tmp_path.glob("kvtier-bench-ttft-*"))   # its stores are removed
    res = CliRunner().invoke(main, ["bench", "ttft", "--model", "tiny", "--storage-dir", str(tmp_path / "none")])
    assert res.exit_code == 2 and "not a writable directory" in res.output


def test_bench_ttft_defaults_to_contexts_the_model_can_prefill_here():
    """The tiny model (a CPU smoke test) defaults to 1k and 2k tokens, not the 16k and 32k of the
    real shape (one 16k recompute takes minutes in float64 on a CPU)."""
    from kvtier.bench.ttft import DEFAULT_CONTEXTS, MODELS
    assert DEFAULT_CONTEXTS.keys() == MODELS.keys() and DEFAULT_CONTEXTS["llama-3-8b"] == "16384,32768"
    res = CliRunner().invoke(main, ["bench", "ttft", "--model", "tiny", "--new-tokens", "16", "--repeats", "1",
                                    "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "| 1,024 | 16 | direct |" in res.output and "| 2,048 | 16 | direct |" in res.output


@pytest.mark.skipif(psutil.virtual_memory().available > 30e9, reason="the real shape's weights fit here")
def test_bench_ttft_refuses_a_model_that_cannot_fit_in_host_memory():
    """llama-3-8b on the CPU (float32, 32.1 GB) is refused before its weights are allocated,
    naming what it needs and the way out, where the OOM killer used to end the process."""
    res = CliRunner().invoke(main, ["bench", "ttft", "--device", "cpu"])
    assert res.exit_code == 1
    assert "weights) needs 32.12 GB of host memory" in res.output and "--model tiny" in res.output


def test_bench_ttft_warms_auto_until_it_has_chosen():
    """auto explores each candidate on a shape's first transfers: the TTFT bench serves that
    many untimed host hits first, so no timed hit is an exploring one."""
    from kvtier.bench.ttft import WARM_HITS, warm_hits
    from kvtier.engine import Engine, EngineConfig, tiny
    from kvtier.engine.engine import make_model
    from kvtier.transfer.auto import AutoBackend
    from kvtier.transfer.dma import DMABackend
    from kvtier.transfer.kernel import KernelBackend

    cfg = dict(prefix_cache="tiers", device_tokens=256, host_tokens=1024, page_size=8, device="cpu")
    model = make_model(tiny("llama", hidden_size=64, n_layers=2, n_heads=4, intermediate_size=96, vocab_size=101),
                       EngineConfig(**cfg), 0)
    e = Engine(model, EngineConfig(**cfg))
    assert warm_hits(e) == WARM_HITS  # the CPU path does not explore
    auto = AutoBackend(KernelBackend(), DMABackend())
    e.kv.cache.engine.backend = auto
    assert warm_hits(e) == auto.settling_transfers == 2 * auto.chooser.explore > WARM_HITS


def test_engine_inputs_knob_is_checked_and_recorded(tmp_path):
    """EngineConfig.inputs names how step inputs reach the GPU; a wrong name is refused before
    anything is built, and bench ttft records the one it ran with (CPU: all three copy alike)."""
    from kvtier.engine import EngineConfig
    with pytest.raises(ValueError, match=r"unknown inputs 'gpu'; use one of \('sms', 'pinned', 'pageable'\)"):
        EngineConfig(inputs="gpu")
    out = tmp_path / "ttft.json"
    res = CliRunner().invoke(main, ["bench", "ttft", "--model", "tiny", "--contexts", "128", "--new-tokens", "16",
                                    "--repeats", "1", "--page-size", "16", "--device", "cpu", "--inputs", "pageable",
                                    "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["inputs"] == "pageable" and doc["rows"][0]["first_tokens_equal"] == 1
    res = CliRunner().invoke(main, ["bench", "ttft", "--model", "tiny", "--inputs", "gpu"])
    assert res.exit_code == 2 and "gpu" in res.output


@pytest.mark.parametrize("env, value", [("KVTIER_HOST_RESERVE_GB", "abc"), ("KVTIER_HOST_LIMIT_GB", "-1"),
                                        ("KVTIER_HOST_HUGE_PAGES", "x")])
def test_a_bad_environment_variable_is_a_usage_error_named_before_any_work(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    for args in (["info"], ["demo", *TINY]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2 and f"{env}={value!r}" in res.output, (args, res.output)
        assert "model:" not in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("args, match", [
    (["--kind", "mha", "--layers", "2"], "a MHA model with no preset needs --heads and --head-dim"),
    (["-m", "deepseek-v3", "--heads", "4"], "--heads does not apply to a MLA model"),
    (["--kind", "mla", "--layers", "2", "--heads", "2", "--head-dim", "4"], "--heads, --head-dim do not apply"),
    (["-m", "llama-3-8b", "--index-head-dim", "128"], "--index-head-dim does not apply to a MHA model"),
])
def test_shape_flags_that_do_not_fit_the_kind_are_named(args, match):
    res = CliRunner().invoke(main, ["info", *args])
    assert res.exit_code == 2 and match in res.output, res.output


def test_bench_ttft_shows_and_checks_that_a_host_hit_gives_the_same_first_token(tmp_path):
    """bench ttft compared the first tokens of host hits with recomputing's but neither showed
    nor failed on it (a review, 2026-12-04): now a column, and a mismatch fails the command."""
    res = CliRunner().invoke(main, ["bench", "ttft", "--model", "tiny", "--contexts", "64", "--new-tokens", "4",
                                    "--repeats", "2", "--page-size", "16", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "same first token |" in res.output and "| 2/2 |" in res.output


def test_the_demo_says_up_front_that_bf16_on_the_cpu_is_not_exact():
    res = CliRunner().invoke(main, ["demo", *TINY, "--dtype", "bf16", "--modes", "none,gpu", "--plot", ""])
    assert "note: torch.bfloat16 on the CPU is not exact" in res.output, res.output
    assert res.output.index("note:") < res.output.index("outputs identical")


def test_the_demo_warm_up_fits_the_smallest_device_pool():
    """The warm-up asked for two new tokens on half the pool: with one slot its request could
    not fit, and the demo failed with a traceback after its checks had passed (a review)."""
    res = CliRunner().invoke(main, ["demo", "--clients", "1", "--rounds", "1", "--system-tokens", "0",
                                    "--user-tokens", "1", "--output-tokens", "1", "--device-tokens", "1",
                                    "--page-size", "1", "--modes", "none", "--plot", "", "--hidden", "32",
                                    "--layers", "1", "--intermediate", "48"])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("kw, match", [
    (dict(use_advisor="no"), "use_advisor must be True or False"),
    (dict(exact=1), "exact must be True or False"),
    (dict(device="gpu"), "device must be 'cpu' or 'cuda'"),
    (dict(layout="page-first"), "unknown layout 'page-first'"),
    (dict(write_policy="write-back"), "unknown write_policy"),
    (dict(eviction="lfu_typo"), "unknown eviction"),
    (dict(io_backend="dmaa"), "unknown io_backend 'dmaa'"),
])
def test_engine_config_names_a_bad_switch_or_device(kw, match):
    from kvtier.engine import EngineConfig
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


@pytest.mark.parametrize("prompt", [None, 5, {1, 2}, (t for t in [1, 2])])
def test_a_prompt_that_is_no_sequence_is_named(prompt):
    import numpy as np
    import torch

    from kvtier.engine import Engine, EngineConfig, tiny
    from kvtier.engine.engine import make_model
    e = Engine(make_model(tiny("llama", hidden_size=32, n_layers=1, n_heads=2, intermediate_size=48, vocab_size=50),
                          EngineConfig(), 0), EngineConfig(prefix_cache="none", device_tokens=64, page_size=4))
    with pytest.raises(ValueError, match="a prompt is a sequence of token ids"):
        e.add_request(prompt, 2)
    assert e.add_request(torch.tensor([1, 2, 3]), 1).token_ids == [1, 2, 3]
    assert e.add_request(np.array([1, 2, 3]), 1).token_ids == [1, 2, 3]
    with pytest.raises(ValueError, match="a prompt is a sequence of token ids"):
        e.add_request(np.array([[1, 2, 3]]), 1)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only message")
def test_engine_config_refuses_cuda_without_it():
    from kvtier.engine import EngineConfig
    with pytest.raises(ValueError, match="this torch has no CUDA device; use device='cpu'"):
        EngineConfig(device="cuda")


@pytest.mark.parametrize("field, value", [("rope_theta", float("nan")), ("rope_theta", 0), ("rms_eps", -1.0),
                                          ("rms_eps", float("inf"))])
def test_a_model_number_that_makes_every_output_zero_is_refused(field, value):
    """nan, 0 or a negative RoPE theta or RMS epsilon built a model whose every token was 0."""
    from kvtier.engine import tiny
    with pytest.raises(ValueError, match=f"{field} must be a finite number above 0"):
        tiny("llama", **{field: value})


@pytest.mark.parametrize("kw, error, match", [
    (dict(layout="page_head"), ValueError, "'page_head' is not supported for MLA"),
    (dict(io_backend="kernel"), ValueError, "needs a CUDA device pool"),
    (dict(host_tokens=10**12), MemoryError, "Lower host_tokens"),
    (dict(device_tokens=10**11), MemoryError, "Lower device_tokens"),
])
def test_engine_build_checks_its_config_against_the_model_before_the_weights(kw, error, match, monkeypatch):
    """A review: these failed only after the weights were made (1 GB and a second for a small
    model, a whole load for a checkpoint)."""
    from kvtier.engine import Engine, EngineConfig, engine as engine_mod, tiny

    def no_weights(*a, **k):
        raise AssertionError("the weights were made before the config was checked")
    monkeypatch.setattr(engine_mod, "make_model", no_weights)
    with pytest.raises(error, match=match):
        Engine.build(tiny("deepseek"), EngineConfig(**kw))
    monkeypatch.setenv("KVTIER_HOST_HUGE_PAGES", "maybe")
    with pytest.raises(ValueError, match="KVTIER_HOST_HUGE_PAGES"):
        Engine.build(tiny("llama"), EngineConfig())
    with pytest.raises(TypeError, match="config must be an EngineConfig, got dict"):
        Engine.build(tiny("llama"), {"device_tokens": 256})


def test_the_demo_writes_its_json_before_its_figure_and_runs_a_mode_named_twice_once(tmp_path, monkeypatch):
    """The figure was written first: a figure that failed lost the run's JSON (a review)."""
    from kvtier.engine import report

    def broken(*a, **k):
        raise RuntimeError("the figure failed")
    monkeypatch.setattr(report, "plot", broken)
    out = tmp_path / "demo.json"
    res = CliRunner().invoke(main, ["demo", *TINY, "--modes", "none,none", "--json", str(out),
                                    "--plot", str(tmp_path / "demo.png")])
    assert isinstance(res.exception, RuntimeError) and out.exists()
    doc = json.loads(out.read_text())
    assert list(doc["modes"]) == ["none"] and "one mode: nothing to compare" in doc["outputs_detail"]


def test_a_checkpoint_config_that_is_not_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{bad")
    (tmp_path / "model.safetensors").write_bytes(b"")
    res = CliRunner().invoke(main, ["demo", "--checkpoint", str(tmp_path), "--no-progress"])
    assert res.exit_code == 2 and f"{tmp_path / 'config.json'} is not valid JSON" in res.output, res.output


def test_a_gpu_only_cache_with_a_gpu_io_backend_still_runs_on_the_cpu():
    """``prefix_cache='gpu'`` moves nothing between tiers, so its io_backend is not checked
    against the device (the engine's new check refused it at first; a review)."""
    from kvtier.engine import Engine, EngineConfig, tiny
    e = Engine.build(tiny("llama"), EngineConfig(prefix_cache="gpu", io_backend="dma", device_tokens=256))
    assert len(e.generate([[1, 2, 3, 4]], max_new_tokens=2)[0]) == 2
