"""`fedpipe server` prints a line as each round begins and is committed, without -v."""

from __future__ import annotations

import logging

import pytest

from fedpipe.cli.server import _print_round_lines


def test_server_prints_its_round_lines_and_warnings_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server_log = logging.getLogger("fedpipe.server.stage_server")
    root_level, handlers = logging.getLogger().level, list(server_log.handlers)
    logging.getLogger().setLevel(logging.WARNING)  # as `fedpipe server` without -v
    try:
        _print_round_lines()
        server_log.info("round 3 of run 'prod' begun")
        server_log.info("StageServer listening on 127.0.0.1:1 (tls)")  # not a round line
        server_log.info("round 3 committed: 2 merged, 1 discarded, dropped none")
        server_log.warning("the stage link on 127.0.0.1:1 is plaintext")
    finally:
        server_log.handlers[:] = handlers
        server_log.setLevel(logging.NOTSET)
        server_log.propagate = True
        logging.getLogger().setLevel(root_level)
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == [
        "fedpipe: round 3 of run 'prod' begun",
        "fedpipe: round 3 committed: 2 merged, 1 discarded, dropped none",
    ]
    assert len(lines) == 3 and lines[2].endswith("the stage link on 127.0.0.1:1 is plaintext")
