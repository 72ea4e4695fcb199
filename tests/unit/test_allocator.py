"""PageAllocator: a stateful model-based test, properties, and every refusal."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvtier.allocator import AllocatorError, PageAllocator


class AllocatorMachine(RuleBasedStateMachine):
    """The allocator against a model: a set of free pages."""

    blocks = Bundle("blocks")

    def __init__(self):
        super().__init__()
        self.alloc = None

    @rule(pages=st.integers(1, 40), page_size=st.sampled_from([1, 4, 16]))
    @precondition(lambda self: self.alloc is None)
    def create(self, pages, page_size):
        self.alloc = PageAllocator(pages * page_size, page_size)
        self.free_model = set(range(pages))
        self.generation = 0  # bumped by clear(): older blocks are stale

    @rule(target=blocks, n=st.integers(0, 12))
    @precondition(lambda self: self.alloc is not None)
    def allocate(self, n):
        ps = self.alloc.page_size
        out = self.alloc.alloc(n * ps)
        if n > len(self.free_model):
            assert out is None
            return (self.generation, [])
        assert out is not None and out.dtype == torch.int64 and len(out) == n * ps
        pages = (out.view(-1, ps)[:, 0] // ps).tolist() if n else []
        assert (out.view(-1, ps) == out.view(-1, ps)[:, :1] + torch.arange(ps)).all()
        assert set(pages) <= self.free_model, "handed out a page that was not free"
        if n and n <= self.alloc.num_pages and self._largest_free_run() >= n:
            assert pages == list(range(pages[0], pages[0] + n)), "a fitting run existed but alloc split"
        self.free_model -= set(pages)
        return (self.generation, out.tolist())

    def _largest_free_run(self) -> int:
        best = run = 0
        for p in range(self.alloc.num_pages):
            run = run + 1 if p in self.free_model else 0
            best = max(best, run)
        return best

    @rule(block=consumes(blocks), split=st.booleans())
    def free(self, block, split):
        generation, block = block
        if not block:
            return
        ps = self.alloc.page_size
        if generation != self.generation:
            # Stale after clear(): refused if its pages are free, never freed twice.
            if all(t // ps in self.free_model for t in block[::ps]):
                with pytest.raises(AllocatorError):
                    self.alloc.free(block)
            return
        if split and len(block) > ps:
            cut = len(block) // ps // 2 * ps
            parts = [block[cut:], block[:cut]]
        else:
            parts = [block]
        for part in parts:
            assert self.alloc.free(torch.tensor(part)) == len(part)
            self.free_model |= {t // ps for t in part[::ps]}

    @rule(block=blocks)
    def double_free_is_refused(self, block):
        _, block = block
        if not block or (block[0] // self.alloc.page_size) not in self.free_model:
            return
        before = self.alloc.available_size()
        with pytest.raises(AllocatorError):
            self.alloc.free(block)
        assert self.alloc.available_size() == before

    @rule(offset=st.integers(1, 3))
    @precondition(lambda self: self.alloc is not None and self.alloc.page_size > 1)
    def partial_page_is_refused(self, offset):
        before = self.alloc.available_size()
        with pytest.raises(AllocatorError):
            self.alloc.free(list(range(offset, offset + self.alloc.page_size)))
        assert self.alloc.available_size() == before

    @rule()
    @precondition(lambda self: self.alloc is not None)
    def clear(self):
        self.alloc.clear()
        self.free_model = set(range(self.alloc.num_pages))
        self.generation += 1

    @invariant()
    def available_is_exact(self):
        if self.alloc is not None:
            assert self.alloc.available_size() == len(self.free_model) * self.alloc.page_size
            assert self.alloc.available_pages() == len(self.free_model)
            assert sorted(np.flatnonzero(~self.alloc._allocated).tolist()) == sorted(self.free_model)


AllocatorMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=60)
TestAllocatorMachine = AllocatorMachine.TestCase


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 9)), max_size=80), seed=st.integers(0, 1000))
@settings(max_examples=100)
def test_allocations_never_overlap_and_free_restores_everything(ops, seed):
    a = PageAllocator(64 * 4, 4)
    rng = np.random.default_rng(seed)
    live = []
    for is_alloc, n in ops:
        if is_alloc or not live:
            out = a.alloc(n * 4)
            if out is not None:
                live.append(out)
        else:
            a.free(live.pop(int(rng.integers(len(live)))))
        held = torch.cat(live) if live else torch.empty(0, dtype=torch.int64)
        assert held.unique().numel() == held.numel()
        assert a.available_size() + held.numel() == a.size
    for block in live:
        a.free(block)
    assert a.available_size() == a.size and a.free_runs() == 1


def test_prefers_one_contiguous_run_after_fragmentation():
    a = PageAllocator(100, 1)
    blocks = [a.alloc(10) for _ in range(10)]
    for b in blocks[::2]:
        a.free(b)
    a.free(blocks[1])  # frees 10..19, merging 0..29 into one run of 30
    out = a.alloc(25)
    assert torch.equal(out, torch.arange(out[0], out[0] + 25))


def test_thread_safety_under_contention():
    a = PageAllocator(4096, 16)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        mine = []
        try:
            for _ in range(300):
                if mine and rng.random() < 0.5:
                    a.free(mine.pop())
                else:
                    out = a.alloc(16 * int(rng.integers(1, 4)))
                    if out is not None:
                        mine.append(out)
            for b in mine:
                a.free(b)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert a.available_size() == a.size and a.free_runs() == 1


@pytest.mark.parametrize("bad, match", [
    (lambda a: a.alloc(3), "not a multiple of page_size"),
    (lambda a: a.alloc(-4), "non-negative"),
    (lambda a: a.alloc(4.0), "non-negative integer"),
    (lambda a: a.free([64, 65, 66, 67]), "out of range"),
    (lambda a: a.free([-4, -3, -2, -1]), "out of range"),
    (lambda a: a.free([4, 5, 6]), "whole number of pages"),
    (lambda a: a.free([5, 6, 7, 8]), "not one whole page"),
    (lambda a: a.free(torch.tensor([0.0, 1.0, 2.0, 3.0])), "integer"),
    (lambda a: a.free(torch.zeros(2, 4, dtype=torch.int64)), "one-dimensional"),
    (lambda a: a.free(list(range(4)) + list(range(4))), "twice"),
    (lambda a: a.free(np.arange(40, 40 + 4 * 6)), "not allocated"),
    (lambda a: a.free(np.concatenate([np.arange(8), np.arange(8)])), "twice"),
    (lambda a: a.free_pages([99]), "out of range"),
])
def test_bad_input_is_refused_and_changes_nothing(bad, match):
    a = PageAllocator(64, 4)
    held = a.alloc(32)
    state = (a.available_size(), a._allocated.copy(), dict(a._runs.by_start))
    with pytest.raises(AllocatorError, match=match):
        bad(a)
    assert (a.available_size(), dict(a._runs.by_start)) == (state[0], state[2])
    assert (a._allocated == state[1]).all()
    assert a.free(held) == 32


@pytest.mark.parametrize("size, page_size", [(0, 1), (3, 4), (16, 0), (16, 2.5)])
def test_bad_construction(size, page_size):
    with pytest.raises(ValueError):
        PageAllocator(size, page_size)


def test_alloc_returns_none_when_full_and_state_is_kept():
    a = PageAllocator(32, 8)
    first = a.alloc(32)
    assert a.alloc(8) is None
    assert a.available_size() == 0
    a.free(first)
    assert a.available_size() == 32


@settings(max_examples=60, deadline=None)
@given(pages=st.lists(st.integers(0, 2**31 - 1), max_size=300), page_size=st.integers(1, 300),
       cache_tokens=st.sampled_from([64, 1 << 20]))
def test_pages_to_tokens_expands_each_page_in_order(pages, page_size, cache_tokens):
    """Each page p as p*page_size .. p*page_size+page_size-1, int64 (no overflow past 2^31 slots),
    alike through the cached offsets and past them."""
    import kvtier.allocator as allocator
    saved = allocator.OFFSET_TOKENS, allocator._OFFSETS
    allocator.OFFSET_TOKENS, allocator._OFFSETS = cache_tokens, {}
    try:
        arr = np.array(pages, dtype=np.int32)
        got = allocator.pages_to_tokens(arr, page_size)
        half = allocator.pages_to_tokens(arr[: len(arr) // 2], page_size)
    finally:
        allocator.OFFSET_TOKENS, allocator._OFFSETS = saved
    assert got.dtype == np.int64
    assert got.tolist() == [p * page_size + k for p in pages for k in range(page_size)]
    assert half.tolist() == got[: len(arr) // 2 * page_size].tolist()
