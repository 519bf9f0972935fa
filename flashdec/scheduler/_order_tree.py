"""A persistent treap of waiting requests keyed by submission order.

Every update copies only the nodes on its path (O(log n) expected) and returns a new root; old
roots stay valid, so a view of the queue is just a root. Each node carries aggregates over its
subtree — size, min and max lifetime private blocks, max table width, number of unusable
prefixes, max skip count — which answer the policies' questions ("first request from position p
that fits h blocks", "first aged request", "requests that can never run") in O(log n).

Skip counts change for a whole range at once ("everyone submitted before X was overtaken"), so
they use add-tags that are never pushed down: ``node.tag`` is added to every strict descendant,
and a request's skip count is its node's ``skip`` plus the tags of its strict ancestors (the
*frame*). A subtree moved under a different parent is re-based with ``shift``.

Priorities are a fixed hash of the key, so the shape depends only on the set of keys.

With KV layer groups a request needs blocks in every group: its entry carries the per-group
``needs`` and each node the component-wise min and max of its subtree. A subtree whose minimum
exceeds the headroom in some group holds no fitting request; the converse does not hold in
general, but requests without a shared prefix have needs that all grow with their length, so
their minima come from one request and the search stays O(log n).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_MASK64 = (1 << 64) - 1


def priority(key: int) -> int:
    """SplitMix64 of ``key``: a well-mixed, deterministic treap priority."""
    z = (key + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Entry:
    """What never changes about a waiting request, shared by every tree version that holds it."""

    __slots__ = (
        "bad_prefix",
        "entered",
        "key",
        "memo",
        "needs",
        "prio",
        "private",
        "request_id",
        "spec",
        "table",
    )

    def __init__(
        self,
        spec: Any,
        private: int,
        table: int,
        bad_prefix: bool,
        entered: int,
        memo: Any = None,
        needs: tuple[int, ...] | None = None,
    ) -> None:
        self.spec = spec
        self.request_id = spec.request_id
        self.key = spec.submission_order
        self.prio = priority(self.key & _MASK64)
        self.private = private  # lifetime private blocks (group 0's with layer groups)
        # lifetime block-table width; with layer groups its length in tokens (each group's table
        # limit is a token limit: ceil(T / bs) <= m  <=>  T <= m * bs)
        self.table = table
        self.needs = needs  # with layer groups: lifetime private blocks per group
        self.bad_prefix = int(bad_prefix)  # names a prefix that is not resident or not covering
        self.entered = entered  # queue step count at submission: wait_steps = steps - entered
        self.memo = memo  # the last WaitingRequest materialised for it (reused while equal)


class Node:
    __slots__ = (
        "entry",
        "left",
        "max_needs",
        "max_private",
        "max_skip",
        "max_table",
        "min_needs",
        "min_private",
        "num_bad",
        "right",
        "size",
        "skip",
        "tag",
    )


def make(entry: Entry, skip: int, tag: int, left: Node | None, right: Node | None) -> Node:
    """A node with its subtree aggregates (``max_skip`` in the node's own frame)."""
    n = Node()
    n.entry = entry
    n.skip = skip
    n.tag = tag
    n.left = left
    n.right = right
    size = 1
    lo = hi = entry.private
    table = entry.table
    bad = entry.bad_prefix
    top = skip
    for child in (left, right):
        if child is not None:
            size += child.size
            if child.min_private < lo:
                lo = child.min_private
            if child.max_private > hi:
                hi = child.max_private
            if child.max_table > table:
                table = child.max_table
            bad += child.num_bad
            if child.max_skip + tag > top:
                top = child.max_skip + tag
    n.size = size
    n.min_private = lo
    n.max_private = hi
    n.max_table = table
    n.num_bad = bad
    n.max_skip = top
    needs = entry.needs
    if needs is None:
        n.min_needs = n.max_needs = None
        return n
    low = high = needs
    for child in (left, right):
        if child is not None:
            low = tuple(map(min, low, child.min_needs))
            high = tuple(map(max, high, child.max_needs))
    n.min_needs = low
    n.max_needs = high
    return n


def shift(t: Node | None, delta: int) -> Node | None:
    """``t`` with ``delta`` added to every skip count of its subtree (one node copied)."""
    if t is None or delta == 0:
        return t
    n = Node()
    n.entry = t.entry
    n.skip = t.skip + delta
    n.tag = t.tag + delta
    n.left = t.left
    n.right = t.right
    n.size = t.size
    n.min_private = t.min_private
    n.max_private = t.max_private
    n.max_table = t.max_table
    n.num_bad = t.num_bad
    n.max_skip = t.max_skip + delta
    n.min_needs = t.min_needs
    n.max_needs = t.max_needs
    return n


def _size(t: Node | None) -> int:
    return 0 if t is None else t.size


def _split(t: Node | None, key: int) -> tuple[Node | None, Node | None]:
    """Keys below ``key`` and above it (``key`` itself absent), both in ``t``'s frame."""
    if t is None:
        return None, None
    if t.entry.key < key:
        low, high = _split(t.right, key)
        return make(t.entry, t.skip, t.tag, t.left, low), shift(high, t.tag)
    low, high = _split(t.left, key)
    return shift(low, t.tag), make(t.entry, t.skip, t.tag, high, t.right)


def _merge(a: Node | None, b: Node | None) -> Node | None:
    """Join two trees of one frame, every key of ``a`` below every key of ``b``."""
    if a is None:
        return b
    if b is None:
        return a
    if a.entry.prio > b.entry.prio:
        return make(a.entry, a.skip, a.tag, a.left, _merge(a.right, shift(b, -a.tag)))
    return make(b.entry, b.skip, b.tag, _merge(shift(a, -b.tag), b.left), b.right)


def insert(t: Node | None, entry: Entry, skip: int) -> Node:
    """``t`` plus ``entry`` with skip count ``skip`` (its key must be absent)."""
    if t is None:
        return make(entry, skip, 0, None, None)
    if entry.prio > t.entry.prio:
        low, high = _split(t, entry.key)
        return make(entry, skip, 0, low, high)
    inner = skip - t.tag  # below t, t's tag is added back
    if entry.key < t.entry.key:
        return make(t.entry, t.skip, t.tag, insert(t.left, entry, inner), t.right)
    return make(t.entry, t.skip, t.tag, t.left, insert(t.right, entry, inner))


def remove(t: Node | None, key: int) -> Node | None:
    """``t`` without ``key`` (which must be present)."""
    assert t is not None, "remove: key absent"
    k = t.entry.key
    if key == k:
        return _merge(shift(t.left, t.tag), shift(t.right, t.tag))
    if key < k:
        return make(t.entry, t.skip, t.tag, remove(t.left, key), t.right)
    return make(t.entry, t.skip, t.tag, t.left, remove(t.right, key))


def add_skip_before(t: Node | None, key: int) -> Node | None:
    """One more skip for every request whose key is below ``key``."""
    if t is None:
        return None
    if t.entry.key < key:
        return make(t.entry, t.skip + 1, t.tag, shift(t.left, 1), add_skip_before(t.right, key))
    return make(t.entry, t.skip, t.tag, add_skip_before(t.left, key), t.right)


def find(t: Node | None, key: int) -> tuple[int, Node, int] | None:
    """``(position, node, frame)`` of ``key``, or None."""
    pos = frame = 0
    while t is not None:
        k = t.entry.key
        if key < k:
            frame += t.tag
            t = t.left
        elif key > k:
            pos += _size(t.left) + 1
            frame += t.tag
            t = t.right
        else:
            return pos + _size(t.left), t, frame
    return None


def at(t: Node, index: int) -> tuple[Node, int]:
    """``(node, frame)`` at ``index`` (0 <= index < t.size)."""
    frame = 0
    while True:
        left = _size(t.left)
        if index < left:
            frame += t.tag
            t = t.left
        elif index > left:
            index -= left + 1
            frame += t.tag
            t = t.right
        else:
            return t, frame


def first_fitting(t: Node | None, start: int, blocks: int, base: int = 0) -> int | None:
    """First position >= ``start`` whose lifetime private blocks are <= ``blocks``."""
    if t is None or t.min_private > blocks or base + t.size <= start:
        return None
    found = first_fitting(t.left, start, blocks, base)
    if found is not None:
        return found
    pos = base + _size(t.left)
    if pos >= start and t.entry.private <= blocks:
        return pos
    return first_fitting(t.right, start, blocks, pos + 1)


def first_fitting_groups(
    t: Node | None, start: int, headroom: tuple[int, ...], base: int = 0
) -> int | None:
    """First position >= ``start`` whose needs are <= ``headroom`` in every group."""
    if t is None or base + t.size <= start or not _within(t.min_needs, headroom):
        return None
    found = first_fitting_groups(t.left, start, headroom, base)
    if found is not None:
        return found
    pos = base + _size(t.left)
    if pos >= start and _within(t.entry.needs, headroom):
        return pos
    return first_fitting_groups(t.right, start, headroom, pos + 1)


def _within(needs: tuple[int, ...], limits: tuple[int, ...]) -> bool:
    return all(n <= x for n, x in zip(needs, limits, strict=True))


def first_aged(
    t: Node | None, start: int, threshold: int, frame: int = 0, base: int = 0
) -> int | None:
    """First position >= ``start`` whose skip count is >= ``threshold``."""
    if t is None or t.max_skip + frame < threshold or base + t.size <= start:
        return None
    inner = frame + t.tag
    found = first_aged(t.left, start, threshold, inner, base)
    if found is not None:
        return found
    pos = base + _size(t.left)
    if pos >= start and t.skip + frame >= threshold:
        return pos
    return first_aged(t.right, start, threshold, inner, pos + 1)


def unrunnable(
    t: Node | None, capacity: int, max_table: int, out: list[int], base: int = 0
) -> list[int]:
    """Append to ``out``, in order, the positions whose private blocks exceed ``capacity``,
    whose table exceeds ``max_table`` blocks, or whose prefix is unusable."""
    if t is None or (t.max_private <= capacity and t.max_table <= max_table and not t.num_bad):
        return out
    unrunnable(t.left, capacity, max_table, out, base)
    pos = base + _size(t.left)
    e = t.entry
    if e.private > capacity or e.table > max_table or e.bad_prefix:
        out.append(pos)
    return unrunnable(t.right, capacity, max_table, out, pos + 1)


def unrunnable_groups(
    t: Node | None, capacity: tuple[int, ...], max_tokens: int, out: list[int], base: int = 0
) -> list[int]:
    """``unrunnable`` with layer groups: needs above ``capacity`` in some group, a length above
    ``max_tokens`` (the tightest group's table), or an unusable prefix."""
    if t is None or (
        t.max_table <= max_tokens and not t.num_bad and _within(t.max_needs, capacity)
    ):
        return out
    unrunnable_groups(t.left, capacity, max_tokens, out, base)
    pos = base + _size(t.left)
    e = t.entry
    if e.table > max_tokens or e.bad_prefix or not _within(e.needs, capacity):
        out.append(pos)
    return unrunnable_groups(t.right, capacity, max_tokens, out, pos + 1)


def iterate(t: Node | None) -> Iterator[tuple[Entry, int]]:
    """``(entry, skip count)`` in key order."""
    stack: list[tuple[Node, int]] = []
    frame = 0
    while stack or t is not None:
        while t is not None:
            stack.append((t, frame))
            frame += t.tag
            t = t.left
        node, frame = stack.pop()
        yield node.entry, node.skip + frame
        frame += node.tag
        t = node.right


def build(items: list[tuple[Entry, int]], lo: int = 0, hi: int | None = None) -> Node | None:
    """A balanced tree of ``(entry, skip count)`` items already in key order (never updated:
    its shape need not follow the priorities)."""
    if hi is None:
        hi = len(items)
    if lo >= hi:
        return None
    mid = (lo + hi) // 2
    entry, skip = items[mid]
    return make(entry, skip, 0, build(items, lo, mid), build(items, mid + 1, hi))
