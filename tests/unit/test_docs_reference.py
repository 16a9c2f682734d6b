"""The docs' generated reference: every setting, command, profile and layer, from the code."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import reference_docs  # noqa: E402

from fedpipe.cli.parser import build_parser  # noqa: E402
from fedpipe.config import FedpipeConfig  # noqa: E402
from fedpipe.config.profiles import device_profile_names, link_names  # noqa: E402


def test_every_setting_appears_with_its_default() -> None:
    page = reference_docs.settings_reference()
    rows = {
        line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| `")
    }
    flat = FedpipeConfig().to_flat()
    assert set(rows) == {f"`{key}`" for key in flat}
    for key, value in flat.items():
        assert f"| `{reference_docs._toml(value)}` |" in rows[f"`{key}`"], key


def test_every_setting_says_what_it_does() -> None:
    undocumented = [
        s.key for _, _, items in reference_docs.settings() for s in items if not s.doc.strip()
    ]
    assert undocumented == [], f"add a comment on the field or a NOTES entry for {undocumented}"


def test_notes_name_only_real_settings() -> None:
    stale = set(reference_docs.NOTES) - set(FedpipeConfig().to_flat())
    assert stale == set()


def test_field_comments_take_the_line_comment_else_the_block_above() -> None:
    @dataclasses.dataclass
    class Example:
        plain: int = 1
        inline: int = 2  # said on its line
        # said above,
        # on two lines
        above: int = 3
        both: int = 4  # the line wins

    comments = reference_docs.field_comments(Example)
    assert comments == {
        "inline": "said on its line",
        "above": "said above, on two lines",
        "both": "the line wins",
    }


def test_defaults_are_written_as_toml() -> None:
    assert reference_docs._toml(True) == "true"
    assert reference_docs._toml("greedy") == '"greedy"'
    assert reference_docs._toml(0.25) == "0.25"


def _leaves(parser: argparse.ArgumentParser, prefix: str) -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {prefix: parser}
    out: dict[str, argparse.ArgumentParser] = {}
    for name, child in subs[0].choices.items():
        out |= _leaves(child, f"{prefix} {name}")
    return out


def test_every_command_and_visible_option_appears() -> None:
    page = reference_docs.cli_reference()
    leaves = _leaves(build_parser(), "fedpipe")
    assert {"fedpipe simulate", "fedpipe server", "fedpipe client", "fedpipe run"} <= set(leaves)
    for path, parser in leaves.items():
        section = page.split(f"### `{path}`\n", 1)[1].split("\n### ", 1)[0]
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            positional = action.metavar or action.dest  # the page names it as usage does
            name = action.option_strings[-1] if action.option_strings else positional
            assert f"`{name}" in section, (path, name)


def test_hidden_spellings_stay_hidden() -> None:
    page = reference_docs.cli_reference()
    assert "--root-certificates" not in page
    assert "--superlink-port" not in page


def test_every_profile_and_link_appears() -> None:
    page = reference_docs.profiles_reference()
    for name in (*device_profile_names(), *link_names()):
        assert f"| `{name}` |" in page


def test_every_layer_package_appears_top_first(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        "[tool.importlinter]\nroot_packages = ['fedpipe']\n"
        "[[tool.importlinter.contracts]]\nname = 'Layers'\ntype = 'layers'\n"
        "layers = ['fedpipe.cli', 'fedpipe.server | fedpipe.edge', 'fedpipe.config']\n"
        "[[tool.importlinter.contracts]]\nname = 'No benchmarks'\ntype = 'forbidden'\n"
    )
    page = reference_docs.layers_reference(pyproject)
    rows = [line for line in page.splitlines() if line.startswith("| ") and "`fedpipe." in line]
    assert [r.split("|")[1:3] for r in rows] == [
        [" 1 ", " `fedpipe.cli` "],
        [" 2 ", " `fedpipe.server` "],
        [" 2 ", " `fedpipe.edge` "],
        [" 3 ", " `fedpipe.config` "],
    ]
    assert "The StageServer" in rows[1]  # the package's own docstring
    assert "| No benchmarks | `forbidden` |" in page


@pytest.mark.parametrize("what", ["settings", "cli", "profiles", "layers"])
def test_the_script_prints_each_part(what: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert reference_docs.main([what]) == 0
    assert capsys.readouterr().out.count("|") > 10
