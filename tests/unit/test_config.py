"""Settings: defaults, TOML, overrides and the errors that tell a user what to fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fedpipe.config import (
    FedpipeConfig,
    ModelConfig,
    PipelineConfig,
    TrainConfig,
    load_config,
    parse_overrides,
)
from fedpipe.edge.schedules import SCHEDULES

TOML = """
[model]
name = "tiny-gpt2"
head_layers = 2

[pipeline]
microbatches = 2
schedule = "1f1b"

[train]
batch_size = 4
lr = 1e-3

[server]
max_message_mb = 8
"""


def test_defaults_are_valid_and_documented() -> None:
    config = FedpipeConfig()
    assert config == load_config()
    assert config.pipeline.microbatches <= config.train.batch_size
    assert config.pipeline.schedule in SCHEDULES
    assert config.server.max_message_bytes == 64 * 1024 * 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train.lr = 1.0  # type: ignore[misc]


def test_load_config_reads_toml_tables(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    config = load_config(path)
    assert config.model.name == "tiny-gpt2"
    assert config.model.head_layers == 2
    assert config.pipeline == PipelineConfig(microbatches=2, schedule="1f1b")
    assert config.train.batch_size == 4 and config.train.lr == 1e-3
    # An integer in TOML for a float setting becomes a float.
    assert config.server.max_message_mb == 8.0 and isinstance(config.server.max_message_mb, float)
    assert config.federated == FedpipeConfig().federated  # untouched sections keep defaults


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    flags = parse_overrides(
        ["pipeline.microbatches=4", 'model.name="tiny-llama"', "train.lr = 0.5"]
    )
    assert flags == {"pipeline.microbatches": "4", "model.name": "tiny-llama", "train.lr": "0.5"}
    config = load_config(path, flags)
    assert config.pipeline.microbatches == 4
    assert config.pipeline.schedule == "1f1b"  # from the file, not overridden
    assert config.model.name == "tiny-llama"
    assert config.train.lr == 0.5


def test_strings_are_coerced_to_the_setting_type() -> None:
    config = FedpipeConfig().with_overrides(
        {
            "train.batch_size": " 16 ",
            "train.lr": "3e-4",
            "server.max_message_mb": "0.5",
            "model.name": "tiny-gpt2",
            "train.seq_len": 32.0,  # a whole float for an int setting
        }
    )
    assert config.train.batch_size == 16 and isinstance(config.train.batch_size, int)
    assert config.train.lr == 3e-4
    assert config.server.max_message_mb == 0.5
    assert config.server.max_message_bytes == 512 * 1024
    assert config.model.name == "tiny-gpt2"
    assert config.train.seq_len == 32 and isinstance(config.train.seq_len, int)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("train.batch_size", "eight", "train.batch_size must be int, got 'eight'"),
        ("train.batch_size", "8.5", "train.batch_size must be int, got '8.5'"),
        ("train.batch_size", 8.5, "train.batch_size must be int, got 8.5"),
        ("train.lr", "fast", "train.lr must be float, got 'fast'"),
        ("model.name", 3, "model.name must be str, got 3"),
    ],
)
def test_wrongly_typed_values_are_refused(key: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FedpipeConfig().with_overrides({key: value})


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("pipeline.microbatch", "did you mean 'pipeline.microbatches'?"),
        ("pipelines.microbatches", "did you mean 'pipeline.microbatches'?"),
        ("train.l", "did you mean 'train.lr'?"),
        ("train.zzz", "known here: train.batch_size, train.seq_len, "),
        ("lr", "known here: data, device, federated, model, pipeline, privacy, server, train"),
    ],
)
def test_unknown_key_names_the_close_match_or_the_choices(key: str, hint: str) -> None:
    with pytest.raises(ValueError, match=f"unknown setting {key!r}; ") as info:
        FedpipeConfig().with_overrides({key: "1"})
    assert hint in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_table_in_toml_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[trian]\nlr = 0.1\n")
    with pytest.raises(ValueError, match="unknown setting 'trian.lr'; did you mean 'train.lr'"):
        load_config(path)
    path.write_text("lr = 0.1\n")
    with pytest.raises(ValueError, match="top-level key 'lr' must be a \\[table\\]"):
        load_config(path)


@pytest.mark.parametrize(
    ("flat", "message"),
    [
        (
            {"pipeline.microbatches": 16, "train.batch_size": 8},
            r"pipeline.microbatches \(16\) must not exceed train.batch_size \(8\)",
        ),
        ({"pipeline.schedule": "zigzag"}, "pipeline.schedule 'zigzag' unknown; choose one of "),
        ({"model.split": "two"}, "model.split='two' needs model.tail_layers=0"),
        ({"model.split": "y"}, "model.split must be 'u' or 'two', got 'y'"),
        ({"model.head_layers": 0}, "model.head_layers must be >= 1, got 0"),
        ({"pipeline.microbatches": 0}, "pipeline.microbatches must be >= 1, got 0"),
        ({"pipeline.uplink_codec": "fp8"}, "pipeline.uplink_codec 'fp8' unknown"),
        ({"train.lr": 0}, "train.lr must be > 0, got 0"),
        ({"server.device": "tpu"}, "server.device must be auto, cpu or cuda, got 'tpu'"),
        ({"server.max_message_mb": "0"}, "server.max_message_mb must be >= 0.5"),
        ({"federated.partition": "random"}, "federated.partition must be iid, by-source or"),
    ],
)
def test_invalid_values_say_what_to_fix(flat: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FedpipeConfig().with_overrides(flat)


def test_schedule_error_lists_every_schedule() -> None:
    with pytest.raises(ValueError) as info:
        PipelineConfig(schedule="zigzag")
    for name in SCHEDULES:
        assert name in str(info.value)


def test_two_part_split_with_no_tail_is_valid() -> None:
    config = FedpipeConfig().with_overrides({"model.split": "two", "model.tail_layers": 0})
    assert config.model == ModelConfig(split="two", tail_layers=0)


def test_to_flat_round_trips_through_with_overrides() -> None:
    config = FedpipeConfig(
        model=ModelConfig(name="tiny-gpt2", split="two", tail_layers=0, lora_targets="c_attn"),
        pipeline=PipelineConfig(microbatches=3, schedule="gpipe", uplink_codec="int8"),
        train=TrainConfig(batch_size=6, lr=5e-4),
    )
    flat = config.to_flat()
    assert flat["pipeline.microbatches"] == 3 and flat["model.split"] == "two"
    assert FedpipeConfig().with_overrides(flat) == config
    # Flower's run config carries strings: the same round trip through str() holds.
    assert FedpipeConfig().with_overrides({k: str(v) for k, v in flat.items()}) == config


def test_parse_overrides_needs_an_equals_sign() -> None:
    with pytest.raises(ValueError, match="--set expects section.key=value, got 'train.lr'"):
        parse_overrides(["train.lr"])


def test_recompute_and_activation_clipping_are_refused_together() -> None:
    with pytest.raises(ValueError, match="recompute_head.*activation_clip"):
        FedpipeConfig().with_overrides(
            {"pipeline.recompute_head": True, "privacy.activation_clip": 1.0}
        )
