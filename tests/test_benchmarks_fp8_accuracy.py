"""benchmarks/bench_fp8_accuracy.py: its pure functions (agreement counting, perplexity from
logits, FP8 value statistics, target verdicts, the report) and a smoke run on a tiny random
bf16 model through the real code path."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import bench_fp8_accuracy as bench
from benchmarks._common import environment


def test_first_divergence_and_greedy_agreement():
    assert bench.first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert bench.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_divergence([1, 2, 3], [1, 2]) == 2  # a missing token differs
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = [[1, 2, 3, 4], [5, 0, 7, 8]]  # one flip; later positions equal again
    result = bench.greedy_agreement(ref, got)
    assert result["matched_tokens"] == 7 and result["total_tokens"] == 8
    assert result["token_share"] == 7 / 8
    assert result["identical_prompts"] == 1 and result["identical_share"] == 0.5
    assert result["first_divergence"] == [4, 1]
    assert result["mean_first_divergence"] == 2.5
    assert result["matched_per_prompt"] == [4, 3]
    assert bench.greedy_agreement(ref, [[9, 9, 9, 9], [9, 9, 9, 9]])["token_share"] == 0
    with pytest.raises(ValueError, match="same non-zero number of prompts"):
        bench.greedy_agreement(ref, ref[:1])


def test_forced_agreement_counts_argmax_equal_to_the_reference():
    result = bench.forced_agreement([[1, 2, 3], [4, 5, 6]], [[1, 0, 3], [4, 5, 6]])
    assert (result["matched_tokens"], result["total_tokens"]) == (5, 6)
    assert result["matched_per_prompt"] == [2, 3]
    with pytest.raises(ValueError, match="3 reference tokens but 2 argmaxes"):
        bench.forced_agreement([[1, 2, 3]], [[1, 2]])


def test_perplexity_from_logits():
    vocab = 7
    uniform = torch.zeros(5, vocab, dtype=torch.bfloat16)
    targets = torch.tensor([0, 3, 6, 2, 1])
    nll = bench.token_nll(uniform, targets)
    assert nll.dtype == torch.float32
    assert bench.perplexity(nll.tolist()) == pytest.approx(vocab)
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    want = torch.nn.functional.cross_entropy(logits, targets)
    assert bench.perplexity(bench.token_nll(logits, targets).tolist()) == pytest.approx(
        math.exp(want.item()), rel=1e-5
    )
    with pytest.raises(ValueError, match="no tokens"):
        bench.perplexity([])
    assert bench.kl_divergence(logits, logits).abs().max().item() < 1e-6
    assert (bench.kl_divergence(logits, uniform.float()) > 0).all()


def test_fake_quant_matches_the_value_stats_round_trip():
    x = torch.randn(1, 2, 5, 4, generator=torch.Generator().manual_seed(0)) * 30
    scale = torch.tensor([0.05, 1.0])  # head 0 saturates at 448 * 0.05 = 22.4
    got = bench.fake_quant(x, scale)
    assert got.dtype == torch.float32 and got[0, 0].abs().max().item() == pytest.approx(22.4)
    err = ((got - x).norm() / x.norm()).item()
    stats = bench.fp8_value_stats([x], scale.view(1, 2))
    assert stats["rel_rms_error"] == pytest.approx(err, rel=1e-5)
    assert stats["saturated"] == int((x[0, 0].abs() > 22.4).sum()) > 0
    assert bench.fake_quant(x.to(torch.bfloat16), scale).dtype == torch.bfloat16


def test_fp8_value_stats_counts_saturated_subnormal_and_flushed_values():
    # one layer, two heads of 4 values: head 0 at scale 1, head 1 at scale 0.5
    x = torch.tensor([[[[500.0, 1.0, 0.01, 0.0]], [[100.0, 2**-12, 1.0, -300.0]]]])
    scales = torch.tensor([[1.0, 0.5]])
    stats = bench.fp8_value_stats([x], scales)
    assert stats["values"] == 8 and stats["nonzero"] == 7
    # 500 > 448; -300 / 0.5 = -600
    assert stats["saturated"] == 2
    # 0.01 < 2**-6 and 2**-12 / 0.5 = 2**-11 (also flushed to zero)
    assert stats["subnormal"] == 2 and stats["flushed_to_zero"] == 1
    assert stats["amax"] == 500.0
    assert stats["saturated_share"] == 2 / 8
    exact = bench.fp8_value_stats([torch.tensor([[[[1.0, 2.0, 0.5]]]])], torch.ones(1, 1))
    assert exact["rel_rms_error"] == 0 and exact["saturated"] == exact["subnormal"] == 0


def _results(greedy_share_flips: int = 0, dyn_ppl: float = 10.05) -> dict:
    """A results dict shaped like bench.run's, from the pure functions."""
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    dyn = [list(r) for r in ref]
    for i in range(greedy_share_flips):
        dyn[1][3 - i] = 0
    static = [[1, 2, 9, 9], [5, 6, 7, 8]]
    outputs = {"bf16": ref, "fp8-dynamic": dyn, "fp8-static": static}
    ppl = {"bf16": 10.0, "fp8-dynamic": dyn_ppl, "fp8-static": 11.0}
    scales = {
        "source": "dynamic",
        "k_min": 0.01,
        "k_max": 0.2,
        "v_min": 0.001,
        "v_max": 0.05,
    }
    stats = bench.fp8_value_stats([torch.tensor([[[[500.0, 0.001]]]])], torch.ones(1, 1))
    return {
        "model": {"name": "m", "description": "a test model", "layers": 1, "kv_heads": 1},
        "device": "cpu",
        "backends": {"append": "torch", "decode": "torch"},
        "prompt_kind": "test prompts",
        "prompts": [{"turn": "a", "tokens": 5}, {"turn": "b", "tokens": 6}],
        "calibration": {
            "prompt_index": 0,
            "tokens": 5,
            "scales": {"fp8-dynamic": scales, "fp8-static": {**scales, "source": "static"}},
        },
        "outputs": outputs,
        "greedy": {c: bench.greedy_agreement(ref, o) for c, o in outputs.items()},
        "teacher_forced": {c: bench.forced_agreement(ref, ref) for c in bench.CONFIGS},
        "perplexity": {
            "text": "a text",
            "tokens": 9,
            "scored": 8,
            "configs": {
                c: {
                    "ppl": p,
                    "mean_nll": math.log(p),
                    "delta_vs_bf16": p / 10.0 - 1,
                    "mean_kl": 0.001,
                    "argmax_agreement": 0.75,
                }
                for c, p in ppl.items()
            },
            "transformers_fake_quant": {
                c: {"ppl": p, "delta_vs_bf16": p / 10.0 - 1, "argmax_agreement": 0.5}
                for c, p in ppl.items()
            },
        },
        "floors": {
            "bf16-alone": {
                "greedy": bench.greedy_agreement(ref, [[1, 2, 3, 4], [5, 6, 0, 0]]),
                "teacher_forced": bench.forced_agreement(ref, ref),
            },
            "transformers-bf16": {"greedy": bench.greedy_agreement(ref, ref)},
        },
        "kv_stats": [{"data": "prompt 0", "kind": "K", "config": "fp8-static", **stats}],
        "wall_s": dict.fromkeys(
            ("load", "greedy", "teacher_forced", "perplexity", "kv_stats", "total"), 1.0
        ),
        "notes": ["a note"],
    }


