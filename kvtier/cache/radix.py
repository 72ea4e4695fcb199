"""The radix tree: token ids at page granularity, with per-node residency.

Pure bookkeeping on ints: token ids, page ids (numpy int64 arrays) and
hashes. No tensor, pool, allocator or transfer appears here; the
controller owns those and tells the tree what became resident where.

Shape of the tree (invariants the controller keeps and the tests check):

- every edge holds a whole number of pages; a child is keyed in its parent
  by the bytes of its first page, so siblings differ in their first page;
- a node is resident in at least one tier: ``device`` (device page ids) or
  ``host`` (host page ids), possibly both;
- device residency is closed under ancestors: a node with device pages has
  a parent with device pages (or is a child of the root);
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

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)


class Node:
    __slots__ = (
        "tokens", "children", "parent", "namespace", "hashes",
        "device", "device_ready", "host", "host_ready", "dev_children",
        "lock_ref", "own_locks", "last_access", "hits", "op", "alive", "owner",
    )

    def __init__(self, tokens: np.ndarray, parent: Node | None, namespace: str, hashes: list[bytes]):
        self.tokens = tokens
        self.children: dict[bytes, Node] = {}
        self.parent = parent
        self.namespace = namespace
        self.hashes = hashes          # one per page (the root: the namespace seed)
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
            root.dev_children = 0
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

    def root(self, namespace: str, seed: bytes | None = None) -> Node | None:
        """The namespace's root; created (with hash seed ``seed``) when given one."""
        node = self.roots.get(namespace)
        if node is None and seed is not None:
            node = self.roots[namespace] = Node(_EMPTY, None, namespace, [seed])
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

    def walk(self, root: Node, tokens: np.ndarray) -> tuple[list[Node], int, tuple[Node, int] | None]:
        """Follow ``tokens`` (whole pages only) down from ``root``; read-only.

        Returns ``(path, matched, partial)``: the fully matched nodes top-down,
        the tokens they cover, and ``(child, k)`` when the walk ended ``k``
        tokens (whole pages, k > 0) into ``child``'s edge.
        """
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        node, pos, path = root, 0, []
        while pos < n:
            child = node.children.get(tokens[pos : pos + ps].tobytes())
            if child is None:
                break
            edge = child.tokens
            m = min(len(edge), n - pos)
            if m > ps:  # the first page is equal: it was the key
                ne = edge[ps:m] != tokens[pos + ps : pos + m]
                first = int(ne.argmax())
                if ne[first]:
                    return path, pos, (child, (first + ps) // ps * ps)
            if m < len(edge):
                return path, pos, (child, m)
            path.append(child)
            pos += m
            node = child
        return path, pos, None

    def split(self, node: Node, k: int) -> Node:
        """Cut ``node``'s edge after ``k`` tokens; returns the new upper node.

        ``node`` keeps the lower part (so a handle to it still ends where it
        did); residency, lock count, statistics and the op in flight are
        shared by both parts; the locks taken at ``node`` stay its own.
        """
        ps = self.page_size
        assert 0 < k < len(node) and k % ps == 0
        p = k // ps
        upper = Node(node.tokens[:k], node.parent, node.namespace, node.hashes[:p])
        upper.lock_ref, upper.last_access, upper.hits = node.lock_ref, node.last_access, node.hits
        upper.device_ready, upper.host_ready, upper.op = node.device_ready, node.host_ready, node.op
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
        key = node.tokens[:ps].tobytes()
        node.parent.children[key] = upper
        node.tokens, node.hashes, node.parent = node.tokens[k:], node.hashes[p:], upper
        upper.children[node.tokens[:ps].tobytes()] = node
        return upper

    def add_leaf(self, parent: Node, tokens: np.ndarray, hashes: list[bytes]) -> Node:
        """A new child of ``parent`` with no residency yet (the caller sets it)."""
        key = tokens[: self.page_size].tobytes()
        assert key not in parent.children and len(tokens) % self.page_size == 0 and len(tokens)
        node = Node(tokens, parent, parent.namespace, hashes)
        parent.children[key] = node
        return node

    def remove(self, node: Node) -> None:
        """Unlink a childless node that holds no pages and no lock."""
        assert not node.children and node.device is None and node.host is None
        assert node.lock_ref == 0 and node.op is None and node.parent is not None
        parent = node.parent
        del parent.children[node.tokens[: self.page_size].tobytes()]
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
        assert node.device is None and len(pages) * self.page_size == len(node)
        assert node.parent.parent is None or node.parent.device is not None
        node.device, node.device_ready = pages, ready
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
