"""The n-gram (prompt-lookup) drafter: drafts copied from the request's own context.

The suffix of the context (prompt + generated tokens) is looked up earlier in the context; the
tokens that followed its longest match (``max_ngram`` down to ``min_ngram`` tokens) are the
draft. One lookup is vectorised: the positions holding the last token are found in one numpy
comparison over the context, then each earlier suffix token narrows them (``max_ngram - 1``
gathers over the candidates only). Each request's context lives in a growing numpy buffer that
takes only the tokens new since its last lookup, so a step costs no copy of the context.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from flashdec.speculative.drafts import DraftRequest

_EMPTY = np.zeros(0, dtype=np.int64)


def propose_ngram(context: np.ndarray, num_tokens: int, min_ngram: int, max_ngram: int):
    """The draft for ``context [L]`` (int64): the up to ``num_tokens`` tokens that followed the
    longest earlier occurrence of the context's last ``n`` tokens, ``max_ngram >= n >=
    min_ngram``. Among occurrences of that longest ``n``, the most recent one that is followed
    by ``num_tokens`` tokens wins, else the earliest (it is followed by the most). Empty when
    no n-gram of ``min_ngram`` tokens or more recurs."""
    size = context.shape[0]
    if size < 2 or num_tokens < 1:
        return _EMPTY
    cand = np.flatnonzero(context[: size - 1] == context[size - 1])  # ends of 1-gram matches
    if cand.size == 0:
        return _EMPTY
    length = np.ones(cand.shape[0], dtype=np.int64)
    alive = np.ones(cand.shape[0], dtype=bool)
    for t in range(1, min(max_ngram, size - 1)):
        before = cand - t
        alive &= before >= 0
        alive &= context[np.maximum(before, 0)] == context[size - 1 - t]
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < min_ngram:
        return _EMPTY
    ends = cand[length == best]  # ascending
    full = ends[ends + 1 + num_tokens <= size]
    end = int(full[-1]) if full.size else int(ends[0])
    return context[end + 1 : end + 1 + num_tokens]


class NgramDrafter:
    """Per-request contexts (prompt + generated tokens, appended incrementally) and their
    n-gram drafts."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self._contexts: dict = {}  # request id -> [buffer, valid length, prompt length]

    def forget(self, rid) -> None:
        self._contexts.pop(rid, None)

    def propose_many(self, wanted: Mapping[object, DraftRequest]) -> dict[object, list[int]]:
        """Each request's drafts (see :meth:`propose`)."""
        return {
            rid: self.propose(rid, w.prompt, w.tokens, w.num_tokens, w.tail)
            for rid, w in wanted.items()
        }

    def propose(
        self,
        rid,
        prompt: torch.Tensor,
        tokens: Sequence[int],
        num_tokens: int,
        tail: Sequence[int] = (),
    ) -> list[int]:
        """Up to ``num_tokens`` drafts for request ``rid`` whose context is ``prompt`` (read
        once), then ``tokens`` (its recorded tokens: only those new since the last call are
        appended) and ``tail`` (tokens not recorded yet, e.g. still to be collected: looked at,
        not kept)."""
        held = self._contexts.get(rid)
        if held is None:
            ids = prompt.detach().cpu().numpy().astype(np.int64)
            buffer = np.empty(max(64, 2 * (ids.shape[0] + len(tokens))), dtype=np.int64)
            buffer[: ids.shape[0]] = ids
            held = self._contexts[rid] = [buffer, ids.shape[0], ids.shape[0]]
        buffer, size, prompt_len = held
        new = len(tokens) - (size - prompt_len)
        if new < 0:  # the request's tokens were reset (its admission was taken back)
            size, new = prompt_len, len(tokens)
        end = size + new + len(tail)
        if end > buffer.shape[0]:
            grown = np.empty(2 * end, dtype=np.int64)
            grown[:size] = buffer[:size]
            buffer = held[0] = grown
        if new:
            buffer[size : size + new] = tokens[len(tokens) - new :]
            size += new
        held[1] = size
        if tail:
            buffer[size:end] = tail
        draft = propose_ngram(buffer[:end], num_tokens, self.min_ngram, self.max_ngram)
        return draft.tolist()
