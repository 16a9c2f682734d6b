"""Documents and the loaders that read them from text and JSON-lines files.

A `Document` is one unit of training text: either plain `text` or a chat (`messages`, a tuple of
`{"role", "content"}` dicts). `source` names where it came from (a file, a book, a user) and is what
non-IID partitioning groups by.
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
    """One training document: exactly one of `text` or `messages` is set."""

    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError("a Document needs exactly one of text= or messages=")
        if self.messages is not None and not isinstance(self.messages, tuple):
            object.__setattr__(self, "messages", tuple(self.messages))

    @property
    def num_chars(self) -> int:
        """Characters of text (for a chat: of all message contents)."""
        if self.text is not None:
            return len(self.text)
        return sum(len(m["content"]) for m in self.messages or ())


def load_documents(
    path: str | Path, *, text_field: str = "text", source: str | None = None
) -> list[Document]:
    """Read documents from a file or a directory.

    - `.txt` / `.txt.gz`: paragraphs (split at blank lines) grouped in order into documents of about
      `TXT_DOC_CHARS` characters.
    - `.jsonl` / `.jsonl.gz`: one JSON object per line, with a string under `text_field`, or
      `messages`, a list of `{"role": str, "content": str}` (a chat). Blank lines and empty texts
      are skipped; a bad line raises ValueError naming the file and line number.
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
    has_text, has_messages = text_field in record, "messages" in record
    if has_text == has_messages:
        raise ValueError(
            f'a record needs exactly one of "{text_field}" (plain text) or "messages" (a chat); '
            f"keys found: {sorted(record)}"
        )
    if has_messages:
        return Document(messages=_parse_messages(record["messages"]), source=src)
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f'"{text_field}" must be a string, got {type(text).__name__}')
    return Document(text=text, source=src) if text.strip() else None


def _parse_messages(messages: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
    out = []
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise ValueError(f'messages[{i}] must be an object with string "role" and "content"')
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)
