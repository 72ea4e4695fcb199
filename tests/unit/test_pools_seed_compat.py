"""Calls as SGLang-style engines and their storage backends make them, each of which kvtier
refused or got wrong before (a review, 2026-12-04), and the refusals that went with them.

The engine's own device pools are stood in for by :class:`EnginePool`: the attributes a
SGLang-style pool has (``size``, ``page_size``, ``k_buffer``/``kv_buffer``/``index_k_buffer``
lists of per-layer tensors ...), with ``size + page_size`` rows a layer as those engines
allocate them (their paged allocator hands out pages 1 .. size/page_size, so the last page's
slots lie past ``size``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier import DSATokenToKVPoolHost, MHATokenToKVPool, MHATokenToKVPoolHost, MLATokenToKVPoolHost
from kvtier.allocator import AllocatorError, PageAllocator
from kvtier.spec import KVSpec
from kvtier_testlib import fill_random, make_device_pool, make_host_pool


class EnginePool:
    """A SGLang-style device pool: per-layer buffers of ``size + page_size`` rows."""

    def __init__(self, kind, size, page_size, layers=2, index_k_row_bytes=None, seed=0):
        gen = torch.Generator().manual_seed(seed)
        rows = size + page_size
        self.size, self.page_size, self.layer_num = size, page_size, layers
        self.dtype = self.store_dtype = torch.bfloat16
        self.device = torch.device("cpu")

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(torch.bfloat16)
        if kind == "mha":
            self.head_num, self.head_dim = 2, 8
            self.k_buffer = [rand(rows, 2, 8) for _ in range(layers)]
            self.v_buffer = [rand(rows, 2, 8) for _ in range(layers)]
            return
        self.kv_lora_rank, self.qk_rope_head_dim = 32, 16
        self.kv_buffer = [rand(rows, 1, 48) for _ in range(layers)]
        if kind == "dsa":
            self.index_head_dim, self.quant_method = 128, "per_tensor"
            self.index_k_row_bytes = index_k_row_bytes
            self.index_k_buffer = [torch.randint(0, 256, (rows, index_k_row_bytes), dtype=torch.uint8, generator=gen)
                                   for _ in range(layers)]


def test_page_calls_take_a_tensor_index_as_storage_backends_pass_it():
    """``get_data_page(host_indices[i * page_size])``: a 0-d tensor, as SGLang's backends call it."""
    dev = make_device_pool("mha", 64, 4, torch.bfloat16, 2)
    fill_random(dev, 1)
    host = make_host_pool(dev, "page_first", 64)
    h = host.alloc(8)
    host.backup_from_device_all_layer(dev, h, torch.arange(8), "direct")
    page = host.get_data_page(h[4], flat=True)
    raw = page.view(torch.uint8)     # random bytes: bf16 NaNs compare unequal
    assert torch.equal(raw, host.get_data_page(int(h[4])).view(torch.uint8))
    host.set_from_flat_data_page(h[0], page)
    assert torch.equal(host.get_data_page(int(h[0])).view(torch.uint8), raw)
    for bad in (torch.tensor(4.0), torch.tensor(True), True, 4.0):
        with pytest.raises(ValueError, match="integer token index"):
            host.get_data_page(bad)


@pytest.mark.parametrize("kind", ["mha", "dsa"])
def test_the_last_page_of_an_engine_pool_moves(kind):
    """Its slots lie past ``size``: they were refused as outside the pool."""
    ps = 4
    pool = EnginePool(kind, 32, ps, index_k_row_bytes=132)
    cls = MHATokenToKVPoolHost if kind == "mha" else DSATokenToKVPoolHost
    host = cls(pool, 0, 0, ps, "layer_first", host_size_tokens=64)
    h = host.alloc(ps)
    last = torch.arange(32, 32 + ps)
    host.backup_from_device_all_layer(pool, h, last, "direct")
    bufs = ("k_buffer", "v_buffer") if kind == "mha" else ("kv_buffer", "index_k_buffer")
    host_of = {"k_buffer": lambda: host.k_buffer, "v_buffer": lambda: host.v_buffer,
               "kv_buffer": lambda: host.kv_buffer, "index_k_buffer": lambda: host.index_k_buffer}
    for name in bufs:
        for layer in range(pool.layer_num):
            assert torch.equal(host_of[name]()[layer][h], getattr(pool, name)[layer][last]), (name, layer)
    with pytest.raises(ValueError, match=r"outside the device pool's slots 0\.\.35"):
        host.backup_from_device_all_layer(pool, h, last + ps, "direct")


