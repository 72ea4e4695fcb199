"""What holds of a cache between its calls: :func:`check_cache`, behind ``HiCache.check()``.

Each check raises :class:`~kvtier.validate.InvariantError` naming the first thing broken.
Reads only: the tree, the tiers' page owners and allocators, the transfers in flight.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ..validate import InvariantError
from .inflight import BACKUP, LOAD
from .radix import Node, RadixTree, first_token, page_key
from .tiers import FREE, REQUEST, TREE, concat


def check_cache(cache) -> None:
    """Every invariant of ``cache`` (a :class:`~.controller.HiCache`), under its lock."""
    tiers, tree = cache.tiers, cache.tree
    nodes = list(tree.nodes())
    check_tree(tree, nodes)
    check_device_pages(tiers, nodes)
    held = cache.storage.held_pages() if cache.storage is not None else []
    if tiers.host_alloc is not None:
        check_host_pages(tiers, nodes, held)
    check_inflight(tiers, nodes)
    if cache.storage is not None:
        check_prefetches(cache.storage, tree)


def _fail(node: Node | None, what: str):
    raise InvariantError(what if node is None else f"{node!r}: {what}")


def check_tree(tree: RadixTree, nodes: list[Node]) -> None:
    """Shape, residency and locks of every node, and the tree's counters."""
    ps = tree.page_size
    below: Counter = Counter()  # lock_ref each node's children hold
    for n in nodes:
        if not n.alive or n.parent is None or n.parent.children.get(n.key) is not n or len(n) == 0 \
                or n.key not in (first_token(n.tokens, 0), page_key(n.tokens, 0, ps)):
            _fail(n, "is not linked into the tree under its first token or page")
        _check_children(n, ps)
        keys = -1 if n.hashes is None else len(n.hashes)
        if len(n) == 0 or len(n) % ps or (n.hashes is not None and keys * ps != len(n)):
            _fail(n, f"holds {len(n)} tokens and {keys} chain keys for pages of {ps}")
        if n.host is not None and n.hashes is None:
            _fail(n, "holds host pages but no chain keys")
        if n.hashes is not None and n.parent.hashes is None:
            _fail(n, "has chain keys while its parent has none")
        if n.device is None and n.host is None:
            _fail(n, "is resident in no tier")
        for tier, pages in (("device", n.device), ("host", n.host)):
            if pages is not None and len(pages) * ps != len(n):
                _fail(n, f"holds {len(pages)} {tier} pages for {len(n)} tokens")
        if n.device is not None and n.parent.parent is not None and n.parent.device is None:
            _fail(n, "is on the device while its parent is not")
        if n.dev_children != sum(c.device is not None for c in n.children.values()):
            _fail(n, f"counts {n.dev_children} children on the device")
        below[n.parent] += n.lock_ref
    for root in tree.roots.values():
        _check_children(root, ps)
    for n in nodes:
        if n.lock_ref != n.own_locks + below[n] or n.own_locks < 0:
            _fail(n, f"lock_ref {n.lock_ref} is not its own {n.own_locks} locks plus its children's {below[n]}")
    _check_counters(tree, nodes)


def _check_children(n: Node, ps: int) -> None:
    """Siblings differ in their first page; ``spill`` counts the children keyed by theirs."""
    pages = {page_key(c.tokens, 0, ps) for c in n.children.values()}
    if len(pages) != len(n.children):
        _fail(n, f"has {len(n.children)} children but {len(pages)} distinct first pages")
    if n.spill != sum(type(k) is tuple for k in n.children):
        _fail(n, f"counts {n.spill} children keyed by their first page")


def _check_counters(tree: RadixTree, nodes: list[Node]) -> None:
    locked = [n for n in nodes if n.lock_ref]
    dev = [n for n in nodes if n.device is not None]
    host = [n for n in nodes if n.host is not None]
    expect = {
        "device_pages": sum(len(n.device) for n in dev), "host_pages": sum(len(n.host) for n in host),
        "device_locked_pages": sum(len(n.device) for n in locked if n.device is not None),
        "host_locked_pages": sum(len(n.host) for n in locked if n.host is not None),
        "locked_nodes": len(locked),
    }
    for name, value in expect.items():
        if getattr(tree, name) != value:
            _fail(None, f"the tree counts {name}={getattr(tree, name)} but its nodes hold {value}")
    if set(tree.device_nodes) != set(dev) or set(tree.host_nodes) != set(host):
        _fail(None, "the tree's sets of device and host nodes are not the nodes holding pages there")


