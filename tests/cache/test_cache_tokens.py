"""Token ids in either form (lists, arrays, tensors) and the slot checks of an insert, against
brute force: page comparison, child keys, walks over mixed trees, page runs, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cache_testlib import make_cache, serve
from kvtier.cache.checks import MAX_RUNS, PageRuns, as_tokens
from kvtier.cache.radix import CHUNK_TOKENS, MEMCMP_TOKENS, RadixTree, first_token, page_key, same_pages, stored

FORMS = [list, lambda xs: np.array(xs, dtype=np.int64)]


def brute_same(a, b, ps):
    n = 0
    while n + ps <= min(len(a), len(b)) and list(a[n : n + ps]) == list(b[n : n + ps]):
        n += ps
    return n


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=60), st.data(), st.sampled_from([1, 2, 3, 8]),
       st.sampled_from(FORMS), st.sampled_from(FORMS))
def test_same_pages_matches_brute_force_in_every_form(a, data, ps, fa, fb):
    b = data.draw(st.lists(st.integers(0, 3), min_size=len(a), max_size=len(a)))
    if a and data.draw(st.booleans()):
        b = list(a)  # often equal, so that long runs get compared
        if data.draw(st.booleans()):
            b[data.draw(st.integers(0, len(a) - 1))] = 9
    e0, q0 = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    edge, query = fa([7] * e0 + a), fb([5] * q0 + b)
    n = min(len(a), len(b)) // ps * ps
    assert same_pages(edge, e0, query, q0, n, ps) == brute_same(a[:n], b[:n], ps)


def test_same_pages_across_chunks():
    """Long runs: lists compared a chunk at a time, arrays as bytes up to MEMCMP_TOKENS and with == past it."""
    a = list(range(3 * CHUNK_TOKENS + 64))
    for at in (0, 5, CHUNK_TOKENS - 1, CHUNK_TOKENS, 2 * CHUNK_TOKENS + 7, len(a) - 1):
        b = list(a)
        b[at] = -1
        for ps in (1, 64):
            n = len(a) // ps * ps
            for fa in FORMS:
                assert same_pages(fa(a), 0, b, 0, n, ps) == at // ps * ps
                assert same_pages(b, 0, fa(a), 0, n, ps) == at // ps * ps
            arr_a, arr_b = np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)  # as bytes, and with ==
            for length in (MEMCMP_TOKENS // ps * ps, n):
                want = at // ps * ps if at < length else length
                assert same_pages(arr_a, 0, arr_b, 0, length, ps) == want == same_pages(arr_b, 0, arr_a, 0, length, ps)


@given(st.lists(st.integers(0, 2**40), min_size=4, max_size=12), st.sampled_from([1, 2, 4]))
def test_page_keys_and_stored_tokens_agree_across_forms(xs, ps):
    arr = np.array(xs, dtype=np.int64)
    assert page_key(xs, 0, ps) == page_key(arr, 0, ps) == page_key(torch.tensor(xs).numpy(), 0, ps)
    assert hash(page_key(xs, 0, ps)) == hash(page_key(arr, 0, ps))
    assert first_token(xs, 1) == first_token(arr, 1) == xs[1] and type(first_token(arr, 1)) is int
    kept = stored(arr, 1, 3)
    arr[1] = -5                       # the caller's array changes; the kept copy does not
    assert kept.tolist() == xs[1:3] and stored(xs, 1, 3) == xs[1:3]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=12), st.sampled_from([0, 1])),
                min_size=1, max_size=8), st.lists(st.integers(0, 2), max_size=14), st.sampled_from([0, 1]),
       st.sampled_from([1, 2]))
def test_walk_over_a_mixed_tree_finds_the_longest_common_prefix(seqs, query, qform, ps):
    """Nodes from lists and arrays side by side; a query of either form finds what brute force does."""
    tree, inserted = RadixTree(ps), []
    root = tree.root("ns", create=True)
    for seq, form in seqs:
        seq = seq[: len(seq) // ps * ps]
        if not seq:
            continue
        path, matched, partial = tree.walk(root, FORMS[form](seq))
        if partial is not None:
            path.append(tree.split(*partial))
            matched += partial[1]
        if matched < len(seq):
            tree.add_leaf(path[-1] if path else root, stored(FORMS[form](seq), matched, len(seq)))
        inserted.append(seq)
    path, matched, partial = tree.walk(root, FORMS[qform](query))
    got = matched + (partial[1] if partial else 0)
    assert got == max([brute_same(s, query, ps) for s in inserted] or [0])


@pytest.mark.parametrize("form", FORMS)
def test_siblings_that_share_a_first_token_are_found_and_removed_apart(form):
    """Above page 1 a child is keyed by its first token; siblings starting with the same token are
    keyed by their first page (spilled), found by either form, and stay found as others go."""
    tree = RadixTree(4)
    root = tree.root("ns", create=True)
    seqs = [[7, 1, 1, 1, 5, 5, 5, 5], [7, 2, 2, 2, 6, 6, 6, 6], [7, 3, 3, 3], [8, 1, 1, 1]]
    leaves = [tree.add_leaf(root, stored(form(s), 0, len(s))) for s in seqs]
    assert [type(n.key) for n in leaves] == [int, tuple, tuple, int] and root.spill == 2
    for seq in seqs:
        for query in (seq, np.array(seq, dtype=np.int64)):
            assert tree.walk(root, query)[1] == len(seq)
    assert tree.walk(root, [7, 4, 4, 4])[1] == 0 and tree.walk(root, [7, 1, 1, 1, 5, 5, 5, 9])[2][1] == 4
    tree.remove(leaves[0])                      # the token's own key goes; the spilled siblings stay found
    assert tree.walk(root, seqs[1])[1] == 8 and tree.walk(root, seqs[2])[1] == 4 and tree.walk(root, seqs[0])[1] == 0
    upper = tree.split(leaves[1], 4)            # the upper part keeps the spilled key; below it, a token key
    assert upper.key == (7, 2, 2, 2) and leaves[1].key == 6 and root.spill == 2
    back = tree.add_leaf(root, form(seqs[0]))   # the free token key is taken again
    assert back.key == 7 and tree.walk(root, seqs[0])[1] == 8 and tree.walk(root, seqs[1])[1] == 8


def test_a_cache_serves_lists_arrays_and_tensors_alike():
    cache, dev, *_ = make_cache(host_pages=0, dev_pages=16)
    seq = list(range(40, 56))
    serve(cache, seq)                                        # inserted from a tensor (serve's form)
    for form in (list, tuple, np.array, torch.tensor, lambda s: np.array(s, dtype=np.int32)):
        assert cache.match_prefix(form(seq)).device_len == 16
    slots = cache.alloc_device(8)
    assert cache.insert(seq[:8] + [1, 2, 3, 4, 5, 6, 7, 8], torch.cat([cache.match_prefix(seq[:8]).device_indices,
                                                                       slots[:8]])) == 8
    assert cache.match_prefix(np.array(seq[:8] + [1, 2, 3, 4, 5, 6, 7, 8])).device_len == 16
    cache.check()


@pytest.mark.parametrize("bad,needle", [([1.5, 2], "integers"), ([1, "x"], "integers"), ([True, 1], "integers"),
                                         (np.zeros((2, 2), dtype=np.int64), "one-dimensional"),
                                         (torch.zeros(3), "integers")])
def test_bad_token_ids_are_refused_with_the_value(bad, needle):
    with pytest.raises(ValueError, match=needle):
        as_tokens(bad)


def test_a_list_with_a_bad_value_inside_is_refused_when_its_key_is_computed():
    cache, *_ = make_cache(host_pages=0)
    with pytest.raises(ValueError, match="token ids must be integers"):
        cache.page_hashes([1, 2.5, 3, 4])


@pytest.mark.parametrize("bad", ["x", 2.5])
def test_a_bad_value_where_the_walk_looks_up_a_child_is_refused_before_any_change(bad):
    cache, *_ = make_cache(host_pages=0, page_size=2)
    serve(cache, list(range(10, 18)))
    query = list(range(10, 18)) + [bad, 1]
    slots = cache.alloc_device(2)
    for call in (lambda: cache.match_prefix(query),
                 lambda: cache.insert(query, torch.cat([cache.match_prefix(query[:8]).device_indices, slots]))):
        with pytest.raises(ValueError, match=f"token_ids must be integers, got {bad!r} .* at position 8"):
            call()
    assert cache.match_prefix(list(range(10, 18))).device_len == 8
    cache.free_device(slots)
    cache.check()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=80), st.sampled_from([1, 2, 4]), st.booleans())
def test_page_runs_match_brute_force(slots, ps, ordered):
    if ordered:
        slots = sorted(slots)
    arr = np.array(slots, dtype=np.int64)
    whole = len(slots) % ps == 0 and all(
        slots[i] == slots[i - i % ps] + i % ps and slots[i - i % ps] % ps == 0 for i in range(len(slots)))
    in_range = all(0 <= s < 40 for s in slots)
    if not (whole and in_range):
        with pytest.raises(ValueError):
            PageRuns.of_slots(arr, ps, 40)
        return
    runs = PageRuns.of_slots(arr, ps, 40)
    pages = [s // ps for s in slots[::ps]]
    assert runs.pages.tolist() == pages
    dup = len(set(pages)) != len(pages)
    assert (runs.repeated() is not None) == dup and (not dup or pages.count(runs.repeated()) > 1)
    marks = np.zeros(40, dtype=np.int8)
    marks[pages[: len(pages) // 2]] = 1
    first = next((p for p in pages if marks[p] != 1), None)
    assert runs.first_not(marks, 1) == first
    runs.mark(marks, 2)
    assert sorted(set(np.flatnonzero(marks == 2).tolist())) == sorted(set(pages))
    for k in range(len(pages) + 1):  # an insert takes the tree's part and the new part apart
        tail = PageRuns.of_slots(arr[k * ps :], ps, 40, base=k * ps)
        assert tail.pages.tolist() == pages[k:]
        assert tail.runs is None or [p for _, f, n in tail.runs for p in range(f, f + n)] == pages[k:]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 10), st.sampled_from([0, 0, 0, 1])), max_size=12),
       st.sampled_from([2, 4]), st.booleans())
def test_unchecked_page_runs_read_each_page_first_slot(pairs, ps, run):
    if run:  # consecutive pages, as an allocator hands them out
        pairs = [(pairs[0][0] + i, off) for i, (_, off) in enumerate(pairs)] if pairs else []
    firsts = [p * ps + off for p, off in pairs]
    arr = np.repeat(np.array(firsts, dtype=np.int64), ps)  # only each page's first slot is read
    if not all(0 <= f < 40 and f % ps == 0 for f in firsts):
        with pytest.raises(ValueError):
            PageRuns.of_slots(arr, ps, 40, whole=False)
        return
    runs = PageRuns.of_slots(arr, ps, 40, whole=False)
    pages = [f // ps for f in firsts]
    assert runs.pages.tolist() == pages
    assert runs.runs is None or [p for _, f, n in runs.runs for p in range(f, f + n)] == pages


def test_many_runs_take_the_gather_path():
    pages = np.arange(0, 4 * (MAX_RUNS + 1), 2)
    runs = PageRuns(pages)
    assert runs.runs is None and runs.repeated() is None
    assert PageRuns(np.append(pages, pages[3])).repeated() == pages[3]


def test_keys_are_computed_when_a_backup_starts_not_on_insert():
    cache, dev, host, engine = make_cache(held=False, write_policy="write_back", dev_pages=16)
    serve(cache, list(range(40, 56)))
    assert all(n.hashes is None for n in cache.tree.nodes())      # write_back: no backup, no key
    cache.evict_device(10**6)                                     # demoted: backed up first
    nodes = list(cache.tree.nodes())
    assert nodes and all(n.host is not None and n.hashes is not None for n in nodes)
    assert [h for n in nodes for h in n.hashes] == cache.page_hashes(list(range(40, 56)))
    cache.check()
