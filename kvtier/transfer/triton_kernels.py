"""One Triton kernel that copies KV items between device rows and any placement.

The device side of a transfer part is per-layer ``(slots, item_bytes)`` rows,
addressed through a table of layer pointers. The other side is a byte buffer
addressed by a :class:`~kvtier.layouts.Placement` (the host pool itself, read
and written zero-copy through its mapped address, or a device staging buffer
laid out like a compact host pool). Every kind, layout and item size goes
through this one kernel: it copies whole chunks as words of the widest size
that every stride and base address allows (16-byte vectors when possible,
single bytes in the worst case).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections import deque
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..layouts import Placement

# Bytes moved per tile. 32 KiB per tile keeps enough PCIe requests in flight
# per SM for zero-copy reads (a host read costs ~1-2 us of latency).
TILE_BYTES = 32 * 1024
NUM_WARPS = 8
# Number rows so neighbours in the buffer are neighbours in the grid (:func:`row_order`);
# False: always layer, item, chunk (kept for A/B probes).
ROW_ORDER_BY_LAYOUT = True
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def _copy_items(
    dev_ptrs, buf, buf_idx, dev_idx, item0, n_items, n_layers, n_rows, n_tiles, layer0,
    page, token, layer_stride, chunk, page_size, n_chunks, chunk_words, item_words,
    TO_BUF: tl.constexpr, BUF_LINEAR: tl.constexpr, VEC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, COL_TILES: tl.constexpr, ONE_TILE: tl.constexpr,
    ORDER: tl.constexpr,
):
    """Rows are (layer, item, chunk) triples; each is ``chunk_words`` words.
    ``ORDER`` numbers them (:func:`row_order`) so that neighbouring rows are
    neighbours in the buffer where its layout allows.

    Item ``i`` (of ``item0 .. item0+n_items``) sits in device slot ``dev_idx[i]``
    and in buffer slot ``buf_idx[i]`` (or ``i - item0`` when ``BUF_LINEAR``).
    Every stride is in words of the pointers' element type.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if ONE_TILE:
        _copy_tile(pid.to(tl.int64), dev_ptrs, buf, buf_idx, dev_idx, item0, n_items, n_layers, n_rows,
                   layer0, page, token, layer_stride, chunk, page_size, n_chunks, chunk_words, item_words,
                   TO_BUF, BUF_LINEAR, VEC, BLOCK_R, BLOCK_W, COL_TILES, ORDER)
    else:
        # Grid-stride over tiles; ``n_tiles`` is tiles per program, the tail is masked.
        for k in range(0, n_tiles):
            _copy_tile(pid.to(tl.int64) + k * nprog, dev_ptrs, buf, buf_idx, dev_idx, item0, n_items,
                       n_layers, n_rows, layer0, page, token, layer_stride, chunk, page_size, n_chunks,
                       chunk_words, item_words, TO_BUF, BUF_LINEAR, VEC, BLOCK_R, BLOCK_W, COL_TILES, ORDER)


