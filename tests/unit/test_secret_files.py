"""The master secret on disk: owner-only from the first byte, and loud when others can read it."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from fedpipe.auth.secret_files import create_secret_file, read_secret_file, warn_if_readable
from fedpipe.cli.main import EXIT_SETTINGS, main


def test_a_secret_file_is_created_owner_only_and_never_over_another(tmp_path: Path) -> None:
    old = os.umask(0)  # even with a permissive umask
    try:
        path = create_secret_file(tmp_path / "keys" / "secret")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(read_secret_file(path)) >= 32
    with pytest.raises(FileExistsError):
        create_secret_file(path)


def test_a_secret_or_key_others_can_read_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = create_secret_file(tmp_path / "secret")
    assert not warn_if_readable(path, "secret file")
    path.chmod(0o640)
    with caplog.at_level(logging.WARNING, logger="fedpipe.auth.secret_files"):
        read_secret_file(path)
    assert f"chmod 600 {path}" in caplog.text and "mode 640" in caplog.text


def test_an_empty_secret_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty; delete it"):
        read_secret_file(path)


def test_a_reachable_stage_server_without_a_secret_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc = main(["server", "--stage-server", "0.0.0.0:0", "--model", "tiny-llama"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_SETTINGS and len(err) == 1, err
    assert "needs a secret" in err[0] and "server.allow_unauthenticated=true" in err[0]


def test_one_rule_says_who_may_serve_without_a_secret() -> None:
    """ServerConfig.secret_refusal is what `fedpipe server`'s check and the StageServer's
    construction both refuse by: loopback alone, a secret, or the explicit opt-out."""
    from fedpipe.cli.preflight import SettingsError, check_secret_needed
    from fedpipe.config import FedpipeConfig, ServerConfig

    server = ServerConfig()
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"):
        assert server.secret_refusal(host, None) == "", host
    for host in ("0.0.0.0", "10.0.0.5", "::", "server.example"):
        assert "needs a secret" in server.secret_refusal(host, None), host
        assert server.secret_refusal(host, "s" * 32) == ""
        assert ServerConfig(allow_unauthenticated=True).secret_refusal(host, None) == ""
    with pytest.raises(SettingsError) as refused:
        check_secret_needed(FedpipeConfig(), "0.0.0.0", None)
    assert str(refused.value) == "--stage-server 0.0.0.0: " + server.secret_refusal("0.0.0.0", "")
