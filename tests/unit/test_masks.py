"""Answers-only labels of instruction examples, against masks built by hand.

Each template is written here inline (a Llama-3-style one, Qwen-style ones with and without
``{% generation %}`` markers); the expected ids and labels are built from the rendered text cut
by hand into pieces that count or do not, each piece tokenized on its own. The bundled SmolLM2
template is tested with its own tokenizer in tests/system/test_bundled_llm.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from fedpipe.data import IGNORE_INDEX, Document, encode_example
from fedpipe.models.tokenizer import build_byte_tokenizer

LLAMA3 = (
    "{{- bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
QWEN = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- endif %}"
)
QWEN_MARKED = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}{% generation %}{{- message.content + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\n' }}{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>"]

CHAT = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
)


def _tokenizer(template: str, specials: list[str]) -> Any:
    """The byte tokenizer with the template's special tokens (one id each) and template."""
    tok = build_byte_tokenizer()
    tok.add_tokens(specials, special_tokens=True)
    if "<|begin_of_text|>" in specials:
        tok.bos_token = "<|begin_of_text|>"
    tok.chat_template = template
    return tok


def _by_hand(tok: Any, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Ids and labels from pieces of text that count (True) or not, tokenized one by one."""
    ids: list[int] = []
    labels: list[int] = []
    for text, counts in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if counts else [IGNORE_INDEX] * len(piece)
    return ids, labels


def _check(tok: Any, doc: Document, pieces: list[tuple[str, bool]], rendered: str) -> None:
    assert "".join(text for text, _ in pieces) == rendered  # the pieces are the real text
    assert encode_example(doc, tok, loss_on="answers") == _by_hand(tok, pieces)


def test_llama3_style_template_counts_each_answer_and_its_eot() -> None:
    tok = _tokenizer(LLAMA3, LLAMA3_SPECIALS)
    head = "<|start_header_id|>{}<|end_header_id|>\n\n"
    pieces = [
        ("<|begin_of_text|>" + head.format("system") + "Be brief.<|eot_id|>", False),
        (head.format("user") + "Capital of France?<|eot_id|>" + head.format("assistant"), False),
        ("Paris.<|eot_id|>", True),
        (head.format("user") + "And of Italy?<|eot_id|>" + head.format("assistant"), False),
        ("Rome.<|eot_id|>", True),
    ]
    _check(
        tok, Document(messages=CHAT), pieces, tok.apply_chat_template(list(CHAT), tokenize=False)
    )


def test_qwen_style_template_with_default_system_turn() -> None:
    tok = _tokenizer(QWEN, CHATML_SPECIALS)
    chat = CHAT[1:]  # no system turn: the template writes its own
    pieces = [
        ("<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n", False),
        ("<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n", False),
        ("Paris.<|im_end|>", True),
        ("\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n", False),
        ("Rome.<|im_end|>", True),
        ("\n", False),
    ]
    doc = Document(messages=chat)
    _check(tok, doc, pieces, tok.apply_chat_template(list(chat), tokenize=False))


def test_qwen_style_template_with_generation_markers() -> None:
    tok = _tokenizer(QWEN_MARKED, CHATML_SPECIALS)
    pieces = [
        ("<|im_start|>system\nBe brief.<|im_end|>\n", False),
        ("<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n", False),
        ("Paris.<|im_end|>", True),
        ("\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n", False),
        ("Rome.<|im_end|>", True),
        ("\n", False),
    ]
    _check(
        tok, Document(messages=CHAT), pieces, tok.apply_chat_template(list(CHAT), tokenize=False)
    )


def test_markers_and_prefixes_agree_on_the_same_text() -> None:
    """The two ways of finding answers give the same labels where both apply."""
    marked = encode_example(
        Document(messages=CHAT), _tokenizer(QWEN_MARKED, CHATML_SPECIALS), loss_on="answers"
    )
    unmarked = _tokenizer(
        QWEN_MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
        CHATML_SPECIALS,
    )
    assert encode_example(Document(messages=CHAT), unmarked, loss_on="answers") == marked


def test_prompt_completion_as_chats_counts_the_completion() -> None:
    tok = _tokenizer(LLAMA3, LLAMA3_SPECIALS)
    doc = Document(messages=CHAT[1:3], prompt_turns=1)
    head = "<|start_header_id|>{}<|end_header_id|>\n\n"
    pieces = [
        ("<|begin_of_text|>" + head.format("user") + "Capital of France?<|eot_id|>", False),
        (head.format("assistant"), False),
        ("Paris.<|eot_id|>", True),
    ]
    _check(tok, doc, pieces, tok.apply_chat_template(list(CHAT[1:3]), tokenize=False))


def test_prompt_completion_as_strings_counts_the_completion_and_eos() -> None:
    tok = build_byte_tokenizer()
    doc = Document(prompt="Q: 2+2?\nA:", completion=" 4")
    ids, labels = encode_example(doc, tok, loss_on="answers")
    expected_ids, expected_labels = _by_hand(tok, [("Q: 2+2?\nA:", False), (" 4", True)])
    assert ids == [*expected_ids, tok.eos_token_id]
    assert labels == [*expected_labels, tok.eos_token_id]


def test_plain_text_counts_everything_and_all_counts_the_prompt_too() -> None:
    tok = _tokenizer(LLAMA3, LLAMA3_SPECIALS)
    ids, labels = encode_example(Document(text="some text"), tok, loss_on="answers")
    assert labels == ids and ids[-1] == tok.eos_token_id
    ids, labels = encode_example(Document(messages=CHAT), tok, loss_on="all")
    assert labels == ids and len(ids) > 20


def test_chat_without_an_assistant_turn_counts_nothing() -> None:
    tok = _tokenizer(LLAMA3, LLAMA3_SPECIALS)
    _, labels = encode_example(Document(messages=CHAT[:2]), tok, loss_on="answers")
    assert set(labels) == {IGNORE_INDEX}


def test_template_whose_start_changes_with_later_turns_is_refused() -> None:
    """A template that writes earlier turns differently once later ones follow (as Qwen3 drops
    the reasoning of earlier answers) cannot be masked by prefixes: refused, saying what to do."""
    shifting = (
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(ValueError, match="generation %}.*data.loss_on"):
        encode_example(Document(messages=CHAT), _tokenizer(shifting, []), loss_on="answers")


def test_loss_on_all_gives_the_same_ids_as_answers() -> None:
    for template, specials in ((LLAMA3, LLAMA3_SPECIALS), (QWEN_MARKED, CHATML_SPECIALS)):
        tok = _tokenizer(template, specials)
        for doc in (Document(messages=CHAT), Document(prompt="a", completion="b")):
            ids, labels = encode_example(doc, tok, loss_on="all")
            assert labels == ids
            assert ids == encode_example(doc, tok, loss_on="answers")[0]


def test_a_chat_the_template_refuses_is_a_value_error_that_says_so() -> None:
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    for template in (strict + LLAMA3, strict + QWEN_MARKED):
        tok = _tokenizer(template, LLAMA3_SPECIALS + CHATML_SPECIALS)
        with pytest.raises(ValueError, match="the chat template refuses this chat: user first"):
            encode_example(Document(messages=CHAT), tok, loss_on="answers")
