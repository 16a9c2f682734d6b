"""The keys that cross Flower (fedpipe.config.flower_keys): every setting and run key through
the app project fedpipe writes and Flower's own parsers, node config from `fedpipe client`'s
flags, and a mistyped key refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import Context, RecordDict
from flwr.cli.config_utils import load_and_validate
from flwr.common.config import flatten_dict, parse_config_args

from fedpipe.cli.client import client_setup, node_config
from fedpipe.cli.parser import build_parser
from fedpipe.config import FedpipeConfig
from fedpipe.config.flower_keys import (
    NodeSettings,
    RunSettings,
    run_config_of,
    settings_from_run_config,
)
from fedpipe.fl.client_app import _device_profile_name
from fedpipe.fl.device_work import run_settings
from fedpipe.launch.engines import format_config_args
from fedpipe.launch.run import nest, write_app

# A setting of every section and of each kind changed from its default, list settings
# holding commas of their own (an inline profile spec, privacy specs, several cuts).
CHANGED = {
    "model.cuts": "1+1,2+1",
    "model.lora_targets": "q_proj,v_proj",
    "pipeline.microbatches": 2,
    "pipeline.delta": True,
    "pipeline.plan_codecs": "fp32,int8",
    "train.lr": 5e-4,
    "data.loss_on": "all",
    "server.max_message_mb": 32.5,
    "federated.profiles": "phone-lte,up=10,down=25,rtt=50ms,rpi-wifi",
    "federated.device_cuts": "2+1,1+1",
    "privacy.devices": "off; decorrelation=1,label_resample=0.1",
    "device.weights": "int4,fp32",
}
RUN = RunSettings(
    dir="/runs/r",
    resume=True,
    stage_address="10.0.0.2:50051",
    secret_file="/s/secret",
    run_id="r.abc",
    round_timeout_s=90.0,
)


def _flower_run_config(app: Path, overrides: dict[str, object]) -> dict[str, object]:
    """The run config Flower gives the apps: the written project's defaults, validated and
    flattened by Flower, then a `--run-config` text parsed by Flower's own parser."""
    project, _ = load_and_validate(app / "pyproject.toml")
    defaults = flatten_dict(project["tool"]["flwr"]["app"]["config"])
    return {**defaults, **parse_config_args([format_config_args(nest(overrides))])}


def test_every_setting_and_run_key_comes_back_from_flowers_run_config(tmp_path: Path) -> None:
    """Written into the app project and passed as `--run-config`, every setting and run key
    is read back equal, and the secret never crosses."""
    config = FedpipeConfig().with_overrides(CHANGED)
    app = write_app(tmp_path / "app", config)
    flat = _flower_run_config(app, RUN.to_run_config())
    assert set(flat) == set(run_config_of(config, RUN))
    assert settings_from_run_config(flat) == (config, RUN)
    secret = RunSettings(secret="s3cret")
    assert "s3cret" not in RunSettings.KEYS and "s3cret" not in secret.to_run_config().values()
    # the defaults alone: the written project is a whole run config
    assert settings_from_run_config(_flower_run_config(app, {})) == (config, RunSettings())


def test_a_list_setting_with_inline_commas_keeps_its_entries_through_flower(
    tmp_path: Path,
) -> None:
    """federated.profiles as a --run-config string: the device is named by the entry
    DeviceWork deals it, not by a piece of an inline spec."""
    app = write_app(tmp_path / "app", FedpipeConfig())
    flat = _flower_run_config(app, {"federated.profiles": CHANGED["federated.profiles"]})
    names = []
    for partition in range(3):
        context = Context(
            run_id=1,
            node_id=partition,
            node_config={"partition-id": partition, "num-partitions": 3},
            state=RecordDict(),
            run_config=flat,
        )
        names.append(_device_profile_name(context)[1])
    assert names == ["phone-lte", "up=10,down=25,rtt=50ms", "rpi-wifi"]


def test_run_settings_are_built_once_per_run_config() -> None:
    """What the ClientApp calls every round: the same run config gives the same (kept)
    objects; another one is read anew."""
    flat = run_config_of(FedpipeConfig().with_overrides(CHANGED), RUN)
    first = run_settings(flat)
    assert run_settings(dict(flat)) is first
    other = run_settings({**flat, "train.lr": 1e-4})
    assert other is not first and other[0].train.lr == 1e-4


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("run.stage_address", "h:1", "run key 'run.stage_address' unknown; did you mean "),
        ("run.round-timeout", "soon", "run key 'run.round-timeout' must be float"),
        ("run.resume", "maybe", "run key 'run.resume' must be true or false"),
    ],
)
def test_a_mistyped_run_key_is_refused_in_one_line(key: str, value: object, said: str) -> None:
    with pytest.raises(ValueError) as caught:
        settings_from_run_config({**run_config_of(FedpipeConfig()), key: value})
    text = str(caught.value)
    assert text.startswith(said) and "\n" not in text
    if "did you mean" in said:
        assert text.endswith("'run.stage-address'?")


def test_a_run_key_given_as_text_takes_its_type() -> None:
    """`flwr run --run-config 'run.resume="false"'` is false, not a non-empty string."""
    _, run = settings_from_run_config({"run.resume": "false", "run.round-timeout": "60"})
    assert run.resume is False and run.round_timeout_s == 60.0


def test_fedpipe_clients_node_config_comes_back_from_flowers_parser(tmp_path: Path) -> None:
    """`fedpipe client`'s flags, rendered for --node-config and parsed by Flower, are read
    back as the node settings the flags name (files as absolute paths)."""
    (tmp_path / "ca.pem").write_text("x")
    args = build_parser().parse_args(
        [
            "client",
            "--partition-id",
            "2",
            "--num-partitions",
            "5",
            "--profile",
            "up=10,down=25,rtt=50ms",
            "--cut",
            "2+1",
            "--privacy",
            "decorrelation=1",
            "--weights",
            "int8",
            "--stage-server",
            "10.0.0.2:50051",
            "--stage-ca",
            str(tmp_path / "ca.pem"),
        ]
    )
    parsed = parse_config_args([format_config_args(node_config(client_setup(args)))])
    assert NodeSettings.from_node_config(parsed) == NodeSettings(
        partition_id=2,
        num_partitions=5,
        profile="up=10,down=25,rtt=50ms",
        cut="2+1",
        privacy="decorrelation=1",
        weights="int8",
        stage_address="10.0.0.2:50051",
        stage_ca=str((tmp_path / "ca.pem").resolve()),
    )


def test_simulated_nodes_config_is_read_and_strings_take_their_type() -> None:
    """Flower's simulation gives partition-id and num-partitions (its legacy path as text)."""
    node = NodeSettings.from_node_config({"partition-id": "3", "num-partitions": 4})
    assert node == NodeSettings(partition_id=3, num_partitions=4)
    assert NodeSettings(partition_id=1).to_node_config() == {
        "partition-id": 1,
        "num-partitions": 0,
    }


@pytest.mark.parametrize(
    ("node", "said"),
    [
        ({"stage-adress": "h:1"}, "node config key 'stage-adress' unknown; did you mean "),
        ({"partition-id": "two"}, "node config key 'partition-id' must be int"),
    ],
)
def test_a_mistyped_node_config_key_is_refused_in_one_line(
    node: dict[str, object], said: str
) -> None:
    with pytest.raises(ValueError) as caught:
        NodeSettings.from_node_config(node)
    text = str(caught.value)
    assert text.startswith(said) and "\n" not in text
