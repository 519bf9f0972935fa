"""The server on a GPU with CUDA graphs (run by scripts/gpu_check.sh on the GPU machine): greedy
streaming clients interleaved with seeded sampling ones — greedy rows take the argmax computed
inside the graph, sampled rows are drawn beside them — each get what they get alone, and a
client that goes away mid-stream gives its blocks back."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

import flashdec
from flashdec.models import build_random_model
from tests.server.conftest import metric, prompts, wait_for

httpx = pytest.importorskip("httpx")

NEW = 24


async def _stream(client, body: dict) -> list[int]:
    tokens = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                tokens += json.loads(line[6:])["choices"][0]["token_ids"]
    return tokens


@pytest.mark.gpu
def test_graphed_server_mixes_greedy_and_sampled_rows(server_for):
    # float32: batches of other sizes than generate's alone keep the argmax bit-stable
    model = build_random_model("tiny-llama", dtype=torch.float32, device="cuda", seed=0)
    llm = flashdec.LLM(model, max_batch_size=16, max_model_len=256)
    assert llm.cuda_graphs
    work = prompts(12, seed=7, hi=60, vocab=model.config.vocab_size)
    alone = [llm.generate([p], NEW, ignore_eos=True)[0] for p in work[:8]]
    server = server_for(llm, model_name="tiny-llama")
    base = {"max_tokens": NEW, "ignore_eos": True, "return_token_ids": True}
    greedy = [{**base, "prompt": p, "temperature": 0} for p in work[:8]]
    hot = [
        {**base, "prompt": p, "temperature": 1.2, "top_k": 40, "seed": 5 + i}
        for i, p in enumerate(work[8:])
    ]

    async def run(bodies):
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(_stream(client, b) for b in bodies))

    sampled_alone = [asyncio.run(run([b]))[0] for b in hot]
    together = asyncio.run(run(greedy + hot))
    assert together[:8] == alone
    assert together[8:] == sampled_alone and all(len(t) == NEW for t in together)
    assert llm._runner.graph_replays > 0

    async def leave_early():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            body = {**base, "prompt": work[0], "max_tokens": 200, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break

    asyncio.run(leave_early())

    def blocks_back():
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return (
            metric(text, "flashdec_kv_blocks_used") == 0
            and metric(text, 'flashdec_requests_finished_total{finish_reason="abort"}') == 1
        )

    assert wait_for(blocks_back)
