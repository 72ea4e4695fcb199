"""Host-memory accounting (cgroup v1 and v2), KV specs, and the CLI as a user runs it."""

from __future__ import annotations

import json
import os
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


def _machine(monkeypatch, total=64 << 30):
    monkeypatch.setattr(memory.psutil, "virtual_memory",
                        lambda: type("VM", (), {"total": total, "available": total - (4 << 30)})())


def _cgroup(d, version, limit, usage, inactive=0):
    """A cgroup directory as the kernel shows it: limit, usage and memory.stat's page cache."""
    d.mkdir(parents=True, exist_ok=True)
    names = ("memory.max", "memory.current", "inactive_file") if version == "v2" else \
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    write(d / names[0], str(limit))
    write(d / names[1], str(usage))
    write(d / "memory.stat", f"anon 1000\n{names[2]} {inactive}\nactive_file 5\n")


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_cgroup_limit_is_read_from_the_process_own_cgroup_under_either_version(tmp_path, version, monkeypatch):
    """The process's cgroup is nested (a systemd service, a container without its own cgroup
    namespace): its limit is found at its own path, where the mount's root has no limit file."""
    _machine(monkeypatch)
    limit, usage = 6 << 30, 2 << 30
    proc = write(tmp_path / "cgroup", "0::/system.slice/kv.service\n" if version == "v2"
                 else "5:cpu,cpuacct:/x\n4:memory:/system.slice/kv.service\n0::/\n")
    base = tmp_path if version == "v2" else tmp_path / "memory"
    _cgroup(base / "system.slice" / "kv.service", version, limit, usage)
    room = memory.cgroup_limit_and_usage(tmp_path, proc)
    assert room == (limit, usage) and room.path == str(base / "system.slice" / "kv.service")
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(memory, "PROC_CGROUP", proc)
    mem = memory.host_memory(1 << 30)
    assert mem.cgroup_limit == limit and mem.cgroup_available == limit - usage - mem.promised - (1 << 30)
    assert mem.cgroup_path == room.path
    assert mem.available == min(mem.host_available, mem.cgroup_available)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_tightest_level_counts_and_page_cache_is_left_out(tmp_path, version, monkeypatch):
    """A parent's limit caps its children together: the level with the least room left
    counts. Inactive page cache, which the kernel reclaims first, is not counted as used."""
    _machine(monkeypatch)
    proc = write(tmp_path / "cgroup", "0::/pod/ctr\n" if version == "v2" else "4:memory:/pod/ctr\n")
    base = tmp_path if version == "v2" else tmp_path / "memory"
    _cgroup(base / "pod", version, 8 << 30, 7 << 30)                      # 1 GiB left
    _cgroup(base / "pod" / "ctr", version, 6 << 30, 3 << 30, inactive=1 << 30)  # 4 GiB left
    assert memory.cgroup_limit_and_usage(tmp_path, proc) == (8 << 30, 7 << 30)
    assert memory.cgroup_limit_and_usage(tmp_path, proc).path == str(base / "pod")
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(memory, "PROC_CGROUP", proc)
    with pytest.raises(MemoryError, match=f"cgroup limit 8.59 GB at {base / 'pod'}"):
        memory.check_host_memory(2 << 30, 0, "a pool")
    _cgroup(base / "pod", version, 8 << 30, 7 << 30, inactive=6 << 30)   # now 7 GiB left there
    assert memory.cgroup_limit_and_usage(tmp_path, proc) == (6 << 30, 2 << 30)


def test_memory_high_caps_a_v2_level_as_its_limit(tmp_path, monkeypatch):
    """cgroup v2's memory.high (the kernel throttles above it) counts as the limit where lower."""
    _machine(monkeypatch)
    proc = write(tmp_path / "cgroup", "0::/svc\n")
    _cgroup(tmp_path / "svc", "v2", 8 << 30, 1 << 30)
    write(tmp_path / "svc" / "memory.high", str(3 << 30))
    assert memory.cgroup_limit_and_usage(tmp_path, proc) == (3 << 30, 1 << 30)
    write(tmp_path / "svc" / "memory.max", "max")          # high alone still caps
    assert memory.cgroup_limit_and_usage(tmp_path, proc) == (3 << 30, 1 << 30)
    write(tmp_path / "svc" / "memory.high", "max")
    assert memory.cgroup_limit_and_usage(tmp_path, proc) is None