def test_dsa_host_rows_follow_the_engines_index_k_format():
    """An engine keeping index-K as 128 bf16 values (256 B rows, not FP8 + scales' 132): the host
    rows were sized 132 and the first backup failed on a reshape."""
    ps = 4
    pool = EnginePool("dsa", 32, ps, index_k_row_bytes=256)
    host = DSATokenToKVPoolHost(pool, 0, 0, ps, "layer_first", host_size_tokens=32)
    assert host.index_k_row_bytes == 256 and host.index_k_buffer.shape[-1] == 256
    assert host.get_size_per_token() == (48 * 2 + 256) * pool.layer_num
    h, d = host.alloc(2 * ps), torch.arange(ps, 3 * ps)
    host.backup_from_device_all_layer(pool, h, d, "direct")
    for layer in range(pool.layer_num):
        assert torch.equal(host.index_k_buffer[layer][h], pool.index_k_buffer[layer][d])
    assert len(host.get_data_page(int(h[0])).view(torch.uint8)) == ps * host.get_size_per_token()
    assert "256 B rows" in host.spec.describe()
    # The FP8 format's pools keep their L3 keys: the salt names the width only where it is not that.
    fp8 = KVSpec("dsa", 2, kv_lora_rank=32, qk_rope_head_dim=16, index_head_dim=128)
    assert b"index_k_bytes" not in fp8.salt("layer_first", ps)
    assert host.spec.salt("layer_first", ps) != fp8.salt("layer_first", ps)


@pytest.mark.parametrize("kind", ["mla", "dsa"])
def test_ksize_per_token_is_every_byte_of_a_token_for_latent_pools(kind):
    """Storage backends size a page as get_ksize_per_token() x page_size (the seed's MLA returns
    get_size_per_token(), which DSA's includes index-K in); kvtier's DSA left index-K out."""
    dev = make_device_pool(kind, 32, 4, torch.bfloat16, 2)
    host = make_host_pool(dev, "layer_first", 32)
    assert host.get_ksize_per_token() == host.get_size_per_token()
    assert host.get_ksize_per_token() * 4 == host.get_data_page(0).numel() * host.get_data_page(0).element_size()


def test_fp8_pools_cast_what_they_are_given_and_refuse_a_wrong_shape_before_writing():
    """A bf16 value into an FP8 pool was stored as its bf16 bytes reinterpreted (1.0 read back
    as [-0.0, 1.875, ...]); a full-width MHA row failed in a broadcast."""
    mla = make_device_pool("mla", 8, 1, torch.float8_e4m3fn, 1, lora=6, rope=2)
    kv = torch.full((2, 1, 8), 1.5, dtype=torch.bfloat16)
    mla.set_kv_buffer(0, torch.tensor([1, 3]), kv)
    got = mla.kv_buffer[0][torch.tensor([1, 3])].view(torch.float8_e4m3fn).float()
    assert torch.equal(got, torch.full((2, 1, 8), 1.5))
    mha = MHATokenToKVPool(8, 1, torch.float8_e4m3fn, 2, 8, 1, "cpu")
    k = torch.full((4, 2, 8), -2.0, dtype=torch.bfloat16)
    mha.set_kv_buffer(0, torch.arange(4), k, k)
    assert torch.equal(mha.k_buffer[0][:4].view(torch.float8_e4m3fn).float(), torch.full((4, 2, 8), -2.0))
    before = mha.k_buffer[0].clone()
    with pytest.raises(ValueError, match=r"k has shape \(4, 2, 4\); 4 slots of this pool take \(4, 2, 8\)"):
        mha.set_kv_buffer(0, torch.arange(4, 8), k[..., :4], k[..., :4])
    assert torch.equal(mha.k_buffer[0], before)


