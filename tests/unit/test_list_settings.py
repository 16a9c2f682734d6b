"""List settings (model.cuts, model.lora_targets, pipeline.plan_codecs, federated.device_cuts,
federated.profiles, privacy.devices, device.weights): a
comma string or a TOML array, parsed once into a tuple when the config is built, and written
back by ``to_flat`` as a string that Flower carries and the ClientApp reads to the same entries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, RecordDict
from flwr.cli.config_utils import load_and_validate
from flwr.common.config import flatten_dict, parse_config_args

from fedpipe.config import FedpipeConfig, load_config, parse_overrides
from fedpipe.config.flower_keys import run_config_of, settings_from_run_config
from fedpipe.fl.client_app import _device_profile_name
from fedpipe.fl.device_work import partition_profile
from fedpipe.launch.engines import format_config_args
from fedpipe.launch.run import nest, write_app
from fedpipe.runs.resume import resume_settings

INLINE = "phone-lte,up=10,down=25,rtt=50ms,rpi-wifi"  # three devices: the middle one inline

STRINGS = """
[model]
head_layers = 1
tail_layers = 1
cuts = "2+1, 1+2"
lora_targets = "q_proj, v_proj"
[pipeline]
plan_codecs = "fp32,int8"
[federated]
profiles = "phone-lte,up=10,down=25,rtt=50ms,rpi-wifi"
device_cuts = "2+1,1+1"
[privacy]
devices = "off; ; decorrelation=1,label_resample=0.1"
[device]
weights = "int8, fp32"
"""
LISTS = """
[model]
head_layers = 1
tail_layers = 1
cuts = ["2+1", "1+2"]
lora_targets = ["q_proj", "v_proj"]
[pipeline]
plan_codecs = ["fp32", "int8"]
[federated]
profiles = ["phone-lte", "up=10,down=25,rtt=50ms", "rpi-wifi"]
device_cuts = ["2+1", "1+1"]
[privacy]
devices = ["off", "", "decorrelation=1,label_resample=0.1"]
[device]
weights = ["int8", "fp32"]
"""


def _load(tmp_path: Path, text: str, name: str) -> FedpipeConfig:
    path = tmp_path / name
    path.write_text(text)
    return load_config(path)


def test_toml_strings_and_toml_arrays_load_to_the_same_tuples(tmp_path: Path) -> None:
    strings = _load(tmp_path, STRINGS, "strings.toml")
    lists = _load(tmp_path, LISTS, "lists.toml")
    assert strings == lists
    assert lists.model.cuts == ((2, 1), (1, 2))
    assert lists.model.offered_cuts == ((1, 1), (2, 1), (1, 2))
    assert lists.federated.device_cuts == ((2, 1), (1, 1))
    assert lists.federated.profiles == ("phone-lte", "up=10,down=25,rtt=50ms", "rpi-wifi")
    assert lists.device.weights == ("int8", "fp32")
    assert lists.model.lora_targets == ("q_proj", "v_proj")
    assert lists.pipeline.plan_codecs == ("fp32", "int8")
    assert lists.pipeline.codec_choices == ("fp32", "int8")
    assert lists.privacy.devices == ("off", "", "decorrelation=1,label_resample=0.1")
    assert lists.device_privacy(1) == {} and lists.device_privacy(2)["decorrelation"] == 1.0
    assert [lists.device_weights(p) for p in (-1, 0, 1, 2)] == ["fp32", "int8", "fp32", "int8"]
    assert [lists.device_cut(p) for p in (0, 1, 2)] == [(2, 1), (1, 1), (2, 1)]


@pytest.mark.parametrize("given", [INLINE, ["phone-lte", "up=10,down=25,rtt=50ms", "rpi-wifi"]])
def test_device_1_of_an_inline_spec_list_runs_the_inline_spec(given: object) -> None:
    cfg = FedpipeConfig().with_overrides({"federated.profiles": given})
    assert [partition_profile(cfg.federated.profiles, p) for p in range(4)] == [
        "phone-lte",
        "up=10,down=25,rtt=50ms",
        "rpi-wifi",
        "phone-lte",
    ]
    context = Context(  # what the ClientApp names device 1 by, from Flower's run config
        run_id=1,
        node_id=1,
        node_config={"partition-id": 1},
        state=RecordDict(),
        run_config=cfg.to_flat(),
    )
    assert _device_profile_name(context) == (1, "up=10,down=25,rtt=50ms")


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("model.cuts", ["2+1", "x"], "model.cuts: 'x' is not a cut"),
        ("model.cuts", ["0+1"], "model.cuts: cut '0+1' needs head >= 1"),
        ("federated.device_cuts", ["1+1", ""], "federated.device_cuts: '' is not a cut"),
        ("federated.profiles", ["phone-lte", "rpi-wfi"], "federated.profiles: unknown device"),
        ("federated.profiles", ["phone-lte,rpi-wifi"], "federated.profiles: entry 'phone-lte,"),
        ("federated.profiles", ["phone-lte", 3], "federated.profiles must be a list of strings"),
        ("device.weights", ["int8", "int3"], "device.weights 'int3' unknown"),
        ("device.weights", 8, "device.weights must be a list of strings"),
        ("model.lora_targets", ["q_proj", ""], "model.lora_targets: entry '' is not one module"),
        ("model.lora_targets", ["q_proj,v_proj"], "model.lora_targets: entry 'q_proj,v_proj'"),
        ("pipeline.plan_codecs", ["int8", "fp8"], "pipeline.plan_codecs 'int8,fp8': unknown"),
        ("pipeline.plan_codecs", "int8, fp8", "pipeline.plan_codecs 'int8, fp8': unknown"),
        ("privacy.devices", ["off; off"], "privacy.devices: entry 'off; off' is not one"),
        ("privacy.devices", ["noise=1"], "privacy.devices: unknown key 'noise'"),
        ("privacy.devices", "off; noise=1", "privacy.devices: unknown key 'noise'"),
    ],
)
def test_a_bad_entry_is_refused_in_one_line_naming_the_key(
    key: str, value: object, words: str
) -> None:
    with pytest.raises(ValueError) as info:
        FedpipeConfig().with_overrides({key: value})
    text = str(info.value)
    assert "\n" not in text and text.startswith(key) and words in text


def test_set_flags_keep_taking_comma_strings() -> None:
    flags = parse_overrides(
        [
            f"federated.profiles={INLINE}",
            "model.cuts=2+1,1+2",
            "pipeline.plan_codecs=fp32,int8",
            "model.lora_targets=q_proj,v_proj",
            "privacy.devices=off; decorrelation=1",
        ]
    )
    cfg = load_config(None, {**flags, "federated.device_cuts": "1+2"})
    assert cfg.pipeline.plan_codecs == ("fp32", "int8")
    assert cfg.model.lora_targets == ("q_proj", "v_proj")
    assert cfg.privacy.devices == ("off", "decorrelation=1")
    assert cfg.federated.profiles == ("phone-lte", "up=10,down=25,rtt=50ms", "rpi-wifi")
    assert cfg.model.cuts == ((2, 1), (1, 2)) and cfg.federated.device_cuts == ((1, 2),)


# Two inline specs in a row: the first two lists' commas alone split back the same, the third's
# would regroup (bw=10,rtt=5ms | bw=20), so to_flat writes that one with "; ".
ROUND_TRIPS = [
    {"federated.profiles": ["phone-lte", "up=10,down=25,rtt=50ms", "rpi-wifi"]},
    {"federated.profiles": ["up=10,down=25", "up=5,down=5,rtt=10ms", "loopback"]},
    {"federated.profiles": ["bw=10", "rtt=5ms,bw=20"]},
    {"federated.profiles": []},
    {
        "model.cuts": ["2+1", "1+2", "3"],
        "federated.device_cuts": ["3+0", "2+1"],
        "device.weights": ["int4", "fp32", "bf16"],
    },
    {
        "model.lora_targets": ["q_proj", "v_proj"],
        "pipeline.plan_codecs": ["int8", "bf16"],
        "privacy.devices": ["off", "", "decorrelation=1,label_resample=0.1", ""],
    },
    {"privacy.devices": [""], "pipeline.plan_codecs": [], "model.lora_targets": []},
]


@pytest.mark.parametrize("overrides", ROUND_TRIPS)
def test_list_settings_come_back_equal_through_flowers_run_config(
    tmp_path: Path, overrides: dict[str, object]
) -> None:
    """config -> to_flat -> the app project and `--run-config` as Flower parses them -> the
    ClientApp's rebuild: the same config, entry for entry."""
    config = FedpipeConfig().with_overrides(overrides)
    flat = run_config_of(config)
    assert all(isinstance(v, (bool, int, float, str)) for v in flat.values())
    app = write_app(tmp_path / "app", config)
    project, _ = load_and_validate(app / "pyproject.toml")
    defaults = flatten_dict(project["tool"]["flwr"]["app"]["config"])
    assert settings_from_run_config(defaults)[0] == config  # the written project alone
    given = {k: flat[k] for k in overrides}
    run_config = {**flatten_dict(project["tool"]["flwr"]["app"]["config"])}
    run_config.update(parse_config_args([format_config_args(nest(given))]))
    assert settings_from_run_config(run_config)[0] == config  # and as `--run-config`
    assert FedpipeConfig().with_overrides(config.to_flat()) == config


