"""The cache's request table: every active request's record, the newest terminal ones, and the
state of every terminal id (ids are never reused; see ``flashdec.cache.history``).

Lookups and the request-id checks every public cache method starts with live here; what a
request holds (blocks, table rows, a prefix) is the cache's and its groups' business.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from flashdec._checks import check_request_id
from flashdec.cache.history import TERMINAL_HISTORY_LIMIT, TerminalHistory
from flashdec.cache.state import RequestId, RequestRecord, RequestState, RetiredRequest


def require_active(record: RequestRecord | RetiredRequest, action: str) -> None:
    if record.state is not RequestState.ACTIVE:
        raise RuntimeError(
            f"cannot {action} request {record.request_id!r}: it is {record.state.value}, "
            "expected active"
        )


class RequestTable:
    """Records of the active requests and of the newest terminal ones, in insertion order; the
    active ones also by themselves (a round costs what is live), and every terminal request's
    state compactly."""

    def __init__(self) -> None:
        self.records: dict[RequestId, RequestRecord] = {}
        self.active: dict[RequestId, RequestRecord] = {}
        self.terminal = TerminalHistory(RequestState.FINISHED, TERMINAL_HISTORY_LIMIT)
        self.num_added = 0

    def record(self, request_id: object) -> RequestRecord | RetiredRequest:
        record = self.records.get(request_id) if type(request_id) in (str, int) else None
        if record is None:
            rid = check_request_id("request_id", request_id)
            state = self.terminal.state(rid)
            if state is None:
                raise ValueError(f"unknown request id {rid!r}")
            return RetiredRequest(rid, state)  # terminal, its record no longer kept
        return record

    def check_ids(self, request_ids: object, *, unique: bool, nonempty: bool) -> list[RequestId]:
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Sequence):
            raise TypeError(
                f"request_ids must be a list or tuple of ids, got {type(request_ids).__name__}"
            )
        rids = list(request_ids)
        active = self.active
        for rid in rids:
            if type(rid) not in (str, int) or rid not in active:  # fast path first
                check_request_id("request id", rid)
                if rid not in self.records and self.terminal.state(rid) is None:
                    raise ValueError(f"unknown request id {rid!r}")
        if nonempty and not rids:
            raise ValueError("request_ids must not be empty")
        if unique and len(set(rids)) != len(rids):
            twice = sorted({repr(r) for r, n in Counter(rids).items() if n > 1})
            raise ValueError(f"request_ids lists {', '.join(twice)} more than once")
        return rids

    def active_records(self, rids: list[RequestId], action: str) -> list[RequestRecord]:
        active = self.active
        for rid in rids:
            if rid not in active:
                require_active(self.record(rid), action)
        return [active[rid] for rid in rids]

    def check_new(self, request_id: object) -> RequestId:
        """A valid id that was never added (ValueError otherwise)."""
        rid = check_request_id("request_id", request_id)
        known = self.records.get(rid)
        state = known.state if known is not None else self.terminal.state(rid)
        if state is not None:
            raise ValueError(
                f"request id {rid!r} already exists ({state.value}); ids are not reused"
            )
        return rid

    def add(self, record: RequestRecord) -> None:
        self.records[record.request_id] = self.active[record.request_id] = record
        self.num_added += 1

    def retire(self, record: RequestRecord, state: RequestState) -> None:
        """An active request (its holdings already given back) becomes terminal."""
        record.retire(state)
        rid = record.request_id
        del self.active[rid]
        dropped = self.terminal.add(rid, state)
        if dropped is not None:  # the oldest terminal record leaves the bounded history
            del self.records[dropped]

    def forget(self, record: RequestRecord) -> None:
        """An active request leaves without a trace (its id may be added again)."""
        del self.records[record.request_id]
        del self.active[record.request_id]
        self.num_added -= 1

    def ids(self, state: RequestState | str | None) -> list[RequestId]:
        if state is None:
            return list(self.records)
        if not isinstance(state, str):
            raise TypeError(
                f"state must be a RequestState, str or None, got {type(state).__name__}"
            )
        try:
            wanted = RequestState(state)
        except ValueError as err:
            values = [s.value for s in RequestState]
            raise ValueError(f"state must be one of {values}, got {state!r}") from err
        if wanted is RequestState.ACTIVE:
            return list(self.active)
        return [rid for rid, rec in self.records.items() if rec.state is wanted]

    def check_integrity(self) -> None:
        """RuntimeError when the kept records disagree with the bounded history."""
        terminal, active = self.terminal, self.active
        if len(self.records) != len(active) + terminal.num_recent:
            raise RuntimeError(
                f"{len(self.records)} request records kept, expected {len(active)} active + "
                f"{terminal.num_recent} recent terminal"
            )
        if terminal.num_recent > terminal.limit:
            raise RuntimeError("terminal request history exceeds its limit")
