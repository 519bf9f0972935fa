"""benchmarks/bench_speculative.py --smoke: every (model, batch, mode) row runs, speculation keeps
greedy output token for token, and the report and its JSON come out."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from benchmarks import bench_speculative, vllm_speculative
from benchmarks._common import environment
from flashdec.models import real_model_problem
from flashdec.speculative import SpeculativeConfig


def _run(tmp_path, *extra: str) -> tuple[list[dict], str]:
    bench_speculative.main(["--smoke", "--out-dir", str(tmp_path), *extra])
    payload = json.loads((tmp_path / "speculative.json").read_text())
    return payload["rows"], (tmp_path / "speculative.md").read_text()


def _check(rows: list[dict], markdown: str) -> None:
    assert all(r["identical_to_off"] for r in rows)
    assert {r["mode"] for r in rows} == {"off", "ngram", "ngram-always"}
    for r in rows:
        assert r["tok_s"] > 0 and 1.0 <= r["tokens_per_step"] <= 5.0
        assert 0 <= r["accepted_tokens"] <= r["draft_tokens"]
        if r["mode"] == "off":
            assert r["draft_tokens"] == 0 and r["tokens_per_step"] == 1.0
    assert "Outputs that differ from plain greedy: none." in markdown
    assert "| vs off |" in markdown and "- commit:" in markdown


def test_smoke_on_the_tiny_shape(tmp_path):
    rows, markdown = _run(tmp_path, "--real-model", "tiny")
    modes = [(b, m) for b in (1, 2) for m in ("off", "ngram", "ngram-always")]
    assert [(r["batch"], r["mode"]) for r in rows] == modes * 2
    _check(rows, markdown)


@pytest.mark.skipif(real_model_problem("smollm2") is not None, reason="smollm2 not installed")
def test_smoke_on_smollm2_grounded_prompts_accepts_drafts(tmp_path):
    rows, markdown = _run(tmp_path)
    chat = [r for r in rows if r["kind"] == "grounded chat"]
    assert [(r["model"], r["batch"], r["mode"]) for r in chat] == [
        ("smollm2", 1, "off"),
        ("smollm2", 1, "ngram"),
        ("smollm2", 1, "ngram-always"),
    ]
    assert chat[2]["accepted_tokens"] > 0  # the answer copies its input: lookups hit
    _check(rows, markdown)


# -- issue 23: the mechanism cost, vLLM beside FlashDec, the targets ------------------------------


def test_smoke_measures_the_mechanism_and_reuses_it(tmp_path):
    """The tiny shape's mechanism rows (graphs off on a CPU) and the targets reach the JSON; a
    later run (another device call) measures other sections and takes these rows from
    --reuse-json; a section measured twice is refused."""
    bench_speculative.main(["--smoke", "--real-model", "tiny", "--out-dir", str(tmp_path)])
    payload = json.loads((tmp_path / "speculative.json").read_text())
    mechanism = payload["mechanism"]
    assert [(r["batch"], r["n"]) for r in mechanism] == [(1, 2), (1, 4), (2, 2), (2, 4)]
    for r in mechanism:
        assert r["model"] == "tiny" and not r["one_token_graph"]
        assert r["context_min"] >= 25 and len(r["verify_ms_reps"]) == 2
        assert r["ratio"] == pytest.approx(r["verify_ms"] / r["one_token_ms"])
    goals = payload["targets"]
    assert [g["target"] for g in goals] == [
        "B = 1: a verification step of n = 4 <= 1.15x one step",
        "B = 1: ngram tok/s >= 1.8x FlashDec without speculation",
        "B = 1: ngram tok/s >= vLLM's ngram tok/s",
    ]
    assert goals[0]["value"] == mechanism[1]["ratio"] and goals[2]["met"] is None
    part = tmp_path / "part"
    argv = ["--smoke", "--real-model", "tiny", "--out-dir", str(part), "--name", "part"]
    bench_speculative.main([*argv, "--sections", "mechanism"])
    merged = tmp_path / "merged"
    argv = ["--smoke", "--real-model", "tiny", "--out-dir", str(merged)]
    bench_speculative.main([*argv, "--sections", "random", "--reuse-json", str(part / "part.json")])
    reused = json.loads((merged / "speculative.json").read_text())
    assert [(r["batch"], r["n"]) for r in reused["mechanism"]] == [(1, 2), (1, 4), (2, 2), (2, 4)]
    assert {r["kind"] for r in reused["rows"]} == {"random weights"}
    assert "## Mechanism cost (tiny, random weights)" in (merged / "speculative.md").read_text()
    # nothing measured now: a merge keeps the measurements' environment
    argv = ["--smoke", "--out-dir", str(tmp_path / "only"), "--reuse-json", str(part / "part.json")]
    bench_speculative.main([*argv, "--sections"])
    only = json.loads((tmp_path / "only" / "speculative.json").read_text())
    first = json.loads((part / "part.json").read_text())["environment"]
    assert only["environment"]["date_utc"] == first["date_utc"] and only["rows"] == []
    assert "merged_by" in only["environment"]
    with pytest.raises(ValueError, match="mechanism measured twice"):
        bench_speculative.main([*argv, "--sections", "mechanism", "random"])


def test_mechanism_steps_commit_nothing():
    """A verification step and a one-token step, timed, leave every context as it was and no
    step open (they are aborted)."""
    import flashdec
    from benchmarks import spec_mechanism
    from flashdec.models import resolve_model

    loaded = resolve_model("tiny", dtype=torch.float32, device="cpu")
    llm = flashdec.LLM(loaded.model, max_batch_size=2, max_model_len=200, num_blocks=40)
    rids = spec_mechanism.context_requests(llm, 2, 20, seed=3)
    runner, engine = llm._runner, llm.engine
    lengths = [engine.cache.seq_len(r) for r in rids]
    assert min(lengths) >= 21  # the prompt and its first token
    for begin, run in (
        spec_mechanism.one_token_step(runner, rids),
        spec_mechanism.verify_step(runner, rids, 4),
    ):
        assert spec_mechanism.step_ms(engine, torch.device("cpu"), begin, run) > 0
        assert [engine.cache.seq_len(r) for r in rids] == lengths
        assert not engine.has_open_step
    begin, run = spec_mechanism.verify_step(runner, rids, 3)
    tx = begin()
    packed = run(tx)
    assert len(packed) == 6  # B x n rows verified
    engine.abort_step(tx)
    # with verification graphs of this width: the padded step the graph would replay (on the
    # CPU none is captured, so it runs eagerly through the same forward), same tokens
    from flashdec.engine.verify_graphs import VerifyGraphs

    runner.verify_graphs = VerifyGraphs(
        engine, runner._verify_forward, max_batch_size=2, num_q_heads=runner.spec.num_q_heads, n=3
    )
    begin, run = spec_mechanism.verify_step(runner, rids, 3)
    tx = begin()
    assert run(tx) == packed and runner.verify_graphs.eager_steps == 1
    engine.abort_step(tx)
    assert [engine.cache.seq_len(r) for r in rids] == lengths


class FakeTokenizer:
    """A chat template: the turn's first 12 bytes, then two marker ids."""

    chat_template = "fake"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return [*messages[-1]["content"].encode()[:12], 1, 2]