def test_numpy_integers_are_integers_and_inf_is_no_size():
    dev = make_device_pool("mha", 64, 4, torch.bfloat16, 2)
    host = MHATokenToKVPoolHost(dev, 0, 0, np.int64(4), "layer_first", host_size_tokens=np.int64(64))
    assert host.size == 64 and type(host.page_size) is int
    spec = KVSpec("mla", np.int64(2), kv_lora_rank=np.int32(32), qk_rope_head_dim=np.int64(16))
    assert spec == KVSpec("mla", 2, kv_lora_rank=32, qk_rope_head_dim=16)
    assert spec.salt("layer_first", 4) == KVSpec("mla", 2, kv_lora_rank=32, qk_rope_head_dim=16).salt("layer_first", 4)
    for name, kw in (("host_size_tokens", {"host_size_tokens": float("inf")}), ("host_size", {"host_size": float("inf")}),
                     ("host_to_device_ratio", {"host_to_device_ratio": float("inf")})):
        args = {"host_to_device_ratio": 0, "host_size": 0, **kw}
        with pytest.raises(ValueError, match=f"{name} must be a non-negative finite number, got inf"):
            MLATokenToKVPoolHost(make_device_pool("mla", 32, 4, torch.bfloat16, 2), args["host_to_device_ratio"],
                                 args["host_size"], 4, "layer_first", host_size_tokens=kw.get("host_size_tokens", 0))


@pytest.mark.parametrize("rope", [16.0, True, -1])
def test_a_rope_dim_that_is_no_count_is_refused(rope):
    """16.0 was taken (bytes_per_token 192.0, and L3 keys other than for 16); True as 1."""
    with pytest.raises(ValueError, match=f"qk_rope_head_dim must be an integer >= 0, got {rope!r}"):
        KVSpec("mla", 2, kv_lora_rank=32, qk_rope_head_dim=rope)


def test_index_k_bytes_is_for_dsa_and_a_count():
    with pytest.raises(ValueError, match="index_k_bytes is for DSA specs only"):
        KVSpec("mla", 2, kv_lora_rank=32, index_k_bytes=256)
    with pytest.raises(ValueError, match="index_k_bytes must be an integer >= 0, got -1"):
        KVSpec("dsa", 2, kv_lora_rank=32, index_head_dim=128, index_k_bytes=-1)


def test_the_allocator_refuses_a_bool_count_and_a_0d_index():
    a = PageAllocator(64, 4)
    with pytest.raises(AllocatorError, match="need_size must be a non-negative integer, got True"):
        a.alloc(True)
    with pytest.raises(AllocatorError, match="num_pages must be a non-negative integer, got True"):
        a.alloc_pages(True)
    with pytest.raises(AllocatorError, match=r"indices must be one-dimensional, got shape \(\)"):
        a.free(torch.tensor(3))
    with pytest.raises(AllocatorError, match="must be an integer tensor, got dtype torch.complex64"):
        a.free(torch.tensor([1 + 2j, 3j, 1j, 2j]))
    assert a.available_size() == 64


def test_free_slots_lists_the_free_token_slots_as_the_seed_did():
    dev = make_device_pool("mla", 64, 4, torch.bfloat16, 2)
    host = make_host_pool(dev, "layer_first", 64)
    assert torch.equal(host.free_slots, torch.arange(64))
    h = host.alloc(8)
    assert torch.equal(host.free_slots, torch.arange(8, 64)) and len(host.free_slots) == host.available_size()
    host.free(h)
    assert len(host.free_slots) == 64


def test_an_unsupported_layout_is_also_the_seeds_not_implemented_error():
    """The seed raised NotImplementedError for DSA's page_first; a caller catching it to fall back
    to layer_first still does."""
    dev = make_device_pool("dsa", 32, 4, torch.bfloat16, 2)
    with pytest.raises(NotImplementedError, match="not supported for DSA"):
        make_host_pool(dev, "page_first", 32)
    with pytest.raises(ValueError, match="not supported for DSA"):
        make_host_pool(dev, "page_first", 32)


# -- a second review against the seed (2026-12-04, later): each failed before its fix -------

