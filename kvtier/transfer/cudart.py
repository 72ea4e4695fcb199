"""Asynchronous 1-D and 2-D memory copies through the CUDA runtime.

torch's ``copy_`` cannot express a pitched copy between host and device (it
makes a strided host tensor contiguous on the CPU first), so the DMA backend
calls ``cudaMemcpy2DAsync`` itself, through the runtime torch already loaded.
"""

from __future__ import annotations

import ctypes
import functools

_DEFAULT_KIND = 4  # cudaMemcpyDefault: direction inferred from the (UVA) addresses


@functools.lru_cache(maxsize=1)
def _lib():
    import torch

    torch.cuda.init()
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        size_t, vp = ctypes.c_size_t, ctypes.c_void_p
        lib.cudaMemcpy2DAsync.argtypes = [vp, size_t, vp, size_t, size_t, size_t, ctypes.c_int, vp]
        lib.cudaMemcpy2DAsync.restype = ctypes.c_int
        return lib
    raise RuntimeError(
        "the CUDA runtime library (libcudart) could not be loaded; use io_backend='kernel' or 'direct'"
    )


def memcpy2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
    """Queue ``height`` rows of ``width`` bytes on ``stream`` (a raw cudaStream_t)."""
    err = _lib().cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, _DEFAULT_KIND, stream)
    if err:
        raise RuntimeError(
            f"cudaMemcpy2DAsync failed with error {err} (width {width}, height {height}, "
            f"pitches {dpitch}/{spitch})"
        )
