"""Argument checks of the cache's public calls: they raise before anything changes.

Also the checks an insert makes of its slots, kept linear in practice: slots are looked at
as runs of consecutive ids (an allocator hands them out so), checked a run at a time.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import torch

from ..allocator import pages_to_tokens
from ..storage.tier import StorageTier
from ..transfer.slots import one_run
from ..validate import require_readable
from .config import CacheConfig
from .radix import Node
from .tiers import REQUEST as _REQUEST

# At most this many runs are checked and marked a slice each; more take one gather or scatter
# over every page (25-37 us per 32k pages on the 2-core CPU) and a sort for repeats.
MAX_RUNS = 32


def _is_token(value) -> bool:
    return type(value) is int or isinstance(value, np.integer)


def _int64_view(values) -> np.ndarray | None:
    """A 1-D int64 CPU tensor or array as an array without a copy (the common case, checked in
    a microsecond: a tensor's own attributes cost more); None for anything else."""
    if type(values) is torch.Tensor:
        try:
            values = values.numpy()  # raises off the CPU, or where it needs grad
        except (RuntimeError, TypeError):
            return None
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
        return values
    return None


def as_tokens(token_ids):
    """Token ids as the tree takes them (:mod:`.radix`): a list as it is, anything else as a
    1-D int64 array (an int64 array or CPU tensor without a copy).

    A list is taken to hold Python (or numpy) ints: only its first and last elements are
    checked here, since checking each costs more than an insert (a list of 32k ints: 160 us
    to sum, 450 us to convert); another value raises ``ValueError`` where a walk looks up a child
    by it (a page's first token), or once its page's chain key is computed. Arrays and tensors
    are checked by their dtype.
    """
    fast = _int64_view(token_ids)
    if fast is not None:
        return fast
    if type(token_ids) is tuple:
        token_ids = list(token_ids)
    if type(token_ids) is list:
        if token_ids and not (_is_token(token_ids[0]) and _is_token(token_ids[-1])):
            bad = token_ids[0] if not _is_token(token_ids[0]) else token_ids[-1]
            raise ValueError(f"token_ids must be integers, got {bad!r} ({type(bad).__name__}) in the list")
        return token_ids
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


def as_slots(values) -> np.ndarray:
    fast = _int64_view(values)
    if fast is not None:
        return fast
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ValueError(f"slot indices must be integers, got a tensor of {values.dtype}")
        require_readable("slot indices", values)
        arr = values.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(values)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"slot indices must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
    if arr.ndim != 1:
        raise ValueError(f"slot indices must be one-dimensional, got shape {tuple(arr.shape)}")
    return arr


def _run_starts(ids: np.ndarray) -> list[int]:
    """Positions where a run of consecutive ids starts (0 first)."""
    if len(ids) < 2:
        return [0] if len(ids) else []
    return [0] + (np.flatnonzero(np.diff(ids) != 1) + 1).tolist()


class PageRuns:
    """Page ids and their runs of consecutive ids: ``runs`` holds ``(position, first page,
    count)`` of each where there are at most :data:`MAX_RUNS`, and ownership is checked and
    marked a run (a slice) at a time; with more, ``runs`` is None and a gather or scatter over
    every page does it."""

    def __init__(self, pages: np.ndarray, starts: list[int] | None = None, firsts: list[int] | None = None):
        self.pages = pages
        starts = _run_starts(pages) if starts is None else starts
        self.runs = None
        if len(starts) <= MAX_RUNS:
            firsts = pages[starts].tolist() if firsts is None else firsts
            self.runs = [(p, f, e - p) for p, f, e in zip(starts, firsts, starts[1:] + [len(pages)])]

    @staticmethod
    def of_slots(slots: np.ndarray, page_size: int, size: int, whole: bool = True, base: int = 0) -> PageRuns:
        """The pages of slots of whole pages (each page's ``page_size`` slots in order; at page 1
        the slots themselves); ``ValueError`` naming the first slot out of range or the first
        position (counted from ``base``) that does not start a whole page. One pass over the
        slots: their runs. ``whole=False`` reads only each page's first slot (the caller vouches
        for the rest)."""
        n = len(slots)
        if n % page_size:
            raise ValueError(f"{n} indices is not a whole number of pages of {page_size} tokens")
        if not whole and page_size > 1:
            firsts = slots[::page_size]
            pages = firsts // page_size
            if len(pages) and one_run(pages):  # a run's first page is its least, its last its greatest
                if firsts[0] >= 0 and firsts[-1] < size and not (firsts % page_size).any():
                    return PageRuns(pages, [0], [int(pages[0])])
            elif len(firsts) and firsts.min() >= 0 and firsts.max() < size and not (firsts % page_size).any():
                return PageRuns(pages)
        if n and one_run(slots):  # as an allocator hands them out: one comparison pass, no index arrays
            return PageRuns._one(slots, page_size, size, base)
        starts = _run_starts(slots)
        ends = starts[1:] + [n] if n else []
        firsts, lasts = slots[starts].tolist(), slots[[e - 1 for e in ends]].tolist()
        if n and (min(firsts) < 0 or max(lasts) >= size):  # a run's first slot is its least, its last its greatest
            bad = min(firsts) if min(firsts) < 0 else max(lasts)
            raise ValueError(f"index {bad} is out of range: valid slots are 0..{size - 1}")
        if page_size == 1:
            return PageRuns(slots, starts, firsts)
        for p, f, e in zip(starts, firsts, ends):  # a run that starts and ends on page boundaries is whole pages
            if p % page_size or f % page_size or e % page_size:
                at = p // page_size * page_size
                raise ValueError(f"indices {slots[at:at + 4].tolist()}... at position {base + at} are not one whole "
                                 f"page (expected p*{page_size} .. p*{page_size}+{page_size - 1})")
        return PageRuns(slots[::page_size] // page_size, [p // page_size for p in starts])

    @staticmethod
    def _one(slots: np.ndarray, page_size: int, size: int, base: int) -> "PageRuns":
        """:meth:`of_slots` of slots that are one run ``f, f + 1, ...`` (same checks, same errors)."""
        n, f = len(slots), int(slots[0])
        if f < 0 or f + n > size:
            raise ValueError(f"index {f if f < 0 else f + n - 1} is out of range: valid slots are 0..{size - 1}")
        if page_size == 1:
            return PageRuns(slots, [0], [f])
        if f % page_size:
            raise ValueError(f"indices {slots[:4].tolist()}... at position {base} are not one whole "
                             f"page (expected p*{page_size} .. p*{page_size}+{page_size - 1})")
        return PageRuns(slots[::page_size] // page_size, [0], [f // page_size])

    def first_not(self, marks: np.ndarray, mark: int) -> int | None:
        """The first page whose mark is not ``mark``, or None."""
        if self.runs is None:
            bad = self.pages[marks[self.pages] != mark]
            return int(bad[0]) if len(bad) else None
        for _, first, n in self.runs:
            ok = marks[first : first + n] == mark
            if not ok.all():
                return first + int(np.argmin(ok))
        return None

    def repeated(self) -> int | None:
        """A page named twice, or None (sort and compare: O(n log n), O(r log r) by runs)."""
        if self.runs is None:
            s = np.sort(self.pages)
            same = np.flatnonzero(s[1:] == s[:-1])
            return int(s[same[0]]) if len(same) else None
        runs = sorted((f, n) for _, f, n in self.runs)
        for (a, n), (b, _) in zip(runs, runs[1:]):
            if b < a + n:
                return b
        return None

    def mark(self, marks: np.ndarray, mark: int) -> None:
        if self.runs is None:
            marks[self.pages] = mark
        else:
            for _, first, n in self.runs:
                marks[first : first + n] = mark


def check_pools(device_pool, host_pool, config, engine) -> None:
    if not isinstance(config, CacheConfig):
        raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
    if device_pool.page_size != config.page_size:
        raise ValueError(
            f"config.page_size={config.page_size} but the device pool has page_size={device_pool.page_size}; "
            "they must match"
        )
    if host_pool is not None:
        if host_pool.device_pool is not device_pool:
            raise ValueError("host_pool mirrors a different device pool; build it from this device_pool")
        if host_pool.page_size != config.page_size:
            raise ValueError(f"host pool page_size={host_pool.page_size} differs from config.page_size={config.page_size}")
        if engine is not None and getattr(engine, "host_pool", None) is not host_pool:
            raise ValueError("transfer_engine moves another host pool than host_pool; build it as "
                             "TransferEngine(host_pool, ...) from this cache's host pool")
    elif engine is not None:
        raise ValueError("transfer_engine given without a host_pool; a device-only cache moves nothing")


def check_node(tree, node) -> None:
    """``node`` is a live node of ``tree`` (a ``MatchResult.node``): ``TypeError`` or ``ValueError`` otherwise."""
    if not isinstance(node, Node):
        raise TypeError(f"expected a MatchResult.node, got {type(node).__name__}")
    if not node.alive:
        raise ValueError("this node was evicted from the cache; match_prefix again")
    top = node
    while top.parent is not None:
        top = top.parent
    if tree.roots.get(top.namespace) is top:
        return
    # An empty match's root, dropped while its namespace held nothing (RadixTree.drop_if_empty).
    if not (top is node and not node.children and node.owner is tree):
        raise ValueError("this node belongs to another cache (or one cleared since); match_prefix again")


def pages_of(n_tokens, name: str, page_size: int, round_up: bool = False) -> int:
    """``n_tokens`` (a non-negative integer) in whole pages: rounded up, or refused unless whole."""
    if not isinstance(n_tokens, (int, np.integer)) or isinstance(n_tokens, bool) or n_tokens < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {n_tokens!r}")
    if round_up:
        return -(-int(n_tokens) // page_size)
    if n_tokens % page_size:
        up = -(-int(n_tokens) // page_size) * page_size
        raise ValueError(f"{name}={n_tokens} is not a multiple of page_size={page_size}; ask for {up}")
    return int(n_tokens) // page_size


def check_storage(storage, host_pool, storage_hook) -> None:
    """A storage tier for a cache over ``host_pool``: a ``StorageTier`` of the pool's shape and page
    size, and no ``storage_hook`` beside it; ``TypeError`` or ``ValueError`` otherwise."""
    if storage is None:
        return
    if not isinstance(storage, StorageTier):
        raise TypeError(f"storage must be a kvtier.storage.tier.StorageTier, got {type(storage).__name__}")
    if host_pool is None:
        raise ValueError("a storage tier needs a host pool: its pages are read into host pages; give host_pool")
    if storage_hook is not None:
        raise ValueError("give storage or storage_hook, not both: the storage tier takes the evicted host pages")
    storage.codec.check_pool(host_pool)


def claim_device_pool(device_pool, cache) -> None:
    """Make ``cache`` the owner of ``device_pool``'s slots (a weak reference on the pool); raise
    if another live cache owns them (two allocators would hand out the same slots, and one
    cache's KV would overwrite the other's)."""
    prior = getattr(device_pool, "_kvtier_cache", None)
    if prior is not None and prior() is not None:
        gc.collect()  # a cache dropped by its caller may wait for the cycle collector
        if prior() is not None:
            raise ValueError("device_pool already has a HiCache that hands out its slots; use that cache, or drop it "
                             "(del it) before building another over the same pool, or build a new device pool")
    device_pool._kvtier_cache = weakref.ref(cache)


def held_pages(path, partial, page_size: int) -> tuple[np.ndarray, bool]:
    """The device pages along a walk (``path`` and ``partial``, :meth:`~.radix.RadixTree.walk`;
    -1 where a node holds none on the device), and whether every node there holds its own."""
    nodes = path + [partial[0]] if partial is not None else path
    held = [n.device if n.device is not None else np.full(len(n) // page_size, -1) for n in nodes]
    if partial is not None:
        held[-1] = held[-1][: partial[1] // page_size]
    pages = held[0] if len(held) == 1 else np.concatenate(held) if held else np.empty(0, np.int32)
    return pages, all(n.device is not None for n in nodes)


def same_slots(slots: np.ndarray, pages: np.ndarray, page_size: int, whole: bool = True) -> bool:
    """Whether ``slots`` are exactly the slots of ``pages`` (``whole=False``: each page's first)."""
    if len(slots) != len(pages) * page_size:
        return False
    if page_size == 1:
        return bool((slots == pages).all())
    if not whole:
        return bool((slots[::page_size] == pages.astype(np.int64) * page_size).all())
    return bool((slots == pages_to_tokens(pages, page_size)).all())


def check_insert_pages(existing: np.ndarray, head: PageRuns | None, new: PageRuns, owner: np.ndarray,
                       page_size: int) -> None:
    """An insert's pages: ``head`` for the query's pages over the tree's ``existing`` ones
    (:func:`held_pages`; None where they are those very pages), ``new`` for the rest (the new
    leaf's). Every page is the caller's (marked :data:`~.tiers.REQUEST` in ``owner``) or the
    tree's own page at that very position, and none is named twice; ``ValueError`` otherwise."""
    dup = None
    if head is not None:
        differ = head.pages != existing
        dup = head.pages[differ] if differ.any() else None
    mine = PageRuns(np.concatenate([dup, new.pages])) if dup is not None else new
    bad = mine.first_not(owner, _REQUEST)
    if bad is not None:
        raise ValueError(f"device page {bad} (slots {bad * page_size}..) is not the caller's: insert takes "
                         "slots from alloc_device, or the tree's own slots for the same tokens")
    twice = mine.repeated()
    if twice is not None:
        raise ValueError(f"device_indices names a page twice (page {twice}); give each page once")


def insert_pages(path, partial, slots: np.ndarray, held: int, owner: np.ndarray, page_size: int, size: int,
                 whole: bool) -> tuple[PageRuns | None, PageRuns]:
    """An insert's ``slots`` (whole pages) checked against the tree it walked (``path`` and
    ``partial``, covering its first ``held`` tokens): ``(head, new)``, the pages over the tree's
    (None where they are the tree's own) and the new leaf's, each checked apart (the new ones are
    usually one run, and the tree's its own slots given back). ``ValueError`` as
    :meth:`PageRuns.of_slots` and :func:`check_insert_pages` raise it."""
    existing, all_held = held_pages(path, partial, page_size)
    try:
        head = None if all_held and same_slots(slots[:held], existing, page_size, whole) else \
            PageRuns.of_slots(slots[:held], page_size, size, whole)
        new = PageRuns.of_slots(slots[held:], page_size, size, whole, held)
    except ValueError as e:
        raise ValueError(f"device_indices: {e}") from None
    check_insert_pages(existing, head, new, owner, page_size)
    return head, new
