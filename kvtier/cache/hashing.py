"""Token ids as arrays, and chained, salted SHA-256 page hashes.

A page's hash is ``sha256(previous page's hash || page token ids as
little-endian int64)``; the chain starts from a seed that hashes the salt
(KV shape, dtype, layout, page size, model id) and the namespace. Equal
hashes therefore mean equal prefixes of equal bytes, which is what makes
them usable as storage (L3) keys. Hashes are computed once per page, when
the page enters the tree, and kept on the node.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..validate import require_readable

HASH_VERSION = b"kvtier-page-sha256-v1"


def as_token_array(token_ids) -> np.ndarray:
    """Token ids as a 1-D int64 numpy array (no copy for int64 arrays and CPU tensors).

    Lists are converted (about 10 ns a token); callers on a hot path pass a
    tensor or an array.
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise ValueError(f"token_ids must be integers, got a tensor of {token_ids.dtype}")
        require_readable("token_ids", token_ids)
        arr = token_ids.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(token_ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        elif not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {tuple(arr.shape)}")
    return arr


def namespace_seed(salt: bytes, namespace: str) -> bytes:
    """The chain's starting value for one namespace."""
    h = hashlib.sha256(HASH_VERSION)
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(namespace.encode())
    return h.digest()


def chain_hashes(prev: bytes, tokens: np.ndarray, page_size: int) -> list[bytes]:
    """Hashes of the whole pages of ``tokens``, chained from ``prev``."""
    n_pages = len(tokens) // page_size
    raw = tokens[: n_pages * page_size].astype("<i8", copy=False).tobytes()
    step = page_size * 8
    out: list[bytes] = []
    for i in range(n_pages):
        h = hashlib.sha256(prev)
        h.update(raw[i * step : (i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out
