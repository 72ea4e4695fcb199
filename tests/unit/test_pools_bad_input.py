"""Every refusal of the pools: a clear error, raised before anything is allocated or changed."""

from __future__ import annotations

import pytest
import torch

from kvtier import (
    DSATokenToKVPool, DSATokenToKVPoolHost, MHATokenToKVPool, MHATokenToKVPoolHost,
    MLATokenToKVPool, MLATokenToKVPoolHost,
)
from kvtier.memory import check_host_memory, host_memory, layer_objects_bytes
from kvtier_testlib import fill_host_random, fill_random, host_snapshot, make_device_pool, make_host_pool


@pytest.fixture
def mha():
    dev = MHATokenToKVPool(64, 4, torch.bfloat16, 3, 40, 2, "cpu")
    fill_random(dev, 1)
    host = MHATokenToKVPoolHost(dev, 0, 0, 4, "page_first", host_size_tokens=64)
    fill_host_random(host, 2)
    return dev, host


def unchanged(dev, host, dev_before, host_before):
    assert all(torch.equal(dev.stacks[n].view(torch.uint8), dev_before[n]) for n in dev_before)
    after = host_snapshot(host)
    assert all(torch.equal(after[n], host_before[n]) for n in host_before)


def snap(dev, host):
    return {n: s.view(torch.uint8).clone() for n, s in dev.stacks.items()}, host_snapshot(host)


# -- construction ----------------------------------------------------------------

@pytest.mark.parametrize("cls, pool_kind, layout, match", [
    (MLATokenToKVPoolHost, "mla", "page_head", r"'page_head' is not supported for MLA.*\['layer_first', 'page_first'\]"),
    (DSATokenToKVPoolHost, "dsa", "page_first", r"not supported for DSA.*\['layer_first'\]"),
    (MHATokenToKVPoolHost, "mha", "head_first", r"not supported for MHA"),
])
def test_unsupported_layout_names_the_valid_ones(cls, pool_kind, layout, match):
    dev = make_device_pool(pool_kind, 32, 4, torch.bfloat16, 2)
    with pytest.raises(ValueError, match=match):
        cls(dev, 2.0, 0, 4, layout)


@pytest.mark.parametrize("kwargs, match", [
    (dict(host_to_device_ratio=0, host_size=0, host_size_tokens=0), "no size"),
    (dict(host_to_device_ratio=-1, host_size=0), "host_to_device_ratio must be a non-negative"),
    (dict(host_to_device_ratio=1, host_size=-2), "host_size must be"),
    (dict(host_to_device_ratio=1, host_size=0, host_size_tokens=2.5), "whole number"),
    (dict(host_to_device_ratio=1, host_size=0, page_size=8), "differs from the device pool's page_size=4"),
    (dict(host_to_device_ratio=1, host_size=0, page_size=0), "page_size must be a positive integer"),
    (dict(host_to_device_ratio=1, host_size=0, device="cuda"), "device must be 'cpu'"),
])
def test_bad_sizes_are_refused(kwargs, match):
    dev = MHATokenToKVPool(32, 4, torch.bfloat16, 2, 16, 2, "cpu")
    args = dict(host_to_device_ratio=2.0, host_size=0, page_size=4, layout="layer_first")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MHATokenToKVPoolHost(dev, **args)


def test_wrong_kind_of_device_pool():
    dev = MLATokenToKVPool(32, 4, torch.bfloat16, 64, 16, 2, "cpu")
    with pytest.raises(TypeError, match="MHA host pool needs a MHA device pool"):
        MHATokenToKVPoolHost(dev, 2.0, 0, 4, "layer_first")