class FakeVllm:
    """``vllm.LLM`` as vllm_speculative.py uses it: ``generate`` over ``prompt_token_ids``
    (each answer ``max_tokens`` tokens from the prompt's ids), and, with an ngram
    ``speculative_config``, request steps of 2 accepted drafts + 1 token counted in
    Prometheus-like counters (vLLM's names). Like vLLM 0.24, it writes the target's model
    config (not JSON) into the ``speculative_config`` dict it is given."""

    instances: ClassVar[list] = []

    def __init__(self, model, speculative_config=None, **kwargs):
        self.model, self.speculative, self.kwargs = model, dict(speculative_config or {}), kwargs
        if speculative_config is not None:
            speculative_config["target_model_config"] = object()
        else:
            self.speculative = None
        self.counters = dict.fromkeys(vllm_speculative.SPEC_METRICS, 0)
        FakeVllm.instances.append(self)

    def generate(self, requests, params, use_tqdm=True):
        assert use_tqdm is False and params.temperature == 0
        outputs = []
        for r in requests:
            ids = r["prompt_token_ids"]
            tokens = tuple((sum(ids) + i) % 50 for i in range(params.max_tokens))
            if self.speculative is not None:
                decode = len(tokens) - 1
                steps = -(-decode // 3)
                drafts, draft_tokens, accepted = vllm_speculative.SPEC_METRICS
                self.counters[drafts] += steps
                self.counters[draft_tokens] += steps * self.speculative["num_speculative_tokens"]
                self.counters[accepted] += decode - steps
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)]))
        return outputs

    def get_metrics(self):
        metrics = [SimpleNamespace(name=n, value=v) for n, v in self.counters.items()]
        return [*metrics, SimpleNamespace(name="vllm:num_preemptions", value=0)]


