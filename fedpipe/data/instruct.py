"""An instruction set built from the bundled corpus: "which book is this verse from?".

Each example is a prompt/completion pair of chats (TRL's conversational format): the user asks
which book of the Bible a verse is from, the assistant answers with the book's name alone, so
exact match is a meaningful score. The books are those the corpus holds (ten); every book gives
the same number of examples (no book is the safe guess), drawn from its verses of moderate
length by a seeded shuffle; the held-out verses are drawn first and never appear in training.
A record's ``source`` is its book, so ``federated.partition = "by-source"`` deals books to
devices as it deals the plain corpus.

``python -m fedpipe.data.instruct OUT_DIR`` writes ``OUT_DIR/train.jsonl`` and
``OUT_DIR/test.jsonl`` (what ``examples/instruct/`` ships).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedpipe.data.documents import Document, default_corpus

__all__ = ["QUESTION", "verse_questions", "write_verse_questions"]

QUESTION = "Which book of the Bible is this verse from? Answer with the book's name only.\n\n"
MIN_CHARS, MAX_CHARS = 40, 160  # verses kept: long enough to tell, short enough to be cheap

Record = dict[str, Any]


def _verses(docs: Sequence[Document]) -> dict[str, list[str]]:
    """Each book's verses (one per line of its chapters), in corpus order, of moderate length."""
    books: dict[str, list[str]] = {}
    for doc in docs:
        for line in (doc.text or "").splitlines():
            verse = line.strip()
            if MIN_CHARS <= len(verse) <= MAX_CHARS:
                books.setdefault(doc.source, []).append(verse)
    return books


def _record(book: str, verse: str) -> Record:
    return {
        "prompt": [{"role": "user", "content": QUESTION + verse}],
        "completion": [{"role": "assistant", "content": book}],
        "source": book,
    }


def verse_questions(
    *,
    train_per_book: int = 40,
    test_per_book: int = 5,
    seed: int = 0,
    docs: Sequence[Document] | None = None,
) -> tuple[list[Record], list[Record]]:
    """(train, held-out) records: per book of ``docs`` (default: the bundled corpus)
    ``test_per_book`` held-out verses, then ``train_per_book`` others; interleaved by book."""
    if train_per_book < 1 or test_per_book < 0:
        raise ValueError(
            f"train_per_book must be >= 1 and test_per_book >= 0, got {train_per_book} and "
            f"{test_per_book}"
        )
    books = _verses(default_corpus() if docs is None else docs)
    need = train_per_book + test_per_book
    short = {book: len(v) for book, v in books.items() if len(v) < need}
    if short:
        raise ValueError(
            f"books with fewer than {need} verses of {MIN_CHARS}-{MAX_CHARS} chars: {short}"
        )
    train: list[Record] = []
    test: list[Record] = []
    for book in sorted(books):
        verses = list(dict.fromkeys(books[book]))  # a verse repeated in a book counts once
        random.Random(f"{seed}:{book}").shuffle(verses)
        test += [_record(book, v) for v in verses[:test_per_book]]
        train += [_record(book, v) for v in verses[test_per_book:need]]
    order = random.Random(seed)
    order.shuffle(train)
    order.shuffle(test)
    return train, test


def write_verse_questions(out: Path, **options: Any) -> tuple[Path, Path]:
    """``out/train.jsonl`` and ``out/test.jsonl`` of :func:`verse_questions`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = (out / "train.jsonl", out / "test.jsonl")
    for path, records in zip(paths, verse_questions(**options), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return paths


if __name__ == "__main__":  # pragma: no cover - a convenience for regenerating examples/data
    if len(sys.argv) != 2:
        sys.exit("usage: python -m fedpipe.data.instruct OUT_DIR")
    for written in write_verse_questions(Path(sys.argv[1])):
        print(written)
