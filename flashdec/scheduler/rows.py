"""The rows a scheduling snapshot is made of: resident prefixes, active and waiting requests.

Each is a small frozen dataclass validated on construction, so a row that exists is consistent
with its spec. ``lifetime_private_blocks`` and ``geometry_of`` say how a request's block needs
follow from the block size and the resident prefixes.

Rows of a snapshot with layer groups (see ``groups``) also carry their block counts per group
(``*_by_group``: one entry per group; the scalar fields repeat group 0's); rows of a one-group
snapshot leave them empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from flashdec._blocks import lifetime_blocks
from flashdec._checks import check_positive_int
from flashdec.scheduler.groups import GroupShape
from flashdec.scheduler.spec import PrefixId, RequestId, RequestSpec, check_request_id


def _check_by_group(owner: str, name: str, value: object, scalar_name: str, scalar: int) -> None:
    """A ``*_by_group`` tuple: ints >= 0, one per group, entry 0 equal to the scalar field (which
    describes group 0)."""
    if not isinstance(value, tuple):
        raise TypeError(f"{owner}: {name} must be a tuple, got {type(value).__name__}")
    for g, count in enumerate(value):
        check_positive_int(f"{owner}: {name}[{g}]", count, minimum=0)
    if value[0] != scalar:
        raise ValueError(
            f"{owner}: {name}[0] ({value[0]}) must equal {scalar_name} ({scalar}): the scalar "
            "field describes group 0"
        )


@dataclass(frozen=True)
class PrefixInfo:
    """A resident shared prefix: its full blocks occupy the pool once, whoever uses them."""

    prefix_id: PrefixId
    num_blocks: int
    num_tokens: int
    refcount: int  # active requests attached to it
    num_blocks_by_group: tuple[int, ...] = ()  # multi-group snapshots: its blocks in each group

    def __post_init__(self) -> None:
        check_request_id("prefix_id", self.prefix_id)
        check_positive_int("num_blocks", self.num_blocks, minimum=0)
        check_positive_int("num_tokens", self.num_tokens, minimum=0)
        check_positive_int("refcount", self.refcount, minimum=0)
        if self.num_blocks_by_group:
            _check_by_group(
                f"prefix {self.prefix_id!r}",
                "num_blocks_by_group",
                self.num_blocks_by_group,
                "num_blocks",
                self.num_blocks,
            )

    @property
    def blocks_in_groups(self) -> tuple[int, ...]:
        """Its blocks per group (one entry for a one-group prefix)."""
        return self.num_blocks_by_group or (self.num_blocks,)


@dataclass(frozen=True)
class GroupBlocks:
    """An active request's blocks in one layer group."""

    committed_blocks: int  # blocks it holds there (shared prefix blocks included)
    committed_private_blocks: int  # of those, the blocks it owns alone
    lifetime_private_blocks: int  # private blocks it will hold there at most

    def __post_init__(self) -> None:
        for name in _GROUP_BLOCK_FIELDS:
            check_positive_int(name, getattr(self, name), minimum=0)
        if not self.committed_private_blocks <= min(
            self.committed_blocks, self.lifetime_private_blocks
        ):
            raise ValueError(
                f"committed_private_blocks ({self.committed_private_blocks}) must be <= "
                f"committed_blocks ({self.committed_blocks}) and <= lifetime_private_blocks "
                f"({self.lifetime_private_blocks})"
            )

    @property
    def remaining_private_blocks(self) -> int:
        """Private blocks it may still take there before it finishes."""
        return self.lifetime_private_blocks - self.committed_private_blocks