def test_targets_met_missed_and_margins():
    goals = bench.targets(_results())
    assert [(g["met"], g["margin"]) for g in goals] == [
        (True, "+1.00 points"),
        (True, "+0.500 points"),
    ]
    assert goals[0]["shown"] == "100.00% (8 / 8)"
    assert goals[1]["shown"] == "+0.500% (10.0500 vs 10.0000)"
    goals = bench.targets(_results(greedy_share_flips=1, dyn_ppl=9.8))
    assert [(g["met"], g["margin"]) for g in goals] == [
        (False, "-11.50 points"),  # 7 / 8 = 87.5%
        (False, "-1.000 points"),  # |9.8 / 10 - 1| = 2%
    ]
    assert [g["met"] for g in bench.targets({})] == [None, None]


def test_report_renders_every_section(tmp_path):
    args = bench.parse_args(["--new-tokens", "4", "--prompts", "2"])
    results = _results(greedy_share_flips=1)
    markdown = bench.report(args, environment(), results)
    assert "# FP8 KV cache accuracy: greedy agreement and perplexity (m)" in markdown
    assert "| fp8-dynamic | 87.50% (7 / 8) | 1 / 2 | 3.5 | 100.00% (8 / 8) |" in markdown
    assert "| fp8-static | 75.00% (6 / 8) | 1 / 2 | 3.0 |" in markdown
    assert "| bf16 | reference | — | — | 100.00% (8 / 8) |" in markdown
    assert "| 1 | 6 | 3 | 4 | 4 / 4 | 4 / 4 |" in markdown  # per prompt
    assert "| fp8-dynamic | 10.0500 | +0.500% |" in markdown
    assert "K 0.01..0.2, V 0.001..0.05 (dynamic)" in markdown
    assert "| prompt 0 | K | 500 | fp8-static | 1 (50.000%) | 1 (50.00%) |" in markdown
    assert "1 met, 1 missed, 0 not measured." in markdown
    assert "| greedy token agreement fp8-dynamic vs bf16 >= 99% | 87.50% (7 / 8) |" in markdown
    assert "- a note" in markdown
    assert "| *floor: bf16, prompts alone* | 75.00% (6 / 8) | 1 / 2 | 3.0 | 100.00%" in markdown
    assert "| *floor: transformers bf16* | 100.00% (8 / 8) | 2 / 2 | 4.0 | — |" in markdown
    assert "bf16, prompts alone 75.00%, transformers bf16 100.00%" in markdown
    assert "| fp8-static | 11.0000 | +10.000% | 50.00% |" in markdown  # the cross-check
    del results["floors"], results["perplexity"]["transformers_fake_quant"]
    markdown = bench.report(args, environment(), results)  # --no-floors
    assert "floor:" not in markdown and "Cross-check" not in markdown
    assert bench.plot(tmp_path / "p.png", _results()) in (tmp_path / "p.png", None)