def test_messages_and_to_flat_print_a_list_as_it_is_written() -> None:
    cfg = FedpipeConfig().with_overrides(
        {"model.cuts": ["2+1", "1+1"], "federated.profiles": ["phone-lte", "rpi-wifi"]}
    )
    flat = cfg.to_flat()
    assert flat["model.cuts"] == "2+1,1+1" and flat["federated.profiles"] == "phone-lte,rpi-wifi"
    assert flat["device.weights"] == "fp32" and flat["federated.device_cuts"] == ""
    assert flat["pipeline.plan_codecs"] == "fp32" and flat["model.lora_targets"] == ""
    assert flat["privacy.devices"] == ""
    with pytest.raises(ValueError, match="^model.cuts '2\\+1,1\\+1' lets devices hold"):
        cfg.with_overrides({"privacy.adapter_dp": "server"})


def test_a_resume_takes_a_list_saved_with_spaces_as_unchanged() -> None:
    cfg = FedpipeConfig().with_overrides({"model.cuts": "2+1,1+2"})
    saved = {**cfg.to_flat(), "model.cuts": "2+1, 1+2"}  # as an earlier version saved it
    resolved, changes = resume_settings(saved, cfg, explicit=set())
    assert resolved == cfg and changes == []


def test_the_client_app_names_a_device_from_the_typed_settings() -> None:
    """A TOML array of profiles reaches the ClientApp as to_flat's string; it names devices
    by the typed settings, and by REFUSED when those settings are refused (the round says
    why, in full)."""
    from fedpipe.fl.client_app import REFUSED

    cfg = FedpipeConfig().with_overrides({"federated.profiles": ["bw=10", "rtt=5ms,bw=20"]})

    def name(run_config: dict[str, Any], partition: int) -> str:
        context = Context(
            run_id=1,
            node_id=1,
            node_config={"partition-id": partition},
            state=RecordDict(),
            run_config=run_config,
        )
        return _device_profile_name(context)[1]

    assert [name(cfg.to_flat(), p) for p in range(3)] == ["bw=10", "rtt=5ms,bw=20", "bw=10"]
    assert name({**cfg.to_flat(), "federated.profiles": "phone-lte,rpi-wfi"}, 0) == REFUSED
