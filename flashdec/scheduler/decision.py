"""``SchedulerDecision``: what a policy decided for one snapshot, and what it decided it from."""

from __future__ import annotations

from dataclasses import dataclass

from flashdec.scheduler.snapshot import SchedulingSnapshot
from flashdec.scheduler.spec import RequestId, SchedulerConfig, check_id_tuple


@dataclass(frozen=True)
class SchedulerDecision:
    """One planning step.

    ``admit``: waiting ids to make active now, in submission order. ``reject``: waiting ids that
    can never run (terminal). ``batch``: ids to decode this step, in priority order — active ids
    and ids admitted by this same decision (the caller imports their context first).
    ``snapshot`` and ``config`` are what the decision was planned from, so an applier can re-plan
    and compare exactly.
    """

    admit: tuple[RequestId, ...]
    reject: tuple[RequestId, ...]
    batch: tuple[RequestId, ...]
    snapshot: SchedulingSnapshot
    config: SchedulerConfig

    def __post_init__(self) -> None:
        check_id_tuple("admit", self.admit)
        check_id_tuple("reject", self.reject)
        check_id_tuple("batch", self.batch)
        if not isinstance(self.snapshot, SchedulingSnapshot):
            raise TypeError(
                f"snapshot must be a SchedulingSnapshot, got {type(self.snapshot).__name__}"
            )
        if not isinstance(self.config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(self.config).__name__}")
        waiting = self.snapshot.waiting_view  # membership by id, without listing the queue
        for name, ids in (("admit", self.admit), ("reject", self.reject)):
            unknown = [rid for rid in ids if not waiting.has_id(rid)]
            if unknown:
                raise ValueError(f"{name} names ids the snapshot does not allow there: {unknown!r}")
        allowed = set(self.snapshot.active_ids) | set(self.admit)
        unknown = [rid for rid in self.batch if rid not in allowed]
        if unknown:
            raise ValueError(f"batch names ids the snapshot does not allow there: {unknown!r}")
        both = set(self.admit) & set(self.reject)
        if both:
            raise ValueError(f"ids both admitted and rejected: {sorted(both, key=repr)!r}")
        if len(self.batch) > self.config.max_batch_size:
            raise ValueError(
                f"batch has {len(self.batch)} ids, more than max_batch_size "
                f"{self.config.max_batch_size}"
            )
        if (
            self.admit
            and len(self.snapshot.active) + len(self.admit) > self.config.max_active_requests
        ):
            raise ValueError(
                f"admitting {len(self.admit)} beside {len(self.snapshot.active)} active requests "
                f"exceeds max_active_requests {self.config.max_active_requests}"
            )

    @property
    def is_noop(self) -> bool:
        return not (self.admit or self.reject or self.batch)
