"""Faults against real files: damaged pages, a full disk, a read-only directory, a writer killed
mid-batch, the directory gone. In every case: no crash, no wrong byte in a host page, the page
is a miss (recomputed by the cache), and a metric counts it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvtier.spec import KVSpec
from kvtier.storage.file import FileBackend, FileConfig
from kvtier.storage.format import PageCodec
from kvtier.storage.tier import TierConfig
from storage_testlib import blob_for, canonical_page, chain, file_tier, salt_of, slots_of, small_pools

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stored(tmp_path, n=4, **kw):
    """A tier over ``tmp_path`` holding ``n`` pages of a chain saved from one pool, and another pool
    (another layout) to prefetch them into."""
    _, (src, dst) = small_pools("mha", ("page_first", "layer_first"), page_size=4, pages=8)
    tier = file_tier(tmp_path, src, **kw)
    keys = chain(n)
    assert tier.save(keys, None, src, slots_of(range(n), 4)) == n and tier.flush(10)
    return tier, src, dst, keys


def _prefetch_checked(tier, src, dst, keys, expect_ready: int):
    """Prefetch into pages 4.. of ``dst``; the ready pages hold the source bytes, the others are untouched."""
    before = [canonical_page(dst, 4 + i) for i in range(len(keys))]
    h = tier.prefetch(keys, dst, slots_of(range(4, 4 + len(keys)), 4))
    assert h.wait(10) == expect_ready and h.done()
    for i in range(len(keys)):
        want = canonical_page(src, i) if i < expect_ready else before[i]
        assert canonical_page(dst, 4 + i) == want, i
    return h


def _damage(path: str, how: str, tier, keys) -> None:
    if how == "flipped":
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
    elif how == "truncated":
        os.truncate(path, os.path.getsize(path) - 100)
    elif how == "zero_length":
        os.truncate(path, 0)
    elif how == "foreign_salt":   # a page of another model under this key (a copied or misdirected file)
        codec = PageCodec(salt_of(_Shape(tier.salt.spec, tier.salt.page_size), "another/model"))
        with open(path, "wb") as f:
            f.write(codec.encode(bytes(codec.payload_bytes), tier.keys([keys[2]])[0]))
    elif how == "wrong_key":      # another page of this chain under this key
        with open(tier.backend.path_of(tier.keys([keys[0]])[0]), "rb") as f:
            other = f.read()
        with open(path, "wb") as f:
            f.write(other)


class _Shape:
    """What ``salt_of`` reads of a pool: its spec and page size."""

    def __init__(self, spec, page_size: int):
        self.spec, self.page_size = spec, page_size


SMALL_SPEC_POOL = _Shape(KVSpec("mla", 2, torch.bfloat16, kv_lora_rank=64, qk_rope_head_dim=0), 16)
KILL_SALT = salt_of(_Shape(KVSpec("mla", 16, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64), 32))  # 576 KiB


REASONS = {"flipped": "corrupt_pages_total.corrupt", "truncated": "corrupt_pages_total.short",
           "zero_length": "corrupt_pages_total.short", "foreign_salt": "foreign_pages_total",
           "wrong_key": "corrupt_pages_total.wrong_key"}


@pytest.mark.parametrize("how", sorted(REASONS))
def test_a_damaged_page_is_a_counted_miss_and_nothing_after_it_is_loaded(tmp_path, how):
    tier, src, dst, keys = _stored(tmp_path)
    _damage(tier.backend.path_of(tier.keys([keys[2]])[0]), how, tier, keys)
    assert tier.lookup(keys) == 4          # the index still lists it: the read finds it out
    h = _prefetch_checked(tier, src, dst, keys, expect_ready=2)
    snap = tier.metrics.snapshot()
    assert snap[REASONS[how]] == 1 and h.outcome == "partial" and snap["prefetches_total.partial"] == 1
    assert sum(v for k, v in snap.items() if k.startswith(("corrupt_pages", "foreign_pages"))) == 1
    # The rejected page is gone from the store: the next lookup stops before it, the next save rewrites it.
    assert tier.lookup(keys) == 2
    assert tier.save(keys, None, src, slots_of(range(4), 4)) == 4 and tier.flush(10)
    _prefetch_checked(tier, src, dst, keys, expect_ready=4)
    tier.close()


def _mount(*args: str) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def _umount(path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys
    sys.path[:0] = [{tests!r}, {storage!r}]
    from kvtier.storage.file import FileBackend, FileConfig
    from storage_testlib import blob_for, chain, salt_of
    from test_storage_faults import SMALL_SPEC_POOL
    mode, path = sys.argv[1], sys.argv[2]
    salt = salt_of(SMALL_SPEC_POOL)
    items = [blob_for(salt, c, seed=i) for i, c in enumerate(chain(6))]
    if mode == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(items[0][2]) // 2,) * 2)
    elif mode == "nobody":
        os.setgid(65534); os.setuid(65534)
    b = FileBackend(FileConfig(path, 1 << 30, io_threads=2))
    ok = b.put([k for k, _, _ in items], [blob for _, _, blob in items])
    bufs = [bytearray(len(items[0][2])) for _ in items]
    got = b.get_into([k for k, _, _ in items], [memoryview(x) for x in bufs])
    print(json.dumps({{"ok": ok, "exists": b.exists([k for k, _, _ in items]), "errors": b.errors,
                      "pages": b.usage().pages, "read": [n == len(x) and bytes(x) == items[i][2]
                                                         for i, (x, n) in enumerate(zip(bufs, got))]}}))
""").format(tests=os.path.join(ROOT, "tests"), storage=os.path.join(ROOT, "tests", "storage"))


