"""Sizes that cannot fit are refused by name before anything is allocated, and bad input is a
one-line error, never a traceback: found by an adversarial pass over the API and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import psutil
import pytest
import torch
from click.testing import CliRunner

from kvtier import MHATokenToKVPool, PageAllocator, memory
from kvtier.allocator import AllocatorError
from kvtier.cli import main
from kvtier.host_pool import host_pool_for
from kvtier.memory import HostMemoryError


def _one_line_error(res, code: int, match: str) -> None:
    assert res.exit_code == code, res.output
    assert isinstance(res.exception, SystemExit), res.exception  # no traceback
    assert match in res.output and "Traceback" not in res.output, res.output


# -- 4. sizes that pass a memory check and then exhaust memory -------------------------------

def test_info_for_a_model_of_absurdly_many_layers_answers_at_once():
    """Placement.page_pieces() built a tuple per layer: 24 GB after 83 s, then the kernel killed
    it. Run in a child under a 3 GB address-space limit and a timeout, so a regression fails
    here instead of taking the machine down."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30));"
            "from kvtier.cli import main; main()")
    res = subprocess.run([sys.executable, "-c", code, "info", "--kind", "mha", "--layers", "9" * 23,
                          "--heads", "1", "--head-dim", "1"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "host tier capacity here: 0 tokens (0 pages of 64)" in res.stdout
    assert f"{10**23 - 1:,} layers" in res.stdout or f"{10**23 - 1} layers" in res.stdout


def _limit_to(monkeypatch, spare_gb: float) -> None:
    """Let this process use ``spare_gb`` more than it holds now (KVTIER_HOST_LIMIT_GB)."""
    rss = psutil.Process().memory_info().rss
    monkeypatch.setenv(memory.LIMIT_ENV, str(rss / 1e9 + spare_gb))
    monkeypatch.setenv(memory.RESERVE_ENV, "0")


def test_a_device_pool_counts_its_per_layer_objects_before_it_is_built(monkeypatch):
    """layer_num=10**6 and 16 MB of KV took 3 GB (a tensor view and pointer per layer and
    component, not counted); 10**7 layers was killed after the check said yes."""
    _limit_to(monkeypatch, 0.5)
    before = psutil.Process().memory_info().rss
    with pytest.raises(HostMemoryError, match="device pool of 500,000 layers on the CPU needs .* Lower size=4"):
        MHATokenToKVPool(4, 4, torch.float16, 1, 2, 500_000)
    assert psutil.Process().memory_info().rss - before < 100 << 20


def test_a_host_pool_counts_its_per_layer_objects_before_it_is_built(monkeypatch):
    dev = MHATokenToKVPool(4, 4, torch.float16, 1, 1, 200_000)   # 0.8 GB of objects at most
    _limit_to(monkeypatch, 0.2)
    with pytest.raises(HostMemoryError, match=r"this MHA host pool \(200,000 layers\) needs"):
        host_pool_for(dev, "layer_first", host_size_tokens=4)


def test_the_round_trip_of_info_counts_per_layer_objects(monkeypatch):
    _limit_to(monkeypatch, 0.5)
    res = CliRunner().invoke(main, ["info", "--kind", "mla", "--layers", "1000000", "--kv-lora-rank", "1",
                                    "--roundtrip", "--roundtrip-tokens", "64"])
    _one_line_error(res, 2, "of a model of 1,000,000 layers needs")


# -- 5. tracebacks instead of one-line errors ------------------------------------------------

@pytest.mark.parametrize("args", [["info", "--reserve-gb", "1e308"], ["info", "--reserve-gb", "1e20"]])
def test_a_reserve_beyond_any_machine_is_a_usage_error(args):
    _one_line_error(CliRunner().invoke(main, args), 2, "is more than any machine has")


@pytest.mark.parametrize("env", [memory.RESERVE_ENV, memory.LIMIT_ENV])
def test_a_memory_setting_beyond_any_machine_is_named(env, monkeypatch):
    """OverflowError from int(1e300 * 1e9), from the CLI and from every pool constructor."""
    dev = MHATokenToKVPool(16, 4, torch.float16, 1, 4, 2)
    monkeypatch.setenv(env, "1e300")
    _one_line_error(CliRunner().invoke(main, ["info"]), 2, f"{env}='1e300' is more memory than a machine has")
    with pytest.raises(ValueError, match=f"{env}='1e300' is more memory"):
        host_pool_for(dev, "layer_first", host_size_tokens=16)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [
    ["info"],
    ["bench", "alloc", "--size", "4096", "--iters", "10", "--repeats", "1"],
    ["demo", "--clients", "1", "--rounds", "1", "--system-tokens", "8", "--user-tokens", "8", "--output-tokens", "2",
     "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--intermediate", "16", "--vocab", "32",
     "--layers", "1", "--device-tokens", "64", "--host-tokens", "128", "--modes", "tiers", "--plot", "",
     "--no-progress"],
])
def test_json_to_a_full_device_is_a_one_line_error(args):
    _one_line_error(CliRunner().invoke(main, [*args, "--json", "/dev/full"]), 1,
                    "cannot write --json /dev/full: No space left on device")


def test_an_allocator_too_large_for_memory_is_refused_by_name():
    """numpy's raw 'Unable to allocate 256. GiB for an array' came out of the constructor."""
    with pytest.raises(HostMemoryError, match=r"PageAllocator\(size=1,099,511,627,776, page_size=4\) needs .* "
                                              "Lower size, or raise page_size"):
        PageAllocator(2**40, 4)


def test_index_tensors_on_the_meta_device_are_named():
    """numpy's TypeError (or torch's NotImplementedError) came out of every index check."""
    from kvtier.cache import CacheConfig, HiCache
    from kvtier.transfer import TransferEngine
    dev = MHATokenToKVPool(64, 4, torch.float16, 1, 4, 2)
    host = host_pool_for(dev, "layer_first", host_size_tokens=64)
    meta = torch.arange(8, device="meta")
    calls = [lambda: host.backup_from_device_all_layer(dev, meta, meta),
             lambda: host.load_to_device_per_layer(dev, meta, meta, 0),
             lambda: host.free(meta), lambda: host.get_page_buffer_meta(meta),
             lambda: host.get_data_page(torch.tensor(0, device="meta")),
             lambda: TransferEngine(host).backup(meta, meta),
             lambda: PageAllocator(64, 4).free_pages(meta)]
    for call in calls:
        with pytest.raises(ValueError, match="on the 'meta' device, whose values kvtier cannot read"):
            call()
    cache = HiCache(dev, host, CacheConfig(page_size=4))
    for call in (lambda: cache.insert(list(range(8)), meta), lambda: cache.free_device(meta),
                 lambda: cache.match_prefix(meta)):
        with pytest.raises(ValueError, match="'meta' device"):
            call()
    cache.check()


# -- 6. smaller ------------------------------------------------------------------------------

def test_info_counts_capacity_in_whole_pages():
    """A page larger than memory printed '3,388,729,344 tokens (0 pages)'."""
    res = CliRunner().invoke(main, ["info", "--page-size", "99999999999999999999"])
    assert res.exit_code == 0 and "host tier capacity here: 0 tokens (0 pages of" in res.output, res.output
    res = CliRunner().invoke(main, ["info", "--page-size", "64", "--json", "-"])
    doc = json.loads(res.stdout)
    assert doc["host_capacity_tokens"] % 64 == 0


@pytest.mark.parametrize("args", [["info"], ["bench", "alloc", "--size", "4096", "--iters", "10", "--repeats", "1"],
                                  ["bench", "cache", "--sizes", "2000", "--prompts", "128", "--page-size", "16",
                                   "--repeats", "2"]])
def test_json_dash_writes_to_stdout_and_the_table_to_stderr(args, tmp_path, monkeypatch):
    """--json - wrote a file named '-'."""
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, [*args, "--json", "-"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) and res.stderr.strip() and not (tmp_path / "-").exists()
    assert "--json" in CliRunner().invoke(main, [*args[:2], "--help"]).output


def test_the_allocator_takes_integers_of_any_kind_but_not_bools():
    """PageAllocator(True, 1) was accepted and PageAllocator(np.int64(64), 4) refused."""
    with pytest.raises(ValueError, match="size must be an integer of at least one page .* got True"):
        PageAllocator(True, 1)
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        PageAllocator(64, True)
    a = PageAllocator(np.int64(64), np.int32(4))
    assert (a.size, a.page_size, type(a.size)) == (64, 4, int) and len(a.alloc(8)) == 8
    a.check()


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.complex128])
def test_device_pools_refuse_dtypes_that_hold_no_kv(dtype):
    with pytest.raises(ValueError, match=f"dtype {dtype} cannot hold KV values; use one of bf16"):
        MHATokenToKVPool(16, 4, dtype, 1, 4, 2)


def test_allocator_check_names_what_is_broken():
    from kvtier.validate import InvariantError
    a = PageAllocator(64, 4)
    pages = a.alloc_pages(5)
    a.free_pages(pages[1:3])
    a.check()
    a._free_pages += 1
    with pytest.raises(InvariantError, match="counts 14 free pages but 13 are not allocated"):
        a.check()
    a._free_pages -= 1
    a._allocated[0] = False
    with pytest.raises(InvariantError):
        a.check()
    with pytest.raises(AllocatorError):
        a.free_pages([99])