def _unique(pages: np.ndarray, what: str) -> None:
    if len(np.unique(pages)) != len(pages):
        values, counts = np.unique(pages, return_counts=True)
        _fail(None, f"{what} page {int(values[counts > 1][0])} is held twice")


def check_device_pages(tiers, nodes: list[Node]) -> None:
    """Every device page is free, a request's, or exactly one node's (a load in flight writes
    pages recorded on its nodes), and the allocator agrees."""
    alloc = tiers.device_alloc
    alloc.check()
    tree_pages = concat([n.device for n in nodes if n.device is not None])
    _unique(tree_pages, "device")
    owner = tiers.owner
    marked = np.flatnonzero(owner == TREE)
    if len(marked) != len(tree_pages) or not np.array_equal(np.sort(tree_pages), marked):
        _fail(None, f"{len(marked)} device pages are marked the tree's, its nodes hold {len(tree_pages)}")
    allocated = alloc.allocated_mask()
    if not np.array_equal(allocated, owner != FREE):
        page = int(np.flatnonzero(allocated != (owner != FREE))[0])
        _fail(None, f"device page {page} is {'allocated' if allocated[page] else 'free'} in the allocator "
                    f"but {['free', 'a request', 'the tree'][owner[page]]}'s by its owner mark")
    if not set(np.unique(owner).tolist()) <= {FREE, REQUEST, TREE}:
        _fail(None, "a device page has an owner mark that is none of free, request, tree")


def check_host_pages(tiers, nodes: list[Node], prefetching: list[np.ndarray] = ()) -> None:
    """Host pages of nodes, of offers to the storage hook and of storage prefetches in flight
    are allocated, each held once (the host pool's allocator may hand out other pages too)."""
    alloc = tiers.host_alloc
    alloc.check()
    held = concat([n.host for n in nodes if n.host is not None] + tiers.held_for_offers() + list(prefetching))
    _unique(held, "host")
    allocated = alloc.allocated_mask()[held]
    if not allocated.all():
        _fail(None, f"host page {int(held[np.argmin(allocated)])} is held but free in the allocator")


def check_inflight(tiers, nodes: list[Node]) -> None:
    """Queues within bounds; each op's nodes point back at it, in the state of its kind; a node
    not ready has an op (or is stale: a failed load's, on the device only); locked nodes are
    resident (checked with the tree); nothing pending an offer is a node's."""
    ops = {}
    for kind, queue in tiers.inflight.queues.items():
        if len(queue) > tiers.inflight.limits[kind]:
            _fail(None, f"{len(queue)} {kind}s in flight, more than the bound {tiers.inflight.limits[kind]}")
        for op in queue:
            if op.kind != kind:
                _fail(None, f"a {op.kind} sits in the {kind} queue")
            ops[id(op)] = op
            for n in op.nodes:
                _check_op_node(op, n)
    for n in nodes:
        if n.op is not None and id(n.op) not in ops:
            _fail(n, "names a transfer that is not in flight")
        if n.host is not None and not n.host_ready and n.op is None:
            _fail(n, "has host pages not ready and no backup writing them")
        if n.stale and n.host is None:
            _fail(n, "is stale (a failed load's pages) with no host copy")


def _check_op_node(op, n: Node) -> None:
    if n.op is not op or not n.alive:
        _fail(n, f"is in a {op.kind} in flight that it does not name (or it left the tree)")
    if op.kind == LOAD and (n.device is None or n.device_ready or n.host is None or not n.host_ready):
        _fail(n, "is being loaded but is not a ready host copy with device pages not ready")
    if op.kind == BACKUP and (n.host is None or n.host_ready or n.device is None or not n.device_ready):
        _fail(n, "is being backed up but is not a ready device copy with host pages not ready")


def check_prefetches(storage, tree: RadixTree) -> None:
    """Each storage prefetch in flight is filed under its anchor and first key, holds one host
    page per key, and holds a lock of its own on its anchor, a live node of the tree."""
    anchored: Counter = Counter()
    for (anchor, first), pf in storage.pending.items():
        if pf.anchor is not anchor or pf.keys[0] != first or pf.done:
            _fail(anchor, "files a storage prefetch that is not its own, or one completed")
        if len(pf.pages) != len(pf.keys) or len(pf.tokens) != len(pf.keys) * tree.page_size:
            _fail(anchor, f"has a prefetch of {len(pf.keys)} keys into {len(pf.pages)} host pages")
        if not anchor.alive:
            _fail(anchor, "anchors a storage prefetch but left the tree")
        anchored[anchor] += 1
    for anchor, n in anchored.items():
        if anchor.own_locks < n:
            _fail(anchor, f"anchors {n} storage prefetches but holds {anchor.own_locks} locks of its own")