def _child(mode: str, path) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, mode, str(path)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _files(path) -> list[str]:
    return [f for _, _, fs in os.walk(path) for f in fs]


def test_a_full_disk_fails_the_puts_that_do_not_fit_and_leaves_no_trace(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    salt = salt_of(SMALL_SPEC_POOL)
    blob_bytes = PageCodec(salt).blob_bytes
    if not _mount("-t", "tmpfs", "-o", f"size={6 * blob_bytes}", "tmpfs", str(small)):
        out = _child("fsize", small)   # no mounts here: a file-size limit in a child refuses writes as for real
        assert out["ok"] == [False] * 6 and out["exists"] == 0 and out["pages"] == 0 and "EFBIG" in out["errors"]
        assert _files(small) == []
        return
    try:
        b = FileBackend(FileConfig(small, 1 << 30))
        items = [blob_for(salt, c, seed=i) for i, c in enumerate(chain(12))]
        ok = [b.put([k], [blob])[0] for k, _, blob in items]
        first_fail = ok.index(False)
        assert first_fail >= 1 and "ENOSPC" in b.errors
        # A failed put leaves nothing: no temporary file, no key; every file on disk is a page the index holds.
        assert all(f.endswith(".kvp") for f in _files(small)) and len(_files(small)) == b.usage().pages
        assert b.exists([items[first_fail][0]]) == 0
        # Full: the store lowered its limit to what it held, so later puts evict the oldest pages to make room.
        assert ok[first_fail + 1:].count(True) >= 1 and b.exists([items[-1][0]]) == int(ok[-1])
        bufs = [bytearray(blob_bytes) for _ in items]
        got = b.get_into([k for k, _, _ in items], [memoryview(x) for x in bufs])
        assert sum(n > 0 for n in got) == b.usage().pages
        for (k, _, blob), n, x in zip(items, got, bufs):
            assert n == -1 or bytes(x) == blob
        b.close()
    finally:
        _umount(small)


def test_a_read_only_directory_refuses_puts_and_still_serves_reads(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    for p in (ro, *ro.parents):     # pytest's temporary directories are 0700: let another user in
        if str(p) in ("/", "/tmp"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o755)
    salt = salt_of(SMALL_SPEC_POOL)
    items = [blob_for(salt, c, seed=i) for i, c in enumerate(chain(6))]
    writer = FileBackend(FileConfig(ro, 1 << 30))
    assert writer.put([k for k, _, _ in items[:3]], [b for _, _, b in items[:3]]) == [True] * 3
    writer.close()
    if _mount("--bind", str(ro), str(ro)):
        try:
            assert _mount("-o", "remount,bind,ro", str(ro))
            b = FileBackend(FileConfig(ro, 1 << 30))
            assert b.put([k for k, _, _ in items], [blob for _, _, blob in items]) == [False] * 6
            assert "EROFS" in b.errors and b.exists([k for k, _, _ in items]) == 3
            bufs = [bytearray(len(items[0][2])) for _ in range(3)]
            b.get_into([k for k, _, _ in items[:3]], [memoryview(x) for x in bufs])
            assert [bytes(x) for x in bufs] == [blob for _, _, blob in items[:3]]
        finally:
            _umount(ro)
    else:
        out = _child("nobody", ro)    # no mounts here: another user of a root-owned directory
        assert out["ok"] == [False] * 3 + [False] * 3 and out["exists"] == 3 and "EACCES" in out["errors"]
        assert out["read"] == [True] * 3 + [False] * 3
    assert all(f.endswith(".kvp") for f in _files(ro)) and len(_files(ro)) == 3


KILLED = textwrap.dedent("""
    import sys
    sys.path[:0] = [{tests!r}, {storage!r}]
    from kvtier.storage.file import FileBackend, FileConfig
    from storage_testlib import blob_for, chain
    from test_storage_faults import KILL_SALT
    b = FileBackend(FileConfig(sys.argv[1], 1 << 30, io_threads=4))
    batches = [[blob_for(KILL_SALT, c, seed=i) for i, c in enumerate(chain(16, tag=tag))] for tag in range(4)]
    for round in range(10**6):
        items = batches[round % 4]
        b.put([k for k, _, _ in items], [blob for _, _, blob in items])
""").format(tests=os.path.join(ROOT, "tests"), storage=os.path.join(ROOT, "tests", "storage"))


def _kill_mid_batch(path) -> bool:
    """Run a writer of batch after batch and SIGKILL it as soon as a page is being written once
    some page is whole: True where it died with a write in flight (a temporary file left behind)."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(path)], stdout=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            files = _files(path)
            if any(f.endswith(".tmp") for f in files) and any(f.endswith(".kvp") for f in files):
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    return any(f.endswith(".tmp") for f in _files(path))


def test_a_writer_killed_mid_batch_leaves_a_consistent_store_that_loads_nothing_wrong(tmp_path):
    assert any(_kill_mid_batch(tmp_path) for _ in range(8)), "never caught the writer in the middle of a batch"
    b = FileBackend(FileConfig(tmp_path, 1 << 30))
    files = _files(tmp_path)
    assert all(f.endswith(".kvp") for f in files), [f for f in files if not f.endswith(".kvp")]
    u = b.usage()
    assert u.pages == len(files) > 0 and u.used_bytes == sum(
        os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(tmp_path) for f in fs)
    codec = PageCodec(KILL_SALT)
    loaded = 0
    for tag in range(4):
        for i, c in enumerate(chain(16, tag=tag)):
            key, payload, _ = blob_for(KILL_SALT, c, seed=i)
            if b.exists([key]):
                buf = bytearray(codec.blob_bytes)
                n = b.get_into([key], [memoryview(buf)])[0]
                assert bytes(codec.verify(buf, n, key)) == payload
                loaded += 1
    assert loaded == u.pages


def test_a_store_whose_directory_is_gone_is_skipped_then_used_again(tmp_path):
    d = tmp_path / "store"
    tier, src, dst, keys = _stored(d, tier=TierConfig(health_interval_s=0.05))
    os.rename(d, tmp_path / "moved")
    assert tier.lookup(keys) == 0 and not tier.healthy()
    assert tier.save(keys, None, src, slots_of(range(4), 4)) == 0
    h = tier.prefetch(keys, dst, slots_of(range(4, 8), 4))
    assert h.wait(5) == 0 and h.outcome == "failed"
    snap = tier.metrics.snapshot()
    assert snap["store_errors_total"] == 1 and snap["save_dropped_pages_total.down"] == 4 and snap["up"] == 0
    os.rename(tmp_path / "moved", d)
    deadline = time.monotonic() + 5
    while not tier.healthy() and time.monotonic() < deadline:
        tier.lookup(keys)   # a call while down starts a background probe once the interval has passed
        time.sleep(0.02)
    assert tier.healthy() and tier.lookup(keys) == 4
    _prefetch_checked(tier, src, dst, keys, expect_ready=4)
    tier.close()
