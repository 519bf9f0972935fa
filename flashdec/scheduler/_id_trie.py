"""A persistent hash trie from request id to submission order.

A view of the waiting queue answers "is this id waiting, and where?" in O(1) while it is the
queue's current state (the queue's dicts); an older view needs its own index, and this one costs
O(log32 n) per update — four or so 32-slot tuples copied — and per lookup.

A node is a 32-tuple of slots (``None``, a sub-node or a ``Bucket``), indexed by successive
5-bit chunks of the id's hash; a bucket holds the ids of one full hash.
"""

from __future__ import annotations

from typing import Any

_WIDTH = 32
_BITS = 5
_MASK64 = (1 << 64) - 1


class Bucket:
    __slots__ = ("hash", "pairs")

    def __init__(self, hash_: int, pairs: tuple[tuple[Any, int], ...]) -> None:
        self.hash = hash_
        self.pairs = pairs  # ((request_id, submission_order), ...)


Trie = tuple | Bucket | None


def lookup(node: Trie, request_id: Any) -> int | None:
    """The submission order stored for ``request_id``, or None."""
    h = hash(request_id) & _MASK64
    shift = 0
    while node is not None:
        if isinstance(node, Bucket):
            if node.hash == h:
                for rid, order in node.pairs:
                    if rid == request_id:
                        return order
            return None
        node = node[(h >> shift) & (_WIDTH - 1)]
        shift += _BITS
    return None


def insert(node: Trie, request_id: Any, order: int) -> Trie:
    """``node`` plus ``request_id -> order`` (the id must be absent)."""
    return _insert(node, hash(request_id) & _MASK64, request_id, order, 0)


def _insert(node: Trie, h: int, request_id: Any, order: int, shift: int) -> Trie:
    if node is None:
        return Bucket(h, ((request_id, order),))
    if isinstance(node, Bucket):
        if node.hash == h:
            return Bucket(h, (*node.pairs, (request_id, order)))
        # two hashes meet here: push the bucket one level down and insert beside it
        slots: list[Trie] = [None] * _WIDTH
        slots[(node.hash >> shift) & (_WIDTH - 1)] = node
        node = tuple(slots)
    i = (h >> shift) & (_WIDTH - 1)
    return (*node[:i], _insert(node[i], h, request_id, order, shift + _BITS), *node[i + 1 :])


def delete(node: Trie, request_id: Any) -> Trie:
    """``node`` without ``request_id`` (which must be present)."""
    return _delete(node, hash(request_id) & _MASK64, request_id, 0)


def _delete(node: Trie, h: int, request_id: Any, shift: int) -> Trie:
    if isinstance(node, Bucket):
        pairs = tuple(p for p in node.pairs if p[0] != request_id)
        return Bucket(node.hash, pairs) if pairs else None
    assert node is not None, "delete: id absent"
    i = (h >> shift) & (_WIDTH - 1)
    new = (*node[:i], _delete(node[i], h, request_id, shift + _BITS), *node[i + 1 :])
    return None if new.count(None) == _WIDTH else new
