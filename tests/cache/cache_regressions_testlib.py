"""What the cache regression tests share (test_cache_regressions.py and
test_cache_regressions_later.py beside this file)."""

from __future__ import annotations

import torch

from cache_testlib import kv_values, write_kv


def _put(cache, dev, seq):
    """Serve ``seq`` with nothing to load: compute what the device lacks, insert, unlock."""
    m = cache.match_prefix(seq, lock=True)
    own = cache.alloc_device(len(seq) - m.device_len)
    write_kv(dev, own, kv_values(seq, 0)[m.device_len:])
    cache.insert(seq, torch.cat([m.device_indices, own]))
    cache.unlock(m.node)
