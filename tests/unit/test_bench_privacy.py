"""``fedpipe bench privacy --quick``: a real tapped training run on a tiny model, attacked."""

from __future__ import annotations

import pytest

from fedpipe.cli.parser import build_parser


def test_cli_registers_the_bench() -> None:
    args = build_parser().parse_args(["bench", "privacy", "--quick", "--json"])
    assert args.func == "fedpipe_bench.commands:cmd_bench_privacy" and args.quick and args.json


def test_a_setting_names_the_privacy_keys_of_each_part() -> None:
    from fedpipe_bench.privacy import DEFAULT, Setting

    clips = (2.0, 0.01)
    assert Setting("none").overrides(clips) == {}
    assert Setting("clip", 0.1).overrides(clips) == {
        "mechanism": "clip",
        "activation_clip": 2.0,
        "activation_noise": 0.1,
        "gradient_clip": 0.01,
        "gradient_noise": 0.1,
    }
    # beside noise, the strength is the noise's and the other parts take their own fields
    both = Setting("decorrelation+token-dim", 0.03, decorrelation=10.0).overrides(clips)
    assert both == {
        "decorrelation": 10.0,
        "mechanism": "token-dim",
        "activation_noise": 0.03,
        "gradient_noise": 0.03,
    }
    act = Setting("clip-activations+label-resample", 0.1, label_resample=0.7).overrides(clips)
    assert act["label_resample"] == 0.7 and "gradient_noise" not in act
    assert Setting("label-resample", 0.7).overrides(clips) == {"label_resample": 0.7}
    assert Setting("decorrelation", 10.0).overrides(clips) == {"decorrelation": 10.0}
    with pytest.raises(ValueError, match="unknown defence 'laplace'"):
        Setting("laplace", 1.0).overrides(clips)
    # every setting the default sweep runs is one a device accepts
    from fedpipe.config import load_config

    for setting in (*DEFAULT.settings, *DEFAULT.deeper_settings, *DEFAULT.spread):
        overrides = {f"privacy.{k}": v for k, v in setting.overrides(clips).items()}
        load_config(None, overrides)
