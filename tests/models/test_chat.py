"""Chat prompts in a tokenizer's own template (a local WordLevel tokenizer; nothing downloaded)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from flashdec.models import chat_prompt

WORDS = ["[UNK]", "<s>", "</s>", "user", "assistant", "system", "hi", "there", "be", "brief"]
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant{% endif %}"
)


@pytest.fixture
def tokenizer():
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = TEMPLATE
    return tok


def test_one_user_turn_ends_where_the_reply_begins(tokenizer):
    assert chat_prompt(tokenizer, "hi there") == [1, 3, 6, 7, 2, 1, 4]


def test_a_conversation(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat_prompt(tokenizer, messages) == [1, 5, 8, 9, 2, 1, 3, 6, 2, 1, 4]


def test_bad_messages_and_no_template(tokenizer):
    with pytest.raises(TypeError, match="messages must be a str or a sequence"):
        chat_prompt(tokenizer, 42)
    with pytest.raises(TypeError, match="messages must be a str or a sequence"):
        chat_prompt(tokenizer, ["hi"])
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        chat_prompt(tokenizer, "hi")
