"""``SchedulingSnapshot``: the K/V-free view of the cache a policy plans from.

It is a tree of small frozen dataclasses and tuples, so two snapshots built from the same state
compare equal field by field and a policy cannot mutate what it reads. Derived fields (lifetime
blocks) are checked against their definition here, so an inconsistent snapshot cannot exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashdec._checks import check_positive_int
from flashdec.scheduler.spec import (
    PrefixId,
    RequestId,
    RequestSpec,
    ceil_div,
    check_request_id,
)


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


def lifetime_private_blocks(
    spec: RequestSpec, block_size: int, prefixes: dict[PrefixId, PrefixInfo]
) -> int:
    """Private blocks ``spec`` needs at full length.

    Its shared prefix's blocks are subtracted only when that prefix is resident and covers the
    context exactly (they are counted once, globally, as resident prefix blocks); otherwise the
    request would need every block privately.
    """
    total = spec.lifetime_blocks(block_size)
    prefix = prefixes.get(spec.prefix_id) if spec.prefix_id is not None else None
    if prefix is not None and prefix.num_tokens == spec.initial_context_tokens:
        return total - prefix.num_blocks
    return total


@dataclass(frozen=True)
class SchedulingSnapshot:
    """Everything a policy may read, at one cache version.

    ``waiting`` is in submission order; ``active`` in the order the caller listed it.
    """

    step: int
    cache_version: int
    block_size: int
    total_blocks: int  # the whole pool
    free_blocks: int
    max_blocks_per_seq: int  # longest block table a request may have
    prefixes: tuple[PrefixInfo, ...] = ()
    active: tuple[ActiveRequest, ...] = ()
    waiting: tuple[WaitingRequest, ...] = ()

    def __post_init__(self) -> None:
        check_positive_int("step", self.step, minimum=0)
        check_positive_int("cache_version", self.cache_version, minimum=0)
        check_positive_int("block_size", self.block_size, minimum=1)
        check_positive_int("total_blocks", self.total_blocks, minimum=1)
        check_positive_int("free_blocks", self.free_blocks, minimum=0)
        check_positive_int("max_blocks_per_seq", self.max_blocks_per_seq, minimum=1)
        self._check_tuple("prefixes", PrefixInfo)
        self._check_tuple("active", ActiveRequest)
        self._check_tuple("waiting", WaitingRequest)
        prefixes = self.prefix_map
        if len(prefixes) != len(self.prefixes):
            raise ValueError("prefixes must not repeat a prefix_id")
        for p in self.prefixes:
            if p.num_tokens != p.num_blocks * self.block_size:
                raise ValueError(
                    f"prefix {p.prefix_id!r} must hold full blocks: num_tokens {p.num_tokens} "
                    f"!= num_blocks {p.num_blocks} * block_size {self.block_size}"
                )
        ids = [r.request_id for r in self.active] + [r.request_id for r in self.waiting]
        if len(set(ids)) != len(ids):
            raise ValueError("a request id appears twice among active and waiting requests")
        orders = [r.spec.submission_order for r in self.active + self.waiting]  # type: ignore[operator]
        if len(set(orders)) != len(orders):
            raise ValueError("submission_order must be unique among active and waiting requests")
        waiting_orders = [r.spec.submission_order for r in self.waiting]
        if waiting_orders != sorted(waiting_orders):
            raise ValueError(f"waiting must be in submission order, got {waiting_orders}")
        for r in self.active:
            self._check_active(r, prefixes)
        for r in self.waiting:
            expected = lifetime_private_blocks(r.spec, self.block_size, prefixes)
            if r.lifetime_private_blocks != expected:
                raise ValueError(
                    f"waiting request {r.request_id!r}: lifetime_private_blocks "
                    f"{r.lifetime_private_blocks} != {expected} derived from its spec"
                )
        used = self.resident_prefix_blocks + sum(r.committed_private_blocks for r in self.active)
        if self.free_blocks + used > self.total_blocks:
            raise ValueError(
                f"free_blocks ({self.free_blocks}) + prefix and private blocks in use ({used}) "
                f"exceed total_blocks ({self.total_blocks})"
            )

    def _check_tuple(self, name: str, kind: type) -> None:
        value = getattr(self, name)
        if not isinstance(value, tuple) or not all(isinstance(v, kind) for v in value):
            raise TypeError(f"{name} must be a tuple of {kind.__name__}")

    def _check_active(self, r: ActiveRequest, prefixes: dict[PrefixId, PrefixInfo]) -> None:
        prefix_blocks = 0
        if r.spec.prefix_id is not None:
            prefix = prefixes.get(r.spec.prefix_id)
            if prefix is None:
                raise ValueError(
                    f"active request {r.request_id!r} uses prefix {r.spec.prefix_id!r}, "
                    "which is not resident"
                )
            prefix_blocks = prefix.num_blocks
        expected = lifetime_private_blocks(r.spec, self.block_size, prefixes)
        if r.lifetime_private_blocks != expected:
            raise ValueError(
                f"active request {r.request_id!r}: lifetime_private_blocks "
                f"{r.lifetime_private_blocks} != {expected} derived from its spec"
            )
        if r.committed_blocks != r.committed_private_blocks + prefix_blocks:
            raise ValueError(
                f"active request {r.request_id!r}: committed_blocks ({r.committed_blocks}) must "
                f"equal committed_private_blocks ({r.committed_private_blocks}) + prefix blocks "
                f"({prefix_blocks})"
            )
        if r.committed_blocks != ceil_div(r.committed_tokens, self.block_size):
            raise ValueError(
                f"active request {r.request_id!r}: committed_blocks ({r.committed_blocks}) must "
                f"be ceil(committed_tokens / block_size) = "
                f"{ceil_div(r.committed_tokens, self.block_size)}"
            )

    @property
    def prefix_map(self) -> dict[PrefixId, PrefixInfo]:
        return {p.prefix_id: p for p in self.prefixes}

    @property
    def resident_prefix_blocks(self) -> int:
        """Blocks held by resident prefixes, counted once however many requests share them."""
        return sum(p.num_blocks for p in self.prefixes)

    @property
    def active_ids(self) -> tuple[RequestId, ...]:
        return tuple(r.request_id for r in self.active)

    @property
    def waiting_ids(self) -> tuple[RequestId, ...]:
        return tuple(r.request_id for r in self.waiting)