def _vllm_run(tmp_path, *extra: str) -> dict:
    args = vllm_speculative.parse_args(
        ["--model-dir", str(tmp_path), "--batch", "1", "2", "--new", "8", "--reps", "2", *extra]
    )
    return vllm_speculative.run(
        args, llm_class=FakeVllm, sampling_params=SimpleNamespace, tokenizer=FakeTokenizer()
    )


def test_vllm_speculative_runs_ngram_with_flashdec_settings(tmp_path):
    """Importing vllm_speculative does not import vLLM; one engine per mode, speculation as
    FlashDec's defaults; acceptance and tokens per step from vLLM's counters; the settings
    recorded are the ones given, serialisable although vLLM wrote into its copy."""
    assert "vllm" not in sys.modules
    FakeVllm.instances.clear()
    result = _vllm_run(tmp_path)
    json.dumps(result)
    assert result["engine_args"]["ngram"]["speculative_config"]["method"] == "ngram"
    off, ngram = FakeVllm.instances
    assert off.speculative is None and off.model == str(tmp_path)
    defaults = SpeculativeConfig()
    assert ngram.speculative == {
        "method": "ngram",
        "num_speculative_tokens": defaults.num_tokens,
        "prompt_lookup_max": defaults.max_ngram,
        "prompt_lookup_min": defaults.min_ngram,
    }
    assert off.kwargs["disable_log_stats"] is False and off.kwargs["dtype"] == "bfloat16"
    rows = result["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [
        (1, "off"),
        (2, "off"),
        (1, "ngram"),
        (2, "ngram"),
    ]
    prompts = bench_speculative.grounded_prompts(FakeTokenizer(), 2)
    assert rows[1]["outputs"] == [[(sum(p) + i) % 50 for i in range(8)] for p in prompts]
    turns = len(bench_speculative.GROUNDED_PROMPTS)
    for r in rows:
        # batch 1: every grounded turn alone, one generate call after another; else one call
        requests = turns if r["batch"] == 1 else r["batch"]
        assert r["generate_calls"] == (turns if r["batch"] == 1 else 1)
        assert r["tok_s"] > 0 and len(r["tok_s_reps"]) == 2
        assert r["generated_tokens"] == 8 * requests and len(r["outputs"]) == requests
        if r["mode"] == "off":
            assert r["draft_tokens"] == 0 and r["tokens_per_step"] == 1.0
        else:  # per request: 7 decode tokens in 3 steps, 4 of 12 drafts accepted
            counts = (r["drafts"], r["draft_tokens"], r["accepted_tokens"])
            assert counts == (3 * requests, 12 * requests, 4 * requests)
            assert r["acceptance_rate"] == pytest.approx(1 / 3)
            assert r["tokens_per_step"] == pytest.approx(7 / 3)


def _rows(off: float, ngram: float) -> list[dict]:
    base = {"model": "m", "kind": "grounded chat", "batch": 1, "outputs": [[5, 6]]}
    return [
        {**base, "mode": "off", "tok_s": off},
        {**base, "mode": "ngram", "tok_s": ngram},
    ]


