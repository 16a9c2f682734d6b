"""Documents and the loaders that read them from text and JSON-lines files.

A `Document` is one unit of training data, in one of the formats TRL's SFTTrainer reads: plain
`text`; a chat (`messages`, a tuple of `{"role", "content"}` dicts); or a `prompt` and its
`completion`, both strings, or both chats (then kept as one chat whose first `prompt_turns`
messages are the prompt). `source` names where it came from (a file, a book, a user) and is
what non-IID partitioning groups by.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["Document", "load_documents", "default_corpus"]

log = logging.getLogger(__name__)

SUFFIXES = (".jsonl.gz", ".jsonl", ".txt.gz", ".txt")
TXT_DOC_CHARS = 4000  # paragraphs of a .txt file are grouped into documents of about this size
_CORPUS_FILE = "kjv_books.jsonl.gz"


@dataclass(frozen=True)
class Document:
    """One training document: exactly one of `text`, `messages` or `completion` is set.

    `prompt` goes with `completion` (a prompt/completion pair as strings); `prompt_turns` > 0
    with `messages` marks a prompt/completion pair as chats (the first `prompt_turns` messages
    are the prompt, the rest the completion).
    """

    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    source: str = ""
    prompt: str | None = None
    completion: str | None = None
    prompt_turns: int = 0

    def __post_init__(self) -> None:
        given = [f for f in (self.text, self.messages, self.completion) if f is not None]
        if len(given) != 1:
            raise ValueError("a Document needs exactly one of text=, messages= or completion=")
        if (self.prompt is None) != (self.completion is None):
            raise ValueError("a Document's prompt= and completion= go together")
        if self.messages is not None and not isinstance(self.messages, tuple):
            object.__setattr__(self, "messages", tuple(self.messages))
        turns = len(self.messages or ())
        if self.prompt_turns and not 0 < self.prompt_turns < turns:
            raise ValueError(
                f"prompt_turns={self.prompt_turns} must leave a completion: the chat has "
                f"{turns} messages"
            )

    @property
    def is_example(self) -> bool:
        """An instruction example (a chat or a prompt/completion pair), not plain text."""
        return self.text is None

    @property
    def num_chars(self) -> int:
        """Characters of text (for a chat: of all message contents)."""
        if self.text is not None:
            return len(self.text)
        if self.completion is not None:
            return len(self.prompt or "") + len(self.completion)
        return sum(len(m["content"]) for m in self.messages or ())


def load_documents(
    path: str | Path, *, text_field: str = "text", source: str | None = None
) -> list[Document]:
    """Read documents from a file or a directory.

    - `.txt` / `.txt.gz`: paragraphs (split at blank lines) grouped in order into documents of about
      `TXT_DOC_CHARS` characters.
    - `.jsonl` / `.jsonl.gz`: one JSON object per line, in one of TRL's formats: a string under
      `text_field`; `messages`, a list of `{"role": str, "content": str}` (a chat); or `prompt`
      and `completion`, both strings or both such lists. Blank lines and empty texts are
      skipped; a record that fits none of them raises ValueError naming the file, the line and
      what was expected.
    - a directory: every file with one of those suffixes below it, in sorted path order.

    A document's source is the record's own "source" field if it has one, else `source`, else the
    file's name without its suffix.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _suffix(p))
        if not files:
            raise ValueError(f"{path}: no {', '.join(SUFFIXES)} files in this directory")
        return [doc for f in files for doc in _load_file(f, text_field, source)]
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if not _suffix(path):
        raise ValueError(f"{path}: unsupported file type; use one of {', '.join(SUFFIXES)}")
    return _load_file(path, text_field, source)


def default_corpus() -> list[Document]:
    """The bundled corpus: 362 chapters of ten King James Bible books; source = book name."""
    ref = resources.files(__package__).joinpath("corpus", _CORPUS_FILE)
    with resources.as_file(ref) as path:
        return load_documents(path)


def _suffix(path: Path) -> str | None:
    return next((s for s in SUFFIXES if path.name.endswith(s)), None)


def _load_file(path: Path, text_field: str, source: str | None) -> list[Document]:
    suffix = _suffix(path)
    assert suffix is not None
    default_source = source if source is not None else path.name[: -len(suffix)]
    try:
        if suffix.startswith(".jsonl"):
            return list(_read_jsonl(path, text_field, default_source))
        return _read_txt(path, default_source)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from e


def _open_text(path: Path) -> Any:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _read_txt(path: Path, source: str) -> list[Document]:
    """Group the file's paragraphs, in order, into documents of about TXT_DOC_CHARS characters."""
    with _open_text(path) as f:
        text = f.read().replace("\r\n", "\n")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    docs, group, size = [], [], 0
    for para in paragraphs:
        group.append(para)
        size += len(para)
        if size >= TXT_DOC_CHARS:
            docs.append(Document(text="\n\n".join(group), source=source))
            group, size = [], 0
    if group:
        docs.append(Document(text="\n\n".join(group), source=source))
    return docs


def _read_jsonl(path: Path, text_field: str, source: str) -> Iterator[Document]:
    skipped = 0
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                doc = _parse_record(line, text_field, source)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            if doc is None:
                skipped += 1
            else:
                yield doc
    if skipped:
        log.warning("%s: skipped %d records with empty text", path, skipped)


_EXPECTED = (
    'a record needs exactly one of "{text}" (a string), "messages" (a list of '
    '{{"role", "content"}} objects), or "prompt" and "completion" (both strings, or both such '
    "lists)"
)


def _parse_record(line: str, text_field: str, source: str) -> Document | None:
    """One JSON line -> a Document (None for an empty text); ValueError says what is wrong."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    src = record.get("source", source)
    if not isinstance(src, str):
        raise ValueError(f'"source" must be a string, got {type(src).__name__}')
    formats = [k for k in (text_field, "messages", "prompt") if k in record]
    if len(formats) != 1 or ("prompt" in record) != ("completion" in record):
        expected = _EXPECTED.format(text=text_field)
        raise ValueError(f"{expected}; keys found: {sorted(record)}")
    if "messages" in record:
        return Document(messages=_parse_messages(record["messages"], "messages"), source=src)
    if "prompt" in record:
        return _prompt_completion(record["prompt"], record["completion"], src)
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f'"{text_field}" must be a string, got {type(text).__name__}')
    return Document(text=text, source=src) if text.strip() else None


def _prompt_completion(prompt: Any, completion: Any, source: str) -> Document:
    """A prompt/completion pair: both strings, or both chats (kept as one chat)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return Document(prompt=prompt, completion=completion, source=source)
    if isinstance(prompt, list) and isinstance(completion, list):
        turns = _parse_messages(prompt, "prompt") + _parse_messages(completion, "completion")
        return Document(messages=turns, prompt_turns=len(prompt), source=source)
    raise ValueError(
        '"prompt" and "completion" must both be strings or both lists of {"role", "content"} '
        f"objects, got {type(prompt).__name__} and {type(completion).__name__}"
    )


def _parse_messages(messages: Any, field: str) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'"{field}" must be a non-empty list of {{"role", "content"}} objects')
    out = []
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise ValueError(f'{field}[{i}] must be an object with string "role" and "content"')
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)
