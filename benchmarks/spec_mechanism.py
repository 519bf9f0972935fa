"""The mechanism cost of speculative decoding (issue 23): a verification step of ``n`` tokens
per request against the one-token step of the same batch, each the way ``flashdec.LLM`` runs it.

- One-token step: ``ModelRunner.decode``'s device part: ``begin_step`` padded to the graph
  bucket, the bucket's CUDA graph replayed (``runner.graphs.run``) when the LLM has graphs, else
  the eager forward; the greedy tokens.
- Verification step: ``ModelRunner._run_verify``'s device part. When the runner's verification
  graphs are of this ``n`` (``n = K + 1`` of its speculative config): ``begin_step(rids,
  num_tokens=[n] * B, pad_to=bucket)``, the drafts copied into the runner's draft buffer, the
  bucket's graph replayed (``verify_graphs.run``). Otherwise packed and eager:
  ``begin_step(rids, num_tokens=[n] * B)``, the ids uploaded (each request's last token gathered
  on the device from ``runner.last_tokens``, then its ``n - 1`` drafts), ``adapter.decode``
  with logits for all ``B * n`` rows. Either way the argmax is read back to the host (the
  runner's one wait per verification step).

Both steps are aborted (``abort_step``: nothing committed), so the contexts never drift; the
commit's and the host bookkeeping's costs are left out of both. Runner internals are used
read-only: ``LLM._runner``, its ``graphs`` and ``verify_graphs`` (``bucket``, ``run``),
``_forward``, ``_attention``, ``_draft_buffer`` and ``last_tokens``; ``graph_replays`` counts the
replays, which is how a row shows whether each step replayed a graph.

Timing: each step alone on an idle device (synchronised before), CUDA events around the host's
step call (its planning, uploads and launches included), medians over ``reps`` after ``warmup``
untimed rounds; the steps of one batch are interleaved round by round. On the CPU the clock is
``time.perf_counter``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from benchmarks._common import sync
from flashdec.runtime import upload

# issue 23: at B = 1, a verification step of n = 4 tokens costs at most 1.15x one step
TARGET_RATIO = 1.15
TARGET_BATCH = 1
TARGET_WIDTH = 4
_DECODE_ROOM = 128  # tokens each context request may still take (the prefill's decodes, n)


def context_requests(llm, batch: int, context: int, seed: int) -> list:
    """``batch`` requests of ``context`` random prompt tokens each, prefilled through the LLM's
    own serving loop until every one has its first token (they stay live, decoding)."""
    vocab = llm.adapter.spec.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (batch, context), generator=gen).tolist()
    rids = [llm.add_request(p, _DECODE_ROOM, ignore_eos=True) for p in prompts]
    for _ in range(batch * context + _DECODE_ROOM):  # a bound: the loop admits as blocks allow
        polled = [llm.poll(rid) for rid in rids]
        if any(done for _, done in polled):
            raise RuntimeError("a context request finished before every prompt was prefilled")
        if all(tokens for tokens, _ in polled):
            return rids
        llm.step()
    raise RuntimeError(f"{batch} prompts of {context} tokens were not prefilled")


def one_token_step(runner, rids: Sequence) -> tuple[Callable, Callable]:
    """``(begin, run)`` of the batch's one-token step (``ModelRunner.decode``'s device part)."""
    engine, graphs = runner.engine, runner.graphs
    rows = len(rids)
    bucket = rows if graphs is None else graphs.bucket(rows)

    def begin():
        return engine.begin_step(list(rids), pad_to=bucket if bucket != rows else None)

    def run(tx):
        slots = engine.cache.steps.transaction_slots(tx)
        if graphs is not None:
            max_len = max(engine.cache.seq_len(rid) for rid in rids) + 1
            _, greedy = graphs.run(tx, slots, bucket, max_len)
        else:
            _, greedy = runner._forward(tx, slots)
        return greedy[:rows]

    return begin, run


def verify_step(runner, rids: Sequence, width: int) -> tuple[Callable, Callable]:
    """``(begin, run)`` of a verification step of ``width`` tokens per request (the last token
    and ``width - 1`` drafts), as ``ModelRunner._run_verify`` runs it: padded to the batch
    bucket with its CUDA graph replayed (``_verify_padded``) when the runner has verification
    graphs of this width, else packed and eager (``_verify_packed``). Draft values do not
    change the work: fixed small ids."""
    engine = runner.engine
    device = runner.spec.device
    batch = len(rids)
    drafts = [[1 + (7 * i + j) % 97 for j in range(width - 1)] for i in range(batch)]
    graphs = runner.verify_graphs
    if graphs is not None and graphs.n == width:
        bucket = graphs.bucket(batch)

        def begin():
            return engine.begin_step(list(rids), num_tokens=[width] * batch, pad_to=bucket)

        def run(tx):
            runner._draft_buffer()[:batch].copy_(upload(drafts, device))
            max_len = max(engine.cache.seq_len(rid) for rid in rids) + width
            logits = graphs.run(tx, engine.step_slots(tx), bucket, max_len)
            return torch.argmax(logits[: batch * width], dim=-1).tolist()  # the one read

        return begin, run

    flat, firsts = [], []
    for d in drafts:
        firsts.append(len(flat))
        flat += [0, *d]
    rows = list(range(batch * width))

    def begin():
        return engine.begin_step(list(rids), num_tokens=[width] * batch)

    def run(tx):
        slots = engine.cache.steps.transaction_slots(tx).request_slots
        ids = upload(flat, device)
        last = runner.last_tokens.index_select(0, slots[:batch])
        ids.index_copy_(0, upload(firsts, device), last)
        logits = runner.adapter.decode(ids, runner._attention(tx), logits_rows=upload(rows, device))
        return torch.argmax(logits, dim=-1).tolist()  # the runner's one read per verify step

    return begin, run


def step_ms(engine, device: torch.device, begin: Callable, run: Callable) -> float:
    """One step, opened, run and aborted, timed alone (milliseconds)."""
    sync(device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        t0 = time.perf_counter()
    tx = begin()
    try:
        run(tx)
        if on_gpu:
            end.record()
            end.synchronize()
    finally:
        if engine.has_open_step:
            engine.abort_step(tx)
    return start.elapsed_time(end) if on_gpu else (time.perf_counter() - t0) * 1e3


def measure_mechanism(
    llm,
    batches: Sequence[int],
    widths: Sequence[int],
    *,
    context: int,
    reps: int,
    warmup: int,
    seed: int = 0,
) -> list[dict]:
    """Per (batch, width): the medians of the one-token and the verification step, and their
    ratio. One set of ``max(batches)`` context requests; a batch takes the first ones."""
    runner = llm._runner  # read-only (see the module docstring)
    engine = runner.engine
    device = runner.spec.device
    rids = context_requests(llm, max(batches), context, seed)
    rows = []
    try:
        for batch in batches:
            sub = rids[:batch]
            steps = {1: one_token_step(runner, sub)}
            steps.update({n: verify_step(runner, sub, n) for n in widths})
            times: dict[int, list[float]] = {n: [] for n in steps}
            graphed = dict.fromkeys(steps, True)  # every timed step of n replayed a graph
            for rep in range(warmup + reps):
                for n, (begin, run) in steps.items():
                    replays = runner.graph_replays
                    ms = step_ms(engine, device, begin, run)
                    graphed[n] &= runner.graph_replays == replays + 1
                    if rep >= warmup:
                        times[n].append(ms)
            lengths = [engine.cache.seq_len(rid) for rid in sub]
            base = statistics.median(times[1])
            for n in widths:
                verify = statistics.median(times[n])
                rows.append(
                    {
                        "batch": batch,
                        "n": n,
                        "context_min": min(lengths),
                        "context_max": max(lengths),
                        "one_token_ms": base,
                        "verify_ms": verify,
                        "ratio": verify / base,
                        "one_token_graph": graphed[1],
                        "verify_graph": graphed[n],
                        "one_token_ms_reps": times[1],
                        "verify_ms_reps": times[n],
                    }
                )
                print({k: v for k, v in rows[-1].items() if not k.endswith("_reps")}, flush=True)
    finally:
        for rid in rids:
            llm.abort_request(rid)
    return rows


def mechanism_target(rows: list[dict]) -> dict:
    """Issue 23's mechanism target: met (True), missed (False) or not measured (None)."""
    name = (
        f"B = {TARGET_BATCH}: a verification step of n = {TARGET_WIDTH} <= "
        f"{TARGET_RATIO:.2f}x one step"
    )
    row = next((r for r in rows if (r["batch"], r["n"]) == (TARGET_BATCH, TARGET_WIDTH)), None)
    if row is None:
        return {"target": name, "value": None, "bar": TARGET_RATIO, "met": None, "margin": "—"}
    ratio = row["ratio"]
    return {
        "target": name,
        "value": ratio,
        "bar": TARGET_RATIO,
        "met": ratio <= TARGET_RATIO,
        "margin": f"{ratio:.2f}x ({ratio - TARGET_RATIO:+.2f}x)",
    }
