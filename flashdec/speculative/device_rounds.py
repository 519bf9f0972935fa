"""The device-side parts of a speculation round that does not wait for the host.

:func:`~flashdec.speculative.ngram.propose_ngram` and
:func:`~flashdec.speculative.rules.accept_greedy` run on the host, so a round that drafts from a
request's context and accepts against the target's argmax must read both back. Here the same
rules are fixed-shape tensor ops over every row at once: no ``.item()``, no ``nonzero``, no
boolean indexing, no branch on a tensor's value, so a round runs without a host sync and can be
captured in a CUDA graph. Every row gives exactly what the host rule gives for it.

The contexts live in a :class:`DeviceTokenHistory`: one preallocated ``[slots, capacity]``
buffer and its lengths, loaded once at admission (host-side) and appended to on the device.
"""

from __future__ import annotations

import torch

from flashdec._checks import check_int_tensor, check_positive_int, check_shape

__all__ = ["DeviceTokenHistory", "accept_greedy_device", "propose_ngram_device"]


class DeviceTokenHistory:
    """Per-slot token contexts on a device: ``tokens [slots, capacity]`` and ``lengths
    [slots]`` (int64, preallocated, fixed addresses so a captured graph keeps reading them).
    Row ``s`` holds its context in ``tokens[s, :lengths[s]]``; what lies past that is garbage
    that no reader looks at.

    Capacity policy: a slot never grows past ``capacity``. :meth:`append` writes the tokens that
    fit and drops the rest; ``lengths`` counts the tokens written, so it stops at ``capacity``.
    (The caller keeps contexts within capacity; the drop only keeps an overflow from touching
    any other slot.)"""

    def __init__(self, num_slots: int, capacity: int, device: torch.device | str = "cpu") -> None:
        self.num_slots = check_positive_int("num_slots", num_slots)
        self.capacity = check_positive_int("capacity", capacity)
        self.device = torch.device(device)
        # one spare element past each buffer: the masked-off writes of append land there, so
        # the scatter keeps a fixed shape and never reaches another slot
        self._token_buffer = torch.zeros(
            num_slots * capacity + 1, dtype=torch.int64, device=self.device
        )
        self._length_buffer = torch.zeros(num_slots + 1, dtype=torch.int64, device=self.device)
        self.tokens = self._token_buffer[: num_slots * capacity].view(num_slots, capacity)
        self.lengths = self._length_buffer[:num_slots]

    def _check_slot(self, slot: object) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise TypeError(f"slot must be an int, got {type(slot).__name__}")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in [0, {self.num_slots}), got {slot}")
        return slot

    def load(self, slot: int, ids: torch.Tensor) -> None:
        """Set slot ``slot``'s context to ``ids [n]`` (``n <= capacity``), e.g. a prompt at
        admission time: host-side, may synchronise. A rejected call changes nothing."""
        self._check_slot(slot)
        check_int_tensor("ids", ids, ndim=1)
        if ids.shape[0] > self.capacity:
            raise ValueError(
                f"ids has {ids.shape[0]} tokens, more than the capacity {self.capacity}"
            )
        self.tokens[slot, : ids.shape[0]].copy_(ids)
        self.lengths[slot] = ids.shape[0]

    def clear(self, slot: int) -> None:
        """Empty slot ``slot`` (its tokens stay, past its length: unread)."""
        self._check_slot(slot)
        self.lengths[slot] = 0

    def context(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s context, ``tokens[slot, :lengths[slot]]`` (reads the length: syncs;
        for set-up, tests and debugging, not for a round)."""
        self._check_slot(slot)
        return self.tokens[slot, : int(self.lengths[slot])]

    def append(self, slots: torch.Tensor, new_tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Append ``new_tokens[r, :counts[r]]`` to slot ``slots[r]`` for every row ``r``
        (``slots [R]``, ``new_tokens [R, W]``, ``counts [R]``), all on the device: no host sync,
        fixed shapes (one masked scatter). ``counts`` are clamped to ``[0, W]``; tokens past
        the capacity are dropped (see the class). ``slots`` must be distinct: a slot named twice
        gets one of its rows' writes, unspecified which. A row whose slot is out of range is
        dropped (checking would sync)."""
        check_int_tensor("slots", slots, ndim=1, device=self.device)
        check_int_tensor("new_tokens", new_tokens, ndim=2, device=self.device)
        check_int_tensor("counts", counts, ndim=1, device=self.device)
        rows, width = new_tokens.shape
        check_shape("slots", slots, (rows,))
        check_shape("counts", counts, (rows,))
        slots = slots.long()
        in_range = (slots >= 0) & (slots < self.num_slots)
        safe_slots = slots.clamp(0, self.num_slots - 1)
        start = self.lengths.gather(0, safe_slots)  # [R]
        counts = counts.long().clamp(0, width)
        offset = torch.arange(width, device=self.device)
        position = start.unsqueeze(1) + offset  # [R, W]
        write = (offset < counts.unsqueeze(1)) & (position < self.capacity) & in_range[:, None]
        spare = self.num_slots * self.capacity  # the token buffer's spare element
        index = torch.where(write, safe_slots.unsqueeze(1) * self.capacity + position, spare)
        self._token_buffer.scatter_(0, index.flatten(), new_tokens.long().flatten())
        grown = (start + counts).clamp(max=self.capacity)
        self._length_buffer.scatter_(0, torch.where(in_range, safe_slots, self.num_slots), grown)


def _check_ngram_args(num_tokens: int, min_ngram: int, max_ngram: int) -> None:
    check_positive_int("num_tokens", num_tokens)
    check_positive_int("min_ngram", min_ngram)
    check_positive_int("max_ngram", max_ngram)
    if max_ngram < min_ngram:
        raise ValueError(f"max_ngram ({max_ngram}) must be >= min_ngram ({min_ngram})")


def propose_ngram_device(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    num_tokens: int,
    min_ngram: int,
    max_ngram: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The n-gram drafts of every row at once: ``(drafts [R, num_tokens], num_drafts [R])``
    (int64) for contexts ``tokens[r, :lengths[r]]`` (``tokens [R, C]``, ``lengths [R]``;
    lengths are clamped to ``[0, C]``). Row ``r``'s ``drafts[r, :num_drafts[r]]`` is exactly
    ``propose_ngram(tokens[r, :lengths[r]], num_tokens, min_ngram, max_ngram)`` (same
    tie-breaks); ``drafts`` is 0 past ``num_drafts``. Fixed-shape tensor ops only (no host
    sync, CUDA-graph capturable); ``O(R * C * min(max_ngram, C))`` elementwise work."""
    check_int_tensor("tokens", tokens, ndim=2)
    check_int_tensor("lengths", lengths, ndim=1, device=tokens.device)
    rows, width = tokens.shape
    check_shape("lengths", lengths, (rows,))
    _check_ngram_args(num_tokens, min_ngram, max_ngram)
    device = tokens.device
    drafts = torch.zeros(rows, num_tokens, dtype=torch.int64, device=device)
    num_drafts = torch.zeros(rows, dtype=torch.int64, device=device)
    if width < 2:  # no context of 2 tokens fits: nothing recurs
        return drafts, num_drafts
    tokens = tokens.long()
    size = lengths.long().clamp(0, width).unsqueeze(1)  # [R, 1]
    end = torch.arange(width, device=device)  # a candidate match's last position
    last = tokens.gather(1, (size - 1).clamp(min=0))  # [R, 1]: the context's last token
    # the match of the suffix that ends at each position, one token further back per step;
    # a candidate ends before the context's last token, so everything read lies in the context
    alive = (tokens == last) & (end < size - 1)
    match = alive.long()
    for back in range(1, min(max_ngram, width - 1)):
        suffix = tokens.gather(1, (size - 1 - back).clamp(min=0))  # [R, 1]
        earlier = torch.nn.functional.pad(tokens[:, : width - back], (back, 0))
        alive = alive & (earlier == suffix) & (end >= back)
        match += alive
    best = match.amax(1, keepdim=True)  # [R, 1]; 0: no candidate
    found = best >= min_ngram
    longest = (match == best) & found
    # the most recent longest match followed by num_tokens tokens, else the earliest one
    full = longest & (end + 1 + num_tokens <= size)
    last_full = torch.where(full, end, -1).amax(1, keepdim=True)
    first = torch.where(longest, end, width).amin(1, keepdim=True)
    chosen = torch.where(last_full >= 0, last_full, first)  # [R, 1]
    count = torch.where(found, (size - 1 - chosen).clamp(0, num_tokens), 0)  # [R, 1]
    offset = torch.arange(num_tokens, device=device)
    taken = tokens.gather(1, (chosen + 1 + offset).clamp(max=width - 1))
    drafts = torch.where(offset < count, taken, 0)
    return drafts, count.squeeze(1)


def accept_greedy_device(
    drafts: torch.Tensor, num_drafts: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of every row at once: ``(accepted [R], next_tokens [R])`` (int64) for
    ``drafts [R, K]`` of which the first ``num_drafts[r]`` count (clamped to ``[0, K]``; the
    rest is padding, never accepted) and the target's argmax ``targets [R, K + 1]``. Row ``r``
    emits ``drafts[r, :accepted[r]]`` then ``next_tokens[r] = targets[r, accepted[r]]``:
    exactly ``accept_greedy(drafts[r, :num_drafts[r]], targets[r])``. Fixed shapes, no sync."""
    check_int_tensor("drafts", drafts, ndim=2)
    check_int_tensor("num_drafts", num_drafts, ndim=1, device=drafts.device)
    check_int_tensor("targets", targets, ndim=2, device=drafts.device)
    rows, k = drafts.shape
    check_shape("num_drafts", num_drafts, (rows,))
    check_shape("targets", targets, (rows, k + 1))
    counted = torch.arange(k, device=drafts.device) < num_drafts.unsqueeze(1)
    agree = (drafts.long() == targets[:, :k].long()) & counted
    accepted = agree.long().cumprod(1).sum(1)  # the leading agreements
    return accepted, targets.long().gather(1, accepted.unsqueeze(1)).squeeze(1)
