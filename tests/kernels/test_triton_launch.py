"""The Triton copy kernel's launch, on the CPU (no kernel runs): the word plan, the launch key,
the launch geometry and the kept launcher's arguments. The kernels themselves run under the
interpreter (interpret_cases.py, through test_triton_interpret.py) and on a GPU
(tests/transfer_gpu/test_transfer_gpu_kernel.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

from kvtier.layouts import LAYOUTS
from kvtier_testlib import MHA


@given(offsets=st.lists(st.integers(0, 4096), min_size=1, max_size=40), buf_off=st.integers(0, 64),
       layout=st.sampled_from(["layer_first", "page_first", "page_head"]), ps=st.sampled_from([1, 16]))
def test_word_plan_from_the_cached_layer_gcd_is_the_plan_from_every_address(offsets, buf_off, layout, ps):
    """The kernels' word size from the part's remembered address gcd equals the one from a
    pass over every layer's address: a wrong one would move misaligned words."""
    pytest.importorskip("triton")
    from kvtier.transfer.triton_kernels import WordPlan, layers_gcd
    mem = torch.zeros(8192, dtype=torch.uint8)
    layers = [mem[o:o + 16] for o in offsets]
    pl = LAYOUTS[layout].placement(MHA.components[0], 4, 64, ps)
    buf = mem[buf_off:]
    g = 0
    for v in (pl.page, pl.token, pl.layer_stride, pl.chunk, pl.chunk_bytes, pl.item_bytes, buf.data_ptr(),
              *(t.data_ptr() for t in layers)):
        g = math.gcd(g, v)
    word = next(w for w in (8, 4, 2, 1) if g % w == 0)
    want = WordPlan(word, 16 // word if g % 16 == 0 else 1)
    assert WordPlan.for_copy(pl, buf, layers, layers_gcd(layers)) == want == WordPlan.for_copy(pl, buf, layers)


@given(a=st.integers(-(2**40), 2**40))
def test_the_launch_key_tells_apart_whatever_triton_specializes_an_int_on(a):
    """The launcher path reuses a compiled kernel only for arguments in the same class: an int
    equal to 1, a multiple of 16 or not, in 32 bits or not, each gets a class of its own, as
    Triton specializes on each (a kernel compiled for a multiple of 16 would be wrong for 17)."""
    pytest.importorskip("triton")
    from kvtier.transfer.triton_kernels import arg_class
    for b in (1, 16, 17, 2**31, -(2**31) - 1, 0, 2**63, 2**64 - 16):
        if arg_class(a) == arg_class(b):
            assert (a == 1) == (b == 1) and (a % 16 == 0) == (b % 16 == 0)
            assert (-(2**31) <= a < 2**31) == (-(2**31) <= b < 2**31)
    assert arg_class(2**40) != arg_class(2**63)  # Triton's i64 and u64
    t = torch.zeros(64, dtype=torch.uint8)
    assert arg_class(t[:8]) != arg_class(t[1:9]) != arg_class(t[:8].view(torch.int64))


@given(n=st.integers(1, 2**40))
def test_next_pow2_is_tritons(n):
    triton = pytest.importorskip("triton")
    from kvtier.transfer.triton_kernels import next_pow2
    assert next_pow2(n) == triton.next_power_of_2(n)


def test_the_launch_geometry_follows_the_tile_size(monkeypatch):
    """Probes sweep TILE_BYTES and NUM_WARPS: each setting gets its own blocks and its own kept
    launcher, not the first setting's from the caches."""
    pytest.importorskip("triton")
    import kvtier.transfer.triton_kernels as tk
    pl = LAYOUTS["layer_first"].placement(MHA.components[0], 4, 4096, 1)
    wp = tk.WordPlan(8, 2)
    before = tk.launch_geometry(pl, wp, 1000, 4, 64, True, True)
    monkeypatch.setattr(tk, "TILE_BYTES", 4 * tk.TILE_BYTES)
    after = tk.launch_geometry(pl, wp, 1000, 4, 64, True, True)
    assert after.consts[3] == 4 * before.consts[3] and after.key != before.key
    monkeypatch.setattr(tk, "ROW_ORDER_BY_LAYOUT", False)
    assert tk.launch_geometry(pl, wp, 1000, 4, 64, True, True) == after  # layer_first: order 0 either way


def test_the_launcher_gets_every_argument_in_the_kernels_order():
    """The kept launcher takes the kernel's arguments by position, constants included: each
    value lands on the parameter of its name."""
    pytest.importorskip("triton")
    import kvtier.transfer.triton_kernels as tk
    pl = LAYOUTS["page_head"].placement(MHA.components[0], 4, 64, 16)
    g = tk._geometry(pl, 2, 8, 37, 3, 5, True, False, False, True)
    names = list(tk._copy_items.arg_names)
    const = [p.name for p in tk._copy_items.params if p.is_constexpr]
    assert names[-len(const):] == const == list(tk._CONST_NAMES)
    tensors = ("dev_ptrs", "buf", "buf_idx", "dev_idx")
    got = dict(zip(names, (*tk.launch_args(g, tensors, 1001, 1002), *g.consts)))
    want = {"dev_ptrs": "dev_ptrs", "buf": "buf", "buf_idx": "buf_idx", "dev_idx": "dev_idx", "item0": 1001,
            "layer0": 1002, "n_items": 37, "n_layers": 3, "n_rows": 3 * 37 * pl.n_chunks,
            "page": pl.page // 2,
            "token": pl.token // 2, "layer_stride": pl.layer_stride // 2, "chunk": pl.chunk // 2,
            "page_size": 16, "n_chunks": pl.n_chunks, "chunk_words": pl.chunk_bytes // 2,
            "item_words": pl.item_bytes // 2, "TO_BUF": True, "BUF_LINEAR": False, "VEC": 8}
    assert {k: got[k] for k in want} == want
    n_tiles = -(-got["n_rows"] // got["BLOCK_R"])
    assert got["n_tiles"] == -(-n_tiles // g.grid) and g.grid == min(n_tiles, 5)
