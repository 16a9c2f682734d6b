"""Codec settings: plain values per link, validated with errors that name the key and choices."""

from __future__ import annotations

import pytest

from fedpipe.config import FedpipeConfig


@pytest.mark.parametrize(
    ("flat", "message"),
    [
        ({"pipeline.uplink_codec": "int3"}, r"pipeline.uplink_codec 'int3' unknown; choose one"),
        ({"pipeline.downlink_codec": "int4g48"}, r"'int4g48' unknown; .* G in 16, 32, 64"),
        ({"pipeline.gradient_codec": "int8g64"}, r"pipeline.gradient_codec 'int8g64' unknown"),
        ({"pipeline.delta_cache_mb": 0}, r"pipeline.delta_cache_mb must be > 0, got 0.* = false"),
        ({"server.max_delta_cache_mb": -1}, r"server.max_delta_cache_mb must be >= 0"),
        ({"pipeline.error_feedback": "maybe"}, r"pipeline.error_feedback"),
    ],
)
def test_invalid_codec_settings_name_the_key_and_the_choices(
    flat: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        FedpipeConfig().with_overrides(flat)


def test_codec_settings_are_plain_values_per_link() -> None:
    config = FedpipeConfig().with_overrides(
        {
            "pipeline.uplink_codec": "int4",
            "pipeline.downlink_codec": "int4g128",
            "pipeline.gradient_codec": "int2",
            "pipeline.error_feedback": "true",
            "pipeline.delta": "on",
            "pipeline.delta_cache_mb": "16",
        }
    )
    p = config.pipeline
    assert (p.uplink_codec, p.downlink_codec, p.gradient_codec) == ("int4", "int4g128", "int2")
    assert p.error_feedback is True and p.delta is True and p.delta_cache_mb == 16.0
    assert FedpipeConfig().with_overrides(config.to_flat()) == config
    defaults = FedpipeConfig().pipeline
    assert (defaults.error_feedback, defaults.delta) == (False, False)  # lossless by default