def test_cli_defaults_and_help(capsys):
    args = bench.parse_args([])
    assert (args.model, args.prompts, args.new_tokens, args.dtype) == ("smollm2", 8, 128, "bf16")
    assert args.text.endswith("benchmarks/data/fp8_ppl_text.txt")
    with pytest.raises(SystemExit) as done:
        bench.parse_args(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for option in ("--out-dir", "--device", "--prompts", "--new-tokens", "--ppl-tokens", "--model"):
        assert option in out
    with pytest.raises(SystemExit, match="--ppl-tokens must be >= 2"):
        bench.parse_args(["--ppl-tokens", "1"])


def test_text_is_original_prose_of_the_right_length():
    text = bench.TEXT_PATH.read_text()
    words = len(text.split())
    assert 500 <= words <= 800  # about 845 SmolLM2 tokens


def test_text_tokens_truncate_and_fall_back_to_random_ids(tmp_path):
    class Tokenizer:
        def __call__(self, text):
            return {"input_ids": [len(w) for w in text.split()]}

    path = tmp_path / "t.txt"
    path.write_text("one three fives sixsix")
    ids, name = bench.text_tokens(Tokenizer(), str(path), 3, 100, 0)
    assert ids == [3, 5, 5] and "(4 words)" in name
    ids, name = bench.text_tokens(None, str(path), 5, 100, 0)
    assert len(ids) == 5 and all(0 <= i < 100 for i in ids) and name.startswith("random ids")


def test_smoke_run_on_a_tiny_bf16_model(tmp_path):
    argv = ["--model", "tiny-llama", "--prompts", "2", "--new-tokens", "4", "--ppl-tokens", "6"]
    argv += ["--device", "cpu", "--out-dir", str(tmp_path)]
    payload = bench.main(argv)
    saved = json.loads((tmp_path / "fp8_accuracy.json").read_text())
    assert saved["args"]["model"] == "tiny-llama" and saved["environment"]["command"]
    for c in bench.CONFIGS:
        assert [len(o) for o in saved["outputs"][c]] == [4, 4]
        assert saved["teacher_forced"][c]["total_tokens"] == 8
        assert saved["perplexity"]["configs"][c]["ppl"] > 1
    # bf16 against itself: the reference, and its own teacher-forced floor
    assert saved["greedy"]["bf16"]["token_share"] == 1.0
    assert saved["teacher_forced"]["bf16"]["token_share"] == 1.0
    assert saved["perplexity"]["configs"]["bf16"]["delta_vs_bf16"] == 0
    assert saved["perplexity"]["scored"] == 5
    dynamic = saved["calibration"]["scales"]["fp8-dynamic"]
    assert dynamic["source"] == "dynamic" and 0 < dynamic["k_min"] <= dynamic["k_max"]
    assert saved["calibration"]["scales"]["fp8-static"]["k_max"] == 1.0
    assert len(saved["kv_stats"]) == 2 * 2 * 2  # 2 data x K/V x 2 FP8 configs
    floors = saved["floors"]
    assert set(floors) == {"bf16-alone", "transformers-bf16"}
    assert [len(o) for o in floors["transformers-bf16"]["outputs"]] == [4, 4]
    assert floors["bf16-alone"]["teacher_forced"]["total_tokens"] == 8
    check = saved["perplexity"]["transformers_fake_quant"]
    assert check["bf16"]["delta_vs_bf16"] == 0 and check["fp8-dynamic"]["ppl"] > 1
    assert [g["met"] in (True, False) for g in saved["targets"]] == [True, True]
    assert payload["targets"] == saved["targets"]
    markdown = (tmp_path / "fp8_accuracy.md").read_text()
    assert "(tiny-llama)" in markdown and "random-id prompts" in markdown
    assert saved["load_average"]["cpus"] >= 1 and "host load average (1 min)" in markdown
    assert "## Targets" in markdown and "greedy token agreement fp8-dynamic" in markdown
