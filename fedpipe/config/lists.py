"""List settings: how each is parsed from a comma string or a list, and written back as
the string a user writes (messages, summaries, Flower's run config)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedpipe.config.cuts import format_cuts, parse_cuts
from fedpipe.config.device import parse_device_weights
from fedpipe.config.federated import parse_profiles
from fedpipe.config.model import parse_lora_targets
from fedpipe.config.pipeline import parse_plan_codecs
from fedpipe.config.privacy import parse_privacy_devices
from fedpipe.config.profile_spec import join_specs

__all__ = ["LIST_SETTINGS", "canonical_list_text", "list_text"]

# How each list setting's entries are written as one string (the inverse of its parser).
_LIST_TEXT: dict[str, Callable[[Any], str]] = {
    "model.cuts": format_cuts,
    "model.lora_targets": ",".join,
    "pipeline.plan_codecs": ",".join,
    "federated.device_cuts": format_cuts,
    "federated.profiles": join_specs,  # with "; " where commas alone would regroup the specs
    "privacy.devices": "; ".join,  # a spec's own commas stay inside it
    "device.weights": ",".join,
}


# Each list setting's parser (a comma string or a list of entries -> the checked tuple).
_LIST_PARSE: dict[str, Callable[[Any, str], tuple[Any, ...]]] = {
    "model.cuts": parse_cuts,
    "model.lora_targets": parse_lora_targets,
    "pipeline.plan_codecs": parse_plan_codecs,
    "federated.device_cuts": parse_cuts,
    "federated.profiles": parse_profiles,
    "privacy.devices": parse_privacy_devices,
    "device.weights": parse_device_weights,
}
LIST_SETTINGS = tuple(_LIST_TEXT)


def list_text(key: str, entries: tuple[Any, ...]) -> str:
    """A list setting's entries as the string a user writes (``"2+1,1+1"``), which its
    parser reads back to the same entries; for messages, summaries and Flower's run config."""
    return _LIST_TEXT[key](entries)


def canonical_list_text(key: str, value: Any) -> str:
    """A list setting's value (a string as written, or a list) as :meth:`FedpipeConfig.to_flat`
    writes it: ``"1+1, 2+2"`` -> ``"1+1,2+2"`` (raises ValueError naming ``key``)."""
    return list_text(key, _LIST_PARSE[key](value, key))
