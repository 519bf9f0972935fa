"""What the HTTP layer costs: one Poisson trace through ``flashdec serve`` and through ``LLM.step``.

The trace is ``serve_trace.py``'s (../shared/tools/serve/: random.Random(seed), expovariate(rate)
gaps, prompt lengths randint(min, max), token ids randrange(vocab)); that file is used when it
can be imported (and its trace checked equal), else the same seeded arrivals are made here. The
same warm ``flashdec.LLM`` serves it twice each way (in process, over HTTP, over HTTP, in
process: each timed pass follows an untimed one of both ways, so both meet the same compiled
kernels and captured CUDA graphs), and the second pass each way is reported:

- in process: ``add_request`` at each arrival, ``step`` while anything runs (serve_trace's loop);
  TTFT = first token on the host - arrival;
- over HTTP (``flashdec.server.start_server``: the HTTP front end in a process of its own, the
  engine thread in this one): a client in a separate process (so its own work stays off the
  server's cores and GIL) sends each request at its arrival time to ``/v1/completions`` with
  ``"stream": true`` (greedy, EOS ignored, token ids); TTFT = first streamed chunk - arrival,
  TPOT = (last chunk - first) / (n - 1).

The client is aiohttp (one ``ClientSession``, no connection cap), as vLLM's serving benchmark
uses: what the client itself spends per request is charged to the server here, so it must be
small. httpx's AsyncClient, this script's first client, measured 2-3.5 ms more per request than
aiohttp or a raw socket (CPU, tiny model, one request at a time), more than the whole server
side (client send to engine: about 1.5 ms, about 1 ms of it before the handler starts).

The issue's bar: the HTTP layer adds <= 2 ms to TTFT p50 and <= 3 % to output tok/s.

On the GPU machine (FastAPI, uvicorn, uvloop, httptools and aiohttp must be importable there:
``pip download`` their cp312 wheels with -c constraints.txt here into .whl, which
scripts/gpu_check.sh installs):
  PYTHONPATH=. python3 benchmarks/bench_http.py --rate 4 16 64 --json $OUT/bench_http.json
Locally, a smoke run of the script itself:
  PYTHONPATH=. python3 benchmarks/bench_http.py --model tiny --device cpu --requests 8 \
      --min-prompt 8 --max-prompt 32 --new 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import queue
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ../shared beside the project's clone (a worktree sits one level deeper)
SERVE_TRACE = (
    next(
        (d for d in (ROOT.parent / "shared", ROOT.parents[1] / "shared") if d.is_dir()),
        ROOT.parent / "shared",
    )
    / "tools"
    / "serve"
)


def make_trace(seed: int, requests: int, lo: int, hi: int, rate: float, vocab: int) -> list:
    """``[(arrival_s, prompt_ids)]``: serve_trace.py's arrivals (bench-serve's trace)."""
    from flashdec.workloads.serving import poisson_trace

    return poisson_trace(
        seed=seed,
        num_requests=requests,
        request_rate=rate,
        min_prompt_len=lo,
        max_prompt_len=hi,
        vocab_size=vocab,
    )


def check_against_serve_trace(args, rate: float, trace: list, vocab: int) -> str:
    """'serve_trace.py' when its trace could be imported and equals ours, else 'mirrored'."""
    try:
        sys.path.insert(0, str(SERVE_TRACE))
        import serve_trace
    except ImportError:
        return "mirrored"
    finally:
        sys.path.pop(0)
    if vocab != serve_trace.VOCAB:
        return "mirrored"
    a = argparse.Namespace(
        seed=args.seed,
        requests=args.requests,
        min_prompt=args.min_prompt,
        max_prompt=args.max_prompt,
    )
    assert serve_trace.trace(a, rate) == trace, "serve_trace.py's trace differs from ours"
    return "serve_trace.py"


def pct(xs: list[float], p: float) -> float:
    """serve_trace.py's percentile (nearest rank), in ms."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] * 1e3 if xs else float("nan")


def summarize(ttft: list[float], tpot: list[float], tokens: int, elapsed: float, done: int) -> dict:
    return {
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p90_ms": pct(ttft, 90),
        "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50),
        "tpot_p90_ms": pct(tpot, 90),
        "output_tok_s": tokens / elapsed,
        "elapsed_s": elapsed,
        "requests_done": done,
    }


def run_in_process(llm, trace: list, new: int) -> dict:
    """serve_trace.py's loop: add each request at its arrival, step while anything runs."""
    start = time.perf_counter()
    arrival, nxt = {}, 0
    while nxt < len(trace) or llm.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(trace) and trace[nxt][0] <= now:
            rid = llm.add_request(trace[nxt][1], new, ignore_eos=True)
            arrival[rid] = start + trace[nxt][0]
            nxt += 1
        if llm.has_unfinished():
            llm.step()
        else:
            time.sleep(max(0.0, trace[nxt][0] - now))
    elapsed = time.perf_counter() - start
    ttft, tpot, tokens, done = [], [], 0, 0
    for rid, arrived in arrival.items():
        t = llm.request_timing(rid)
        ttft.append(t.first_token_at - arrived)
        if t.num_tokens > 1:
            tpot.append((t.finished_at - t.first_token_at) / (t.num_tokens - 1))
        tokens += t.num_tokens
        done += t.num_tokens == new
        llm.release(rid)
    return summarize(ttft, tpot, tokens, elapsed, done)


