"""A bounded load test: 200 requests from 32 concurrent clients (half streamed, greedy, small
outputs): every response complete and token for token what ``LLM.generate`` gives, 0 errors,
and the metrics add up."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.server.conftest import make_llm, metric, prompts

httpx = pytest.importorskip("httpx")

NUM_REQUESTS = 200
CLIENTS = 32
NEW = 6
DISTINCT = 25  # prompts, each sent 8 times


async def _one(client: httpx.AsyncClient, prompt: list[int], stream: bool) -> list[int]:
    body = {
        "prompt": prompt,
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if not stream:
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        data = response.json()
        assert data["choices"][0]["finish_reason"] == "length"
        assert data["usage"]["completion_tokens"] == NEW
        return data["choices"][0]["token_ids"]
    tokens, done = [], False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                tokens += json.loads(line[6:])["choices"][0]["token_ids"]
    assert done
    return tokens


def test_200_requests_from_32_clients(server_for):
    work = prompts(DISTINCT, seed=3)
    llm = make_llm(max_batch_size=32)
    expected = llm.generate(work, NEW, ignore_eos=True)
    server = server_for(llm)
    jobs = [(i % DISTINCT, i % 2 == 1) for i in range(NUM_REQUESTS)]

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for job in jobs:
            queue.put_nowait(job)
        results, errors = {}, []
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:

            async def worker():
                while not queue.empty():
                    index, stream = queue.get_nowait()
                    try:
                        results.setdefault(index, []).append(
                            await _one(client, work[index], stream)
                        )
                    except Exception as exc:
                        errors.append(exc)

            await asyncio.gather(*(worker() for _ in range(CLIENTS)))
            metrics = (await client.get("/metrics")).text
        return results, errors, metrics

    start = time.perf_counter()
    results, errors, text = asyncio.run(run())
    elapsed = time.perf_counter() - start
    assert errors == []
    assert sum(map(len, results.values())) == NUM_REQUESTS
    for index, outputs in results.items():
        assert all(out == expected[index] for out in outputs)
    assert metric(text, "flashdec_requests_received_total") == NUM_REQUESTS
    assert metric(text, 'flashdec_requests_finished_total{finish_reason="length"}') == NUM_REQUESTS
    assert metric(text, "flashdec_generation_tokens_total") == NUM_REQUESTS * NEW
    assert metric(text, "flashdec_prompt_tokens_total") == sum(len(work[i]) for i, _ in jobs)
    assert metric(text, "flashdec_time_to_first_token_seconds_count") == NUM_REQUESTS
    assert metric(text, "flashdec_time_per_output_token_seconds_count") == NUM_REQUESTS
    assert metric(text, "flashdec_kv_blocks_used") == 0
    assert metric(text, 'flashdec_time_to_first_token_seconds_bucket{le="+Inf"}') == NUM_REQUESTS
    assert elapsed < 120  # bounded (about 10 s here on 2 busy CPU cores)
