"""Argument checks shared by every config: raise before anything is built."""

from __future__ import annotations


def require_positive_int(name: str, value) -> None:
    """``value`` must be an int > 0 (bools are refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
