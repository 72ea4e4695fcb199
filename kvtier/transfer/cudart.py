"""Asynchronous 2-D and batched memory copies through the CUDA runtime.

torch's ``copy_`` cannot express a pitched copy between host and device (it
makes a strided host tensor contiguous on the CPU first), and queueing many
small copies one Python call at a time costs microseconds each. So the DMA
backend calls the runtime torch already loaded: ``cudaMemcpy2DAsync`` for a
pitched copy, ``cudaMemcpyBatchAsync`` (CUDA >= 12.8) to queue a whole
array of 1-D copies in one call, and ``cudaMemcpyAsync`` for a single 1-D copy
too long for a 2-D call's pitch.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

_DEFAULT_KIND = 4  # cudaMemcpyDefault: direction inferred from the (UVA) addresses
_SRC_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: sources read in stream order


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


class _Runtime:
    def __init__(self, lib: ctypes.CDLL, major: int):
        self.lib = lib
        size_t, vp = ctypes.c_size_t, ctypes.c_void_p
        lib.cudaMemcpy2DAsync.argtypes = [vp, size_t, vp, size_t, size_t, size_t, ctypes.c_int, vp]
        lib.cudaMemcpy2DAsync.restype = ctypes.c_int
        lib.cudaMemcpyAsync.argtypes = [vp, vp, size_t, ctypes.c_int, vp]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        self.batch = getattr(lib, "cudaMemcpyBatchAsync", None)
        if self.batch is not None:
            args = [vp, vp, vp, size_t, vp, vp, size_t]
            # CUDA 12.8/12.9 had a failIdx argument before the stream; CUDA 13 dropped it.
            self.batch.argtypes = args + ([vp] if major == 12 else []) + [vp]
            self.batch.restype = ctypes.c_int
        self.major = major
        self.attrs = _MemcpyAttributes(_SRC_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0), 0)
        self.attr_idx = (ctypes.c_size_t * 1)(0)


@functools.lru_cache(maxsize=1)
def _rt() -> _Runtime:
    import torch

    torch.cuda.init()
    # The runtime torch was built against first: a name dlopen has not loaded yet opens a second,
    # separate runtime (a CUDA 13 toolkit on the path beside a cu12 torch).
    built = int((torch.version.cuda or "0").split(".")[0])
    names = [("libcudart.so.13", 13), ("libcudart.so.12", 12)]
    names.sort(key=lambda nm: nm[1] != built)
    for name, major in names + [("libcudart.so", 0)]:
        try:
            return _Runtime(ctypes.CDLL(name), major)
        except OSError:
            continue
    raise RuntimeError(
        "the CUDA runtime library (libcudart) could not be loaded; use io_backend='kernel' or 'direct'"
    )


def memcpy2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
    """Queue ``height`` rows of ``width`` bytes on ``stream`` (a raw cudaStream_t)."""
    err = _rt().lib.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, _DEFAULT_KIND, stream)
    if err:
        _failed(err, f"cudaMemcpy2DAsync failed with error {err} (width {width}, height {height}, "
                     f"pitches {dpitch}/{spitch})")


def memcpy1d(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Queue one 1-D copy of ``nbytes`` on ``stream`` (a raw cudaStream_t)."""
    err = _rt().lib.cudaMemcpyAsync(dst, src, nbytes, _DEFAULT_KIND, stream)
    if err:
        _failed(err, f"cudaMemcpyAsync failed with error {err} ({nbytes} bytes)")


def _failed(err: int, message: str) -> None:
    """Raise ``message`` for a runtime call that returned ``err``, after clearing the thread's last
    error: left set, torch reports it at its next CUDA call, whatever that call is."""
    _rt().lib.cudaGetLastError()
    raise RuntimeError(message)


def has_batch() -> bool:
    """True when the runtime can queue an array of copies in one call."""
    rt = _rt()
    return rt.batch is not None and rt.major in (12, 13)


def memcpy_batch(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
    """Queue ``len(sizes)`` 1-D copies (uint64 addresses, uint64 sizes) on ``stream`` in one call.

    The copies of one batch may run in any order among themselves (they
    must not overlap); as a whole the batch is ordered on ``stream``.
    """
    n = int(sizes.size)
    if n == 0:
        return
    if stream == 0:
        raise ValueError("cudaMemcpyBatchAsync refuses the legacy default stream; queue on a created stream")
    rt = _rt()
    d = np.ascontiguousarray(dsts, dtype=np.uint64)
    s = np.ascontiguousarray(srcs, dtype=np.uint64)
    z = np.ascontiguousarray(sizes, dtype=np.uint64)
    args = [d.ctypes.data, s.ctypes.data, z.ctypes.data, n, ctypes.addressof(rt.attrs),
            ctypes.addressof(rt.attr_idx), 1]
    if rt.major == 12:
        fail = ctypes.c_size_t(0)
        args.append(ctypes.addressof(fail))
    err = rt.batch(*args, stream)
    if err:
        _failed(err, f"cudaMemcpyBatchAsync failed with error {err} ({n} copies, "
                     f"sizes {int(z.min())}..{int(z.max())} bytes)")