@triton.jit
def _copy_tile(
    tile, dev_ptrs, buf, buf_idx, dev_idx, item0, n_items, n_layers, n_rows, layer0,
    page, token, layer_stride, chunk, page_size, n_chunks, chunk_words, item_words,
    TO_BUF: tl.constexpr, BUF_LINEAR: tl.constexpr, VEC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, COL_TILES: tl.constexpr, ORDER: tl.constexpr,
):
    """One tile of ``BLOCK_R`` rows; rows past ``n_rows`` are masked off."""
    rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    if ORDER == 0:    # layer, item, chunk (chunk fastest)
        c = rows % n_chunks
        rest = rows // n_chunks
        i = rest % n_items
        lyr = rest // n_items
    elif ORDER == 1:  # item, layer, chunk
        c = rows % n_chunks
        rest = rows // n_chunks
        lyr = rest % n_layers
        i = rest // n_layers
    else:             # item, chunk, layer (layer fastest)
        lyr = rows % n_layers
        rest = rows // n_layers
        c = rest % n_chunks
        i = rest // n_chunks
    d_slot = tl.load(dev_idx + item0 + i, mask=rmask, other=0)
    if BUF_LINEAR:
        b_slot = i
    else:
        b_slot = tl.load(buf_idx + item0 + i, mask=rmask, other=0)
    b_off = ((b_slot // page_size) * page + (b_slot % page_size) * token
             + lyr * layer_stride + c * chunk)
    d_base = tl.load(dev_ptrs + layer0 + lyr, mask=rmask, other=0)
    d_ptr = d_base.to(tl.pointer_type(buf.dtype.element_ty), bitcast=True)
    d_off = d_slot * item_words + c * chunk_words
    b_off = tl.multiple_of(b_off, VEC)
    d_off = tl.multiple_of(d_off, VEC)
    for w0 in tl.static_range(0, COL_TILES * BLOCK_W, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)
        cols = tl.max_contiguous(tl.multiple_of(cols, BLOCK_W), BLOCK_W)
        # Compare whole vectors so the mask is constant across each 16-byte access.
        m = rmask[:, None] & ((cols // VEC) < (chunk_words // VEC))[None, :]
        bp = buf + b_off[:, None] + cols[None, :]
        dp = d_ptr[:, None] + d_off[:, None] + cols[None, :]
        if TO_BUF:
            tl.store(bp, tl.load(dp, mask=m), mask=m)
        else:
            tl.store(dp, tl.load(bp, mask=m), mask=m)


@dataclass(frozen=True)
class WordPlan:
    """The word size a copy between one placement and device rows can use."""

    word: int      # bytes per element the kernel moves
    vec: int       # words per 16-byte vector that every offset is a multiple of

    @staticmethod
    def for_copy(pl: Placement, buf: torch.Tensor, dev_layers, dev_gcd: int | None = None) -> "WordPlan":
        """``dev_gcd``: the gcd of the device layers' addresses, if the caller has it
        (:meth:`PartTables.gcd`): a pass over 32-78 layers' addresses per call otherwise."""
        g = layers_gcd(dev_layers) if dev_gcd is None else dev_gcd
        for v in (pl.page, pl.token, pl.layer_stride, pl.chunk, pl.chunk_bytes, pl.item_bytes, buf.data_ptr()):
            g = math.gcd(g, int(v))
        g = g or 16
        word = next(w for w in (8, 4, 2, 1) if g % w == 0)
        vec = 16 // word if g % 16 == 0 else 1
        return WordPlan(word, vec)


def layers_gcd(dev_layers) -> int:
    """The gcd of the device layers' addresses (0 for none)."""
    g = 0
    for t in dev_layers:
        g = math.gcd(g, t.data_ptr())
    return g


def row_order(pl: Placement, n_layers: int) -> int:
    """How the kernel numbers its (layer, item, chunk) rows for ``pl``: 0 item-major
    within each layer (layer-major layouts, and any one-layer copy), 1 layer-major within
    each item (page_first: a token's layers are adjacent), 2 layer fastest, then chunk
    (page_head: a head's layers are adjacent, then the next head's). Neighbouring rows
    are then neighbours in memory, so a warp's accesses cover longer runs of it.
    """
    if n_layers == 1 or pl.layer_stride >= pl.token:
        return 0
    return 2 if pl.n_chunks > 1 and pl.layer_stride < pl.chunk else 1


def layer_ptr_table(dev_layers, device) -> torch.Tensor:
    """Addresses of the per-layer device buffers, as int64 on ``device``."""
    return torch.tensor([t.data_ptr() for t in dev_layers], dtype=torch.int64, device=device)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def copy_items(pl: Placement, buf: torch.Tensor, dev_layers, dev_ptrs: torch.Tensor,
               buf_idx: torch.Tensor | None, dev_idx: torch.Tensor, item0: int, n_items: int,
               layer0: int, n_layers: int, to_buf: bool, max_blocks: int, wp: WordPlan | None = None) -> int:
    """Launch the copy on the current stream; returns the number of blocks (SMs) used.

    ``buf`` is the 1-D uint8 buffer ``pl`` addresses (its first byte is offset
    0); ``buf_idx=None`` puts item ``i`` at buffer slot ``i - item0``. Shapes
    and alignment are checked here, before anything runs. ``wp``: the word
    plan, when the caller already has it for these addresses (it costs a pass
    over every layer's address).
    """
    if buf.dim() != 1 or buf.dtype != torch.uint8:
        raise ValueError(f"buf must be a 1-D uint8 tensor, got {tuple(buf.shape)} {buf.dtype}")
    if dev_idx.dtype != torch.int64 or (buf_idx is not None and buf_idx.dtype != torch.int64):
        raise ValueError("index tensors must be int64")
    if n_items <= 0 or n_layers <= 0:
        return 0
    wp = wp or WordPlan.for_copy(pl, buf, dev_layers)
    w = wp.word
    words = buf.numel() // w
    bview = buf[: words * w].view(_WORD_DTYPES[w])
    chunk_words = pl.chunk_bytes // w
    block_w = min(triton.next_power_of_2(chunk_words), max(TILE_BYTES // w // 4, 16))
    block_r = max(1, min(TILE_BYTES // w // block_w, 256))
    n_rows = n_layers * n_items * pl.n_chunks
    n_tiles = triton.cdiv(n_rows, block_r)
    # The interpreter cannot loop over a runtime bound (numpy >= 2.4 refuses
    # int() of its 1-element scalars), so there every program does one tile.
    one_tile = interpreting()
    grid = n_tiles if one_tile else max(1, min(n_tiles, max_blocks))
    _copy_items[(grid,)](
        dev_ptrs, bview, dev_idx if buf_idx is None else buf_idx, dev_idx, item0, n_items, n_layers, n_rows,
        triton.cdiv(n_tiles, grid), layer0, pl.page // w, pl.token // w, pl.layer_stride // w, pl.chunk // w, pl.page_size,
        pl.n_chunks, chunk_words, pl.item_bytes // w,
        TO_BUF=to_buf, BUF_LINEAR=buf_idx is None, VEC=wp.vec, BLOCK_R=block_r, BLOCK_W=block_w,
        COL_TILES=triton.cdiv(chunk_words, block_w), ONE_TILE=one_tile,
        ORDER=row_order(pl, n_layers) if ROW_ORDER_BY_LAYOUT else 0, num_warps=NUM_WARPS,
    )
    return grid


@triton.jit
def _fetch_words(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def _copy_words(src: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event:
    """Copy ``src`` into ``dst`` (int64, either may be pinned host memory) by a kernel on the
    current stream; returns the event recorded after it."""
    block = 1024
    _fetch_words[(triton.cdiv(src.numel(), block),)](src, dst, src.numel(), BLOCK=block)
    done = torch.cuda.Event()
    done.record()
    return done


# Pinned index copies a fetch kernel may still read: (tensor, event), oldest first. The
# caching host allocator knows nothing of kernel reads, so a freed pinned block could be
# handed out again (and overwritten) before the kernel ran; each stays here until its
# event has fired.
_fetching: deque = deque()
_fetching_lock = threading.Lock()


def fetch_index(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host int64 index tensor copied to ``device`` by SMs, on the current stream, without blocking.

    The copy engines may be busy for many milliseconds with bulk transfers
    queued earlier (a load's host -> device copies); a small index copy queued
    behind them would hold up an unrelated transfer (and, from pageable
    memory, the host). A kernel reads a pinned copy of the index over PCIe instead.
    """
    # Always a pinned copy of our own, even of a pinned tensor: the kernel reads it when the
    # stream gets there, and the caller may refill its tensor as soon as the call returns.
    src = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
    src.copy_(idx)
    out = torch.empty(src.numel(), dtype=torch.int64, device=device)
    if src.numel():
        read = _copy_words(src, out)
        with _fetching_lock:
            while _fetching and _fetching[0][1].query():
                _fetching.popleft()
            _fetching.append((src, read))
    return out


def fetch_index_to_host(idx: torch.Tensor):
    """A CUDA int64 index tensor as a numpy array, read back by a kernel on the current stream.

    Waits only for the current stream's work (which produced the index), not
    for bulk device -> host copies other streams have queued on the copy engine.
    """
    src = idx.to(torch.int64).contiguous()
    out = torch.empty(src.numel(), dtype=torch.int64, pin_memory=True)
    if src.numel():
        _copy_words(src, out).synchronize()
    return out.numpy()