def test_targets_are_judged_met_missed_or_not_measured():
    mechanism = [{"batch": 1, "n": 2, "ratio": 1.05}, {"batch": 1, "n": 4, "ratio": 1.10}]
    vllm = {"rows": [{"batch": 1, "mode": "ngram", "tok_s": 200.0}]}
    goals = bench_speculative.targets(_rows(100.0, 190.0), mechanism, vllm)
    assert [g["met"] for g in goals] == [True, True, False]
    assert goals[0]["margin"] == "1.10x (-0.05x)" and goals[1]["margin"] == "1.90x (+0.10x)"
    assert goals[2]["bar"] == 200.0 and goals[2]["margin"] == "-10 tok/s (-5.0%) vs vLLM"
    goals = bench_speculative.targets(_rows(100.0, 170.0), [{**mechanism[1], "ratio": 1.2}], None)
    assert [g["met"] for g in goals] == [False, False, None]
    assert goals[2]["margin"] == "no --vllm-json"
    assert [g["met"] for g in bench_speculative.targets([], [], vllm)] == [None, None]


def test_vllm_json_is_checked_merged_and_reported(tmp_path):
    """Two files (the modes run apart) merge; a file of other settings or another model
    directory is refused; the report puts vLLM's rows and the verdicts beside FlashDec's."""
    model = tmp_path / "model"
    model.mkdir()
    paths = []
    for mode in ("off", "ngram"):
        path = tmp_path / f"{mode}.json"
        path.write_text(json.dumps(_vllm_run(model, "--modes", mode)))
        paths.append(str(path))
    args = bench_speculative.parse_args(["--new", "8", "--real-model", str(model)])
    vllm = bench_speculative.load_vllm(paths, args)
    assert [(r["batch"], r["mode"]) for r in vllm["rows"]] == [
        (1, "off"),
        (2, "off"),
        (1, "ngram"),
        (2, "ngram"),
    ]
    assert set(vllm["engine_args"]) == {"off", "ngram"}
    with pytest.raises(ValueError, match="new: ours 256"):
        other = bench_speculative.parse_args(["--real-model", str(model)])
        bench_speculative.load_vllm(paths, other)
    with pytest.raises(ValueError, match="model: ours"):
        bench_speculative.load_vllm(
            paths, bench_speculative.parse_args(["--new", "8", "--real-model", str(tmp_path)])
        )
    rows = [{**r, "dtype": "bfloat16", "identical_to_off": True} for r in _rows(1.0, 2.0)]
    for r in rows:
        r.update(draft_tokens=4, acceptance_rate=0.5, tokens_per_step=1.5)
        r["outputs"] = vllm["rows"][0]["outputs"]
    markdown = bench_speculative.report(args, environment(), rows, [], vllm)
    assert "## vLLM None on the same prompts and weights" in markdown
    assert (
        "| 1 | ngram |" in markdown and "| 8/8 |" in markdown  # 8 turns
    )
    assert "| B = 1: ngram tok/s >= vLLM's ngram tok/s | MISSED |" in markdown


def test_batch_one_on_the_real_model_runs_every_turn_alone_and_sums_them():
    """``generate_calls``: batch 1 on the real model is each prompt alone, in turn; otherwise
    one call. ``_measure`` times all calls as one run and takes drafts and steps from the
    runner's counters over it."""
    import flashdec
    from flashdec.models import resolve_model

    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 8, 9, 7, 8, 9], [1, 2, 1, 2, 1, 2, 1]]
    assert bench_speculative.generate_calls(prompts, 1, real=True) == [[p] for p in prompts]
    assert bench_speculative.generate_calls(prompts, 1, real=False) == [prompts]
    assert bench_speculative.generate_calls(prompts, 3, real=True) == [prompts]
    loaded = resolve_model("tiny", dtype=torch.float32, device="cpu")
    llm = flashdec.LLM(
        loaded.model, max_batch_size=1, speculative=flashdec.SpeculativeConfig(num_tokens=3)
    )
    args = bench_speculative.parse_args(["--new", "12", "--reps", "2"])
    calls = bench_speculative.generate_calls(prompts, 1, real=True)
    result = bench_speculative._measure(llm, calls, args, ignore_eos=True)
    alone = [llm.generate([p], 12, ignore_eos=True)[0] for p in prompts]
    assert result["outputs"] == alone and result["generate_calls"] == 3
    assert result["generated_tokens"] == 36 and len(result["tok_s_reps"]) == 2
    assert 1.0 <= result["tokens_per_step"] <= 4.0
    assert result["accepted_tokens"] <= result["draft_tokens"]