def test_a_page_of_another_float_dtype_is_converted_and_one_of_integers_refused():
    """A float16 page into a bf16 pool was written as its bytes (1.5 read back as 0.125), as
    was an int16 one; the seed converted the values. Raw bytes (uint8) still go as they are."""
    dev = make_device_pool("mha", 64, 4, torch.bfloat16, 2)
    host = make_host_pool(dev, "page_first", 64)
    n = host.get_data_page(0).numel()
    host.set_from_flat_data_page(0, torch.full((n,), 1.5, dtype=torch.float16))
    assert torch.equal(host.get_data_page(0), torch.full((n,), 1.5, dtype=torch.bfloat16))
    before = host.get_data_page(4).clone()
    with pytest.raises(ValueError, match="data_page has dtype torch.int16; a page of this pool is torch.bfloat16"):
        host.set_from_flat_data_page(4, torch.full((n,), 7, dtype=torch.int16))
    assert torch.equal(host.get_data_page(4), before)
    host.set_from_flat_data_page(4, host.get_data_page(0).view(torch.uint8))
    assert torch.equal(host.get_data_page(4), host.get_data_page(0))
    fp8 = make_host_pool(make_device_pool("mla", 64, 4, torch.float8_e4m3fn, 2, lora=6, rope=2), "page_first", 64)
    m = fp8.get_data_page(0).numel()
    with pytest.raises(ValueError, match="a page of this pool is torch.uint8"):
        fp8.set_from_flat_data_page(0, torch.ones(m // 2, dtype=torch.bfloat16))   # the same bytes, not FP8
    fp8.set_from_flat_data_page(0, torch.full((m,), 2.0).to(torch.float8_e4m3fn))  # FP8 values: its bytes
    assert (fp8.get_data_page(0).view(torch.float8_e4m3fn).float() == 2.0).all()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_transfers_follow_device_buffers_the_engine_replaced(kind):
    """The device pool's per-layer tensors were read once, at the first transfer: after the
    engine rebuilt them, loads went to the old tensors (the seed read them at every call).
    A replacement of another width is refused by name."""
    pool = EnginePool(kind, 32, 4)
    cls = MHATokenToKVPoolHost if kind == "mha" else MLATokenToKVPoolHost
    host = cls(pool, 0, 0, 4, "layer_first", host_size_tokens=64)
    h = host.alloc(4)
    host.backup_from_device_all_layer(pool, h, torch.arange(4), "direct")
    names = ("k_buffer", "v_buffer") if kind == "mha" else ("kv_buffer",)
    old = {n: [t.clone() for t in getattr(pool, n)] for n in names}
    for n in names:
        setattr(pool, n, [torch.zeros_like(t) for t in getattr(pool, n)])
    for layer in range(pool.layer_num):
        host.load_to_device_per_layer(pool, h, torch.arange(8, 12), layer, "direct")
    for n in names:
        for layer in range(pool.layer_num):
            assert torch.equal(getattr(pool, n)[layer][8:12], old[n][layer][:4]), (n, layer)
    getattr(pool, names[0])[1] = torch.zeros(36, 3, dtype=torch.bfloat16)   # one layer, in place, narrower
    with pytest.raises(ValueError, match=f"device pool's {names[0]} holds 2 layers of \\[6, "):
        host.load_to_device_per_layer(pool, h, torch.arange(8, 12), 0, "direct")


def test_too_little_host_memory_is_also_the_seeds_value_error(monkeypatch):
    """The seed raised ValueError for a host pool too large, and engines catch it to retry
    smaller; kvtier's MemoryError escaped that."""
    import psutil

    from kvtier import memory
    # 1 GB beyond what this process (and the pools it promised) holds already, wherever in a suite it runs
    held = psutil.Process().memory_info().rss + memory.promised_bytes()
    monkeypatch.setenv(memory.LIMIT_ENV, f"{held / memory.GB + 1:.3f}")
    monkeypatch.setenv(memory.RESERVE_ENV, "0")
    dev = make_device_pool("mha", 64, 4, torch.bfloat16, 2)
    try:
        host = MHATokenToKVPoolHost(dev, 0, 10_000, 4, "page_first")
    except ValueError as e:
        assert isinstance(e, MemoryError) and "needs 10000.00 GB of host memory" in str(e)
        host = MHATokenToKVPoolHost(dev, 0, 0, 4, "page_first", host_size_tokens=64)
    assert host.size == 64


def test_holding_the_pools_lock_holds_its_allocator():
    """The seed's alloc, free and clear ran under ``self.lock``; kvtier made the lock and never took it."""
    import threading
    host = make_host_pool(make_device_pool("mha", 64, 4, torch.bfloat16, 2), "page_first", 64)
    got = []
    with host.lock:
        t = threading.Thread(target=lambda: got.append(host.alloc(64)))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not got and host.available_size() == 64
    t.join()
    assert got[0].numel() == 64 and host.available_size() == 0


@pytest.mark.parametrize("kind", ["mha", "mla", "dsa"])
def test_an_init_kv_buffer_override_places_the_pool_in_its_tensors(kind):
    """Engines override the seed's ``init_kv_buffer`` to put host KV in memory of their own;
    kvtier never called it, so the override was silently ignored. Its tensor (and a DSA
    override's ``index_k_buffer``) is now the pool's storage; a misshapen one is refused."""
    pool = EnginePool(kind, 32, 4, index_k_row_bytes=132)
    base = {"mha": MHATokenToKVPoolHost, "mla": MLATokenToKVPoolHost, "dsa": DSATokenToKVPoolHost}[kind]
    mine = {}

    class Own(base):
        def init_kv_buffer(self):
            made = super().init_kv_buffer()
            mine["kv"] = torch.full_like(made, 7)
            if kind == "dsa":
                self.index_k_buffer = mine["index_k"] = torch.full_like(self.index_k_buffer, 9)
            return mine["kv"]
    host = Own(pool, 0, 0, 4, "layer_first", host_size_tokens=64)
    assert host.kv_buffer.data_ptr() == mine["kv"].data_ptr()
    if kind == "dsa":
        assert host.index_k_buffer.data_ptr() == mine["index_k"].data_ptr()
    h = host.alloc(4)
    host.backup_from_device_all_layer(pool, h, torch.arange(4), "direct")
    first = "k_buffer" if kind == "mha" else "kv_buffer"
    assert torch.equal(mine["kv"][0][0][h] if kind == "mha" else mine["kv"][0][h], getattr(pool, first)[0][:4])
    if kind == "dsa":
        assert torch.equal(mine["index_k"][0][h], pool.index_k_buffer[0][:4])

    class Wrong(base):
        def init_kv_buffer(self):
            return torch.zeros(3, dtype=super().init_kv_buffer().dtype)
    with pytest.raises(ValueError, match=r"init_kv_buffer\(\) gave kv_buffer as torch.bfloat16 \(3,\) on cpu; this pool's "
                                         r"layer_first layout needs a contiguous CPU tensor"):
        Wrong(pool, 0, 0, 4, "layer_first", host_size_tokens=64)

    class Padded(base):
        def get_size_per_token(self):
            return super().get_size_per_token() + 64
    with pytest.raises(ValueError, match=r"get_size_per_token\(\) gives .* a padded or other token size is not supported"):
        Padded(pool, 0, 0, 4, "layer_first", host_size_tokens=64)


def test_a_bad_device_pool_device_or_layer_id_is_named():
    """device='bogus' gave torch's own parse error, device_pool=None an AttributeError, and a
    layer_id of True was layer 1 (a 0-d tensor, as get_data_page takes, was refused)."""
    dev = make_device_pool("mha", 64, 4, torch.bfloat16, 2)
    with pytest.raises(ValueError, match="device must be 'cpu', got 'bogus'"):
        MHATokenToKVPoolHost(dev, 0, 0, 4, "page_first", "bogus", host_size_tokens=64)
    with pytest.raises(TypeError, match="device_pool must be a device KV pool .* got NoneType"):
        MHATokenToKVPoolHost(None, 0, 0, 4, "page_first", host_size_tokens=64)
    host = make_host_pool(dev, "page_first", 64)
    h = host.alloc(4)
    for bad in (True, 1.0, torch.tensor(1.0), 2):
        with pytest.raises(ValueError, match=r"layer_id must be an integer in 0\.\.1"):
            host.load_to_device_per_layer(dev, h, torch.arange(4), bad, "direct")
    host.load_to_device_per_layer(dev, h, torch.arange(4), torch.tensor(1), "direct")


def test_a_pool_not_yet_written_still_counts_against_the_next(monkeypatch):
    """Pageable memory is taken as it is first written, so the OS's figures did not show a pool
    made but not yet filled: a second pool could be promised the same memory (the seed's check
    too), and both failed later in the OOM killer. Such pools' unwritten bytes now count."""
    import gc

    from kvtier import memory
    gc.collect()                                                       # earlier tests' pools, if any
    monkeypatch.setenv(memory.RESERVE_ENV, "0")
    dev = make_device_pool("mha", 64, 4, torch.bfloat16, 2)
    free = memory.host_memory().available
    before = memory.promised_bytes()
    monkeypatch.setenv(memory.LIMIT_ENV, str((memory.psutil.Process().memory_info().rss + 0.5e9) / 1e9))
    per_token = dev.spec.bytes_per_token
    tokens = int(0.3e9) // per_token // 4 * 4                          # 0.3 GB, never written
    first = MHATokenToKVPoolHost(dev, 0, 0, 4, "page_first", host_size_tokens=tokens, pin_memory=False)
    assert memory.promised_bytes() - before >= 0.3e9 - 4096 and free > 0.6e9
    with pytest.raises(MemoryError, match=r"needs 0\.30 GB of host memory but only 0\.[012]\d GB"):
        MHATokenToKVPoolHost(dev, 0, 0, 4, "page_first", host_size_tokens=tokens, pin_memory=False)
    first.kv_buffer.view(torch.uint8).view(-1).fill_(1)               # written: in RSS now, no longer promised
    assert memory.promised_bytes() - before < 0.01e9
    del first
    MHATokenToKVPoolHost(dev, 0, 0, 4, "page_first", host_size_tokens=tokens, pin_memory=False)


def test_the_seeds_module_level_names_are_there():
    """``synchronized``, ``get_available_host_memory_bytes`` and ``get_cgroup_memory_limit_and_current``,
    which subclasses and engines import from the seed's module, were missing."""
    from kvtier import host_pool, memory
    avail, host_avail, cg = host_pool.get_available_host_memory_bytes(0)
    mem = memory.host_memory(0)
    assert abs(host_avail - mem.host_available) < 0.5e9 and abs(avail - mem.available) < 0.5e9
    assert (cg is None) == (host_pool.get_cgroup_memory_limit_and_current() is None)

    class Counted(MHATokenToKVPoolHost):
        @host_pool.synchronized
        def held(self):
            return self.lock._is_owned()
    host = Counted(make_device_pool("mha", 64, 4, torch.bfloat16, 2), 0, 0, 4, "page_first", host_size_tokens=64)
    assert host.held() and not host.lock._is_owned()


@pytest.mark.parametrize("kind", ["mha", "mla", "dsa"])
def test_a_seed_style_override_finds_the_seeds_attributes(kind):
    """The seed's subclasses build their buffer from head_num/head_dim or kv_lora_rank +
    qk_rope_head_dim, and size a token from them; those were set only after the hooks ran
    (AttributeError: no attribute 'head_num')."""
    pool = EnginePool(kind, 32, 4, index_k_row_bytes=132)
    base = {"mha": MHATokenToKVPoolHost, "mla": MLATokenToKVPoolHost, "dsa": DSATokenToKVPoolHost}[kind]

    class SeedStyle(base):
        def get_size_per_token(self):
            if kind == "mha":
                per = self.head_num * self.head_dim * self.dtype.itemsize * self.layer_num * 2
            else:
                per = (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype.itemsize * self.layer_num
            return per + (self.index_k_row_bytes * self.layer_num if kind == "dsa" else 0)

        def init_kv_buffer(self):
            if kind == "mha":
                dims = (2, self.layer_num, self.size, self.head_num, self.head_dim)
            else:
                dims = (self.layer_num, self.size, 1, self.kv_lora_rank + self.qk_rope_head_dim)
            return torch.zeros(dims, dtype=self.dtype)
    host = SeedStyle(pool, 0, 0, 4, "layer_first", host_size_tokens=64)
    assert host.size_per_token == pool.layer_num * (64 if kind == "mha" else 96 + (132 if kind == "dsa" else 0))
    h = host.alloc(4)
    host.backup_from_device_all_layer(pool, h, torch.arange(4), "direct")
    first = "k_buffer" if kind == "mha" else "kv_buffer"
    assert torch.equal(getattr(host, first)[0][h].reshape(4, -1), getattr(pool, first)[0][:4].reshape(4, -1))


def test_an_override_returning_the_pools_own_buffer_keeps_it_as_it_was():
    """Taken back as the kept buffer, the pool's own tensor kept its huge-page advice but its
    buffer said it had none (a review)."""
    pool = EnginePool("mla", 32, 4)

    class Same(MLATokenToKVPoolHost):
        def init_kv_buffer(self):
            return super().init_kv_buffer()
    host = Same(pool, 0, 0, 4, "layer_first", host_size_tokens=64, huge_pages=True)
    assert [b.huge_pages for b in host._buffers] == [True] and host.kv_buffer is host.component_tensors["kv"]
