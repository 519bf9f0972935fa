"""The model runner: the serving loop's executor for a transformers model.

It owns what a step of :class:`flashdec.LLM` does beyond the engine: each request's record
(prompt, tokens, timing, sampling: :class:`~flashdec.engine.request.Request`), the
device-resident last tokens and their hand-off to the host one step late, the choice of the
next token (argmax or a sample), and the warm start: the CUDA graphs of the decode forward
(:class:`~flashdec.engine.decode_graphs.DecodeGraphs`), those of the verification step when
speculation is on (:class:`~flashdec.engine.verify_graphs.VerifyGraphs`) and the mixed step's
kernels, made ready before the first request.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from flashdec.engine.decode_graphs import (
    DecodeGraphs,
    WarmStart,
    free_rows,
    placeholder_requests,
)
from flashdec.engine.decode_state import max_table_tokens
from flashdec.engine.engine import DecodeEngine
from flashdec.engine.loop import StepExecutor
from flashdec.engine.piecewise_graphs import TOKEN_BUCKETS, PiecewiseGraphs
from flashdec.engine.request import Request, now
from flashdec.engine.sampling import (
    SamplingParams,
    make_generator,
    probabilities,
    sample,
)
from flashdec.engine.verify_graphs import VerifyGraphs
from flashdec.runtime import upload
from flashdec.speculative import (
    DraftController,
    Drafter,
    DraftRequest,
    NgramDrafter,
    SpeculationGate,
    SpeculativeConfig,
    accept_greedy,
    accept_sampled,
)


class ModelRunner(StepExecutor):
    """The serving loop's executor for a model: mixed prompt + decode steps, decode steps (eager
    or graph), sampling.

    Tokens stay on the device between steps: each request's last token sits in ``last_tokens``
    at its cache request slot, the decode forward gathers its inputs from there (inside the
    graph) and the step's choices are scattered back. The host reads a step's tokens only after
    the *next* step is launched, so its bookkeeping (scheduling, the next ``begin_step``) overlaps
    the GPU's work. A request that produced EOS is therefore seen one step late: the token
    computed meanwhile is dropped.
    """

    def __init__(
        self,
        engine: DecodeEngine,
        adapter,
        *,
        max_batch_size: int,
        cuda_graphs: bool,
        speculative: SpeculativeConfig | None = None,
        max_step_tokens: int | None = None,
        drafter: Drafter | None = None,
        mixed_step_graphs: bool | None = None,
    ) -> None:
        # adapter: a flashdec.models.DecoderAdapter (models sit above the engine: not imported)
        self.engine = engine
        self.adapter = adapter
        self.spec = adapter.spec
        self.max_batch_size = max_batch_size
        device = self.spec.device
        self.eos = frozenset(self.spec.eos_token_ids)
        self.requests: dict[int, Request] = {}
        self.sampled: set = set()  # requests that sample (the others take the argmax)
        self._shared_generator: torch.Generator | None = None  # of unseeded add_request calls
        self.last_tokens = torch.zeros(0, dtype=torch.long, device=device)
        self.graphs = (
            DecodeGraphs(
                engine,
                self._forward,
                max_batch_size=max_batch_size,
                num_q_heads=self.spec.num_q_heads,
            )
            if cuda_graphs
            else None
        )
        # verification steps of K drafts per row (padded), as graphs: captured at the warm start
        self.verify_graphs = (
            VerifyGraphs(
                engine,
                self._verify_forward,
                max_batch_size=max_batch_size,
                num_q_heads=self.spec.num_q_heads,
                n=speculative.num_tokens + 1,
            )
            if cuda_graphs and speculative is not None
            else None
        )
        self._draft_ids: torch.Tensor | None = None  # [max_batch_size, K]: what a graph reads
        # mixed steps' dense work per token bucket, attention eager between (default: with
        # the decode graphs)
        if mixed_step_graphs is None:
            mixed_step_graphs = cuda_graphs
        if mixed_step_graphs and not cuda_graphs:
            raise ValueError("mixed_step_graphs=True needs cuda_graphs=True")
        self.mixed_graphs = (
            PiecewiseGraphs(adapter, max_tokens=max_step_tokens or TOKEN_BUCKETS[-1])
            if mixed_step_graphs
            else None
        )
        self._ensure_slots()
        # the step whose tokens are still on their way to the host: (batch, host view, event)
        self.pending: tuple[list, torch.Tensor, torch.cuda.Event | None] | None = None
        self.ended: set = set()  # requests collect() saw end that no decode has reported yet
        pinned = device.type == "cuda"
        self._host_tokens = [
            torch.zeros(max_batch_size, dtype=torch.long, pin_memory=pinned) for _ in range(2)
        ]
        self._turn = 0
        # speculative decoding: drafts per request, verified in one mixed-token step
        self.speculative = speculative
        self.max_step_tokens = max_step_tokens  # drafts keep a step within it
        if speculative is not None:  # method="draft": the drafter comes built (its own cache)
            if drafter is None and speculative.method == "draft":
                raise ValueError("SpeculativeConfig(method='draft') needs its drafter")
            self.drafter = drafter or NgramDrafter(speculative.min_ngram, speculative.max_ngram)
            self.controller = DraftController(speculative.num_tokens)
            speedup = speculative.min_speedup
            self.gate = None if speedup is None else SpeculationGate(speedup)
        self._served: dict = {}  # request -> tokens the last run gave it (absent: one)
        self._accepted: dict = {}  # request -> drafts the last run accepted
        self._caps: dict = {}  # request -> most drafts this run's step may take for it
        # running totals: drafts proposed and accepted; (request, step) pairs that decoded and
        # the tokens they produced; steps the gate kept plain (speculation did not pay there)
        self.counters = dict.fromkeys(
            ("draft_tokens", "accepted_tokens", "request_steps", "step_tokens", "held_steps"), 0
        )

    def _ensure_slots(self) -> None:
        """``last_tokens`` covers every request slot of the cache (it grows rarely; graphs that
        read the old tensor are dropped)."""
        needed = self.engine.cache.layout.num_request_slots
        if self.last_tokens.shape[0] < needed:
            grown = torch.zeros(needed, dtype=torch.long, device=self.spec.device)
            grown[: self.last_tokens.shape[0]] = self.last_tokens
            self.last_tokens = grown
            for graphs in (self.graphs, self.verify_graphs):  # they read the old tensor
                if graphs is not None:
                    graphs.drop()

    @property
    def graph_replays(self) -> int:
        """Decode and verification steps that replayed a CUDA graph."""
        return sum(g.replays for g in (self.graphs, self.verify_graphs) if g is not None)

    def warm_start(self) -> WarmStart:
        """Before the first request (the engine idle): capture every decode graph (and, with
        speculation, every verification graph, in the same memory pool) and the mixed steps'
        piecewise graphs, then compile the mixed steps' kernels, all on placeholder requests.
        Returns the decode graphs' report (the others' are ``verify_graphs.warm_start`` and
        ``mixed_graphs.warm_start``)."""
        engine = self.engine
        # two at least: the mixed warm-up pairs a long context with a chunk (max_batch_size=1)
        rows = min(max(self.graphs.buckets[-1], 2), free_rows(engine))
        with placeholder_requests(engine, rows) as rids:
            self._ensure_slots()  # the graphs read last_tokens: sized for the rows first
            report = self.graphs.capture_all(rids)
            if self.verify_graphs is not None:
                self.verify_graphs.capture_all(rids, pool=self.graphs.pool)
            if self.mixed_graphs is not None:
                self.mixed_graphs.capture_all()
            self._compile_mixed_steps(rids)
        return report

    def _compile_mixed_steps(self, rids: list) -> None:
        """Mixed steps before serving, so that no prompt waits for a kernel compile: every
        extend kernel variant, launched once; then the steps themselves (their other kernels):
        a prompt chunk, committed, leaves a long context; then, per query tile height, a chunk
        alone and beside a decode row over that context, aborted. The placeholders take the
        committed blocks with them."""
        engine = self.engine
        cache = engine.cache
        engine.attention.build_extend_kernels(self.spec.num_q_heads, self.max_batch_size)
        # the committed chunk and a later step's chunk fit together, with a block to spare each
        room = (free_rows(engine) - 2) * min(spec.block_size for spec in cache.kv_groups) // 2
        limit = engine.max_tokens_per_request_step or 1024
        chunk = min(1024, limit, max_table_tokens(cache) - 1, room)
        if chunk < 2:
            return  # no room for a chunk: the first prompt builds the steps' other kernels
        group = self.spec.num_q_heads // self.spec.num_kv_heads
        # one query length per tile height (16..128 rows of tokens x group heads)
        lengths = sorted({min(chunk, max(2, rows // group)) for rows in (16, 32, 64, 128)})
        if len(rids) < 2:  # one row: chunks alone
            for n in lengths:
                self._placeholder_step(rids, [n], commit=False)
            return
        self._placeholder_step(rids[:1], [chunk], commit=True)
        for n in lengths:
            self._placeholder_step(rids[1:2], [n], commit=False)  # no context: single pass
            self._placeholder_step(rids[:2], [1, n], commit=False)  # a long one: split-KV

    def _placeholder_step(self, rids: list, counts: list[int], *, commit: bool) -> None:
        engine = self.engine
        device = self.spec.device
        tx = engine.begin_step(rids, num_tokens=counts)
        try:
            ids = torch.zeros(sum(counts), dtype=torch.long, device=device)
            last_rows = upload(counts, device).cumsum(0) - 1
            self._mixed_forward(ids, tx, last_rows)
            if commit:
                engine.commit_step(tx)
        finally:
            if engine.has_open_step:
                engine.abort_step(tx)

    def request_generator(self, sampling: SamplingParams) -> torch.Generator:
        """A seeded request's own generator (its samples then do not depend on the batch);
        unseeded requests share one, seeded from the operating system's entropy."""
        if sampling.seed is not None:
            return make_generator(self.spec.device, sampling.seed)
        if self._shared_generator is None:
            self._shared_generator = torch.Generator(device=self.spec.device)
            self._shared_generator.seed()
        return self._shared_generator

    def generated_tokens(self, rid) -> list[int]:
        """The tokens of ``rid`` that reached the host after its context (none for an unknown
        id): what the prefix cache hashes when it finishes (SubmissionQueue.generated_tokens)."""
        req = self.requests.get(rid)
        return [] if req is None else req.tokens[req.folded :]

    def forget(self, rid) -> None:
        self.requests.pop(rid, None)
        self.sampled.discard(rid)
        if self.speculative is not None:
            self.drafter.forget(rid)
            self.controller.forget(rid)

    # -- tokens -------------------------------------------------------------------------------
    def _choose(
        self, logits: torch.Tensor, greedy_ids: torch.Tensor | None = None, batch: Sequence = ()
    ) -> torch.Tensor:
        """Next token per row of ``logits [B, V]`` (row ``i`` is request ``batch[i]``), on the
        device: the argmax (``greedy_ids``, when the CUDA graph computed it) for greedy requests,
        a sample for the others. Rows that share sampling params and a generator are sampled
        together, in batch order; an all-greedy batch costs nothing more than the argmax."""
        tokens = greedy_ids if greedy_ids is not None else torch.argmax(logits, dim=-1)
        if not self.sampled:
            return tokens
        groups: dict = {}
        for row, rid in enumerate(batch):
            if rid in self.sampled:
                req = self.requests[rid]
                groups.setdefault((req.sampling, id(req.generator)), (req, []))[1].append(row)
        if not groups:
            return tokens
        tokens = tokens.clone()  # greedy_ids may be a CUDA graph's output: never written
        for req, rows in groups.values():
            index = upload(rows, logits.device)
            sampled = sample(logits.index_select(0, index), req.sampling, req.generator)
            tokens.index_copy_(0, index, sampled)
        return tokens

    def _record(self, rid, token: int, now: float) -> bool:
        """Append a generated token (ignored once the request has ended); True when it ends."""
        req = self.requests.get(rid)
        if req is None or req.finished_at is not None:
            return False
        req.tokens.append(token)
        if req.first_token_at is None:
            req.first_token_at = now
        if len(req.tokens) >= req.max_new_tokens or (not req.ignore_eos and token in self.eos):
            req.finished_at = now
            return True
        return False

    def is_pending(self, rid) -> bool:
        """Whether a token of ``rid`` is still on its way from the device."""
        return self.pending is not None and rid in self.pending[0]

    def collect(self) -> None:
        """Read the pending step's tokens (waits for that step only); the requests that ended
        join ``ended`` until a decode reports them to the loop."""
        if self.pending is None:
            return
        batch, host, event = self.pending
        if event is not None:
            event.synchronize()
        self.pending = None
        stamp = now()
        for rid, token in zip(batch, host.tolist(), strict=True):
            if self._record(rid, token, stamp):
                self.ended.add(rid)

    def revert_admission(self, request_ids: Sequence) -> None:
        """The loop took these admissions back: forget the first tokens their prompts gave."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                req.reset()
            if self.speculative is not None:
                self.drafter.forget(rid)

    def _hand_off(self, batch: list, tokens: torch.Tensor) -> None:
        """Start copying ``tokens [B]`` to the host; :meth:`collect` reads them later."""
        host = self._host_tokens[self._turn][: len(batch)]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=True)
        event = None
        if tokens.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending = (batch, host, event)

    # -- the loop's executor ------------------------------------------------------------------
    def tokens_served(self, request_id) -> int:
        return self._served.get(request_id, 1)

    def run(self, batch: Sequence, chunks: Sequence[tuple[object, int]]) -> tuple[set, set]:
        """One loop step: a verification step when speculation is on and some request of
        ``batch`` has drafts (:meth:`_run_verify`), else :meth:`_run_plain`."""
        self._served, self._accepted, self._caps = {}, {}, {}
        if self.speculative is None:
            return self._plain(batch, chunks)
        done = self._speculate(batch, chunks)
        for rid in done[1]:  # ended: the drafter lets them go now (a draft model's blocks too)
            self.drafter.forget(rid)
        return done

    def _speculate(self, batch: Sequence, chunks: Sequence[tuple[object, int]]) -> tuple[set, set]:
        gate, counters = self.gate, self.counters
        if gate is not None:
            gate.started()
        if not batch:
            return self._plain(batch, chunks)
        ctl = self.controller
        batch = list(batch)
        budgets = {rid: ctl.budget(rid) for rid in batch}
        drafts, skipped = {}, set()
        if ctl.speculates(len(batch)) and any(budgets.values()):
            if gate is None or gate.allows(len(batch)):
                drafts, skipped = self._drafts(batch, budgets, chunks)
            else:
                counters["held_steps"] += 1
        before = counters["request_steps"], counters["step_tokens"]
        verified = any(drafts.values())
        if verified:
            done = self._run_verify(batch, chunks, drafts, skipped)
        else:
            done = self._plain(batch, chunks)
        if gate is not None:  # a step with prompt chunks costs mostly theirs: not measured
            requests = 0 if chunks else counters["request_steps"] - before[0]
            gate.finished(requests, counters["step_tokens"] - before[1], verified)
        # the step is committed: the controller learns from it
        for rid in batch:
            if not budgets[rid]:
                ctl.tick(rid)
            elif rid in drafts:
                ctl.update(rid, len(drafts[rid]), self._accepted.get(rid, 0))
        return done

    def _plain(self, batch: Sequence, chunks: Sequence[tuple[object, int]]) -> tuple[set, set]:
        done = self._run_plain(batch, chunks)
        self.counters["request_steps"] += len(batch)  # one token each
        self.counters["step_tokens"] += len(batch)
        return done

    def _peek(self) -> dict:
        """The pending step's tokens by request, read (it waits for that step) but left
        pending: :meth:`collect` records them once the next step has committed."""
        if self.pending is None:
            return {}
        batch, host, event = self.pending
        if event is not None:
            event.synchronize()
        return dict(zip(batch, host.tolist(), strict=True))

    def _drafts(self, batch: list, budgets: dict, chunks: Sequence) -> tuple[dict, set]:
        """Each request's drafts (looked up for those with a budget) and the requests whose
        pending token already ends them (they sit this step out). Drafts are clipped so that
        no request can pass ``max_new_tokens`` (one token of a step is always the target's),
        a sliding-window group gets at most ``window - 1`` tokens of a request, and the step
        stays within ``max_step_tokens``."""
        peek = self._peek()
        limit = self.engine.max_tokens_per_request_step
        room = None
        if self.max_step_tokens is not None:
            room = self.max_step_tokens - len(batch) - sum(n for _, n in chunks)
        wanted, skipped = {}, set()
        for rid in batch:
            req = self.requests[rid]
            tail = (peek[rid],) if rid in peek else ()
            have = len(req.tokens) + len(tail)
            if req.finished_at is not None or (
                tail
                and (have >= req.max_new_tokens or (not req.ignore_eos and tail[0] in self.eos))
            ):
                skipped.add(rid)
                continue
            cap = req.max_new_tokens - have - 1  # what the request's commitment leaves
            if limit is not None:
                cap = min(cap, limit - 1)
            self._caps[rid] = cap
            k = min(budgets[rid], cap)
            if room is not None:
                k = min(k, room)
            if k <= 0:  # no budget, or none left: not a lookup the controller learns from
                continue
            wanted[rid] = DraftRequest(req.prompt, req.tokens, k, tail)
            if room is not None:
                room -= k
        return (self.drafter.propose_many(wanted) if wanted else {}), skipped

    def _run_verify(
        self, batch: list, chunks: Sequence[tuple[object, int]], drafts: dict, skipped: set
    ) -> tuple[set, set]:
        """One mixed-token step: each request of ``batch`` brings its last token and its drafts
        (``n = 1 + len(drafts)``), the prompt ``chunks`` follow; logits for every verified row.
        The accepted drafts plus the target's next token are committed (``commit_step(accept=)``
        restores the rest). Synchronous: the acceptance must reach the host before the commit,
        so the tokens are recorded at once (nothing stays pending). One wait for the device
        (:meth:`_verify`'s read); the index uploads are asynchronous (:func:`_upload`).

        A step that :meth:`_verify_bucket` finds a batch bucket for runs padded to ``K``
        drafts a row and that bucket (:meth:`_verify_padded`: a CUDA graph when one fits)."""
        self._ensure_slots()
        live = [rid for rid in batch if rid not in skipped]
        drafted = [drafts.get(rid, []) for rid in live]
        bucket = self._verify_bucket(live, chunks)
        if bucket is not None:
            slots, emitted, accepted = self._verify_padded(live, drafted, bucket)
            first_rids, rows = [], list(range(len(live)))
        else:
            slots, emitted, accepted, first_rids, rows = self._verify_packed(live, drafted, chunks)
        # committed: only bookkeeping from here on (no model, no engine call that can fail)
        self.collect()  # the previous step's tokens (the peek read them, this records them)
        stamp = now()
        for rid, tokens in zip([*live, *first_rids], emitted, strict=True):
            for token in tokens:
                if self._record(rid, token, stamp):
                    self.ended.add(rid)
        for rid, tokens, taken in zip(live, emitted[: len(live)], accepted, strict=True):
            self._served[rid] = len(tokens)
            self._accepted[rid] = taken
        for rid in skipped:
            self._served[rid] = 0
        device = self.spec.device
        last = upload([e[-1] for e in emitted], device)
        self.last_tokens.index_copy_(0, slots.index_select(0, upload(rows, device)), last)
        counters = self.counters
        counters["draft_tokens"] += sum(map(len, drafted))
        counters["accepted_tokens"] += sum(accepted)
        counters["request_steps"] += len(live)
        counters["step_tokens"] += sum(len(e) for e in emitted[: len(live)])
        ended, self.ended = self.ended, set()
        return set(), ended

    def _verify_bucket(self, live: list, chunks: Sequence) -> int | None:
        """The batch bucket a verification step pads to, or None (it runs packed, eagerly):
        with verification graphs, a step without prompt chunks whose every live request may
        take ``K`` drafts (its commitment, the windows and ``max_step_tokens`` allow ``K + 1``
        tokens each; fewer real drafts are padded, their acceptance capped by the real ones)."""
        graphs = self.verify_graphs
        if graphs is None or chunks or not live:
            return None
        n = graphs.n
        if any(self._caps.get(rid, 0) < n - 1 for rid in live):
            return None
        if self.max_step_tokens is not None and len(live) * n > self.max_step_tokens:
            return None
        return graphs.bucket(len(live))

    def _draft_buffer(self) -> torch.Tensor:
        """``[max_batch_size, K]`` drafts of a padded verification step: filled before the
        step, read by its graph (fixed address: made once)."""
        if self._draft_ids is None:
            self._draft_ids = torch.zeros(
                self.max_batch_size,
                self.verify_graphs.n - 1,
                dtype=torch.long,
                device=self.spec.device,
            )
        return self._draft_ids

    def _verify_padded(self, live: list, drafted: list, bucket: int) -> tuple:
        """The step of :meth:`_run_verify` as a fixed-shape step: every row brings its last
        token and ``K`` drafts (its own, then padding), the rows pad to ``bucket``; the graph
        of (bucket, launch key) replays when one fits, else the same forward runs eagerly.
        Returns the live rows' request slots, the emitted tokens and the accepted counts."""
        engine, graphs = self.engine, self.verify_graphs
        n, count = graphs.n, len(live)
        device = self.spec.device
        max_len = max(engine.cache.seq_len(rid) for rid in live) + n
        padded = [[*d, *([0] * (n - 1 - len(d)))] for d in drafted]  # any id: never accepted
        tx = engine.begin_step(live, num_tokens=[n] * count, pad_to=bucket)
        try:
            slots = engine.cache.steps.transaction_slots(tx).request_slots
            self._draft_buffer()[:count].copy_(upload(padded, device))
            logits = graphs.run(tx, engine.step_slots(tx), bucket, max_len)
            emitted, accepted = self._verify(logits[: count * n], live, drafted, [], width=n)
            engine.commit_step(tx, accept=[len(e) for e in emitted])
        except BaseException:  # nothing committed: the inputs and the pending tokens stay
            if engine.has_open_step:
                engine.abort_step(tx)
            raise
        return slots, emitted, accepted

    def _verify_forward(self, tx, slots) -> torch.Tensor:
        """The model over an open fixed-shape verification step (what its graph captures): each
        row's last token gathered from ``last_tokens`` with the fixed ``slots``' request slots,
        its drafts from the draft buffer, all on the device. Logits of every row."""
        rows = slots.num_rows
        last = self.last_tokens.index_select(0, slots.request_slots).view(rows, 1)
        ids = torch.cat([last, self._draft_buffer()[:rows]], dim=1).view(-1)
        return self.adapter.decode(ids, self._attention(tx))

    def _verify_packed(self, live: list, drafted: list, chunks: Sequence) -> tuple:
        """The step of :meth:`_run_verify` packed as drafted (prompt chunks after the verified
        rows), eager. Returns the step's request slots, the emitted tokens, the accepted counts,
        the requests whose prompt ended in it and the slot rows the emitted tokens belong to."""
        engine, cache = self.engine, self.engine.cache
        rids = [*live, *(rid for rid, _ in chunks)]
        counts = [1 + len(d) for d in drafted] + [n for _, n in chunks]
        starts = [cache.seq_len(rid) for rid, _ in chunks]
        ending = [  # chunks that end their prompt: their last row gives the first token
            i
            for i, ((rid, n), start) in enumerate(zip(chunks, starts, strict=True))
            if start + n == self.requests[rid].context.shape[0]
        ]
        verified = sum(counts[: len(live)])
        ends = list(itertools.accumulate(counts))
        rows = [*range(verified), *(ends[len(live) + i] - 1 for i in ending)]
        flat, firsts = [], []
        for d in drafted:
            firsts.append(len(flat))
            flat += [0, *d]  # 0: the last token, gathered on the device
        device = self.spec.device
        tx = engine.begin_step(rids, num_tokens=counts)
        try:
            slots = cache.steps.transaction_slots(tx).request_slots
            ids = upload(flat, device)
            ids.index_copy_(
                0,
                upload(firsts, device),
                self.last_tokens.index_select(0, slots[: len(live)]),
            )
            pieces = [ids] + [
                self.requests[rid].context[start : start + n]
                for (rid, n), start in zip(chunks, starts, strict=True)
            ]
            logits = self._mixed_forward(torch.cat(pieces), tx, upload(rows, device))
            first_rids = [chunks[i][0] for i in ending]
            emitted, accepted = self._verify(logits, live, drafted, first_rids)
            accept = [len(e) for e in emitted[: len(live)]] + counts[len(live) :]
            engine.commit_step(tx, accept=accept)
        except BaseException:  # nothing committed: the inputs and the pending tokens stay
            if engine.has_open_step:
                engine.abort_step(tx)
            raise
        return (
            slots,
            emitted,
            accepted,
            first_rids,
            [*range(len(live)), *(len(live) + i for i in ending)],
        )

    def _verify(
        self,
        logits: torch.Tensor,
        live: list,
        drafted: list,
        first_rids: list,
        width: int | None = None,
    ) -> tuple[list[list[int]], list[int]]:
        """The tokens each verified request emits (greedy: the matching drafts plus the
        argmax; sampled: the speculative-sampling rule with its generator), cut after the
        first EOS unless ``ignore_eos``, and how many of them are drafts; then the first token
        of each request of ``first_rids`` (its prompt's last row, after the verified rows).
        ``width``: rows per request when padded (only the first ``1 + len(draft)`` of them
        are read: padding drafts are never accepted); None: ``1 + len(draft)``."""
        greedy = torch.argmax(logits, dim=-1)
        draws, row = [], 0  # sampled requests' (accepted, next token), enqueued in batch order
        for rid, draft in zip(live, drafted, strict=True):
            real = 1 + len(draft)
            if rid in self.sampled:
                req = self.requests[rid]
                probs = probabilities(logits[row : row + real], req.sampling)
                drafts = upload([draft], logits.device).view(1, len(draft))
                draws += accept_sampled(probs.unsqueeze(0), drafts, req.generator)
            row += width or real
        chosen = self._choose(logits[row:], greedy[row:], first_rids) if first_rids else None
        # the one wait for the device: every token of the step in one read
        host = torch.cat([greedy, *draws, *([chosen] if first_rids else [])]).tolist()
        targets, drawn = host[: greedy.shape[0]], iter(host[greedy.shape[0] :])
        emitted, accepted, row = [], [], 0
        for rid, draft in zip(live, drafted, strict=True):
            real = 1 + len(draft)
            req = self.requests[rid]
            if rid in self.sampled:
                num, token = next(drawn), next(drawn)
                tokens = [*draft[:num], token]
            else:
                tokens = accept_greedy(draft, targets[row : row + real])
            taken = len(tokens) - 1
            if not req.ignore_eos:
                cut = next((i for i, t in enumerate(tokens) if t in self.eos), None)
                if cut is not None:
                    tokens, taken = tokens[: cut + 1], min(taken, cut + 1)
            emitted.append(tokens)
            accepted.append(taken)
            row += width or real
        emitted += [[t] for t in drawn]  # the first tokens of ``first_rids``
        return emitted, accepted

    def _run_plain(self, batch: Sequence, chunks: Sequence[tuple[object, int]]) -> tuple[set, set]:
        """One engine step for the decode ``batch`` and the prompt ``chunks`` together (decode
        rows first): the projections and the MLP run once over every packed token, attention
        is the engine's extend over the paged cache. A step without prompt chunks is a decode
        step (CUDA graphs). A request whose prompt ends here gets its first token from its
        last prompt row; tokens reach the host with the next step's collect, like decode's."""
        if not chunks:
            return set(), self.decode(batch) if batch else set()
        engine, cache = self.engine, self.engine.cache
        self._ensure_slots()
        batch = list(batch)
        rids = [*batch, *(rid for rid, _ in chunks)]
        counts = [1] * len(batch) + [n for _, n in chunks]
        starts = [cache.seq_len(rid) for rid, _ in chunks]
        sampled = [*range(len(batch))] + [  # requests that get a token: decode rows, ends
            len(batch) + i
            for i, ((rid, n), start) in enumerate(zip(chunks, starts, strict=True))
            if start + n == self.requests[rid].context.shape[0]
        ]
        if all(n == 1 for _, n in chunks):  # e.g. prompts that a prefix-cache hit left one token
            inputs = torch.cat(
                [
                    self.requests[rid].context[s : s + 1]
                    for (rid, _), s in zip(chunks, starts, strict=True)
                ]
            )
            every = len(sampled) == len(rids)
            return set(), self.decode(
                rids, prompt_inputs=inputs, sampled=None if every else sampled
            )
        device = self.spec.device
        index = upload(sampled, device)
        last_rows = (upload(counts, device).cumsum(0) - 1).index_select(0, index)
        tx = engine.begin_step(rids, num_tokens=counts)
        try:
            slots = cache.steps.transaction_slots(tx).request_slots
            pieces = [self.last_tokens.index_select(0, slots[: len(batch)])] if batch else []
            pieces += [
                self.requests[rid].context[start : start + n]
                for (rid, n), start in zip(chunks, starts, strict=True)
            ]
            logits = self._mixed_forward(torch.cat(pieces), tx, last_rows)
            sampled_rids = [rids[i] for i in sampled]
            tokens = self._choose(logits, batch=sampled_rids) if sampled else None
            engine.commit_step(tx)
        except BaseException:  # nothing committed: the inputs and the pending tokens stay
            if engine.has_open_step:
                engine.abort_step(tx)
            raise
        # committed: only bookkeeping from here on (no model, no engine call that can fail)
        self.collect()
        if tokens is not None:
            self.last_tokens.index_copy_(0, slots.index_select(0, index), tokens)
            self._hand_off(sampled_rids, tokens)
        ended, self.ended = self.ended, set()
        return set(), ended

    def decode(
        self,
        batch: Sequence,
        *,
        prompt_inputs: torch.Tensor | None = None,
        sampled: Sequence[int] | None = None,
    ) -> set:
        """Launch one step of one token per request of ``batch``, then collect the previous
        step's tokens. Its input is each request's last token, except for the last
        ``len(prompt_inputs)`` rows: prompt tokens (one-token prompt chunks ride a decode step,
        so they replay its CUDA graph: an eager step of any other row count would plan, and
        build, a decode kernel of its own). Only the rows ``sampled`` (default: all) get a
        token."""
        engine = self.engine
        batch = list(batch)
        rows = len(batch)
        bucket = rows if self.graphs is None else self.graphs.bucket(rows)
        tx = engine.begin_step(batch, pad_to=bucket if bucket != rows else None)
        try:
            slots = engine.cache.steps.transaction_slots(tx)
            if prompt_inputs is not None:  # gathered by request slot, like the last tokens
                first = rows - prompt_inputs.shape[0]
                self.last_tokens.index_copy_(0, slots.request_slots[first:rows], prompt_inputs)
            if self.graphs is not None:
                max_len = max(engine.cache.seq_len(rid) for rid in batch) + 1
                logits, greedy_ids = self.graphs.run(tx, slots, bucket, max_len)
            else:
                logits, greedy_ids = self._forward(tx, slots)
            if sampled is None:
                index, chosen = None, batch
                tokens = self._choose(logits[:rows], greedy_ids[:rows], batch)
            else:
                index = upload(sampled, self.spec.device)
                chosen = [batch[i] for i in sampled]
                logits, greedy_ids = (
                    logits.index_select(0, index),
                    greedy_ids.index_select(0, index),
                )
                tokens = self._choose(logits, greedy_ids, chosen)
            engine.commit_step(tx)
        except BaseException:  # nothing decoded: the inputs and the pending tokens stay
            if engine.has_open_step:
                engine.abort_step(tx)
            raise
        # committed: only bookkeeping from here on (no model, no engine call that can fail)
        request_slots = slots.request_slots[:rows]
        if index is not None:
            request_slots = request_slots.index_select(0, index)
        self.last_tokens.index_copy_(0, request_slots, tokens)
        self.collect()
        if chosen:
            self._hand_off(chosen, tokens)
        ended, self.ended = self.ended, set()
        return ended

    def _mixed_forward(self, ids: torch.Tensor, tx, logits_rows: torch.Tensor) -> torch.Tensor:
        """The logits of ``logits_rows`` of the open mixed step ``tx`` over ``ids``: its dense
        work on the piecewise graphs of its token bucket when one fits, else eager."""
        graphs = self.mixed_graphs
        layers = graphs if graphs is not None and graphs.fits(ids.shape[0]) else None
        return self.adapter.decode(ids, self._attention(tx), logits_rows=logits_rows, layers=layers)

    def _attention(self, tx):
        engine = self.engine
        return lambda layer, q, k, v: engine.step_layer(tx, layer, q, k, v)

    def _forward(self, tx, slots):
        ids = self.last_tokens.index_select(0, slots.request_slots)  # [rows], on the device
        logits = self.adapter.decode(ids, self._attention(tx))
        return logits, torch.argmax(logits, dim=-1)