@pytest.mark.parametrize("content", ["max", "", "garbage", str(1 << 62), str(64 << 30)])
def test_unlimited_cgroup_is_ignored(tmp_path, content, monkeypatch):
    """No limit, an unreadable one, or one at the machine's memory or above: no cgroup cap."""
    _machine(monkeypatch)
    write(tmp_path / "memory.max", content)
    write(tmp_path / "memory.current", "100")
    assert memory.cgroup_limit_and_usage(tmp_path, tmp_path / "no-proc-file") is None


@pytest.mark.parametrize("listed", ["0::/../..", "0::/"])
def test_a_path_outside_the_mount_or_no_proc_file_reads_the_mounts_root(tmp_path, listed, monkeypatch):
    """Inside a container with its own cgroup namespace the mount's root is the container's
    cgroup; a process outside the namespace's root sees a path with '..', read as the root."""
    _machine(monkeypatch)
    _cgroup(tmp_path, "v2", 5 << 30, 1 << 30)
    for proc in (write(tmp_path / "cgroup", listed + "\n"), tmp_path / "missing"):
        assert memory.cgroup_limit_and_usage(tmp_path, proc) == (5 << 30, 1 << 30)


def test_this_machines_own_cgroups_are_read_without_error():
    """The real /proc/self/cgroup and mounts of whatever machine runs the tests."""
    got = memory.cgroup_limit_and_usage()
    assert got is None or (got[0] > 0 and got[1] >= 0)


def test_reserve_from_environment(monkeypatch):
    monkeypatch.setenv(memory.RESERVE_ENV, "2.5")
    assert memory.default_reserve_bytes() == int(2.5e9)
    monkeypatch.setenv(memory.RESERVE_ENV, "lots")
    with pytest.raises(ValueError, match="KVTIER_HOST_RESERVE_GB='lots'"):
        memory.default_reserve_bytes()


@pytest.mark.parametrize("raw", ["0", "-3", "lots", "nan", "inf"])
def test_a_bad_host_limit_is_refused_by_name(raw, monkeypatch):
    monkeypatch.setenv(memory.LIMIT_ENV, raw)
    with pytest.raises(ValueError, match=f"KVTIER_HOST_LIMIT_GB='{raw}'"):
        memory.host_memory(0)


def test_the_host_limit_stands_in_for_what_the_os_reports_available(monkeypatch):
    """A VM whose memory grows as it is used reports little available: with
    KVTIER_HOST_LIMIT_GB set, the check counts the limit less this process's resident
    memory instead (the cgroup still caps it), and says which it used."""
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: type("VM", (), {"total": 32 << 30, "available": 2 << 30})())
    monkeypatch.setattr(memory, "cgroup_limit_and_usage", lambda: None)
    with pytest.raises(MemoryError, match="host limit.*KVTIER_HOST_LIMIT_GB to what this process may use"):
        memory.check_host_memory(int(50e9), 0, "a pool")
    monkeypatch.setenv(memory.LIMIT_ENV, "100")
    rss = memory.psutil.Process().memory_info().rss
    mem = memory.check_host_memory(int(50e9), 0, "a pool")
    assert mem.limit == int(100e9)
    assert abs(mem.available - (int(100e9) - rss)) < 256 << 20   # the resident size moves a little
    with pytest.raises(MemoryError, match="KVTIER_HOST_LIMIT_GB=100 less this process's resident memory"):
        memory.check_host_memory(int(100e9), 0, "a pool")
    monkeypatch.setattr(memory, "cgroup_limit_and_usage", lambda: (int(20e9), int(5e9)))
    with pytest.raises(MemoryError, match="cgroup limit"):
        memory.check_host_memory(int(50e9), 0, "a pool")


