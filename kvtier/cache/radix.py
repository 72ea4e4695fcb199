"""The radix tree: token ids at page granularity, with per-node residency.

Pure bookkeeping on ints: token ids, page ids (numpy arrays) and chain keys. No tensor,
pool, allocator or transfer appears here; the controller owns those and tells the tree what
became resident where.

Tokens are kept in the form they arrived in, so that neither form pays to convert the
other on the hot path: a node inserted from a Python list holds a list slice (8 bytes a
token plus the int objects), one inserted from an array or tensor an int64 copy (8 bytes a
token). A query of either form is compared a page run at a time, at C speed (list
equality on slices, numpy comparison), converting only the part compared where the forms
differ, and stopping at the first page that differs (:func:`same_pages`). A child is keyed
in its parent by its first token as a Python int (:func:`first_token`), which both forms give
alike; above page 1, a child whose first token a sibling already holds is keyed by its whole
first page instead (:func:`page_key`, a tuple of ints; the parent's ``spill`` counts those),
and a lookup compares the first token's child's first page before taking it. Device page ids
are int32 (a pool has fewer than 2^31 pages); host page ids are as the host allocator gives.

Shape of the tree (invariants the controller keeps and the tests check):

- every edge holds a whole number of pages; siblings differ in their first page;
- a node is resident in at least one tier: ``device`` (device page ids) or
  ``host`` (host page ids), possibly both;
- device residency is closed under ancestors: a node with device pages has
  a parent with device pages (or is a child of the root);
- ``hashes`` (the chain keys, one per page) is None until a page needs a key
  (:class:`~.hashing.ChainKeys`); a node with host pages has them, and so has
  the parent of a node that has them;
- ``lock_ref`` counts the requests holding a path through the node; a node
  is locked when it or any descendant is locked by a request;
- ``op`` is the transfer in flight on the node (a backup reading its device
  pages into ``host``, or a load writing ``device`` from ``host``); while
  set, neither tier's pages of the node may be freed;
- a node whose device pages are not ready and that has no op is *stale*: a
  load into them failed, so they hold no valid KV (its host copy does); it
  is loaded again into the same pages, or its device pages are freed once
  nothing holds it.
"""

from __future__ import annotations

import operator

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)
# Tokens compared per list slice: an early mismatch costs at most this much copying, and a
# 24k-token hit from a list takes ~90 us in slices of 4,096 against ~75 us in one (2-core CPU).
CHUNK_TOKENS = 4096
# Arrays up to this many tokens are compared as bytes (1,024: 0.8 us against 3 us for ==); longer
# ones with == (21,696: 7 us, where copying them out as bytes took 13-140 us). 2-core CPU.
MEMCMP_TOKENS = 4096


def first_token(tokens, pos: int) -> int:
    """The token at ``pos`` as a Python int (a list's own int, or an array element's value);
    ``ValueError`` naming it where it is not an integer (a list is not checked whole)."""
    t = tokens[pos]
    if type(t) is int:
        return t
    try:
        return operator.index(t)
    except TypeError:
        raise ValueError(f"token_ids must be integers, got {t!r} ({type(t).__name__}) at position {pos}") from None


def page_key(tokens, pos: int, page_size: int):
    """The key of the page at ``pos`` among its siblings: its token, or its tokens as a tuple."""
    if page_size == 1:
        return first_token(tokens, pos)
    page = tokens[pos : pos + page_size]
    return tuple(page) if type(page) is list else tuple(page.tolist())


def stored(tokens, start: int, end: int):
    """``tokens[start:end]`` for a node to keep: a list slice, or an int64 copy of an array."""
    part = tokens[start:end]
    return part if type(part) is list else part.copy()


def _as_list(tokens, start: int, n: int) -> list:
    part = tokens[start : start + n]
    return part if type(part) is list else part.tolist()


