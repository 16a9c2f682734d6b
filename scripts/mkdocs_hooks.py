"""MkDocs hook (mkdocs.yml ``hooks:``): fill the docs' generated parts at build time.

On every page, a line that is exactly one of these markers is replaced:

- ``<!-- fedpipe:settings -->``: every setting with its default (``reference_docs.py``);
- ``<!-- fedpipe:cli -->``: every command and option (``reference_docs.py``);
- ``<!-- fedpipe:profiles -->``: the named device profiles and links (``reference_docs.py``);
- ``<!-- fedpipe:layers -->``: the layers and contracts import-linter enforces
  (``reference_docs.py``);
- ``<!-- fedpipe:bench NAME -->``: the tables of ``docs/benchmarks/data/NAME.json`` with their
  source, or how to record them (``render_bench_docs.py``);
- ``<!-- fedpipe:plot NAME -->``: the plot drawn from that record at build time (an inline SVG;
  ``render_bench_docs.PLOTS`` names the benches that have one).

Any other ``<!-- fedpipe:... -->`` marker fails the build, so a typo cannot hide a table.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts below

import reference_docs  # noqa: E402
import render_bench_docs  # noqa: E402

_ANY_MARKER = re.compile(r"^<!-- fedpipe:(?P<what>\S+)(?: (?P<arg>\S+))? -->$", re.MULTILINE)


def expand_page(markdown: str, data_dir: Path, page_dir: Path) -> str:
    """``markdown`` with every marker replaced; ``page_dir`` is the page's folder in docs/."""
    link = Path(*[".."] * len(page_dir.parts), *data_dir.parts[-2:]).as_posix() + "/"

    def one(match: re.Match[str]) -> str:
        what, arg = match.group("what"), match.group("arg")
        if what == "settings" and arg is None:
            return reference_docs.settings_reference()
        if what == "cli" and arg is None:
            return reference_docs.cli_reference()
        if what == "profiles" and arg is None:
            return reference_docs.profiles_reference()
        if what == "layers" and arg is None:
            return reference_docs.layers_reference()
        if what == "bench" and arg is not None:
            return render_bench_docs.render(arg, data_dir, link)
        if what == "plot" and arg is not None:
            return render_bench_docs.render_plot(arg, data_dir, link)
        raise PluginError(f"unknown docs marker {match.group(0)!r}")

    try:
        return _ANY_MARKER.sub(one, markdown)
    except ValueError as exc:
        raise PluginError(str(exc)) from exc


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: the page's Markdown, before it is rendered."""
    docs_dir = Path(config["docs_dir"])
    data_dir = docs_dir / "benchmarks" / "data"
    page_dir = Path(page.file.src_uri).parent
    return expand_page(markdown, data_dir, page_dir)
