"""The request lifecycle of a :class:`~flashdec.engine.DecodeEngine`: the states a request has
before and beside the cache (waiting, rejected, cancelled while waiting) and the moves between
them and the cache's (``add_request`` / ``admit`` / ``finish_request`` / ``cancel_request``).
A mixin of the engine, one concept: it reads and changes only the state the constructor set
(``cache``, ``_waiting``, ``_closed``, ``_mode``, ``submissions``); the cache stays the source
of truth for every request it holds.
"""

from __future__ import annotations

from flashdec._checks import check_request_id
from flashdec.engine.states import FROM_CACHE, EngineRequestState


class RequestLifecycle:
    """Request states and their transitions (see :class:`~flashdec.engine.DecodeEngine`)."""

    def request_state(self, request_id: object) -> EngineRequestState:
        if request_id in self._waiting:
            return EngineRequestState.WAITING
        closed = self._closed.state(request_id) if type(request_id) in (str, int) else None
        if closed is not None:
            return closed
        check_request_id("request id", request_id)
        return FROM_CACHE[self.cache.request_state(request_id)]  # ValueError when unknown

    def request_ids(self, state: EngineRequestState | None = None) -> list:
        """The requests this engine knows, optionally only those in ``state``: every waiting
        and active one, and the newest terminal ones (``TERMINAL_HISTORY_LIMIT`` closed before
        admission, as many of the cache's); an older terminal id keeps its
        ``request_state`` but is no longer listed."""
        ids = [*self._waiting, *self._closed.recent(), *self.cache.request_ids()]
        return [rid for rid in ids if state is None or self.request_state(rid) is state]

    def _check_new_id(self, request_id: object, mode: str) -> None:
        check_request_id("request id", request_id)
        if request_id in self._waiting or self._closed.state(request_id) is not None:
            raise ValueError(f"request id {request_id!r} already exists (ids are not reused)")
        try:
            self.cache.request_state(request_id)
        except ValueError:
            pass
        else:
            raise ValueError(f"request id {request_id!r} already exists in the cache")
        if self._mode not in (None, mode):
            raise RuntimeError(
                f"this engine runs {self._mode} requests; add_request/admit (unscheduled) and "
                "submit_request (scheduler-managed) cannot be mixed: a lifetime scheduler must "
                "know the lifetime of every active request"
            )

    def add_request(self, request_id: object) -> None:
        """Register a waiting request (not yet in the cache) that ``admit`` makes active."""
        self._require_no_open_step("add_request")
        self._check_new_id(request_id, "unscheduled")
        self._mode = "unscheduled"
        self._waiting[request_id] = None

    def admit(self, request_id: object) -> None:
        """Make a waiting (unscheduled) request active in the cache (empty, seq_len 0)."""
        self._require_no_open_step("admit")
        state = self.request_state(request_id)
        if state is not EngineRequestState.WAITING:
            raise RuntimeError(
                f"request {request_id!r} is {state.value}; only a waiting request can be admitted"
            )
        if self._waiting[request_id] is not None:
            raise RuntimeError(
                f"request {request_id!r} is scheduler-managed; it is admitted by "
                "apply_scheduler_decision"
            )
        self.cache.add_request(request_id)
        del self._waiting[request_id]

    def finish_request(self, request_id: object) -> None:
        """Finish an active request: the cache releases its private blocks."""
        self._require_no_open_step("finish_request")
        self._require_state(request_id, EngineRequestState.ACTIVE, "finish")
        if self.cache.prefix_cache.enabled:  # its generated text joins the prefix cache
            self.submissions.cache_finished_blocks(request_id)
        self.cache.finish_request(request_id)
        self._forget(request_id)

    def cancel_request(self, request_id: object) -> None:
        """Cancel a waiting or active request."""
        self._require_no_open_step("cancel_request")
        state = self.request_state(request_id)
        if state is EngineRequestState.ACTIVE:
            self.cache.cancel_request(request_id)
            self._forget(request_id)
        elif state is EngineRequestState.WAITING:
            self._leave_queue(request_id, EngineRequestState.CANCELLED)
        else:
            raise RuntimeError(
                f"request {request_id!r} is {state.value}; only waiting or active requests "
                "can be cancelled"
            )

    def _forget(self, request_id) -> None:
        """Drop what the engine keeps of a request that just became terminal."""
        self.submissions.forget(request_id)

    def _leave_queue(self, request_id, state: EngineRequestState | None) -> None:
        """A request stops waiting: admitted (``state`` None), rejected or cancelled."""
        spec = self._waiting.pop(request_id)
        if spec is not None:
            self.submissions.remove(request_id)
        if state is not None:
            self._closed.add(request_id, state)
            self._forget(request_id)