async def _replay(url: str, trace: list, new: int) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)  # no cap on open connections: one per request
    timeout = aiohttp.ClientTimeout(total=6 * 3600)  # vLLM's benchmark's
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()

        async def one(at: float, prompt: list[int]):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            body = {
                "prompt": prompt,
                "max_tokens": new,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                "stream": True,
            }
            first = last = None
            n = 0
            async with session.post(url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for raw in response.content:  # one server-sent-events line at a time
                    if not raw.startswith(b"data: {"):
                        continue
                    got = len(json.loads(raw[6:])["choices"][0].get("token_ids", ()))
                    if got:
                        now = time.perf_counter()
                        first = first or now
                        last, n = now, n + got
            return start + at, first, last, n

        results = await asyncio.gather(*(one(at, prompt) for at, prompt in trace))
        elapsed = time.perf_counter() - start
    ttft = [first - arrived for arrived, first, _, _ in results]
    tpot = [(last - first) / (n - 1) for _, first, last, n in results if n > 1]
    tokens = sum(n for *_, n in results)
    return summarize(ttft, tpot, tokens, elapsed, sum(n == new for *_, n in results))


def installed(*names: str) -> dict:
    """Each package's version, None when it is not installed (the server falls back without
    uvloop or httptools)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _client(url: str, trace: list, new: int, out) -> None:
    out.put(asyncio.run(_replay(url, trace, new)))


def run_over_http(url: str, trace: list, new: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_client, args=(url, trace, new, out))
    proc.start()
    try:
        while True:
            try:
                return out.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(
                        f"the client process failed (exit {proc.exitcode})"
                    ) from None
    finally:
        proc.join(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama3-8b-shape")
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, nargs="+", default=[16.0])
    p.add_argument("--min-prompt", type=int, default=256)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--json")
    args = p.parse_args()

    from flashdec.runtime import prepare_triton

    prepare_triton()
    import torch

    import flashdec
    from flashdec.models import build_random_model
    from flashdec.server import start_server

    dtype = None
    if args.device == "cpu":  # as the CLI: intra-op threads only contend on a small CPU
        torch.set_num_threads(1)
        dtype = torch.float32
    model = build_random_model(args.model, dtype=dtype, device=args.device, seed=0)
    new, longest = args.new, args.max_prompt + args.new
    llm = flashdec.LLM(  # serve_trace.py's sizes
        model,
        max_batch_size=args.max_batch_size,
        num_blocks=args.max_batch_size * (longest // 16 + 2) + 64,
        max_model_len=longest + 64,
        # every pass replays the same trace: cached prompts would make later passes cheaper
        enable_prefix_caching=False,
    )
    vocab = model.config.vocab_size
    rows = []
    for rate in args.rate:
        trace = make_trace(args.seed, args.requests, args.min_prompt, args.max_prompt, rate, vocab)
        source = check_against_serve_trace(args, rate, trace, vocab)
        # equal warmth: each timed pass comes after this trace ran once untimed both ways (the
        # first run of a batch-size bucket compiles, the second captures its CUDA graph)
        run_in_process(llm, trace, new)
        with start_server(llm, model_name=args.model) as server:
            run_over_http(server.url, trace, new)
            http = run_over_http(server.url, trace, new)
        inproc = run_in_process(llm, trace, new)
        row = {
            "rate": rate,
            "trace": source,
            "in_process": inproc,
            "http": http,
            "ttft_p50_added_ms": http["ttft_p50_ms"] - inproc["ttft_p50_ms"],
            "output_tok_s_change_pct": 100 * (http["output_tok_s"] / inproc["output_tok_s"] - 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'rate':>6} {'TTFT p50 ms (step / HTTP / +)':>32} {'out tok/s (step / HTTP / %)':>32}")
    for r in rows:
        a, b = r["in_process"], r["http"]
        ttft = f"{a['ttft_p50_ms']:.2f} / {b['ttft_p50_ms']:.2f} / {r['ttft_p50_added_ms']:+.2f}"
        toks = f"{a['output_tok_s']:.0f} / {b['output_tok_s']:.0f} / "
        toks += f"{r['output_tok_s_change_pct']:+.1f}%"
        print(f"{r['rate']:>6} {ttft:>32} {toks:>32}")
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "flashdec": flashdec.__version__,
        "http": installed("fastapi", "uvicorn", "uvloop", "httptools", "aiohttp"),
        "requests": args.requests,
        "prompts": [args.min_prompt, args.max_prompt],
        "new": new,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
