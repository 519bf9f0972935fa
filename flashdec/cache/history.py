"""Terminal request history: what stays of a request once it is finished or cancelled.

A server serves requests without end, so nothing may keep a full record per request ever
served. What the contract promises of a terminal request — its state, and that its id is never
reused — is kept for ever in :class:`IdSet` s; the newest ``limit`` terminal ids are also
listed (their owner keeps their full records, e.g. the cache's final ``seq_len``).

Memory per terminal request beyond the newest ``limit``: an int id that ended the usual way
(finished) costs nothing when it extends a run of consecutive retired ints (``flashdec.LLM``
numbers its requests 0, 1, 2, ...; a gap — an id still running, or never used — costs one run,
two ints, while it lasts); an int id that ended otherwise (cancelled) costs a run in its
state's set; any other id is one set entry holding the id (about 30-60 bytes plus the id
object itself), two when it did not end the usual way.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Hashable, Iterator

TERMINAL_HISTORY_LIMIT = 1024  # terminal requests whose full records are kept


class IdSet:
    """A growing set of hashable ids: ints as sorted runs of consecutive values, anything else
    (str ids) in a set. Lookup is O(log runs); adding an int costs O(log runs) plus a C-level
    list insert or delete (O(runs) bytes moved) when it starts or joins runs. Ids retired in
    the order they were handed out, give or take the requests still running, form a handful
    of runs."""

    __slots__ = ("_ends", "_others", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []  # run i is [starts[i], ends[i]), runs disjoint, apart
        self._ends: list[int] = []
        self._others: set[Hashable] = set()

    def __contains__(self, item: object) -> bool:
        if type(item) is not int:
            return item in self._others
        i = bisect_right(self._starts, item) - 1
        return i >= 0 and item < self._ends[i]

    def __len__(self) -> int:
        return sum(self._ends) - sum(self._starts) + len(self._others)

    @property
    def num_runs(self) -> int:
        return len(self._starts)

    @property
    def num_stored(self) -> int:
        """Entries held: one per run of ints, one per other id."""
        return len(self._starts) + len(self._others)

    def add(self, item: Hashable) -> None:
        if type(item) is not int:
            self._others.add(item)
            return
        starts, ends = self._starts, self._ends
        i = bisect_right(starts, item) - 1  # the run starting at or before item
        if i >= 0 and item < ends[i]:
            return
        left = i >= 0 and ends[i] == item
        right = i + 1 < len(starts) and starts[i + 1] == item + 1
        if left and right:  # item closes the gap between two runs
            ends[i] = ends[i + 1]
            del starts[i + 1], ends[i + 1]
        elif left:
            ends[i] = item + 1
        elif right:
            starts[i + 1] = item
        else:
            starts.insert(i + 1, item)
            ends.insert(i + 1, item + 1)

    def discard(self, item: Hashable) -> None:
        """Remove ``item`` if present (a run is split around an int)."""
        if type(item) is not int:
            self._others.discard(item)
            return
        starts, ends = self._starts, self._ends
        i = bisect_right(starts, item) - 1
        if i < 0 or item >= ends[i]:
            return
        start, end = starts[i], ends[i]
        del starts[i], ends[i]
        if item + 1 < end:  # the part after item
            starts.insert(i, item + 1)
            ends.insert(i, end)
        if start < item:  # the part before it
            starts.insert(i, start)
            ends.insert(i, item)


class TerminalHistory:
    """The state of every terminal request (compact, for ever) and the newest ``limit`` ids.

    Every terminal id is in one :class:`IdSet`; only the ids whose state is not ``common`` (the
    usual end, e.g. finished) are also in a set of their state, so a rare state interrupts no
    run of the usual one.
    """

    __slots__ = ("_counts", "_ids", "_recent", "_unusual", "common", "limit")

    def __init__(self, common: object, limit: int = TERMINAL_HISTORY_LIMIT) -> None:
        self.common = common
        self.limit = limit
        self._ids = IdSet()
        self._unusual: dict[object, IdSet] = {}
        self._counts: dict[object, int] = {}
        self._recent: deque = deque()

    def add(self, request_id: Hashable, state: object) -> Hashable | None:
        """Record a newly terminal request; returns the id that left the newest ``limit``
        (its owner drops its full record), or None."""
        self._ids.add(request_id)
        if state != self.common:
            self._unusual.setdefault(state, IdSet()).add(request_id)
        self._counts[state] = self._counts.get(state, 0) + 1
        self._recent.append(request_id)
        return self._recent.popleft() if len(self._recent) > self.limit else None

    def discard(self, request_id: Hashable) -> None:
        """Take back a terminal id just added (a serving step taken back): it was never
        terminal. The newest ids are searched from the end."""
        state = self.state(request_id)
        if state is None:
            return
        self._ids.discard(request_id)
        if state != self.common:
            self._unusual[state].discard(request_id)
        self._counts[state] -= 1
        for i in range(len(self._recent) - 1, -1, -1):
            if self._recent[i] == request_id:
                del self._recent[i]
                break

    def state(self, request_id: object) -> object | None:
        """The terminal state of ``request_id``, or None if it never became terminal."""
        if request_id not in self._ids:
            return None
        for state, ids in self._unusual.items():
            if request_id in ids:
                return state
        return self.common

    def count(self, state: object) -> int:
        """Requests that ever reached ``state``."""
        return self._counts.get(state, 0)

    def recent(self) -> Iterator:
        """The newest ``limit`` terminal ids, oldest first."""
        return iter(self._recent)

    @property
    def num_recent(self) -> int:
        return len(self._recent)

    @property
    def num_stored(self) -> int:
        """Entries the id sets hold (runs of ints, other ids): what grows with gaps and
        unusual states, never with requests that end the usual way in id order."""
        return self._ids.num_stored + sum(ids.num_stored for ids in self._unusual.values())
