"""The draft-model drafter: a smaller model of the same tokenizer proposes drafts greedily.

It runs its own paged KV cache (built by ``flashdec.LLM`` beside the target's: same device and
block size, as many tokens) and its own engine. That cache holds only verified tokens. Each
round, one step brings every request's tokens verified since its last round (committed: prompt
chunks the first time, the accepted drafts and the target's token after), and each request's
last row proposes its first draft. Each further draft comes from a step over the request's
drafts so far, which is aborted: a rejected draft leaves no trace in the draft cache (the
transaction restores its slots bit-identically), so nothing ever has to be trimmed. Every
request of a round shares its steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from flashdec.cache import PagedKVCache
from flashdec.engine.engine import DecodeEngine
from flashdec.runtime import upload
from flashdec.speculative.drafts import DraftRequest

# prompt tokens one catch-up step brings per request at most (bounds the step's activations)
MAX_CATCH_UP_TOKENS = 2048


class DraftModelDrafter:
    """Drafts from ``adapter``'s model (a :class:`flashdec.models.DecoderAdapter`: models sit
    above the engine, not imported) through ``cache``, the draft model's own, with the engine
    backends given."""

    def __init__(
        self, adapter, cache: PagedKVCache, *, append_backend: str, decode_backend: str
    ) -> None:
        self.adapter = adapter
        self.engine = DecodeEngine.for_model(
            cache, adapter.spec, append_backend=append_backend, decode_backend=decode_backend
        )
        self._requests: set = set()  # request ids in the draft cache

    def forget(self, rid) -> None:
        """Drop ``rid``'s draft state (its blocks return to the draft pool)."""
        if rid in self._requests:
            self._requests.discard(rid)
            self.engine.cache.discard_request(rid)

    def propose_many(self, wanted: Mapping[object, DraftRequest]) -> dict[object, list[int]]:
        """Each request's greedy drafts, all requests in the same steps. A request whose
        context is no longer than what its draft cache holds (its tokens were taken back, or a
        failed step is being retried) starts over."""
        if not wanted:
            return {}
        cache = self.engine.cache
        pending = {}
        for rid, want in wanted.items():
            context_len = want.prompt.shape[0] + len(want.tokens) + len(want.tail)
            if rid in self._requests and cache.seq_len(rid) >= context_len:
                self.forget(rid)
            if rid not in self._requests:
                cache.add_request(rid)
                self._requests.add(rid)
            pending[rid] = self._unseen(cache.seq_len(rid), want)
        limit = min(
            self.engine.max_tokens_per_request_step or MAX_CATCH_UP_TOKENS, MAX_CATCH_UP_TOKENS
        )
        while True:  # long catch-ups first, in committed chunks whose logits nobody reads
            long = [(rid, ids[:limit]) for rid, ids in pending.items() if ids.shape[0] > limit]
            if not long:
                break
            self._step(long, commit=True)
            for rid, chunk in long:
                pending[rid] = pending[rid][chunk.shape[0] :]
        # rows by descending budget: each further step's requests are the first rows; the
        # drafts stay on the device until the round ends (one read, no wait between steps)
        order = sorted(pending, key=lambda rid: -wanted[rid].num_tokens)
        most = wanted[order[0]].num_tokens
        drafts = torch.empty(len(order), most, dtype=torch.long, device=self.adapter.spec.device)
        drafts[:, 0] = self._step([(rid, pending[rid]) for rid in order], commit=True)
        for j in range(1, most):
            rows = sum(1 for rid in order if wanted[rid].num_tokens > j)
            ids = drafts[:rows, :j]  # each request brings its drafts so far
            batch = [(rid, ids[i]) for i, rid in enumerate(order[:rows])]
            drafts[:rows, j] = self._step(batch, commit=False)
        return {
            rid: row[: wanted[rid].num_tokens]
            for rid, row in zip(order, drafts.tolist(), strict=True)
        }

    def _unseen(self, held: int, want: DraftRequest) -> torch.Tensor:
        """The request's context from position ``held`` on, as device ids."""
        device = self.adapter.spec.device
        generated = [*want.tokens, *want.tail]
        prompt_len = want.prompt.shape[0]
        if held >= prompt_len:
            return upload(generated[held - prompt_len :], device)
        return torch.cat([want.prompt[held:], upload(generated, device)])

    def _step(self, batch: list[tuple[object, torch.Tensor]], *, commit: bool) -> torch.Tensor:
        """One draft-model step over each request's ``ids``; the argmax of each request's last
        row, on the device. ``commit``: the tokens stay in the draft cache, else the step is
        aborted."""
        engine = self.engine
        rids = [rid for rid, _ in batch]
        counts = [ids.shape[0] for _, ids in batch]
        last_rows = [end - 1 for end in itertools.accumulate(counts)]
        tx = engine.begin_step(rids, num_tokens=counts)
        try:
            logits = self.adapter.decode(
                torch.cat([ids for _, ids in batch]),
                lambda layer, q, k, v: engine.step_layer(tx, layer, q, k, v),
                logits_rows=upload(last_rows, self.adapter.spec.device),
            )
            tokens = logits.argmax(dim=-1)
            if commit:
                engine.commit_step(tx)
        finally:
            if engine.has_open_step:
                engine.abort_step(tx)
        return tokens