def test_too_large_a_pool_names_requested_and_available_gb_before_allocating():
    dev = MHATokenToKVPool(32, 4, torch.bfloat16, 8, 128, 32, "cpu")
    avail = host_memory(0).available
    tokens = int(avail // dev.spec.bytes_per_token * 4)
    with pytest.raises(MemoryError) as err:
        MHATokenToKVPoolHost(dev, 0, 0, 4, "layer_first", host_size_tokens=tokens, reserve_bytes=0)
    msg = str(err.value)
    assert "GB of host memory but only" in msg and "Shrink the pool" in msg and "KVTIER_HOST_RESERVE_GB" in msg
    # The pool asks for its data plus its per-layer objects (views, pointers, transfer parts).
    requested = -(-tokens // 4) * 4 * dev.spec.bytes_per_token + layer_objects_bytes(32, len(dev.spec.components))
    assert f"needs {requested / 1e9:.2f} GB" in msg


def test_reserve_is_honoured():
    dev = MHATokenToKVPool(32, 4, torch.bfloat16, 2, 16, 2, "cpu")
    total = host_memory(0).available
    with pytest.raises(MemoryError, match="in reserve"):
        MHATokenToKVPoolHost(dev, 0, 0, 4, "layer_first", host_size_tokens=64, reserve_bytes=total)
    with pytest.raises(MemoryError):
        check_host_memory(1, total + 1, "x")


def test_sizing_precedence_and_page_alignment(caplog):
    dev = MHATokenToKVPool(100, 8, torch.bfloat16, 2, 16, 2, "cpu")
    per_token = dev.spec.bytes_per_token
    by_tokens = MHATokenToKVPoolHost(dev, 3.0, 1.0, 8, "layer_first", host_size_tokens=20)
    assert by_tokens.size == 24 and by_tokens.page_num == 3          # tokens win, rounded up to pages
    by_gb = MHATokenToKVPoolHost(dev, 3.0, per_token * 17 / 1e9, 8, "layer_first")
    assert by_gb.size == 24                                         # then GB
    by_ratio = MHATokenToKVPoolHost(dev, 1.5, 0, 8, "layer_first")
    assert by_ratio.size == 152                                     # then ratio (150 -> 19 pages)
    exact = MHATokenToKVPoolHost(dev, 0, 0, 8, "layer_first", host_size_tokens=16)
    assert exact.size == 16                                         # no extra page when aligned
    assert "smaller than the device pool" in caplog.text
    caplog.clear()
    MHATokenToKVPoolHost(dev, 2.0, 0, 8, "layer_first")
    assert "smaller than the device pool" not in caplog.text


def test_device_pool_bad_arguments():
    with pytest.raises(ValueError, match="size must be a positive"):
        MHATokenToKVPool(0, 1, torch.bfloat16, 2, 16, 2, "cpu")
    with pytest.raises(ValueError, match="holds no whole page"):
        MHATokenToKVPool(3, 4, torch.bfloat16, 2, 16, 2, "cpu")
    with pytest.raises(ValueError, match="head_num must be a positive"):
        MHATokenToKVPool(16, 4, torch.bfloat16, 0, 16, 2, "cpu")
    with pytest.raises(ValueError, match="unknown KV dtype"):
        MHATokenToKVPool(16, 4, "int3", 2, 16, 2, "cpu")
    with pytest.raises(ValueError, match="multiple of 128"):
        DSATokenToKVPool(16, 4, torch.bfloat16, 64, 16, 2, "cpu", index_head_dim=100)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            MHATokenToKVPool(16, 4, torch.bfloat16, 2, 16, 2, "cuda")


# -- transfers ------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda d, h: h.backup_from_device_all_layer(d, torch.arange(4), torch.arange(8), "direct"), "must pair up"),
    (lambda d, h: h.backup_from_device_all_layer(d, torch.arange(60, 68), torch.arange(8), "direct"), "outside the host pool"),
    (lambda d, h: h.backup_from_device_all_layer(d, torch.arange(4), torch.arange(62, 66), "direct"), "outside the device pool"),
    (lambda d, h: h.backup_from_device_all_layer(d, torch.tensor([1, 1, 2, 3]), torch.arange(4), "direct"), "twice"),
    (lambda d, h: h.backup_from_device_all_layer(d, torch.arange(4.0), torch.arange(4), "direct"), "integer"),
    (lambda d, h: h.backup_from_device_all_layer(d, torch.arange(4), torch.arange(4), "dma2"), "unknown io_backend 'dma2'"),
    (lambda d, h: h.load_to_device_per_layer(d, torch.arange(4), torch.arange(4), 2, "direct"), "layer_id must be an integer in 0..1"),
    (lambda d, h: h.load_to_device_per_layer(d, torch.arange(4).view(2, 2), torch.arange(4), 0, "direct"), "one-dimensional"),
])
def test_bad_transfer_changes_nothing(mha, call, match):
    dev, host = mha
    before = snap(dev, host)
    with pytest.raises(ValueError, match=match):
        call(dev, host)
    unchanged(dev, host, *before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("backend", ["kernel", "dma"])
def test_gpu_backends_without_cuda_name_direct(mha, backend):
    dev, host = mha
    before = snap(dev, host)
    with pytest.raises(ValueError, match=f"io_backend='{backend}' needs a CUDA device pool.*io_backend='direct'"):
        host.backup_from_device_all_layer(dev, torch.arange(4), torch.arange(4), backend)
    unchanged(dev, host, *before)


def test_dsa_refuses_partial_pages_before_copying():
    dev = DSATokenToKVPool(64, 4, torch.bfloat16, 64, 16, 2, "cpu")
    fill_random(dev, 3)
    host = DSATokenToKVPoolHost(dev, 0, 0, 4, "layer_first", host_size_tokens=32)
    fill_host_random(host, 4)
    before = snap(dev, host)
    with pytest.raises(ValueError, match="block-split.*whole page"):
        host.backup_from_device_all_layer(dev, torch.arange(1, 5), torch.arange(4), "direct")
    with pytest.raises(ValueError, match="whole page"):
        host.load_to_device_per_layer(dev, torch.arange(4), torch.tensor([4, 5, 6, 8]), 0, "direct")
    unchanged(dev, host, *before)


def test_mismatched_device_pool_is_refused(mha):
    dev, host = mha
    other = MHATokenToKVPool(64, 4, torch.bfloat16, 3, 48, 2, "cpu")
    before = snap(dev, host)
    with pytest.raises(ValueError, match="does not match"):
        host.backup_from_device_all_layer(other, torch.arange(4), torch.arange(4), "direct")
    unchanged(dev, host, *before)


# -- pages --------------------------------------------------------------------------

@pytest.mark.parametrize("call, exc, match", [
    (lambda h: h.get_data_page(2), ValueError, "not the first slot of a page"),
    (lambda h: h.get_data_page(64), ValueError, "not the first slot of a page"),
    (lambda h: h.get_data_page(1.0), ValueError, "integer token index"),
    (lambda h: h.set_from_flat_data_page(4, torch.zeros(10, dtype=torch.bfloat16)), ValueError, "holds 20 bytes but a page"),
    (lambda h: h.set_from_flat_data_page(5, h.get_dummy_flat_data_page()), ValueError, "first slot of a page"),
    (lambda h: h.set_from_flat_data_page(4, [0] * 10), TypeError, "torch.Tensor"),
    (lambda h: h.get_page_buffer_meta(torch.arange(1, 5)), ValueError, "whole pages"),
    (lambda h: h.get_page_buffer_meta(torch.arange(6)), ValueError, "whole number of pages"),
])
def test_bad_page_calls_change_nothing(mha, call, exc, match):
    dev, host = mha
    before = snap(dev, host)
    with pytest.raises(exc, match=match):
        call(host)
    unchanged(dev, host, *before)


def test_dummy_page_needs_no_pinned_memory_and_matches_the_flat_page(mha):
    _, host = mha
    dummy = host.get_dummy_flat_data_page()
    page = host.get_data_page(0)
    assert dummy.shape == page.shape and dummy.dtype == page.dtype and not dummy.any()
    host.set_from_flat_data_page(8, dummy)
    assert not host.get_data_page(8).view(torch.uint8).any()


def test_dsa_flat_page_and_meta_include_index_k():
    dev = DSATokenToKVPool(32, 4, torch.bfloat16, 64, 16, 2, "cpu", index_head_dim=256)
    host = DSATokenToKVPoolHost(dev, 0, 0, 4, "layer_first", host_size_tokens=16)
    fill_host_random(host, 9)
    page = host.get_data_page(4)
    latent = 4 * 2 * (64 + 16) * 2
    index = 4 * 2 * (256 + 2 * 4)
    assert page.dtype == torch.uint8 and page.numel() == latent + index == host.page_bytes
    assert torch.equal(page[latent:].view(2, -1), host.index_k_buffer[:, 4:8].reshape(2, -1))
    _, sizes = host.get_page_buffer_meta(torch.arange(4, 8))
    assert sum(sizes) == latent + index


def test_alloc_free_clear_available(mha):
    _, host = mha
    assert host.available_size() == 64
    a = host.alloc(16)
    assert host.available_size() == 48
    with pytest.raises(ValueError, match="multiple of page_size"):
        host.alloc(3)
    assert host.free(a) == 16 and host.available_size() == 64
    host.alloc(64)
    assert host.alloc(4) is None
    host.clear()
    assert host.available_size() == 64


def test_index_arrays_of_any_stride_and_clear_refusals():
    """A reversed numpy view raised torch's own negative-stride error, a uint64 slot of 2**63
    or more was reported as a negative slot, and the duplicate-slot message named no slot."""
    import numpy as np
    dev = make_device_pool("mha", 64, 4, torch.bfloat16, 2)
    fill_random(dev, 3)
    host, same = make_host_pool(dev, "page_first", 64), make_host_pool(dev, "page_first", 64)
    host.backup_from_device_all_layer(dev, np.arange(8)[::-1], np.arange(8), "direct")
    same.backup_from_device_all_layer(dev, np.arange(8)[::-1].copy(), np.arange(8), "direct")
    assert torch.equal(host.raw_bytes("k"), same.raw_bytes("k")) and torch.equal(host.raw_bytes("v"), same.raw_bytes("v"))
    assert not torch.equal(host.get_data_page(0), host.get_data_page(4))
    with pytest.raises(ValueError, match=r"host_indices holds a slot of 2\*\*63 or more"):
        host.backup_from_device_all_layer(dev, np.array([2**63 + 5], dtype=np.uint64), np.arange(1), "direct")
    with pytest.raises(ValueError, match="host_indices names slot 3 twice"):
        host.backup_from_device_all_layer(dev, np.array([5, 3, 3]), np.arange(3), "direct")
