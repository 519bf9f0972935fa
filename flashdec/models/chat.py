"""Chat prompts: messages in a tokenizer's own chat template, as the token ids a model reads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from transformers.tokenization_utils_base import PreTrainedTokenizerBase


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: str | Sequence[Mapping[str, str]]
) -> list[int]:
    """``messages`` (one user turn as a str, or ``{"role", "content"}`` dicts) in the tokenizer's
    chat template, ending where the assistant's reply begins.

    Raises:
        TypeError: ``messages`` is neither a str nor a sequence of mappings.
        ValueError: the tokenizer has no chat template.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    elif not isinstance(messages, Sequence) or not all(isinstance(m, Mapping) for m in messages):
        raise TypeError(
            f"messages must be a str or a sequence of role/content dicts, got {messages!r:.80}"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template: send the prompt as text")
    encoded = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True
    )
    # transformers 5 returns a BatchEncoding here, earlier versions a list of ids
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)
