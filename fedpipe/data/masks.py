"""Token ids and labels of one instruction example, with the loss on its answers only.

Labels are the input ids where a token counts in the loss and ``IGNORE_INDEX`` (-100) elsewhere,
the convention of Hugging Face models and of fedpipe's tail; the model shifts them inside its
loss. With ``loss_on = "answers"`` the tokens that count are:

- a chat (``messages``): every assistant turn's tokens, as the chat template writes them (the
  answer and its end-of-turn marker, not the role header or the whitespace between turns);
- a prompt/completion pair: the completion's tokens (strings: followed by the eos, which counts);
- plain text: every token, followed by the eos.

Where the chat template marks the assistant turns with ``{% generation %}`` blocks, the marked
text counts (transformers' ``return_assistant_tokens_mask``). Elsewhere, an assistant turn is
the text that rendering the conversation up to and including it adds to rendering the turns
before it with the generation prompt; a template that does not render a conversation's start as
a prefix of the whole is refused with what to do. ``loss_on = "all"`` counts every token.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from jinja2 import TemplateError

from fedpipe.config import LOSS_ON
from fedpipe.data.documents import Document

__all__ = ["IGNORE_INDEX", "LOSS_ON", "LossOn", "encode_example", "prompt_and_answer"]

IGNORE_INDEX = -100  # labels that do not count (torch's cross-entropy default, as the tail's)
LossOn = Literal["answers", "all"]

_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")
Span = tuple[int, int]  # [start, end) in characters of the rendered text


def encode_example(
    doc: Document, tokenizer: Any, *, loss_on: LossOn
) -> tuple[list[int], list[int]]:
    """(input ids, labels) of ``doc``: labels equal the ids where a token counts, else -100."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
    if loss_on == "all":  # no answer to find: every token of the text counts
        text, spans, eos = _whole(doc, tokenizer)
    elif doc.messages is not None and not doc.prompt_turns and _has_generation_blocks(tokenizer):
        ids, mask = _marked_chat(doc.messages, tokenizer)
        return ids, _labels(ids, mask)
    else:
        text, spans, eos = _spans(doc, tokenizer)
    ids, mask = _tokenize_spans(text, spans, tokenizer)
    if eos:
        ids, mask = [*ids, _eos_id(tokenizer)], [*mask, True]
    return ids, _labels(ids, mask)


def prompt_and_answer(doc: Document, tokenizer: Any) -> tuple[str, str] | None:
    """(the text a model answers, the reference answer) of an example, rendered as training
    renders it; None for plain text or a chat without an assistant turn.

    A string prompt/completion pair: the prompt as it is (training tokenizes prompt +
    completion). A chat: the turns before its last assistant turn, with the template's
    generation prompt, and that turn's content; a prompt/completion pair of chats: the prompt
    turns, with the generation prompt, and the completion's last assistant turn (or its last
    turn).
    """
    if doc.completion is not None:
        return doc.prompt or "", doc.completion
    if doc.messages is None:
        return None
    messages = list(doc.messages)
    if doc.prompt_turns:
        completion = messages[doc.prompt_turns :]
        answers = [m for m in completion if m["role"] == "assistant"] or completion
        return _render(tokenizer, messages[: doc.prompt_turns], prompt=True), answers[-1]["content"]
    last = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not last:
        return None
    return _render(tokenizer, messages[: last[-1]], prompt=True), messages[last[-1]]["content"]


def _labels(ids: Sequence[int], mask: Sequence[bool]) -> list[int]:
    return [i if m else IGNORE_INDEX for i, m in zip(ids, mask, strict=True)]


def _whole(doc: Document, tokenizer: Any) -> tuple[str, list[Span], bool]:
    """The text of ``doc``, all of it one span, and whether an eos follows (not after a chat:
    its template ends it)."""
    if doc.messages is None:
        text = doc.text if doc.text is not None else (doc.prompt or "") + (doc.completion or "")
        return text, [(0, len(text))], True
    text = _render(tokenizer, list(doc.messages))
    return text, [(0, len(text))], False


def _spans(doc: Document, tokenizer: Any) -> tuple[str, list[Span], bool]:
    """The text to tokenize, its answer spans, and whether an eos (counted) follows it."""
    if doc.text is not None:
        return doc.text, [(0, len(doc.text))], True
    if doc.completion is not None:
        prompt = doc.prompt or ""
        return prompt + doc.completion, [(len(prompt), len(prompt) + len(doc.completion))], True
    messages = list(doc.messages or ())
    text = _render(tokenizer, messages)
    if doc.prompt_turns:
        start = _prefix_end(text, _render(tokenizer, messages[: doc.prompt_turns], prompt=True))
        return text, [(start, _trim_end(text, start, len(text)))], False
    return text, _assistant_spans(text, messages, tokenizer), False


def _assistant_spans(text: str, messages: Sequence[dict[str, str]], tokenizer: Any) -> list[Span]:
    """Each assistant turn's characters in ``text``, by rendering the conversation's prefixes."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _prefix_end(text, _render(tokenizer, messages[:i], prompt=True))
        end = _prefix_end(text, _render(tokenizer, messages[: i + 1]))
        spans.append((start, _trim_end(text, start, end)))
    return spans


def _trim_end(text: str, start: int, end: int) -> int:
    """``end`` less the whitespace a template writes between turns (after the end-of-turn)."""
    return start + len(text[start:end].rstrip())


def _prefix_end(text: str, prefix: str) -> int:
    """len(prefix), which must begin ``text``; else the template cannot be masked this way."""
    if not text.startswith(prefix):
        raise ValueError(
            "the chat template renders the start of a conversation differently from the whole "
            "(a turn's text depends on the turns after it), so the assistant turns cannot be "
            "found by rendering prefixes; mark them with {% generation %} ... "
            '{% endgeneration %} in the template, or set data.loss_on = "all"'
        )
    return len(prefix)


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], *, prompt: bool = False) -> str:
    """The chat as the template writes it; with ``prompt``, followed by the generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        return _plain_chat(messages, prompt=prompt)
    with _template_errors():
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=prompt
        )
    return str(text)


@contextmanager
def _template_errors() -> Iterator[None]:
    """A chat the template refuses (its ``raise_exception``, say) as a ValueError that says so."""
    try:
        yield
    except TemplateError as exc:
        raise ValueError(f"the chat template refuses this chat: {exc}") from None


def _plain_chat(messages: Sequence[dict[str, str]], *, prompt: bool) -> str:
    """ "role: content" lines, for a tokenizer without a chat template."""
    lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return lines + ("assistant: " if prompt else "")


def _has_generation_blocks(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and _GENERATION.search(template) is not None


def _marked_chat(
    messages: Sequence[dict[str, str]], tokenizer: Any
) -> tuple[list[int], list[bool]]:
    """Ids and mask of a chat whose template marks the assistant turns ({% generation %})."""
    with _template_errors():
        out = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def _tokenize_spans(
    text: str, spans: Sequence[Span], tokenizer: Any
) -> tuple[list[int], list[bool]]:
    """Token ids of ``text`` (no special tokens added) and whether each overlaps a span."""
    # verbose=False: examples longer than the model's context are expected; rows cut them.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    mask = [any(s < e1 and e > s1 for s1, e1 in spans) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(
            "the tokenizer has no eos token to end an example; set tokenizer.eos_token"
        )
    return int(eos)
