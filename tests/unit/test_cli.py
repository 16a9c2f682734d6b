"""The command line: help without torch, defaults shown, old spellings, one-line errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from harness.cli import error_line as _error_line

from fedpipe import __version__
from fedpipe.cli.main import EXIT_SETTINGS, _interrupted, describe_error, main
from fedpipe.cli.parser import build_parser
from fedpipe.launch.processes import ProcessStartError


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedpipe {__version__}"


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += [sub, *_subparsers(sub)]
    return found


def test_every_option_has_help_that_states_its_default() -> None:
    for parser in _subparsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(
                action, argparse._HelpAction | argparse._SubParsersAction
            ):
                continue
            text = formatter._get_help_string(action)  # type: ignore[attr-defined]
            assert action.help, f"{parser.prog} {action.option_strings}: no help"
            if action.option_strings:
                assert "default" in text, f"{parser.prog} {action.option_strings}: {text}"


def test_flags_mean_the_same_in_every_command() -> None:
    """--superlink and --stage-server take HOST:PORT everywhere; --tls-ca is one CA flag."""
    for argv in (["client"], ["run"], ["register-node", "k.pub"]):
        args = build_parser().parse_args([*argv, "--superlink", "10.0.0.1:9000"])
        assert args.superlink == "10.0.0.1:9000"
        assert build_parser().parse_args([*argv, "--tls-ca", "ca.pem"]).tls_ca == "ca.pem"
    server = build_parser().parse_args(["server", "--superlink", "0.0.0.0:9000"])
    assert server.superlink == "0.0.0.0:9000"
    assert build_parser().parse_args(["server", "--superlink"]).superlink == "127.0.0.1:8000"
    assert build_parser().parse_args(["server"]).superlink is None


@pytest.mark.parametrize(
    ("argv", "dest", "value", "use"),
    [
        (["client", "--port", "9100"], "supernode_port", 9100, "--supernode-port"),
        (["client", "--stage-ca", "ca.pem"], "stage_ca", "ca.pem", "--tls-ca"),
        (["client", "--root-certificates", "ca.pem"], "root_certificates", "ca.pem", "--tls-ca"),
        (["run", "--root-certificates", "ca.pem"], "root_certificates", "ca.pem", "--tls-ca"),
        (["server", "--port", "0"], "legacy_port", 0, "--stage-server"),
        (["server", "--superlink-port", "0"], "legacy_superlink_port", "0", "--superlink"),
        (["server", "--tls", "a", "b", "c"], "legacy_tls", ["a", "b", "c"], "--tls-ca"),
        (["server", "--superlink-dir", "d"], "workdir", Path("d"), "--workdir"),
    ],
)
def test_old_spellings_still_work_with_a_notice(
    capsys: pytest.CaptureFixture[str], argv: list[str], dest: str, value: object, use: str
) -> None:
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    notice = capsys.readouterr().err.strip()
    assert notice.startswith(f"fedpipe: note: {argv[1]} is deprecated; use {use}")
    assert argv[1] not in build_parser().format_help()


def test_old_server_flags_compose_the_new_addresses() -> None:
    from fedpipe.cli.server import _server_setup
    from fedpipe.config import FedpipeConfig

    args = build_parser().parse_args(
        ["server", "--port", "0", "--superlink", "--superlink-port", "8123"]
    )
    plan = _server_setup(args, FedpipeConfig())
    assert (plan.stage_host, plan.stage_port, plan.superlink) == ("127.0.0.1", 0, "127.0.0.1:8123")


# -- one-line errors, exit status 2, nothing started ------------------------------------------
def test_unknown_setting_names_the_close_match(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error_line(capsys, ["simulate", "--set", "pipeline.microbatch=2"])
    assert "did you mean 'pipeline.microbatches'" in line


def test_bad_setting_value_and_missing_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert "train.lr must be float" in _error_line(capsys, ["run", "--set", "train.lr=fast"])
    line = _error_line(capsys, ["simulate", "--config", str(tmp_path / "no.toml")])
    assert "does not exist" in line
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nname=1")
    assert "not valid TOML" in _error_line(capsys, ["simulate", "--config", str(bad)])


def test_resume_needs_the_run_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--resume needs --name NAME" in _error_line(capsys, ["simulate", "--resume"])


@pytest.mark.parametrize("command", ["simulate", "run"])
@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan"])
def test_a_timeout_that_is_not_a_positive_time_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, value: str
) -> None:
    """Refused before a run folder is made (a zero timeout used to start a run and stop it)."""
    argv = [command, "--timeout", value, "--runs-dir", str(tmp_path), "--name", "t"]
    line = _error_line(capsys, argv)
    assert line == f"fedpipe: error: --timeout must be a number of seconds > 0, got {value}"
    assert not (tmp_path / "t").exists()


def test_unknown_profile_and_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error_line(capsys, ["simulate", "--profiles", "phone-lte,rpi-wify"])
    assert "'rpi-wify'" in line and "did you mean 'rpi-wifi'" in line
    line = _error_line(capsys, ["simulate", "--strategy", "fedavgg"])
    assert "did you mean 'fedavg'" in line


def test_missing_empty_and_single_source_data(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert "does not exist" in _error_line(capsys, ["simulate", "--data", str(tmp_path / "x")])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert "holds no text" in _error_line(capsys, ["simulate", "--data", str(empty)])
    single = tmp_path / "one.txt"
    single.write_text("\n\n".join(f"paragraph {i} " * 200 for i in range(40)))
    line = _error_line(capsys, ["simulate", "--data", str(single), "--devices", "2"])
    assert "1 source(s)" in line and "federated.partition=iid" in line


def test_a_record_in_no_known_format_names_file_line_and_formats(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    data = tmp_path / "chats.jsonl"
    good = (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    )
    data.write_text(f'{good}\n{good}\n{{"question": "hi", "answer": "yo"}}\n')
    line = _error_line(capsys, ["simulate", "--data", str(data)])
    assert f"{data}:3: " in line
    assert '"messages"' in line and '"prompt" and "completion"' in line
    assert "keys found: ['answer', 'question']" in line


def test_more_devices_than_the_bundled_corpus_has_books(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = _error_line(capsys, ["simulate", "--devices", "12"])
    assert "10 source(s) (files, books" in line and "--devices 10 or fewer" in line


def test_split_that_leaves_the_server_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--set", "model.head_layers=2", "--set", "model.tail_layers=2"]
    line = _error_line(capsys, argv)
    assert "tiny-llama's 4" in line and "sum <= 3" in line
    line = _error_line(capsys, ["simulate", "--set", "train.seq_len=4096"])
    assert "512 positions" in line


def test_bench_pipeline_picks_a_split_that_fits_the_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """tiny-llama has 4 blocks: the bench's 2 + 2 default becomes 1 + 1, so the only error
    left is the deliberately unknown schedule (checked after the model and split); given
    2 + 2 explicitly, the split is what is refused."""
    from fedpipe.cli.preflight import default_split

    assert [default_split(n) for n in (2, 3, 4, 5, 30)] == [1, 1, 1, 2, 2]
    argv = ["bench", "pipeline", "--model", "tiny-llama", "--schedules", "x"]
    line = _error_line(capsys, [*argv, "--links", "1gbit-5ms,up=10,down=25,rtt=50ms"])
    assert "--schedules" in line and "'x'" in line and "sum <= 3" not in line
    fixed = ["--set", "model.head_layers=2", "--set", "model.tail_layers=2"]
    line = _error_line(capsys, [*argv, *fixed])
    assert "tiny-llama's 4" in line and "sum <= 3" in line


def test_cuda_asked_for_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is fine here")
    line = _error_line(capsys, ["server", "--device", "cuda", "--stage-server", "127.0.0.1:0"])
    assert "torch sees no CUDA GPU" in line


def test_client_settings(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "did you mean 'phone-lte'" in _error_line(capsys, ["client", "--profile", "phon-lte"])
    line = _error_line(capsys, ["client", "--partition-id", "2", "--num-partitions", "2"])
    assert "outside 0..1" in line
    line = _error_line(capsys, ["client", "--auth-key", str(tmp_path / "key")])
    assert "--auth-key" in line


def test_errors_of_running_commands_are_one_line() -> None:
    text = (
        "supernode :9094 (pid 7) exited with 1; log x.log:\nINFO ...\nFailed to activate SuperNode."
    )
    line, code = describe_error(ProcessStartError(text, "supernode refused"))
    assert (line, code) == ("supernode refused", 1)
    line, code = describe_error(RuntimeError("boom\nline 2"))
    assert code == 1 and "\n" not in line and "-v" in line
    assert describe_error(ValueError("bad value"))[1] == EXIT_SETTINGS


def test_interrupted_run_says_where_and_how_to_resume(tmp_path: Path) -> None:
    args = build_parser().parse_args(["simulate", "--runs-dir", str(tmp_path), "--rounds", "5"])
    args.name = "r1"
    argv = ["simulate", "--runs-dir", str(tmp_path), "--rounds", "5"]
    assert "start again with: fedpipe simulate" in _interrupted(args, argv)
    (tmp_path / "r1" / "checkpoints" / "round-0002").mkdir(parents=True)
    line = _interrupted(args, argv)
    assert "after round 2" in line
    assert line.endswith(f"fedpipe simulate --runs-dir {tmp_path} --rounds 5 --name r1 --resume")


def test_the_settings_a_command_line_gives_come_from_one_read_of_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fedpipe simulate`/`run`: the config and the keys a --resume keeps (flags, --set, the
    --config file's) come from one read of the TOML file."""
    import tomllib

    from fedpipe.cli.main import given_from_args
    from fedpipe.config import loading

    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nlr = 0.001\n[pipeline]\nplan_codecs = ["fp32", "int8"]\n')
    reads = []
    load = tomllib.load
    monkeypatch.setattr(loading.tomllib, "load", lambda fh: reads.append(1) or load(fh))
    args = build_parser().parse_args(
        ["simulate", "--config", str(toml), "--set", "pipeline.microbatches=2", "--rounds", "5"]
    )
    flags = {"federated.rounds": args.rounds, "federated.num_devices": args.devices}
    config, given = given_from_args(args, **flags)
    assert reads == [1]
    assert given == {
        "train.lr",
        "pipeline.plan_codecs",
        "pipeline.microbatches",
        "federated.rounds",
    }
    assert config.train.lr == 0.001 and config.pipeline.plan_codecs == ("fp32", "int8")
    assert config.pipeline.microbatches == 2 and config.federated.rounds == 5