def _bisect(a: list, b: list, page_size: int) -> int:
    """Tokens in the whole pages before the first page where the lists differ (they do)."""
    lo, hi = 0, -(-len(a) // page_size)  # pages [0, lo) are equal; the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * page_size : mid * page_size] == b[lo * page_size : mid * page_size]:
            lo = mid
        else:
            hi = mid
    return lo * page_size


def same_pages(edge, e0: int, query, q0: int, n: int, page_size: int) -> int:
    """How many leading tokens (whole pages) of ``edge[e0:e0+n]`` and ``query[q0:q0+n]`` are
    equal; ``n`` is a whole number of pages. Either may be a list or an int64 array."""
    if type(edge) is not list and type(query) is not list:
        a, b = edge[e0 : e0 + n], query[q0 : q0 + n]
        if n <= MEMCMP_TOKENS and a.tobytes() == b.tobytes():  # both int64: two small copies and a memcmp
            return n
        ne = a != b
        first = int(ne.argmax()) if n else 0
        return first // page_size * page_size if n and ne[first] else n
    step = max(CHUNK_TOKENS // page_size, 1) * page_size
    done = 0
    while done < n:
        k = min(step, n - done)
        a, b = _as_list(edge, e0 + done, k), _as_list(query, q0 + done, k)
        if a != b:
            return done + _bisect(a, b, page_size)
        done += k
    return n


class Node:
    __slots__ = (
        "tokens", "key", "children", "parent", "namespace", "hashes",
        "device", "device_ready", "host", "host_ready", "dev_children",
        "lock_ref", "own_locks", "last_access", "hits", "op", "alive", "owner", "from_storage", "spill",
    )

    def __init__(self, tokens, parent: Node | None, namespace: str, key=None):
        self.tokens = tokens          # a list or an int64 array (see the module's docstring)
        self.key = key                # the key in the parent's children: first_token, or page_key (a spill)
        self.children: dict = {}
        self.spill = 0                # children keyed by page_key: a sibling holds their first token
        self.parent = parent
        self.namespace = namespace
        self.hashes: list[bytes] | None = None  # chain keys, one per page (a root: [seed]); None until needed
        self.device: np.ndarray | None = None
        self.device_ready = False     # False while a load is writing the pages
        self.host: np.ndarray | None = None
        self.host_ready = False       # False while a backup is writing the pages
        self.dev_children = 0         # children with device pages
        self.lock_ref = 0
        self.own_locks = 0            # locks taken at this node itself (lock_ref counts descendants' too)
        self.last_access = 0
        self.hits = 0
        self.op = None
        self.alive = True
        self.owner = None             # a root: its tree (a dropped root's handle is still its tree's)
        self.from_storage = False     # its host copy was read from storage, and is not loaded since

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def stale(self) -> bool:
        """Device pages a failed load left: allocated, holding no valid KV, nothing writing them."""
        return self.device is not None and not self.device_ready and self.op is None

    @property
    def is_root(self) -> bool:
        return self.parent is None and self.alive

    def __repr__(self) -> str:
        return (f"Node({len(self.tokens)} tokens, device={self.device is not None}/{self.device_ready}, "
                f"host={self.host is not None}/{self.host_ready}, lock={self.lock_ref}, op={self.op is not None})")


class RadixTree:
    """Per-namespace radix trees plus residency accounting (in pages)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.roots: dict[str, Node] = {}
        self.reset()

    def reset(self) -> None:
        """Forget every node; handles to roots stay valid (:meth:`drop_if_empty`)."""
        for node in self.nodes():
            node.alive = False
        for root in list(self.roots.values()):
            root.children.clear()
            root.dev_children = root.spill = 0
            self.drop_if_empty(root)
        # Insertion-ordered sets of the nodes holding pages in each tier.
        self.device_nodes: dict[Node, None] = {}
        self.host_nodes: dict[Node, None] = {}
        self.device_pages = 0
        self.device_locked_pages = 0
        self.host_pages = 0
        self.host_locked_pages = 0
        self.locked_nodes = 0
        self.clock = 0

    # -- structure -------------------------------------------------------

    def root(self, namespace: str, create: bool = False) -> Node | None:
        """The namespace's root; None if it has none, unless ``create``."""
        node = self.roots.get(namespace)
        if node is None and create:
            node = self.roots[namespace] = Node(_EMPTY, None, namespace)
            node.owner = self
        return node

    def drop_if_empty(self, root: Node) -> None:
        """Forget a namespace's root that holds nothing below it and no lock of its own.

        Else every namespace ever looked up, or cached and then evicted, would
        keep a root for good: a server keyed by user or adapter grows without
        bound. A handle to a dropped root stays usable: it is an empty match,
        and locking it holds nothing (its ``owner`` says which tree it was).
        """
        if (root.parent is None and not root.children and not root.own_locks
                and self.roots.get(root.namespace) is root):
            del self.roots[root.namespace]

    def walk(self, root: Node, tokens, limit: int | None = None) -> tuple[list[Node], int, tuple[Node, int] | None]:
        """Follow ``tokens`` (a list or an int64 array; whole pages of its first ``limit``,
        default all) down from ``root``; read-only.

        Returns ``(path, matched, partial)``: the fully matched nodes top-down,
        the tokens they cover, and ``(child, k)`` when the walk ended ``k``
        tokens (whole pages, k > 0) into ``child``'s edge.
        """
        ps = self.page_size
        n = len(tokens) if limit is None else limit
        n -= n % ps
        skip = 1 if ps == 1 else 0  # tokens a first-token key vouches for: the whole page at page 1
        node, pos, path = root, 0, []
        while pos < n:
            child, same = node.children.get(first_token(tokens, pos)), 0
            if child is not None:
                m = min(len(child.tokens), n - pos)
                same = skip + same_pages(child.tokens, skip, tokens, pos + skip, m - skip, ps)
            if same == 0 and node.spill:  # that child starts with another page: look for a spilled one
                child = node.children.get(page_key(tokens, pos, ps))
                if child is not None:
                    m = min(len(child.tokens), n - pos)
                    same = ps + same_pages(child.tokens, ps, tokens, pos + ps, m - ps, ps)
            if same == 0:
                break
            if same < m:
                return path, pos, (child, same)
            if m < len(child.tokens):
                return path, pos, (child, m)
            path.append(child)
            pos += m
            node = child
        return path, pos, None

    def walk_split(self, root: Node, tokens) -> tuple[list[Node], int]:
        """:meth:`walk`, the edge it ended inside split there: ``(path, matched)``, the path's last
        node ending exactly at the match."""
        path, matched, partial = self.walk(root, tokens)
        if partial is not None:
            path.append(self.split(*partial))
            matched += partial[1]
        return path, matched

    def split(self, node: Node, k: int) -> Node:
        """Cut ``node``'s edge after ``k`` tokens; returns the new upper node.

        ``node`` keeps the lower part (so a handle to it still ends where it
        did); residency, lock count, statistics and the op in flight are
        shared by both parts; the locks taken at ``node`` stay its own.
        """
        ps = self.page_size
        assert 0 < k < len(node) and k % ps == 0
        p = k // ps
        upper = Node(node.tokens[:k], node.parent, node.namespace, node.key)
        if node.hashes is not None:
            upper.hashes, node.hashes = node.hashes[:p], node.hashes[p:]
        upper.lock_ref, upper.last_access, upper.hits = node.lock_ref, node.last_access, node.hits
        upper.device_ready, upper.host_ready, upper.op = node.device_ready, node.host_ready, node.op
        upper.from_storage = node.from_storage
        if node.op is not None:
            node.op.nodes.append(upper)
        if node.device is not None:
            upper.device, node.device = node.device[:p], node.device[p:]
            upper.dev_children = 1
            self.device_nodes[upper] = None
        if node.host is not None:
            upper.host, node.host = node.host[:p], node.host[p:]
            self.host_nodes[upper] = None
        if node.lock_ref:
            self.locked_nodes += 1
        node.parent.children[node.key] = upper
        node.tokens, node.parent = node.tokens[k:], upper
        node.key = first_token(node.tokens, 0)  # upper's only child
        upper.children[node.key] = node
        return upper

    def add_leaf(self, parent: Node, tokens) -> Node:
        """A new child of ``parent`` holding ``tokens`` (kept as given: see :func:`stored`), with
        no residency yet (the caller sets it)."""
        key = first_token(tokens, 0)
        if key in parent.children:  # a sibling starts with that token (and, the walk found, another page)
            key = page_key(tokens, 0, self.page_size)
        assert key not in parent.children and len(tokens) % self.page_size == 0 and len(tokens)
        node = Node(tokens, parent, parent.namespace, key)
        parent.children[key] = node
        parent.spill += type(key) is tuple
        return node

    def remove(self, node: Node) -> None:
        """Unlink a childless node that holds no pages and no lock."""
        assert not node.children and node.device is None and node.host is None
        assert node.lock_ref == 0 and node.op is None and node.parent is not None
        parent = node.parent
        del parent.children[node.key]
        parent.spill -= type(node.key) is tuple
        node.parent = None
        node.alive = False
        self.drop_if_empty(parent)

    def path_to(self, node: Node) -> list[Node]:
        """Nodes from the root's child down to ``node``."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def nodes(self):
        """Every non-root node, parents before children."""
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def touch(self, nodes, hit: bool) -> None:
        self.clock += 1
        for node in nodes:
            node.last_access = self.clock
            node.hits += hit

    # -- locks -----------------------------------------------------------

    def lock(self, node: Node) -> None:
        node.own_locks += 1
        while node.parent is not None:
            if node.lock_ref == 0:
                self.locked_nodes += 1
                self.device_locked_pages += 0 if node.device is None else len(node.device)
                self.host_locked_pages += 0 if node.host is None else len(node.host)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        assert node.parent is None or node.lock_ref > 0
        node.own_locks -= 1
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_nodes -= 1
                self.device_locked_pages -= 0 if node.device is None else len(node.device)
                self.host_locked_pages -= 0 if node.host is None else len(node.host)
            node = node.parent
        self.drop_if_empty(node)

    # -- residency -------------------------------------------------------

    def set_device(self, node: Node, pages: np.ndarray, ready: bool) -> None:
        """Record ``pages`` (kept as an int32 copy: the caller's array may change) on ``node``."""
        assert node.device is None and len(pages) * self.page_size == len(node)
        assert node.parent.parent is None or node.parent.device is not None
        node.device, node.device_ready = pages.astype(np.int32), ready
        self.device_nodes[node] = None
        self.device_pages += len(pages)
        if node.lock_ref:
            self.device_locked_pages += len(pages)
        node.parent.dev_children += 1

    def drop_device(self, node: Node) -> np.ndarray:
        assert node.device is not None and node.dev_children == 0 and node.op is None
        pages, node.device, node.device_ready = node.device, None, False
        del self.device_nodes[node]
        self.device_pages -= len(pages)
        if node.lock_ref:
            self.device_locked_pages -= len(pages)
        node.parent.dev_children -= 1
        return pages

    def set_host(self, node: Node, pages: np.ndarray, ready: bool) -> None:
        assert node.host is None and len(pages) * self.page_size == len(node)
        node.host, node.host_ready = pages, ready
        self.host_nodes[node] = None
        self.host_pages += len(pages)
        if node.lock_ref:
            self.host_locked_pages += len(pages)

    def drop_host(self, node: Node) -> np.ndarray:
        assert node.host is not None and node.op is None
        pages, node.host, node.host_ready = node.host, None, False
        del self.host_nodes[node]
        self.host_pages -= len(pages)
        if node.lock_ref:
            self.host_locked_pages -= len(pages)
        return pages


def ready_prefix(path: list[Node]) -> int:
    """How many of ``path``'s first nodes hold their pages on the device, ready."""
    n = 0
    while n < len(path) and path[n].device is not None and path[n].device_ready:
        n += 1
    return n


def load_tokens(nodes: list[Node]) -> int:
    """Tokens of ``nodes`` that a load would move: on the host only, or stale on the device."""
    return sum(len(n) for n in nodes if n.device is None or n.stale)
