"""Argument checks shared by every config: raise before anything is built."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch


class InvariantError(RuntimeError):
    """A check of internal state (``check()`` of a cache, an allocator or a pool) found an
    invariant broken; the message names the first one."""


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool (``True`` is no count of anything)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_int_dtype(dtype: torch.dtype) -> bool:
    """An integer tensor dtype: not floating point, complex or bool."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def require_readable(name: str, t: torch.Tensor) -> None:
    """A tensor whose values kvtier can read: on the CPU or a CUDA device (a ``meta`` tensor
    has none, and other devices are not kvtier's)."""
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is a tensor on the {t.device.type!r} device, whose values kvtier cannot read; "
                         "pass it on the CPU (or the pool's CUDA device)")


def is_finite_number(value, low: float = 0.0, strict: bool = False) -> bool:
    """A finite number (Python, numpy or a one-element tensor; not a bool or a string) of at
    least ``low``, or above it where ``strict``."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        return False
    try:
        v = float(value)
    except (TypeError, ValueError, RuntimeError):
        return False
    return math.isfinite(v) and (v > low if strict else v >= low)


def require_positive_int(name: str, value) -> None:
    """``value`` must be an integer > 0 (Python or numpy; bools are refused)."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def require_int_at_least(name: str, value, low: int) -> None:
    """``value`` must be an integer >= ``low`` (Python or numpy; bools are refused)."""
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_namespace(namespace) -> None:
    """A cache namespace: a non-empty string."""
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace must be a non-empty string, got {namespace!r}")


def require_index(name: str, value, n: int) -> None:
    """``value`` must be an integer in ``0..n-1`` (Python or numpy; bools are refused)."""
    if not is_int(value) or not 0 <= value < n:
        raise ValueError(f"{name} must be an integer in 0..{n - 1}, got {value!r}")


def device_type(device) -> str | None:
    """The type of a torch device name or object (``"cpu"``, ``"cuda"`` ...); None for one torch
    cannot read."""
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        return None