@dataclass(frozen=True)
class ActiveRequest:
    """A request resident in the cache (admitted, not yet finished or cancelled).

    In a snapshot with layer groups, ``blocks_by_group`` holds its blocks in every group and the
    three scalar block fields repeat group 0's.
    """

    request_id: RequestId
    spec: RequestSpec
    committed_tokens: int  # the cache's seq_len (shared prefix tokens included)
    committed_blocks: int  # blocks in its table (shared prefix blocks included)
    committed_private_blocks: int  # of those, the blocks it owns alone
    lifetime_private_blocks: int  # private blocks it will hold at most (at full length)
    service_wait_steps: int = 0  # consecutive steps it was runnable but not decoded
    blocks_by_group: tuple[GroupBlocks, ...] = ()  # with layer groups: one entry per group

    def __post_init__(self) -> None:
        check_request_id("request_id", self.request_id)
        if not isinstance(self.spec, RequestSpec):
            raise TypeError(f"spec must be a RequestSpec, got {type(self.spec).__name__}")
        if self.spec.request_id != self.request_id:
            raise ValueError(
                f"spec.request_id {self.spec.request_id!r} must equal request_id "
                f"{self.request_id!r}"
            )
        tokens, blocks, private, lifetime, wait = (
            self.committed_tokens,
            self.committed_blocks,
            self.committed_private_blocks,
            self.lifetime_private_blocks,
            self.service_wait_steps,
        )
        if (  # rows are rebuilt every step: one test for the common case, messages on failure
            type(tokens) is not int
            or type(blocks) is not int
            or type(private) is not int
            or type(lifetime) is not int
            or type(wait) is not int
            or min(tokens, blocks, private, lifetime, wait) < 0
        ):
            for name in _ACTIVE_INT_FIELDS:
                check_positive_int(name, getattr(self, name), minimum=0)
        if tokens > self.spec.total_tokens:
            raise ValueError(
                f"request {self.request_id!r} holds {tokens} tokens, more than "
                f"its lifetime of {self.spec.total_tokens} (context + max_new_tokens)"
            )
        if private > blocks:
            raise ValueError(
                f"request {self.request_id!r}: committed_private_blocks "
                f"({private}) must be <= committed_blocks ({blocks})"
            )
        if private > lifetime:
            raise ValueError(
                f"request {self.request_id!r} holds {private} private "
                f"blocks, more than its lifetime commitment of {lifetime}"
            )
        if self.blocks_by_group:
            self._check_groups()

    def _check_groups(self) -> None:
        groups = self.blocks_by_group
        if not isinstance(groups, tuple) or not all(isinstance(g, GroupBlocks) for g in groups):
            raise TypeError(
                f"request {self.request_id!r}: blocks_by_group must be a tuple of GroupBlocks"
            )
        first = groups[0]
        scalars = (
            self.committed_blocks,
            self.committed_private_blocks,
            self.lifetime_private_blocks,
        )
        if scalars != (
            first.committed_blocks,
            first.committed_private_blocks,
            first.lifetime_private_blocks,
        ):
            raise ValueError(
                f"request {self.request_id!r}: committed_blocks, committed_private_blocks and "
                f"lifetime_private_blocks {scalars} must be group 0's ({first})"
            )

    @property
    def remaining_private_blocks(self) -> int:
        """Private blocks it may still take before it finishes (group 0's, with layer groups)."""
        return self.lifetime_private_blocks - self.committed_private_blocks

    @property
    def blocks_in_groups(self) -> tuple[GroupBlocks, ...]:
        """``blocks_by_group``, or the scalar fields as one group for a row without groups."""
        if self.blocks_by_group:
            return self.blocks_by_group
        return (
            GroupBlocks(
                self.committed_blocks, self.committed_private_blocks, self.lifetime_private_blocks
            ),
        )

    @property
    def runnable(self) -> bool:
        """It still has a token to decode."""
        return self.committed_tokens < self.spec.total_tokens


@dataclass(frozen=True)
class WaitingRequest:
    """A submitted request not yet admitted to the cache."""

    request_id: RequestId
    spec: RequestSpec
    lifetime_private_blocks: int  # private blocks it would hold at most (at full length)
    wait_steps: int = 0  # steps spent waiting so far
    skip_count: int = 0  # times a later submission was admitted while it waited
    lifetime_private_blocks_by_group: tuple[int, ...] = ()  # multi-group snapshots, per group

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
        if self.lifetime_private_blocks_by_group:
            _check_by_group(
                f"request {self.request_id!r}",
                "lifetime_private_blocks_by_group",
                self.lifetime_private_blocks_by_group,
                "lifetime_private_blocks",
                self.lifetime_private_blocks,
            )

    @property
    def lifetime_private_blocks_in_groups(self) -> tuple[int, ...]:
        """Its lifetime private blocks per group (one entry for a one-group row)."""
        return self.lifetime_private_blocks_by_group or (self.lifetime_private_blocks,)


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


def lifetime_private_blocks_by_group(
    spec: RequestSpec, shapes: Sequence[GroupShape], prefixes: Mapping[PrefixId, PrefixInfo]
) -> tuple[int, ...]:
    """Private blocks ``spec`` holds at most in each layer group (``shapes``: each group's
    ``(block_size, window)``).

    A shared prefix is resident full blocks in every group, so the request's own tokens start on a
    block boundary everywhere, and what it holds privately is what a request of its own tokens
    alone would hold: ``lifetime_blocks(total - prefix tokens)`` per group. With one full group
    this is ``lifetime_private_blocks``.
    """
    prefix = shared_prefix(spec, prefixes)
    own = spec.total_tokens - (0 if prefix is None else prefix.num_tokens)
    return tuple(lifetime_blocks(own, block_size, window) for block_size, window in shapes)


# (block_size or per-group (block_size, window) shapes, {(prefix_id, blocks, num_tokens)})
Geometry: TypeAlias = tuple[
    int | tuple[GroupShape, ...], frozenset[tuple[PrefixId, int | tuple[int, ...], int]]
]


def geometry_of(
    block_size: int, prefixes: Iterable[PrefixInfo], shapes: tuple[GroupShape, ...] = ()
) -> Geometry:
    """What ``lifetime_private_blocks`` (and whether a prefix is usable) depends on: the block
    size and each resident prefix's ``(prefix_id, num_blocks, num_tokens)`` — not refcounts.
    With layer groups (``shapes``: each group's ``(block_size, window)``), the shapes and each
    prefix's blocks per group."""
    if not shapes:
        return block_size, frozenset((p.prefix_id, p.num_blocks, p.num_tokens) for p in prefixes)
    return shapes, frozenset((p.prefix_id, p.num_blocks_by_group, p.num_tokens) for p in prefixes)


_GROUP_BLOCK_FIELDS = ("committed_blocks", "committed_private_blocks", "lifetime_private_blocks")
_ACTIVE_INT_FIELDS = ("committed_tokens", *_GROUP_BLOCK_FIELDS, "service_wait_steps")
