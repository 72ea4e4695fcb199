"""Runs of slots: the arithmetic every backend and the chooser share (numpy only).

A transfer names its host slots in transfer order. Allocators hand slots out as
one run (``first, first + 1, ...``); scattered pages or single tokens make many
short runs. How long the runs are decides how copies split (:mod:`.dma`) and which
backend a transfer suits (:mod:`.auto`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..allocator import whole_page_rows


def whole_pages(host_idx: np.ndarray, page_size: int) -> bool:
    """True when the indices are whole pages, each in order (what page-jumping layouts need)."""
    if page_size == 1:
        return True
    if host_idx.size % page_size:
        return False
    return bool(whole_page_rows(host_idx, page_size).all())


def run_starts(host_idx: np.ndarray, cuts: np.ndarray | None = None, paired: np.ndarray | None = None) -> np.ndarray:
    """Where each run of consecutive slots starts (positions in ``host_idx``); a position in
    ``cuts`` (chunk edges) starts a new run too, and with ``paired`` (the slots on the other
    side, as many), so does a position where those are not consecutive."""
    brk = np.ones(host_idx.size, dtype=bool)
    if host_idx.size:
        brk[1:] = np.diff(host_idx) != 1
        if paired is not None:
            brk[1:] |= np.diff(paired) != 1
        if cuts is not None:
            brk[cuts] = True
    return np.flatnonzero(brk)


@dataclass(frozen=True)
class Runs:
    """The runs of consecutive slots in a host index: each distinct run length and how
    many runs have it. Worked out once per transfer (:meth:`of`) and handed to every
    step that needs it: the planning bound, the shape keys and the plans."""

    n: int
    lengths: tuple[int, ...]
    counts: tuple[int, ...]

    @staticmethod
    def of(host_idx: np.ndarray) -> "Runs":
        n = int(host_idx.size)
        if not n:
            return Runs(0, (), ())
        if one_run(host_idx):
            return Runs(n, (n,), (1,))
        starts = run_starts(host_idx)  # more than one run: the shortcut above takes one
        lengths = np.diff(np.append(starts, n))
        counts = _counted(lengths)
        if counts is None:
            lengths, counts = np.unique(lengths, return_counts=True)
        else:
            lengths = np.flatnonzero(counts)
            counts = counts[lengths]
        return Runs(n, tuple(lengths.tolist()), tuple(counts.tolist()))

    @property
    def single(self) -> bool:
        """One run: the slots are ``first, first + 1, ...`` (as an allocator hands them out)."""
        return self.counts == (1,)

    @property
    def mean_class(self) -> int:
        """log2 of the mean run length."""
        return _mean_class(self.n, sum(self.counts))


def one_run(host_idx: np.ndarray) -> bool:
    """One run, as an allocator hands slots out (``host_idx`` not empty): strictly increasing
    over a span of n - 1 slots is first, first + 1, ... One comparison pass, no index arrays."""
    return (int(host_idx[-1]) - int(host_idx[0]) == host_idx.size - 1
            and bool((host_idx[1:] > host_idx[:-1]).all()))


def _mean_class(n: int, runs: int) -> int:
    return int(math.log2(max(n / max(1, runs), 1)))


def run_count(host_idx: np.ndarray) -> int:
    """How many runs of consecutive slots ``host_idx`` holds (``sum(Runs.of(host_idx).counts)``)
    in one comparison pass, without their lengths (a tenth of :meth:`Runs.of`'s time)."""
    if host_idx.size == 0:
        return 0
    return 1 if one_run(host_idx) else 1 + int(np.count_nonzero(np.diff(host_idx) != 1))


def run_class(host_idx: np.ndarray, runs: Runs | None = None) -> int:
    """log2 of the mean length of the runs of consecutive slots: what decides how copies split
    (:attr:`Runs.mean_class`; without ``runs``, from :func:`run_count` alone)."""
    return runs.mean_class if runs is not None else _mean_class(int(host_idx.size), run_count(host_idx))


@dataclass(frozen=True)
class HostOrder:
    """A transfer's slot pairs in host-slot order: ``order`` the permutation, ``slots`` the
    host slots in that order (``host[order]``). Whole pages are kept together."""

    order: np.ndarray
    slots: np.ndarray

    @staticmethod
    def of(host: np.ndarray, page_size: int) -> "HostOrder | None":
        """The order that puts ``host`` slots in ascending order, whole pages kept together;
        None when they already are (as an allocator hands them out).

        Scattered host pages moved in this order become ascending addresses, and pages that
        happen to be neighbours join into one run. One sort gives both the permutation and
        the sorted slots: each slot (or page's first slot) shifted up with its position in
        the low bits. Slots repeated in a load keep their order among themselves.
        """
        if ascending(host):
            return None
        ps = page_size if page_size > 1 and whole_pages(host, page_size) else 1
        keys = host[::ps].astype(np.int64)
        bits = max(1, (keys.size - 1).bit_length())
        if int(keys.min()) < 0 or int(keys.max()) >= 1 << (62 - bits):
            first = np.argsort(keys, kind="stable")   # slots too large to share a word with positions
            firsts = keys[first]
        else:
            packed = (keys << bits) | np.arange(keys.size, dtype=np.int64)
            packed.sort()
            first, firsts = packed & ((1 << bits) - 1), packed >> bits
        if ps == 1:
            return HostOrder(first, firsts)
        step = np.arange(ps)
        return HostOrder((first[:, None] * ps + step).reshape(-1), (firsts[:, None] + step).reshape(-1))


def ascending(host: np.ndarray) -> bool:
    """True when ``host`` slots strictly ascend, as an allocator hands them out."""
    return host.size < 2 or bool((host[1:] > host[:-1]).all())


def _counted(lengths: np.ndarray) -> np.ndarray | None:
    """How many of ``lengths`` (run lengths, not empty) have each value, ``np.bincount``, when
    they are small beside their number (runs of scattered slots: counting them is 2.5-3x faster
    than ``np.unique``'s sort); None when a sort is cheaper (few long runs)."""
    top = int(lengths.max())
    return None if top > 4 * lengths.size + 64 else np.bincount(lengths, minlength=top + 1)


def _lengths_by_value(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(lengths, return_inverse=True)``, by :func:`_counted` where it counts."""
    counts = _counted(lengths)
    if counts is None:
        return np.unique(lengths, return_inverse=True)
    distinct = np.flatnonzero(counts)
    rank = np.zeros(counts.size, np.int64)
    rank[distinct] = np.arange(distinct.size, dtype=np.int64)
    return distinct, rank[lengths]
