"""``WaitingQueue``: the waiting requests and their fairness counters, at O(log n) per update.

The queue is persistent: ``view()`` is O(1) and returns an immutable ``WaitingView`` that later
updates do not change. A scheduling round therefore costs what changes (submissions, admissions,
rejections, one fairness step) and what is admitted, not the length of the queue:

- ``submit`` / ``remove`` insert or delete one request — O(log n);
- ``advance`` is the fairness step of ``advance_fairness_counters``: every request still waiting
  waits one more step (a global step count) and every one submitted before the newest admitted
  request counts one more skip (a range add-tag) — O(log n);
- a view answers what the policies ask — first request from a position that fits ``h`` blocks,
  first aged one, the ones that can never run — in O(log n) each (see ``_order_tree``).

Every request is derived (its lifetime private blocks, whether its prefix is usable) from one
geometry — the block size and the resident prefixes, and with KV layer groups each group's block
size and window — recorded at ``submit``; a snapshot built on a view checks that its own geometry
is the same.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, NoReturn, overload

import flashdec.scheduler._id_trie as _id_trie
import flashdec.scheduler._order_tree as _order_tree
from flashdec._checks import check_positive_int
from flashdec.scheduler.groups import GroupShape, check_window
from flashdec.scheduler.rows import (
    Geometry,
    PrefixInfo,
    WaitingRequest,
    geometry_of,
    lifetime_private_blocks,
    lifetime_private_blocks_by_group,
    shared_prefix,
)
from flashdec.scheduler.spec import PrefixId, RequestId, RequestSpec, check_request_id


def _is_request_id(value: object) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def _entry(spec: RequestSpec, geometry: Geometry, prefix_map: dict, entered: int) -> Any:
    sizes = geometry[0]
    bad_prefix = spec.prefix_id is not None and shared_prefix(spec, prefix_map) is None
    if isinstance(sizes, int):
        return _order_tree.Entry(
            spec,
            private=lifetime_private_blocks(spec, sizes, prefix_map),
            table=spec.lifetime_blocks(sizes),
            bad_prefix=bad_prefix,
            entered=entered,
        )
    needs = lifetime_private_blocks_by_group(spec, sizes, prefix_map)
    return _order_tree.Entry(
        spec,
        private=needs[0],
        table=spec.total_tokens,
        bad_prefix=bad_prefix,
        entered=entered,
        needs=needs,
    )


def check_group_shapes(block_size: int, group_shapes: object) -> tuple[GroupShape, ...]:
    """Layer groups' ``(block_size, window)`` pairs: empty for one full-attention group,
    otherwise one per group (group 0's block size is ``block_size``)."""
    if not isinstance(group_shapes, tuple):
        raise TypeError(
            "group_shapes must be a tuple of (block_size, window), got "
            f"{type(group_shapes).__name__}"
        )
    for g, shape in enumerate(group_shapes):
        if not isinstance(shape, tuple) or len(shape) != 2:
            raise TypeError(
                f"group_shapes[{g}] must be a (block_size, window) tuple, got {shape!r}"
            )
        check_positive_int(f"group_shapes[{g}] block_size", shape[0])
        check_window(f"group_shapes[{g}] window", shape[1])
    if group_shapes:
        if group_shapes[0][0] != block_size:
            raise ValueError(
                f"group 0's block size ({group_shapes[0][0]}) must be block_size ({block_size})"
            )
        if len(group_shapes) == 1 and group_shapes[0][1] is None:
            raise ValueError(
                "one full-attention group needs no group_shapes (block_size describes it)"
            )
    return group_shapes


class _Live:
    """A queue's current state as dicts. A view of that state uses them for O(1) lookups for as
    long as ``version`` has not moved on."""

    __slots__ = ("by_id", "by_order", "version")

    def __init__(self) -> None:
        self.by_id: dict[RequestId, Any] = {}
        self.by_order: dict[int, Any] = {}
        self.version = 0


class WaitingView(Sequence[WaitingRequest]):
    """An immutable, read-only sequence of ``WaitingRequest`` in submission order.

    Elements are built on access (the same object again while its counters are unchanged).
    A view equals another view or a tuple with the same elements; two views of one queue state
    compare in O(1). Take one with ``WaitingQueue.view()``; a snapshot built from a tuple wraps
    it with ``SchedulingSnapshot.waiting_view``.
    """

    __slots__ = ("_geometry", "_hash", "_ids", "_live", "_root", "_steps", "_version")

    def __init__(self) -> NoReturn:
        raise TypeError("a WaitingView comes from WaitingQueue.view() or a snapshot's waiting_view")

    @classmethod
    def _of(
        cls,
        root: _order_tree.Node | None,
        ids: _id_trie.Trie,
        steps: int,
        geometry: Geometry | None,
        live: _Live,
    ) -> WaitingView:
        view = object.__new__(cls)
        view._root = root
        view._ids = ids
        view._steps = steps
        view._geometry = geometry
        view._live = live
        view._version = live.version
        view._hash = None
        return view

    @classmethod
    def _wrap(
        cls,
        requests: tuple[WaitingRequest, ...],
        block_size: int,
        prefixes: Iterable[PrefixInfo],
        group_shapes: tuple[GroupShape, ...] = (),
    ) -> WaitingView:
        """A view of checked rows (in submission order, derived under this geometry): O(n)."""
        prefixes = tuple(prefixes)
        geometry = geometry_of(block_size, prefixes, group_shapes)
        prefix_map = {p.prefix_id: p for p in prefixes}
        live = _Live()
        items = []
        for r in requests:
            entry = _entry(r.spec, geometry, prefix_map, entered=-r.wait_steps)
            entry.memo = r  # hand back the caller's own objects
            live.by_id[r.request_id] = entry
            live.by_order[entry.key] = entry
            items.append((entry, r.skip_count))
        return cls._of(_order_tree.build(items), None, 0, geometry if requests else None, live)

    # ---------------------------------------------------------------- the sequence
    def __len__(self) -> int:
        return 0 if self._root is None else self._root.size

    @overload
    def __getitem__(self, index: int) -> WaitingRequest: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[WaitingRequest, ...]: ...
    def __getitem__(self, index: int | slice) -> WaitingRequest | tuple[WaitingRequest, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        i = operator.index(index)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"waiting index {index} out of range for {n} requests")
        node, frame = _order_tree.at(self._root, i)
        return self._row(node.entry, node.skip + frame)

    def __iter__(self) -> Iterator[WaitingRequest]:
        for entry, skip in _order_tree.iterate(self._root):
            yield self._row(entry, skip)

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, WaitingRequest):
            return False
        return self.get(value.request_id) == value

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, WaitingView):
            if self._root is other._root and (self._steps == other._steps or self._root is None):
                return True
        elif not isinstance(other, tuple):
            # like a tuple: never equal to a list or another sequence type
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self))  # equal to the hash of an equal tuple
        return self._hash

    def __repr__(self) -> str:
        return f"WaitingView({tuple(self)!r})"

    def __copy__(self) -> WaitingView:
        return self

    def __deepcopy__(self, memo: dict) -> WaitingView:
        return self  # immutable

    def _row(self, entry: Any, skip: int) -> WaitingRequest:
        wait = self._steps - entry.entered
        row = entry.memo
        if row is None or row.wait_steps != wait or row.skip_count != skip:
            row = WaitingRequest(
                entry.request_id, entry.spec, entry.private, wait, skip, entry.needs or ()
            )
            entry.memo = row
        return row

    # ---------------------------------------------------------------- lookups by id and order
    @property
    def geometry(self) -> Geometry | None:
        """The geometry every element was derived with (None when empty)."""
        return self._geometry

    def _current(self) -> _Live | None:
        live = self._live
        return live if live.version == self._version else None

    def _order_of(self, request_id: object) -> int | None:
        if not _is_request_id(request_id):
            return None
        live = self._current()
        if live is not None:
            entry = live.by_id.get(request_id)
            return None if entry is None else entry.key
        return _id_trie.lookup(self._ids, request_id)

    def has_id(self, request_id: object) -> bool:
        """Whether ``request_id`` is waiting in this view: O(1) on the queue's current view,
        O(log n) on an older one."""
        return self._order_of(request_id) is not None

    def has_any_id(self, request_ids: Iterable[RequestId]) -> bool:
        """Whether any of ``request_ids`` is waiting in this view."""
        live = self._current()
        if live is None:
            return any(self.has_id(rid) for rid in request_ids)
        request_ids = tuple(request_ids)
        if live.by_id.keys().isdisjoint(request_ids):  # the usual answer, at C speed
            return False
        return any(_is_request_id(rid) and rid in live.by_id for rid in request_ids)

    def has_any_submission_order(self, orders: Iterable[int]) -> bool:
        """Whether a request with any of these submission orders is waiting in this view."""
        live = self._current()
        if live is not None:
            return not live.by_order.keys().isdisjoint(orders)
        return any(self.has_submission_order(o) for o in orders)

    def has_submission_order(self, submission_order: int) -> bool:
        """Whether a request with this submission order is waiting in this view."""
        live = self._current()
        if live is not None:
            return submission_order in live.by_order
        return _order_tree.find(self._root, submission_order) is not None

    def get(self, request_id: object) -> WaitingRequest | None:
        """The waiting request with this id, or None."""
        order = self._order_of(request_id)
        if order is None:
            return None
        _, node, frame = _order_tree.find(self._root, order)
        return self._row(node.entry, node.skip + frame)

    def position(self, request_id: RequestId) -> int:
        """Index of ``request_id`` in submission order; ValueError if it is not waiting."""
        order = self._order_of(request_id)
        if order is None:
            raise ValueError(f"request {request_id!r} is not waiting")
        return _order_tree.find(self._root, order)[0]

    def request_ids(self) -> tuple[RequestId, ...]:
        """Every waiting id in submission order (O(n))."""
        return tuple(entry.request_id for entry, _ in _order_tree.iterate(self._root))

    # ---------------------------------------------------------------- policy queries, O(log n)
    def first_fitting(self, start: int, blocks: int) -> int | None:
        """First position >= ``start`` whose ``lifetime_private_blocks`` is <= ``blocks``."""
        check_positive_int("start", start, minimum=0)
        return _order_tree.first_fitting(self._root, start, blocks)

    def first_fitting_groups(self, start: int, headroom: tuple[int, ...]) -> int | None:
        """With layer groups: first position >= ``start`` whose lifetime private blocks are <=
        ``headroom`` in every group (one entry per group)."""
        check_positive_int("start", start, minimum=0)
        self._require_groups(len(headroom))
        return _order_tree.first_fitting_groups(self._root, start, headroom)

    def _require_groups(self, count: int) -> None:
        geometry = self._geometry
        if geometry is not None and (isinstance(geometry[0], int) or len(geometry[0]) != count):
            groups = 1 if isinstance(geometry[0], int) else len(geometry[0])
            raise ValueError(
                f"this view's requests were derived for {groups} group(s) "
                f"{'without group shapes ' if groups == 1 else ''}but {count} limits were given"
            )

    def first_aged(self, start: int, threshold: int) -> int | None:
        """First position >= ``start`` whose ``skip_count`` is >= ``threshold``."""
        check_positive_int("start", start, minimum=0)
        check_positive_int("threshold", threshold, minimum=0)
        return _order_tree.first_aged(self._root, start, threshold)

    def unrunnable(self, capacity: int, max_table_blocks: int) -> tuple[int, ...]:
        """Positions, in order, of requests that need more than ``capacity`` private blocks or a
        table wider than ``max_table_blocks``, or whose prefix is not resident or does not cover
        their context. O((k + 1) log n) for k positions."""
        return tuple(_order_tree.unrunnable(self._root, capacity, max_table_blocks, []))

    def unrunnable_groups(self, capacity: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
        """With layer groups: positions of requests that need more than ``capacity[g]`` private
        blocks in some group ``g``, are longer than ``max_tokens`` (what the narrowest group's
        block table holds), or whose prefix is unusable. O((k + 1) log n) in the common case."""
        self._require_groups(len(capacity))
        return tuple(_order_tree.unrunnable_groups(self._root, capacity, max_tokens, []))


class QueueCheckpoint(NamedTuple):
    """A :class:`WaitingQueue`'s state at one moment (its persistent trees and counters)."""

    root: Any
    ids: Any
    steps: int
    geometry: Any
    version: int


class WaitingQueue:
    """Submitted requests not yet admitted, in submission order, with their fairness counters.

    The engine-facing state behind ``SchedulingSnapshot.waiting``: submit a request, remove it
    once admitted, rejected or cancelled, ``advance`` once per scheduling step, and hand
    ``view()`` to the snapshot. Every call checks its arguments before changing anything.
    """

    def __init__(self) -> None:
        self._root: _order_tree.Node | None = None
        self._ids: _id_trie.Trie = None
        self._steps = 0  # fairness steps so far; a request's wait is steps since it entered
        self._geometry: Geometry | None = None
        self._live = _Live()
        self._view: WaitingView | None = None

    def __len__(self) -> int:
        return len(self._live.by_id)

    def __contains__(self, request_id: object) -> bool:
        return _is_request_id(request_id) and request_id in self._live.by_id

    def __repr__(self) -> str:
        return f"WaitingQueue({len(self)} waiting, geometry={self._geometry!r})"

    @property
    def geometry(self) -> Geometry | None:
        """``(block_size, {(prefix_id, num_blocks, num_tokens)})`` every waiting request was
        derived with; None while the queue is empty (the next submission sets it)."""
        return self._geometry

    def spec(self, request_id: RequestId) -> RequestSpec:
        """The spec of a waiting request; ValueError if it is not waiting."""
        return self._entry_of(request_id).spec

    def _entry_of(self, request_id: RequestId) -> Any:
        check_request_id("request_id", request_id)
        entry = self._live.by_id.get(request_id)
        if entry is None:
            raise ValueError(f"request {request_id!r} is not waiting")
        return entry

    def _changed(self) -> None:
        self._live.version += 1
        self._view = None

    def submit(
        self,
        spec: RequestSpec,
        *,
        block_size: int,
        prefixes: Iterable[PrefixInfo] = (),
        group_shapes: tuple[GroupShape, ...] = (),
    ) -> None:
        """Add ``spec`` at its submission order, with zero counters.

        ``block_size`` and ``prefixes`` (the resident prefixes) derive its lifetime private
        blocks — with KV layer groups also ``group_shapes``, each group's ``(block_size,
        window)`` (group 0's block size is ``block_size``; prefixes then give their blocks per
        group); they must be the geometry of every request already waiting (ValueError
        otherwise). A repeated id or submission order is a ValueError. O(log n + prefixes).
        """
        if not isinstance(spec, RequestSpec):
            raise TypeError(f"spec must be a RequestSpec, got {type(spec).__name__}")
        check_positive_int("block_size", block_size, minimum=1)
        group_shapes = check_group_shapes(block_size, group_shapes)
        if isinstance(prefixes, (str, bytes)) or not isinstance(prefixes, Iterable):
            raise TypeError(f"prefixes must be an iterable of PrefixInfo, got {prefixes!r}")
        prefixes = tuple(prefixes)
        prefix_map: dict[PrefixId, PrefixInfo] = {}
        for p in prefixes:
            if not isinstance(p, PrefixInfo):
                raise TypeError(f"prefixes must hold PrefixInfo, got {type(p).__name__}")
            prefix_map[p.prefix_id] = p
            if len(p.num_blocks_by_group) != len(group_shapes):
                raise ValueError(
                    f"prefix {p.prefix_id!r} must give its blocks in each of the "
                    f"{len(group_shapes)} groups (none without groups), got "
                    f"{p.num_blocks_by_group}"
                )
        if len(prefix_map) != len(prefixes):
            raise ValueError("prefixes must not repeat a prefix_id")
        geometry = geometry_of(block_size, prefixes, group_shapes)
        if self._geometry is not None and geometry != self._geometry:
            raise ValueError(
                f"waiting requests were derived with block size and prefixes {self._geometry}, "
                f"not {geometry}; resident prefixes may change only while nothing waits"
            )
        live = self._live
        if spec.request_id in live.by_id:
            raise ValueError(f"request {spec.request_id!r} is already waiting")
        if spec.submission_order in live.by_order:
            raise ValueError(f"submission_order {spec.submission_order} is already waiting")
        entry = _entry(spec, geometry, prefix_map, entered=self._steps)
        self._root = _order_tree.insert(self._root, entry, 0)
        self._ids = _id_trie.insert(self._ids, spec.request_id, entry.key)
        live.by_id[spec.request_id] = entry
        live.by_order[entry.key] = entry
        self._geometry = geometry
        self._changed()

    def remove(self, request_id: RequestId) -> RequestSpec:
        """Take a request out (admitted, rejected or cancelled) and return its spec. O(log n)."""
        entry = self._entry_of(request_id)
        self._root = _order_tree.remove(self._root, entry.key)
        self._ids = _id_trie.delete(self._ids, request_id)
        live = self._live
        del live.by_id[request_id]
        del live.by_order[entry.key]
        if not live.by_id:
            self._geometry = None
        self._changed()
        return entry.spec

    def checkpoint(self) -> QueueCheckpoint:
        """The current state, for :meth:`restore` (O(1): the trees are persistent)."""
        return QueueCheckpoint(
            self._root, self._ids, self._steps, self._geometry, self._live.version
        )

    def restore(self, checkpoint: QueueCheckpoint, removed: Sequence[RequestId]) -> None:
        """Undo the removals since ``checkpoint``: the requests ``removed`` wait again with the
        counters they had. Nothing else may have changed the queue meanwhile (RuntimeError,
        nothing changed). O(removed · log n)."""
        if not isinstance(checkpoint, QueueCheckpoint):
            raise TypeError(
                f"checkpoint must be a QueueCheckpoint, got {type(checkpoint).__name__}"
            )
        live = self._live
        removed = tuple(removed)
        # exactly len(removed) changes since, each one the removal of a checkpointed request
        orders = [_id_trie.lookup(checkpoint.ids, rid) for rid in removed]
        if (
            live.version != checkpoint.version + len(removed)
            or len(set(removed)) != len(removed)
            or any(o is None for o in orders)
            or any(_is_request_id(rid) and rid in live.by_id for rid in removed)
        ):
            raise RuntimeError(
                "the queue changed since the checkpoint by more than removing "
                f"{list(removed)!r}; it cannot be restored"
            )
        for rid, order in zip(removed, orders, strict=True):
            entry = _order_tree.find(checkpoint.root, order)[1].entry
            live.by_id[rid] = entry
            live.by_order[order] = entry
        self._root, self._ids = checkpoint.root, checkpoint.ids
        self._steps, self._geometry = checkpoint.steps, checkpoint.geometry
        self._changed()

    def advance(self, newest_admitted_order: int | None) -> None:
        """One fairness step for the requests still waiting (remove the admitted and rejected
        ones first), as ``advance_fairness_counters`` defines it: each waits one more step, and
        each submitted before ``newest_admitted_order`` (the largest submission order admitted
        this step; None if nothing was) counts one more skip. O(log n)."""
        if newest_admitted_order is not None:
            check_positive_int("newest_admitted_order", newest_admitted_order, minimum=0)
            self._root = _order_tree.add_skip_before(self._root, newest_admitted_order)
        self._steps += 1
        self._changed()

    def view(self) -> WaitingView:
        """The current state as an immutable ``WaitingView``: O(1)."""
        if self._view is None:
            self._view = WaitingView._of(
                self._root, self._ids, self._steps, self._geometry, self._live
            )
        return self._view
