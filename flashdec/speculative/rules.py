"""The accept rules of a verification step.

A request brings its last token and drafts ``x_1..x_k``; the target model's rows ``0..k`` give
the distribution of the token after each prefix. Greedy: accept the longest prefix of drafts
equal to the target's argmax, then take the target's next token. Sampled (Leviathan et al.
2023; Chen et al. 2023): draft ``x_i`` is accepted with probability ``min(1, p(x_i)/q(x_i))``;
an n-gram draft is deterministic (``q`` is a point mass), so with probability ``p(x_i)``. At
the first rejection the token is drawn from the residual ``max(0, p - q)`` normalised (``p``
with ``x_i`` removed); after ``k`` acceptances from row ``k``. Each emitted token is then
distributed exactly as the target model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a greedy verification emits: the drafts that equal the target's argmax
    ``targets`` (``len(drafts) + 1`` rows), up to the first that does not, then the target's
    token there. Always at least one token."""
    accepted = 0
    for draft, target in zip(drafts, targets, strict=False):
        if draft != target:
            break
        accepted += 1
    return [*drafts[:accepted], targets[accepted]]


def accept_sampled(
    probs: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for ``R`` independent rows at once: ``probs [R, k + 1, V]`` (the
    target's distributions after each prefix), deterministic ``drafts [R, k]`` (int64). Returns
    ``(accepted [R], next_token [R])``: row ``r`` emits ``drafts[r, :accepted[r]]`` then
    ``next_token[r]``. Draws ``R * k`` uniforms, then one categorical sample per row, from
    ``generator``."""
    rows, k = drafts.shape
    index = torch.arange(rows, device=probs.device)
    if k == 0:
        accepted = torch.zeros(rows, dtype=torch.long, device=probs.device)
        return accepted, torch.multinomial(probs[:, 0], 1, generator=generator).flatten()
    p_draft = probs[:, :k].gather(2, drafts.unsqueeze(-1)).squeeze(-1)  # [R, k]
    uniform = torch.rand(rows, k, generator=generator, device=probs.device, dtype=probs.dtype)
    accepted = (uniform < p_draft).long().cumprod(1).sum(1)  # the leading accepts
    row = probs[index, accepted]  # [R, V]: where the next token is drawn
    rejected = accepted < k
    rejected_draft = drafts[index, accepted.clamp(max=k - 1)].unsqueeze(1)
    kept = torch.where(rejected.unsqueeze(1), 0.0, row.gather(1, rejected_draft))
    residual = row.scatter(1, rejected_draft, kept)  # p without the rejected draft
    return accepted, torch.multinomial(residual, 1, generator=generator).flatten()
