"""The rows a scheduling snapshot is made of: resident prefixes, active and waiting requests.

Each is a small frozen dataclass validated on construction, so a row that exists is consistent
with its spec. ``lifetime_private_blocks`` and ``geometry_of`` say how a request's block needs
follow from the block size and the resident prefixes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from flashdec._checks import check_positive_int
from flashdec.scheduler.spec import PrefixId, RequestId, RequestSpec, check_request_id


@dataclass(frozen=True)
class PrefixInfo:
    """A resident shared prefix: its full blocks occupy the pool once, whoever uses them."""

    prefix_id: PrefixId
    num_blocks: int
    num_tokens: int
    refcount: int  # active requests attached to it

    def __post_init__(self) -> None:
        check_request_id("prefix_id", self.prefix_id)
        check_positive_int("num_blocks", self.num_blocks, minimum=0)
        check_positive_int("num_tokens", self.num_tokens, minimum=0)
        check_positive_int("refcount", self.refcount, minimum=0)


@dataclass(frozen=True)
class ActiveRequest:
    """A request resident in the cache (admitted, not yet finished or cancelled)."""

    request_id: RequestId
    spec: RequestSpec
    committed_tokens: int  # the cache's seq_len (shared prefix tokens included)
    committed_blocks: int  # blocks in its table (shared prefix blocks included)
    committed_private_blocks: int  # of those, the blocks it owns alone
    lifetime_private_blocks: int  # private blocks it will hold at full length
    service_wait_steps: int = 0  # consecutive steps it was runnable but not decoded

    def __post_init__(self) -> None:
        check_request_id("request_id", self.request_id)
        if not isinstance(self.spec, RequestSpec):
            raise TypeError(f"spec must be a RequestSpec, got {type(self.spec).__name__}")
        if self.spec.request_id != self.request_id:
            raise ValueError(
                f"spec.request_id {self.spec.request_id!r} must equal request_id "
                f"{self.request_id!r}"
            )
        for name in (
            "committed_tokens",
            "committed_blocks",
            "committed_private_blocks",
            "lifetime_private_blocks",
            "service_wait_steps",
        ):
            check_positive_int(name, getattr(self, name), minimum=0)
        if self.committed_tokens > self.spec.total_tokens:
            raise ValueError(
                f"request {self.request_id!r} holds {self.committed_tokens} tokens, more than "
                f"its lifetime of {self.spec.total_tokens} (context + max_new_tokens)"
            )
        if self.committed_private_blocks > self.committed_blocks:
            raise ValueError(
                f"request {self.request_id!r}: committed_private_blocks "
                f"({self.committed_private_blocks}) must be <= committed_blocks "
                f"({self.committed_blocks})"
            )
        if self.committed_private_blocks > self.lifetime_private_blocks:
            raise ValueError(
                f"request {self.request_id!r} holds {self.committed_private_blocks} private "
                f"blocks, more than its lifetime commitment of {self.lifetime_private_blocks}"
            )

    @property
    def remaining_private_blocks(self) -> int:
        """Private blocks it may still take before it finishes."""
        return self.lifetime_private_blocks - self.committed_private_blocks

    @property
    def runnable(self) -> bool:
        """It still has a token to decode."""
        return self.committed_tokens < self.spec.total_tokens


@dataclass(frozen=True)
class WaitingRequest:
    """A submitted request not yet admitted to the cache."""

    request_id: RequestId
    spec: RequestSpec
    lifetime_private_blocks: int  # private blocks it would hold at full length
    wait_steps: int = 0  # steps spent waiting so far
    skip_count: int = 0  # times a later submission was admitted while it waited

    def __post_init__(self) -> None:
        check_request_id("request_id", self.request_id)
        if not isinstance(self.spec, RequestSpec):
            raise TypeError(f"spec must be a RequestSpec, got {type(self.spec).__name__}")
        if self.spec.request_id != self.request_id:
            raise ValueError(
                f"spec.request_id {self.spec.request_id!r} must equal request_id "
                f"{self.request_id!r}"
            )
        for name in ("lifetime_private_blocks", "wait_steps", "skip_count"):
            check_positive_int(name, getattr(self, name), minimum=0)


def shared_prefix(spec: RequestSpec, prefixes: Mapping[PrefixId, PrefixInfo]) -> PrefixInfo | None:
    """The resident prefix whose blocks ``spec`` shares: the one it names, if that prefix is
    resident and covers its context exactly; otherwise ``None`` (no sharing)."""
    if spec.prefix_id is None:
        return None
    prefix = prefixes.get(spec.prefix_id)
    if prefix is not None and prefix.num_tokens == spec.initial_context_tokens:
        return prefix
    return None


def lifetime_private_blocks(
    spec: RequestSpec, block_size: int, prefixes: Mapping[PrefixId, PrefixInfo]
) -> int:
    """Private blocks ``spec`` needs at full length.

    Its shared prefix's blocks are subtracted only when that prefix is resident and covers the
    context exactly (they are counted once, globally, as resident prefix blocks); otherwise the
    request would need every block privately.
    """
    total = spec.lifetime_blocks(block_size)
    prefix = shared_prefix(spec, prefixes)
    return total if prefix is None else total - prefix.num_blocks


Geometry: TypeAlias = tuple[int, frozenset[tuple[PrefixId, int, int]]]


def geometry_of(block_size: int, prefixes: Iterable[PrefixInfo]) -> Geometry:
    """What ``lifetime_private_blocks`` (and whether a prefix is usable) depends on: the block
    size and each resident prefix's ``(prefix_id, num_blocks, num_tokens)`` — not refcounts."""
    return block_size, frozenset((p.prefix_id, p.num_blocks, p.num_tokens) for p in prefixes)