def test_a_host_pool_over_the_host_limit_is_refused_before_allocating(monkeypatch):
    """A real pool against a limit just above what this process holds: refused, naming the
    limit, with nothing allocated (the resident size does not grow by the pool's bytes)."""
    from kvtier.device_pool import MHATokenToKVPool
    from kvtier.host_pool import MHATokenToKVPoolHost
    dev = MHATokenToKVPool(64, 4, torch.bfloat16, 8, 128, 4, "cpu")   # 64 KiB a token
    rss = memory.psutil.Process().memory_info().rss
    monkeypatch.setenv(memory.LIMIT_ENV, f"{(rss + (64 << 20)) / 1e9:.4f}")
    with pytest.raises(MemoryError, match="KVTIER_HOST_LIMIT_GB="):
        MHATokenToKVPoolHost(dev, 0, 0, 4, "layer_first", host_size_tokens=1 << 14, reserve_bytes=0)  # 1 GiB
    assert memory.psutil.Process().memory_info().rss < rss + (512 << 20)
    pool = MHATokenToKVPoolHost(dev, 0, 0, 4, "layer_first", host_size_tokens=256, reserve_bytes=0)  # 16 MiB
    assert pool.size == 256


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
    assert all(0 <= r["huge_page_share"] <= 1 for r in data["roundtrip"]["layouts"].values())
    assert data["huge_pages"] == memory.huge_pages_default() and data["transparent_huge_pages"] == memory.thp_mode()
    assert "host pages:" in res.output and "host pool in huge pages" in res.output


