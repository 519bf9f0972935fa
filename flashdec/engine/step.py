"""What the engine keeps of a step: its result, the open step's state, a captured step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdec.cache import TokenTransactionView
from flashdec.engine.decode_state import DecodeState
from flashdec.engine.verify_state import VerifySlots
from flashdec.kernels import ExtendWorkspace


@dataclass(frozen=True)
class StepResult:
    """What a committed step published: tokens for every listed request, all layers."""

    transaction_id: int
    request_ids: tuple
    positions: tuple[int, ...]  # where each request's first new token went (= pre-step seq_len)
    seq_lens: tuple[int, ...]  # committed lengths after the step
    num_layers: int


class OpenStep:
    """Engine-side state of the one open transaction (the cache keeps the reservation).

    Everything a layer needs is kept per KV layer group (one entry each; one group is the
    normal case): the group's slots, decode plan, outputs, input shapes and bound launch.
    """

    __slots__ = (
        "backups",
        "bound",
        "decode",
        "extend",
        "fixed",
        "group_slots",
        "kind",
        "layer_outputs",
        "max_len_after",
        "num_rows",
        "num_tokens",
        "outputs",
        "plan_len",
        "positions",
        "query_lens",
        "request_ids",
        "seq_lens_after",
        "shapes",
        "slots",
        "tokens_per_row",
        "transaction_id",
    )

    def __init__(
        self, kind: str, view: TokenTransactionView, group_slots: tuple, positions, lens_after
    ):
        # "decode" (one token each), "extend" (n >= 1 tokens each, attended in the step) or
        # "prefill" (a prompt import of caller-built K/V)
        self.kind = kind
        self.transaction_id = view.transaction_id
        self.request_ids = view.request_ids
        self.group_slots = group_slots  # every group's slots
        self.slots = slots = group_slots[0]
        self.num_rows = slots.num_rows
        self.num_tokens = view.num_tokens  # tokens of the transaction (every group's input rows)
        # tuples, as StepResult reports them (begin_step makes tuples: no copy on its path)
        self.positions: tuple[int, ...] = tuple(positions)
        self.seq_lens_after: tuple[int, ...] = tuple(lens_after)
        self.max_len_after = max(lens_after)
        self.plan_len = self.max_len_after  # the length decode plans are sized for
        count = len(group_slots)
        self.decode: list[DecodeState | None] = [None] * count
        # an extend step's plan and workspace per group, made by its first layer (host lengths)
        self.extend: list[ExtendWorkspace | None] = [None] * count
        # [layers of the group, rows, Hq, D]: every layer's attention, and its views per layer
        self.outputs: list[torch.Tensor | None] = [None] * count
        self.layer_outputs: list[tuple[torch.Tensor, ...]] = [()] * count
        self.shapes: list[tuple | None] = [None] * count  # (q, k/v) shapes of the first layer
        # per group: where the fused append saves the slots' old bytes (None: the cache did)
        self.backups: tuple[torch.Tensor | None, ...] = ()
        # per group: the fast path's launch, the q, k, v strides it was bound to, the outputs
        # (a decode step); the strides, bound append and extend and their rotated-q buffer
        # (an extend step)
        self.bound: list[tuple | None] = [None] * count
        self.query_lens: torch.Tensor | None = None  # an extend step's new tokens per request
        # tokens of every row: 1 for a decode step, n for a fixed-shape extend step (its
        # metadata in ``fixed``, per group: a CUDA graph can capture it), 0 for other steps
        self.tokens_per_row = 1 if kind == "decode" else 0
        self.fixed: tuple[VerifySlots, ...] = ()

    @property
    def generations(self) -> tuple[int, ...]:
        """The slot buffers' generation in every group (a captured graph reads them)."""
        return tuple(slots.generation for slots in self.group_slots)


class CapturedStep:
    """A CUDA graph over the layers of one step, replayable for later steps of the same shape:
    as many rows, as many tokens per row (1: decode; n: a fixed-shape extend step), the same
    metadata buffers.

    ``output`` is what the captured body returned (tensors the graph rewrites on every replay).
    """

    def __init__(
        self, engine, graph, output, num_rows: int, generation, keep: tuple, tokens_per_row: int = 1
    ):
        self.engine = engine
        self.graph = graph
        self.output = output
        self.num_rows = num_rows
        self.tokens_per_row = tokens_per_row
        self.generation = generation  # the slot buffers' generation(s) it read
        self._keep = keep  # buffers the graph reads (its decode or extend workspaces)

    def fits(self, tx) -> bool:
        """Whether ``replay_step(tx, self)`` is valid: the open step ``tx`` has this graph's
        rows and tokens per row and reads the same slot buffers (a bigger batch since the
        capture replaces a decode step's)."""
        return self._fits(self.engine._require_open_step(tx))

    def _fits(self, step: OpenStep) -> bool:
        return (self.num_rows, self.tokens_per_row, self.generation) == (
            step.num_rows,
            step.tokens_per_row,
            step.generations,
        )
