"""``flashdec generate``'s result: warm-up, agreement rows and the first divergence; prompts
given as token ids; text streamed piece by piece."""

from __future__ import annotations

import dataclasses

import pytest

from flashdec.workloads.generation import TextStream, _first_difference, run_generate
from flashdec.workloads.model_config import GenerateConfig


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


class _ByteTokenizer:
    """Token ids are UTF-8 bytes: one character may take several tokens."""

    def decode(self, tokens, skip_special_tokens=False):
        return bytes(tokens).decode("utf-8", errors="replace")


def test_text_stream_holds_a_piece_back_inside_a_character():
    pieces = []
    stream = TextStream(_ByteTokenizer(), pieces.append)
    tokens = list("hé!".encode())  # é is two bytes
    for n in range(1, len(tokens) + 1):
        stream.update(tokens[:n])
    assert pieces == ["h", "é", "!"]
    stream.update(tokens, final=True)  # nothing new
    assert "".join(pieces) == "hé!"
    cut = []
    TextStream(_ByteTokenizer(), cut.append).update(list("hé".encode())[:2], final=True)
    assert cut == ["h\ufffd"]  # the end of the output: what there is


def test_token_id_prompts_replace_the_configs():
    config = GenerateConfig(batch=2, prompt_len=7, max_new_tokens=4, compare=True, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    result = run_generate(config, prompts=prompts)
    assert result.prompt_tokens == 12 and result.exact
    assert result.texts is None and result.text is None  # a built-in shape: no tokenizer
    with pytest.raises(ValueError, match="streaming text needs the model's tokenizer"):
        run_generate(config, prompts=prompts, on_text=print)
