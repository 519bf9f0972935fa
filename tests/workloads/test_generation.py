"""``flashdec generate``'s result: warm-up, agreement rows and the first divergence."""

from __future__ import annotations

import dataclasses

from flashdec.workloads.config import GenerateConfig
from flashdec.workloads.generation import _first_difference, run_generate


def test_first_difference():
    assert _first_difference([1, 2, 3], [1, 2, 3]) is None
    assert _first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert _first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early (EOS)


def test_warmup_run_is_reported_and_changes_no_token():
    config = GenerateConfig(batch=2, prompt_len=7, max_new_tokens=5, compare=True, ignore_eos=True)
    cold = run_generate(config)
    warm = run_generate(dataclasses.replace(config, warmup_run=True))
    assert warm.generated == cold.generated
    assert warm.first_divergence == (None, None)  # float32 tiny model: token-exact
    labels = dict(warm.rows())
    assert labels["timings"].startswith("after an untimed warm-up run")
    assert "timings" not in dict(cold.rows())
    assert "first divergence (step)" not in labels and "note" not in labels


def test_a_low_precision_divergence_is_explained():
    config = GenerateConfig(batch=2, prompt_len=7, max_new_tokens=5, compare=True, ignore_eos=True)
    result = dataclasses.replace(
        run_generate(config),
        dtype="bfloat16",
        matches_transformers=1,
        tokens_equal=7,
        first_divergence=(None, 2),
    )
    labels = dict(result.rows())
    assert labels["first divergence (step)"] == "median 2, earliest 2"
    assert "near-tie" in labels["note"]
