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
import warnings
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


# Launch through the compiled kernel's own launcher once Triton has compiled it for the
# arguments' specialization (:func:`_launch_copy`); False: Triton's full launch path every call.
FAST_LAUNCH = True
_CONST_NAMES = ("TO_BUF", "BUF_LINEAR", "VEC", "BLOCK_R", "BLOCK_W", "COL_TILES", "ONE_TILE", "ORDER")
_launchers: dict = {}


def arg_class(a) -> tuple:
    """What Triton specializes a kernel on for argument ``a``, or finer: a tensor's dtype and
    whether its address is a multiple of 16; an int's width, whether it is 1 and whether it is a
    multiple of 16. Two calls whose arguments agree on these run the same compiled kernel."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    return (a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31), a >= 0, a >= 1 << 63)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``), as ``triton.next_power_of_2``, which
    costs a JIT function's call from Python."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class _Geometry:
    """What a copy's launch takes from its placement, word plan and item and layer counts."""

    grid: int
    ints: tuple    # n_items .. item words: the kernel's int arguments after ``item0``, less ``layer0``
    consts: tuple  # the constexpr arguments, in ``_CONST_NAMES`` order
    key: tuple     # consts and the ints' classes (:func:`arg_class`)


@functools.lru_cache(maxsize=4096)
def _geometry(pl: Placement, word: int, vec: int, n_items: int, n_layers: int, max_blocks: int, to_buf: bool,
              linear: bool, one_tile: bool, by_layout: bool, tile_bytes: int = TILE_BYTES) -> _Geometry:
    w = word
    chunk_words = pl.chunk_bytes // w
    block_w = min(next_pow2(chunk_words), max(tile_bytes // w // 4, 16))
    block_r = max(1, min(tile_bytes // w // block_w, 256))
    n_rows = n_layers * n_items * pl.n_chunks
    n_tiles = _cdiv(n_rows, block_r)
    grid = n_tiles if one_tile else max(1, min(n_tiles, max_blocks))
    ints = (n_items, n_layers, n_rows, _cdiv(n_tiles, grid), pl.page // w, pl.token // w, pl.layer_stride // w,
            pl.chunk // w, pl.page_size, pl.n_chunks, chunk_words, pl.item_bytes // w)
    consts = (to_buf, linear, vec, block_r, block_w, _cdiv(chunk_words, block_w), one_tile,
              row_order(pl, n_layers) if by_layout else 0)
    return _Geometry(grid, ints, consts, (consts, tuple(map(arg_class, ints))))


def launch_geometry(pl: Placement, wp: WordPlan, n_items: int, n_layers: int, max_blocks: int, to_buf: bool,
                    linear: bool) -> _Geometry:
    """:func:`_geometry` under the module's settings as they are now (probes change them)."""
    return _geometry(pl, wp.word, wp.vec, int(n_items), int(n_layers), int(max_blocks), bool(to_buf), linear,
                     interpreting(), ROW_ORDER_BY_LAYOUT, TILE_BYTES)


def _triton_knobs() -> tuple:
    """The settings of Triton's own that its kernel cache key holds beside the arguments."""
    knobs = getattr(triton, "knobs", None)
    runtime, compilation = getattr(knobs, "runtime", None), getattr(knobs, "compilation", None)
    return (getattr(runtime, "debug", None), getattr(compilation, "instrumentation_mode", None))


def launch_args(g: _Geometry, tensors: tuple, item0: int, layer0: int) -> tuple:
    """:func:`_copy_items`'s runtime arguments, in its order (its constexprs follow, as ``g.consts``)."""
    return (*tensors, item0, *g.ints[:3], g.ints[3], layer0, *g.ints[4:])


def _triton_launch(g: _Geometry, args: tuple):
    """Launch through Triton's own path (bind, specialize, look up); returns the compiled kernel."""
    return _copy_items[(g.grid,)](*args, **dict(zip(_CONST_NAMES, g.consts)), num_warps=NUM_WARPS)


def _launch_copy(g: _Geometry, tensors: tuple, item0: int, layer0: int) -> None:
    """Launch :func:`_copy_items` on the current stream.

    Triton's launch binds, specializes and looks the kernel up on every call (0.1-0.3 ms a
    call on a slow host, once per DMA chunk). The first call for a specialization (see
    :func:`arg_class`) goes that way and keeps the compiled kernel; later ones call its
    launcher with the same arguments, constants included, in the kernel's order.
    """
    global FAST_LAUNCH
    args = launch_args(g, tensors, item0, layer0)
    if not FAST_LAUNCH or interpreting():
        _triton_launch(g, args)
        return
    key = (torch.cuda.current_device(), NUM_WARPS, _triton_knobs(), g.key, arg_class(item0), arg_class(layer0),
           *map(arg_class, tensors))
    run = _launchers.get(key)
    if run is None:
        _launchers[key] = _triton_launch(g, args)
        return
    try:
        run[(g.grid, 1, 1)](*args, *g.consts)
    except (TypeError, AttributeError) as err:
        # A Triton whose launcher takes other arguments (before 3.3 it got only the runtime ones)
        # refuses them before anything is launched: its own launch path from now on.
        FAST_LAUNCH = False
        _launchers.clear()
        warnings.warn(f"kvtier: Triton {triton.__version__}'s compiled-kernel launcher refused the copy kernel's "
                      f"arguments ({err}); launching through Triton's own path", RuntimeWarning, stacklevel=2)
        _triton_launch(g, args)


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
    if any(i is not None and (i.dtype != torch.int64 or not i.is_contiguous()) for i in (dev_idx, buf_idx)):
        raise ValueError("index tensors must be contiguous int64 (the kernel reads them packed)")
    if n_items <= 0 or n_layers <= 0:
        return 0
    wp = wp or WordPlan.for_copy(pl, buf, dev_layers)
    w = wp.word
    # The interpreter cannot loop over a runtime bound (numpy >= 2.4 refuses
    # int() of its 1-element scalars), so there every program does one tile.
    g = launch_geometry(pl, wp, n_items, n_layers, max_blocks, to_buf, buf_idx is None)
    bview = buf[: buf.numel() // w * w].view(_WORD_DTYPES[w])
    _launch_copy(g, (dev_ptrs, bview, dev_idx if buf_idx is None else buf_idx, dev_idx), int(item0), int(layer0))
    return g.grid


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
