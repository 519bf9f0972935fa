"""A request's state as the engine sees it: the cache's states plus those before admission."""

from __future__ import annotations

import enum

from flashdec.cache import RequestState


class EngineRequestState(enum.StrEnum):
    """Where a request is from the engine's point of view (a superset of the cache's states)."""

    WAITING = "waiting"  # known to the engine, not yet in the cache
    ACTIVE = "active"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    REJECTED = "rejected"  # the scheduler decided it can never fit

    def __str__(self) -> str:
        return self.value


FROM_CACHE = {  # the cache's states, as the engine names them
    RequestState.ACTIVE: EngineRequestState.ACTIVE,
    RequestState.FINISHED: EngineRequestState.FINISHED,
    RequestState.CANCELLED: EngineRequestState.CANCELLED,
}
