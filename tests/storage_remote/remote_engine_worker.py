"""One engine rank in its own process, over a shared remote store (run by test_remote_engines.py).
Each action is ``save`` (fill a host pool from a seed, save a chain of pages through a storage
tier of its own) or ``load`` (prefetch the chain into a fresh host pool). Prints one JSON line:
per action, the tier's lookup before acting, the pages' canonical digests and its counters."""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "storage")]

from storage_testlib import canonical_page, chain, salt_of, slots_of, small_pools  # noqa: E402
from kvtier.storage import backend_class  # noqa: E402
from kvtier.storage.tier import StorageTier, TierConfig  # noqa: E402

PAGES = 4


def act(backend, rank: int, action: str) -> dict:
    """``save:<kind>:<seed>`` or ``load:<kind>:<seed>`` through a tier of its own over ``backend``."""
    role, kind, seed = action.split(":")
    _, (host,) = small_pools(kind, ("layer_first",), page_size=4, pages=2 * PAGES, seed=int(seed))
    salt = salt_of(host, tp_rank=rank, tp_size=2) if kind == "mha" else salt_of(host)
    tier = StorageTier(backend, salt, TierConfig())
    keys = chain(PAGES, tag=42)
    found = tier.lookup(keys)
    if role == "save":
        assert tier.save(keys, None, host, slots_of(range(PAGES), 4)) == PAGES and tier.flush(60)
        pages = range(PAGES)
    else:
        handle = tier.prefetch(keys, host, slots_of(range(PAGES, 2 * PAGES), 4))
        assert handle.wait(60) == PAGES, handle.outcome
        pages = range(PAGES, 2 * PAGES)
    metrics = tier.metrics.snapshot()
    return {"found": found, "digests": [hashlib.sha256(canonical_page(host, p)).hexdigest() for p in pages],
            "skipped": metrics["save_skipped_pages_total"], "written": metrics["written_pages_total"]}


def main(backend_name: str, config_json: str, rank: int, actions: list[str]) -> None:
    cls = backend_class(backend_name)
    fields = json.loads(config_json)
    if "nodes" in fields:  # JSON has no tuples
        fields["nodes"] = tuple(tuple(n) for n in fields["nodes"])
    backend = cls(cls.config_class(**fields))
    print(json.dumps([act(backend, rank, a) for a in actions]))
    backend.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