def test_info_shows_a_file_stores_use_and_its_capacity_for_the_model(tmp_path):
    from kvtier.storage.file import FileBackend, FileConfig
    from kvtier.storage.format import HEADER_BYTES
    store = FileBackend(FileConfig(str(tmp_path / "store"), 1 << 30))
    store.put([bytes(15) + bytes([i]) for i in range(3)], [bytes(HEADER_BYTES + 100)] * 3)  # any bytes: sizes count
    out = tmp_path / "info.json"
    res = CliRunner().invoke(main, ["info", "-m", "llama-3-8b", "--storage-dir", str(tmp_path / "store"),
                                    "--storage-gb", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    s = json.loads(out.read_text())["storage"]
    page = HEADER_BYTES + 64 * 131072
    assert (s["pages"], s["used_bytes"], s["capacity_bytes"], s["page_bytes"]) == (3, 3 * (HEADER_BYTES + 100), 10**9, page)
    assert s["capacity_tokens"] == 10**9 // page * 64 and "storage tier capacity for this model" in res.output
    res = CliRunner().invoke(main, ["info", "-m", "llama-3-8b", "--storage-dir", str(tmp_path / "store")])
    assert res.exit_code == 0 and "the disk's" in res.output
    for args, words in ((["--storage-gb", "1"], "give --storage-dir too"),
                        (["--storage-dir", str(tmp_path / "nowhere")], "is not a directory")):
        res = CliRunner().invoke(main, ["info", "-m", "llama-3-8b", *args])
        assert res.exit_code == 2 and words in res.output, res.output


def test_info_says_when_the_host_limit_stands_in(tmp_path, monkeypatch):
    out = tmp_path / "info.json"
    monkeypatch.setenv(memory.LIMIT_ENV, "123")
    res = CliRunner().invoke(main, ["info", "--model", "llama-3-8b", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "KVTIER_HOST_LIMIT_GB=123 in place of the OS's available memory" in res.output
    assert json.loads(out.read_text())["host_limit_bytes"] == int(123e9)


def test_info_names_the_cgroup_whose_limit_counts(tmp_path, monkeypatch):
    _machine(monkeypatch)
    proc = write(tmp_path / "cgroup", "0::/svc/kv\n")
    _cgroup(tmp_path / "svc", "v2", 6 << 30, 1 << 30)
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(memory, "PROC_CGROUP", proc)
    out = tmp_path / "info.json"
    res = CliRunner().invoke(main, ["info", "--model", "llama-3-8b", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert f"cgroup limit {(6 << 30) / 1e9:.1f} GB at {tmp_path / 'svc'}" in res.output
    got = json.loads(out.read_text())
    assert got["cgroup_path"] == str(tmp_path / "svc") and got["cgroup_limit_bytes"] == 6 << 30


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


@pytest.mark.parametrize("huge", [False, True])
def test_host_buffers_ask_for_huge_pages_only_when_told(huge, monkeypatch):
    """``huge_pages=True`` (the default on Linux, ``KVTIER_HOST_HUGE_PAGES`` unset): the buffer
    lies in a mapping of its own, from a 2 MiB boundary, advised for transparent huge pages
    (``hg`` in its VmFlags), and holds what is written; ``False`` (or the variable at 0):
    ordinary memory."""
    monkeypatch.delenv(memory.HUGE_PAGES_ENV, raising=False)
    assert memory.huge_pages_default() == memory.HUGE_PAGES_SUPPORTED
    if huge and not memory.HUGE_PAGES_SUPPORTED:
        pytest.skip("this platform cannot ask for huge pages")
    b = memory.HostBuffer((3, 700, 1000), torch.bfloat16, pin=False, huge_pages=None if huge else False)
    t = b.tensor
    assert t.shape == (3, 700, 1000) and t.dtype == torch.bfloat16 and b.huge_pages == huge
    flat = t.view(-1).view(torch.uint8)
    flat.copy_(torch.arange(flat.numel()).remainder(251).to(torch.uint8))
    assert int(flat[4321]) == 4321 % 251 and int(flat[-1]) == (flat.numel() - 1) % 251
    if huge:
        assert t.data_ptr() % memory.HUGE_PAGE == 0 and "hg" in memory.vm_flags(t.data_ptr())
        assert 0 <= memory.huge_page_bytes(t) <= t.numel() * 2
    else:
        # numpy advises huge pages for its own large arrays, heap memory included, and a tensor
        # may later be given that memory (it then shows "hg" through nobody's fault here): so
        # this is checked in a process where numpy does not.
        code = ("import torch; "
                "from kvtier import memory; import numpy as np; a = np.ones(8 << 20, np.uint8); del a; "
                "b = memory.HostBuffer((3, 700, 1000), torch.bfloat16, pin=False, huge_pages=False); "
                "print('hg' in memory.vm_flags(b.tensor.data_ptr()), b.huge_pages)")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "NUMPY_MADVISE_HUGEPAGE": "0"})
        assert res.stdout.split() == ["False", "False"], res.stderr[-2000:]
    monkeypatch.setenv(memory.HUGE_PAGES_ENV, "0")
    assert not memory.HostBuffer((4,), torch.uint8, pin=False).huge_pages
    monkeypatch.setenv(memory.HUGE_PAGES_ENV, "1")
    if memory.HUGE_PAGES_SUPPORTED:
        assert memory.HostBuffer((4,), torch.uint8, pin=False).huge_pages
        assert memory.HostBuffer((0,), torch.uint8, pin=False, huge_pages=True).tensor.numel() == 0
    else:
        with pytest.raises(ValueError, match="set it to 0"):
            memory.HostBuffer((4,), torch.uint8, pin=False)


def test_bad_huge_pages_settings_are_refused_by_name_before_allocating(monkeypatch):
    from kvtier.device_pool import pool_from_spec
    from kvtier.host_pool import host_pool_for
    monkeypatch.setenv(memory.HUGE_PAGES_ENV, "yes")
    with pytest.raises(ValueError, match="KVTIER_HOST_HUGE_PAGES='yes' must be 1"):
        memory.HostBuffer((4,), torch.uint8, pin=False)
    monkeypatch.delenv(memory.HUGE_PAGES_ENV)
    dev = pool_from_spec(preset("llama-3-8b"), 64, 16, "cpu")
    with pytest.raises(ValueError, match="huge_pages must be True, False or None"):
        host_pool_for(dev, "layer_first", host_size_tokens=64, huge_pages="yes")
    with pytest.raises(ValueError, match="huge_pages must be True, False or None"):
        memory.HostBuffer((4,), torch.uint8, pin=False, huge_pages=1)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_host_pool_on_huge_pages_moves_the_same_bytes(layout):
    """A pool made with ``huge_pages=True`` backs up and loads exactly as one without."""
    from kvtier.device_pool import pool_from_spec
    from kvtier.host_pool import host_pool_for
    spec = KVSpec("mla", 3, torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=16)
    dev = pool_from_spec(spec, 256, 16, "cpu")
    for st in dev.stacks.values():
        st.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(3))
    pools = [host_pool_for(dev, layout, host_size_tokens=256, huge_pages=h) for h in (False, True)]
    assert [p.huge_pages for p in pools] == [False, True]
    h = torch.cat([torch.arange(48, 64), torch.arange(16, 32)])
    d = torch.cat([torch.arange(160, 176), torch.arange(0, 16)])
    for p in pools:
        for name in p.component_tensors:
            p.raw_bytes(name).fill_(0xA5)  # ordinary memory starts as whatever was there
        p.backup_from_device_all_layer(dev, h, d, "direct")
    for name in pools[0].component_tensors:
        assert torch.equal(pools[0].raw_bytes(name), pools[1].raw_bytes(name))
    before = {k: v.clone() for k, v in dev.stacks.items()}
    for layer in range(spec.layer_num):
        pools[1].load_to_device_per_layer(dev, h, d + 32, layer, "direct")
    for k, st in dev.stacks.items():
        assert torch.equal(st[:, d + 32].view(torch.uint8), before[k][:, d].view(torch.uint8))


@pytest.mark.parametrize("text,mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                       ("always madvise [never]", "never"), ("garbled", None)])
def test_the_transparent_huge_page_setting_is_read_and_explained(tmp_path, text, mode, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text(text)
    assert memory.thp_mode(f) == mode
    assert memory.thp_mode(tmp_path / "missing") is None
    monkeypatch.delenv(memory.HUGE_PAGES_ENV, raising=False)
    note = memory.huge_pages_note(mode, read=False)
    if not memory.HUGE_PAGES_SUPPORTED:
        assert "do not ask" in note
    elif mode in ("always", "madvise"):
        assert "ask for 2 MiB pages" in note and mode in note
    else:
        assert "4 KiB pages" in note and "slower" in note
    monkeypatch.setenv(memory.HUGE_PAGES_ENV, "0")
    assert "do not ask" in memory.huge_pages_note(mode, read=False)


@pytest.mark.parametrize("kind", ["mha", "mla", "dsa"])
def test_a_host_pools_huge_page_share_counts_each_mapping_once(kind):
    """``HostPool.huge_page_share``: MHA's K and V lie in one mapping, DSA's parts in two;
    each mapping's huge pages count once, so the share is a share (it read 200% for MHA,
    counting the shared mapping once per component), and it is what smaps says of the
    pool's mappings (huge pages fill the buffers here where the kernel's setting allows)."""
    if not memory.HUGE_PAGES_SUPPORTED:
        pytest.skip("this platform cannot ask for huge pages")
    from kvtier.device_pool import pool_from_spec
    from kvtier.host_pool import host_pool_for
    spec = {"mha": KVSpec("mha", 2, torch.bfloat16, head_num=8, head_dim=128),
            "mla": KVSpec("mla", 2, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64),
            "dsa": KVSpec("dsa", 2, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)}[kind]
    dev = pool_from_spec(spec, 64, 64, "cpu")
    host = host_pool_for(dev, "layer_first", host_size_tokens=4096, huge_pages=True)
    for name in host.component_tensors:
        host.raw_bytes(name).fill_(1)  # touched: the kernel backs what it can
    share = host.huge_page_share()
    buffers = [b.tensor for b in host._buffers]
    held = sum(t.numel() * t.element_size() for t in buffers)
    assert 0 <= share <= 1
    assert share == sum(memory.huge_page_bytes(t) for t in buffers) / held
    if memory.thp_mode() == "always" or memory.thp_mode() == "madvise":
        assert share > 0, "a touched pool of several MiB, advised, got no huge pages"
    host.close()


@pytest.mark.parametrize("args, match", [
    (["info", "--reserve-gb", "nan"], "give a finite number of at least 0"),
    (["info", "--reserve-gb", "inf"], "give a finite number of at least 0"),
    (["info", "-m", "llama-3-8b", "--kind", "mla"], "--model llama-3-8b is a MHA model; --kind mla does not apply"),
    (["info", "--json", "/proc/kvtier-info.json"], "cannot be written"),
    (["info", "--roundtrip", "--roundtrip-tokens", str(10**11)], "Lower --roundtrip-tokens."),
    (["bench", "alloc", "--size", "64", "--page-size", "128"], "--size 64 holds no page of --page-size 128"),
    (["bench", "alloc", "--size", str(10**11)], "Lower --size."),
    (["bench", "cache", "--budget-us", "nan"], "give a finite number above 0"),
    (["bench", "cache", "--budget-us", "-1"], "give a finite number above 0"),
    (["bench", "cache", "--sizes", str(10**11), "--prompts", "64"], "Lower --sizes."),
    (["bench", "cache", "--prompts", "32"], "a prompt of 32 tokens is shorter than a page"),
    (["bench", "cache", "--sizes", "10,x"], "'10,x' is not comma-separated integers"),
])
def test_every_commands_bad_input_is_named_before_any_work(args, match):
    """From a review of the CLI (2026-12-05): tracebacks (nan, inf, a numpy allocation of 93 GiB,
    a pool's internal argument), a silent empty table, a message that named no flag, and an
    output path that root could not write found only at the end."""
    import time
    t = time.perf_counter()
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and match in res.output, res.output
    # nothing printed first (info's table starts with "model", bench alloc's header with "pool")
    assert res.exception.__class__ is SystemExit and not res.output.startswith(("model", "      pool"))
    assert time.perf_counter() - t < 10


@pytest.mark.parametrize("args", [["info"], ["bench", "transfer", "--quick"]])
def test_a_bad_huge_pages_setting_is_refused_before_any_output(args, monkeypatch):
    monkeypatch.setenv("KVTIER_HOST_HUGE_PAGES", "maybe")
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "KVTIER_HOST_HUGE_PAGES='maybe'" in res.output
    assert res.output.lstrip().startswith(("Error", "Usage")), res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_bench_transfer_on_the_cpu_refuses_a_gpu_backend_asked_for():
    """It timed direct under the name of nothing asked for: the table's one column was direct."""
    res = CliRunner().invoke(main, ["bench", "transfer", "--quick", "--backend", "kernel"])
    assert res.exit_code == 2 and "kernel needs CUDA" in res.output, res.output


def test_the_python_api_names_a_wrong_first_argument_and_bad_numbers():
    from kvtier.device_pool import pool_from_spec
    from kvtier.host_pool import MHATokenToKVPoolHost, host_pool_for
    spec = KVSpec("mha", 2, torch.float16, head_num=2, head_dim=8)
    dev = pool_from_spec(spec, 64, 16, "cpu")
    with pytest.raises(TypeError, match="must be a kvtier device pool .* got NoneType"):
        host_pool_for(None)
    with pytest.raises(TypeError, match="got a KVSpec: make the pool first"):
        MHATokenToKVPoolHost(spec, 2.0, 0, 16, "layer_first")
    with pytest.raises(ValueError, match="reserve_bytes must be a finite number of bytes >= 0, got nan"):
        host_pool_for(dev, reserve_bytes=float("nan"))
    with pytest.raises(ValueError, match="device='gpu': a kvtier device pool lives on 'cpu' or 'cuda'"):
        pool_from_spec(spec, 64, 16, device="gpu")


def test_the_up_front_output_check_leaves_links_fifos_and_files_alone(tmp_path):
    """The check makes and removes a file only where nothing is: it followed a dangling link
    (leaving an empty target and a plain file where the link was), and opened a FIFO, handing
    its reader an end of file so that the real write later blocked (a review)."""
    import threading
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target.json")
    res = CliRunner().invoke(main, ["info", "--json", str(link)])
    assert res.exit_code == 0 and link.is_symlink() and json.loads((tmp_path / "target.json").read_text())
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()), daemon=True)
    reader.start()
    res = CliRunner().invoke(main, ["info", "--json", str(fifo)])
    reader.join(20)
    assert res.exit_code == 0 and got and "bytes_per_token" in json.loads(got[0])
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    assert CliRunner().invoke(main, ["info", "--json", str(kept), "--reserve-gb", "nan"]).exit_code == 2
    assert kept.read_text() == "old" and not (tmp_path / "new.json").exists()


def test_bench_alloc_needs_no_pool_reserve(monkeypatch):
    """It checked its plain tensors against the host pools' 10 GiB reserve: on an 8 GB machine
    every --size was refused (a review)."""
    monkeypatch.setenv("KVTIER_HOST_LIMIT_GB", "8")
    res = CliRunner().invoke(main, ["bench", "alloc", "--size", "4096", "--iters", "10", "--repeats", "1"])
    assert res.exit_code == 0 and "4,096" in res.output, res.output


def test_a_reserve_may_be_any_finite_number_type():
    import numpy as np
    assert memory.host_memory(torch.tensor(1 << 30)).reserve == 1 << 30
    assert memory.host_memory(np.float32(5)).reserve == 5
    for bad in ("1", float("inf"), -1, True):
        with pytest.raises(ValueError, match="reserve_bytes must be a finite number"):
            memory.host_memory(bad)
