"""The command line in-process: a command that must fail with exactly one line."""

from __future__ import annotations

import pytest

from fedpipe.cli.main import EXIT_SETTINGS, main

__all__ = ["error_line"]


def error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``fedpipe argv`` in-process; it must exit 2 with exactly one line on stderr."""
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_SETTINGS, err
    assert len(err) == 1, err
    assert err[0].startswith("fedpipe: error: ")
    return err[0]
