"""The baseline for ``kvtier bench cache``: a radix tree that compares token by token.

This is how a plain Python prefix cache works (one token a step, lists
for keys and slot values, children keyed by their first token). It is
correct and simple; the benchmark measures how much page-granular,
vectorised matching saves against it in the same run.
"""

from __future__ import annotations


class RefNode:
    __slots__ = ("key", "value", "children")

    def __init__(self, key: list[int], value: list[int]):
        self.key, self.value = key, value
        self.children: dict[int, RefNode] = {}


def _common(key: list[int], tokens: list[int], pos: int) -> int:
    n = min(len(key), len(tokens) - pos)
    i = 0
    while i < n and key[i] == tokens[pos + i]:
        i += 1
    return i


class ReferenceRadixTree:
    def __init__(self):
        self.root = RefNode([], [])
        self.size = 0

    def match(self, tokens: list[int]) -> list[int]:
        """Slot values of the longest cached prefix of ``tokens``."""
        node, pos, out = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common(child.key, tokens, pos)
            out += child.value[:k]
            pos += k
            if k < len(child.key):
                break
            node = child
        return out

    def insert(self, tokens: list[int], values: list[int]) -> int:
        """Cache ``tokens`` with ``values``; returns how many were already cached."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                node.children[tokens[pos]] = RefNode(tokens[pos:], values[pos:])
                self.size += len(tokens) - pos
                return pos
            k = _common(child.key, tokens, pos)
            if k < len(child.key):
                upper = RefNode(child.key[:k], child.value[:k])
                child.key, child.value = child.key[k:], child.value[k:]
                upper.children[child.key[0]] = child
                node.children[tokens[pos]] = upper
                child = upper
            pos += k
            node = child
        return pos
