"""kvtier's streams keep off one another and off the callers' (kvtier.transfer.streams).

PyTorch hands out its 32 pooled streams per priority in turn. The GPU side, where real
pooled streams alias and kvtier repairs them, is in tests/transfer_gpu/test_transfer_gpu_ordering.py
(``test_*alias*``). Here: the search over a pool that goes round, and the clash rule.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from kvtier.transfer import streams


@given(pool=st.integers(1, 40), start=st.integers(0, 200), avoid=st.sets(st.integers(0, 39), max_size=40))
def test_a_round_robin_pool_yields_a_stream_outside_the_avoided_ones_within_one_round(pool, start, avoid):
    avoid = {a for a in avoid if a < pool}
    counter = itertools.count(start)
    draws = []

    def draw():
        h = next(counter) % pool
        draws.append(h)
        return f"stream {h}", h
    item, handle, distinct = streams.pick_distinct(draw, avoid, tries=pool + 1)
    assert item == f"stream {handle}" and handle == draws[-1]
    if len(avoid) < pool:
        assert distinct and handle not in avoid
        assert len(draws) <= pool  # found within one round of the pool
        assert all(h in avoid for h in draws[:-1])  # and at the first free one
    else:
        assert not distinct and len(draws) == pool + 1


def test_a_stream_clashes_with_a_callers_stream_or_one_it_is_given_unless_repair_is_off():
    mine, other, caller = (SimpleNamespace(cuda_stream=h) for h in (7001, 7002, 7003))
    assert not streams.clashes(mine, other)
    assert streams.clashes(mine, SimpleNamespace(cuda_stream=7001))
    streams.note_caller(SimpleNamespace(cuda_stream=7001))
    try:
        assert streams.clashes(mine) and not streams.clashes(caller)
        streams.repair = False
        assert not streams.clashes(mine, SimpleNamespace(cuda_stream=7001))
    finally:
        streams.repair = True
        streams._callers.discard(7001)


def test_an_owners_streams_count_as_taken_while_it_lives():
    """Engines and staging rings register as owners; a dropped one gives its streams back
    (held weakly: PyTorch's stream objects cannot take weak references safely)."""
    import gc

    class Owner:
        def __init__(self, *handles):
            self.s = [SimpleNamespace(cuda_stream=h) for h in handles] + [None]

        def kvtier_streams(self):
            return self.s
    owner = Owner(9001, 9002)
    streams.register(owner)
    assert {9001, 9002} <= streams._taken()
    del owner
    gc.collect()
    assert not {9001, 9002} & streams._taken()
