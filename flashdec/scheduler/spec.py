"""What the scheduler is told about a request and how it is configured.

``RequestSpec`` fixes everything a policy may plan with before a request runs: its prompt size,
its generation budget, its place in the submission order and an optional resident prefix.
``SchedulerConfig`` fixes the caps every policy honours. Both are frozen and validated once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from flashdec._checks import check_positive_int

RequestId: TypeAlias = str | int
PrefixId: TypeAlias = str | int


def check_request_id(name: str, value: object) -> RequestId:
    """A request or prefix id is a ``str`` or an ``int`` (``bool`` is not an id)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"{name} must be a str or int, got {type(value).__name__}")
    return value


def check_id_tuple(name: str, value: object) -> tuple[RequestId, ...]:
    """A tuple of distinct request ids (order is meaningful, so no lists or sets)."""
    if not isinstance(value, tuple):
        raise TypeError(f"{name} must be a tuple of request ids, got {type(value).__name__}")
    # one check per distinct element type, not per id (batches are checked every step)
    if any(t is bool or not issubclass(t, (str, int)) for t in set(map(type, value))):
        for i, rid in enumerate(value):
            check_request_id(f"{name}[{i}]", rid)
    if len(set(value)) != len(value):
        raise ValueError(f"{name} must not repeat an id, got {value!r}")
    return value


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class RequestSpec:
    """A request as submitted: ``initial_context_tokens`` of prompt, then up to
    ``max_new_tokens`` decoded tokens. ``submission_order`` ranks it in the FIFO queue.

    With ``prefix_id`` the whole context is a resident shared prefix (it must cover the context
    exactly); only the decoded tail then needs private blocks.
    """

    request_id: RequestId
    initial_context_tokens: int
    max_new_tokens: int
    submission_order: int
    prefix_id: PrefixId | None = None

    def __post_init__(self) -> None:
        check_request_id("request_id", self.request_id)
        check_positive_int("initial_context_tokens", self.initial_context_tokens, minimum=0)
        check_positive_int("max_new_tokens", self.max_new_tokens, minimum=1)
        check_positive_int("submission_order", self.submission_order, minimum=0)
        if self.prefix_id is not None:
            check_request_id("prefix_id", self.prefix_id)

    @property
    def total_tokens(self) -> int:
        """Length of the request once its last token is committed."""
        return self.initial_context_tokens + self.max_new_tokens

    def lifetime_blocks(self, block_size: int) -> int:
        """Blocks the request's table spans at full length (shared prefix blocks included)."""
        return ceil_div(self.total_tokens, block_size)


@dataclass(frozen=True)
class SchedulerConfig:
    """Caps every policy honours.

    ``max_active_requests`` bounds requests resident in the cache, ``max_batch_size`` the requests
    decoded in one step, ``reserve_blocks`` keeps blocks of the pool out of every commitment and
    ``aging_threshold`` is how often a waiting request may be overtaken before it blocks later
    arrivals (0 = strict FIFO; ``None`` = aging off, later arrivals may overtake forever).
    """

    max_active_requests: int
    max_batch_size: int
    reserve_blocks: int = 0
    aging_threshold: int | None = 8

    def __post_init__(self) -> None:
        check_positive_int("max_active_requests", self.max_active_requests, minimum=1)
        check_positive_int("max_batch_size", self.max_batch_size, minimum=1)
        check_positive_int("reserve_blocks", self.reserve_blocks, minimum=0)
        if self.aging_threshold is not None:
            check_positive_int("aging_threshold", self.aging_threshold, minimum=0)
