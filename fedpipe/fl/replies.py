"""What a device's train reply may carry into everyone's model, checked before aggregation.

A reply is the device's word: its adapters and its metrics. The ServerApp accepts only what an
honest device of the run sends, and a reply that is anything else is that device's failure
(named, like a non-finite adapter), never an error that stops the round:

- **arrays**: exactly the adapter keys of the cut the device declares (one the server offers),
  each of the global adapter's shape, finite; never a folded base delta (``*.base_delta``: only
  the ServerApp folds them) and never a key no cut holds;
- **metrics**: the keys a fedpipe device sends (:data:`METRIC_KEYS`, plus the delta coding ones
  its settings add), each a finite number;
- **privacy**: the figures of the device's own stage-link defences (:data:`PRIVACY_KEYS`), each
  a finite number, in a record of their own: devices may run different defences, and Flower
  aggregates a round's metrics only when every device sends the same keys;
- **data**: on instruction data, what became of the device's examples (:data:`DATA_KEYS`: rows
  made, truncated, dropped), each a whole number >= 0, in a record of its own for the same
  reason;
- **the weight** ``num-examples``: a whole number from 0 to what the round lets a device train
  (``train.batch_size x train.local_steps``); a claim past it is refused, not trusted.

:class:`TrainReply` is the reply beside its adapters as one typed record: the device writes it
(:meth:`TrainReply.write`, the ClientApp and the benches' in-process devices) and the ServerApp
reads it back (:meth:`TrainReply.read`), so each record and key is spelt here only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedpipe.config import DEVICE_WEIGHTS, FedpipeConfig, format_cut
from fedpipe.edge.trainer import TrainReport
from fedpipe.lora.aggregation import DELTA_SUFFIX, adapter_block

__all__ = [
    "DATA_KEYS",
    "METRIC_KEYS",
    "NUM_EXAMPLES",
    "PRIVACY_KEYS",
    "ReplyRules",
    "TrainReply",
    "check_reply",
    "device_keys",
]

NUM_EXAMPLES = "num-examples"  # the weight Flower's strategies aggregate by
_PARTITION = "partition-id"
# What every fedpipe device reports: its round's report (fedpipe.edge.trainer.TrainReport,
# whose metrics() spells the keys) and its partition; delta coding adds its own.
METRIC_KEYS = frozenset(TrainReport().metrics()) | {_PARTITION}
_OPTIONAL_KEYS = frozenset(TrainReport(delta_resumed=False).metrics()) - METRIC_KEYS
# The reply's "privacy" record: LinkAccountant.report and, under privacy.decorrelation, the
# head's mean distance correlation with its tokens.
PRIVACY_KEYS = frozenset(
    {
        "privacy-releases",
        "privacy-delta",
        "privacy-epsilon",
        "privacy-epsilon-activations",
        "privacy-epsilon-gradients",
        "privacy-decorrelation",
    }
)


# The reply's "data" record: fedpipe.data.ExampleCounts.metrics() (instruction data only).
DATA_KEYS = frozenset(
    {
        "examples-rows",
        "examples-truncated",
        "examples-dropped-overlong",
        "examples-dropped-unanswered",
    }
)


@dataclass(frozen=True)
class ReplyRules:
    """What the round's replies may hold: each offered cut's keys and shapes, and the weight."""

    keys_by_cut: Mapping[str, Mapping[str, tuple[int, ...]]]  # "2+1" -> {key: shape}
    default_cut: str  # the cut of a device that declares none
    max_examples: int  # train.batch_size x train.local_steps
    rows_per_step: int = 0  # train.batch_size: a step the server counted weighs this much


def device_keys(
    config: FedpipeConfig, initial: Mapping[str, torch.Tensor], num_layers: int
) -> dict[str, dict[str, tuple[int, ...]]]:
    """Per offered cut, the device adapter keys (and shapes) a device of that cut holds.

    ``initial`` holds the seeded adapters of every offered cut; a cut ``h+t`` holds blocks
    ``0..h-1`` and, in the U-shaped split, ``L-t..L-1`` of the model's ``L`` blocks.
    """
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for head, tail in config.model.offered_cuts:
        blocks = set(range(head))
        if config.model.split == "u":
            blocks |= set(range(num_layers - tail, num_layers))
        out[format_cut((head, tail))] = {
            key: tuple(value.shape)
            for key, value in initial.items()
            if not key.endswith(DELTA_SUFFIX) and adapter_block(key) in blocks | {None}
        }
    return out


def check_reply(reply: Message, rules: ReplyRules) -> str:
    """Why ``reply`` (not an error reply) may not be aggregated, as one line; "" when it may."""
    why = _problem(reply, rules)
    if not why or why.startswith("device adapter not aggregated"):
        return why
    return f"reply not aggregated: {why}"


def _problem(reply: Message, rules: ReplyRules) -> str:
    content = reply.content
    arrays, metrics = content.get("arrays"), content.get("metrics")
    if not isinstance(arrays, ArrayRecord) or not isinstance(metrics, MetricRecord):
        return "the reply has no adapters ('arrays') or no metrics ('metrics')"
    why = (
        _metrics_problem(metrics, rules.max_examples)
        or _privacy_problem(content)
        or _data_problem(content)
    )
    if why:
        return why
    device = content.get("device", ConfigRecord())
    weights = cast(ConfigRecord, device).get("weights", "fp32")
    if weights not in DEVICE_WEIGHTS:  # only recorded, but a record holds known names only
        return f"it declares device weights {weights!r}, not one of {', '.join(DEVICE_WEIGHTS)}"
    cut = str(cast(ConfigRecord, device).get("cut", rules.default_cut))
    if cut not in rules.keys_by_cut:
        offered = ", ".join(rules.keys_by_cut)
        return f"it declares cut {cut!r}, which the server does not offer ({offered})"
    return _arrays_problem(arrays, rules.keys_by_cut[cut], cut)


def _metrics_problem(metrics: MetricRecord, max_examples: int) -> str:
    keys = set(metrics.keys())
    missing = sorted(METRIC_KEYS - keys)
    if missing:
        return f"its metrics lack {', '.join(missing)}"
    extra = sorted(keys - METRIC_KEYS - _OPTIONAL_KEYS)
    if extra:
        return f"its metrics carry keys no fedpipe device sends: {', '.join(extra[:5])}"
    for key, value in metrics.items():
        if not isinstance(value, int | float) or not math.isfinite(float(value)):
            return f"metric {key} is {value!r}, not a finite number"
    examples = float(cast(float, metrics[NUM_EXAMPLES]))
    if not (examples.is_integer() and 0 <= examples <= max_examples):
        return (
            f"it claims {examples:g} examples; a device trains 0 to {max_examples} in a round "
            "(train.batch_size x train.local_steps)"
        )
    return ""


def _privacy_problem(content: RecordDict) -> str:
    if "privacy" not in content:
        return ""
    record = content["privacy"]
    if not isinstance(record, ConfigRecord):
        return "its 'privacy' record is not a ConfigRecord"
    extra = sorted(set(record.keys()) - PRIVACY_KEYS)
    if extra:
        return f"its privacy record carries keys no fedpipe device sends: {', '.join(extra[:5])}"
    for key, value in record.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"privacy figure {key} is {value!r}, not a finite number"
        if not math.isfinite(float(value)):
            return f"privacy figure {key} is {value!r}, not a finite number"
    return ""


def _data_problem(content: RecordDict) -> str:
    if "data" not in content:
        return ""
    record = content["data"]
    if not isinstance(record, ConfigRecord):
        return "its 'data' record is not a ConfigRecord"
    extra = sorted(set(record.keys()) - DATA_KEYS)
    if extra:
        return f"its data record carries keys no fedpipe device sends: {', '.join(extra[:5])}"
    for key, value in record.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"data count {key} is {value!r}, not a whole number >= 0"
    return ""


# The reply's records besides "arrays" (the adapters, which Flower's strategies aggregate).
_METRICS, _PLAN, _PRIVACY, _DATA, _DEVICE = "metrics", "plan", "privacy", "data", "device"


@dataclass(frozen=True)
class TrainReply:
    """What a device's train reply says besides its adapters.

    ``metrics`` are Flower's (:data:`METRIC_KEYS`: the strategies weigh by ``num-examples``);
    ``plan`` the device's pipeline plan (``pipeline.plan = auto``), ``privacy`` its stage-link
    defences' figures, ``data`` what became of its instruction examples: each its own record,
    absent when empty. ``cut``, ``weights`` and ``profile`` (added by the ClientApp's wrapper
    that names the device) travel in the ``device`` record; "" where a reply lacks them.
    """

    metrics: Mapping[str, Any]  # numbers (MetricRecord values)
    cut: str = ""
    weights: str = ""
    profile: str = ""
    plan: Mapping[str, Any] = field(default_factory=dict)
    privacy: Mapping[str, int | float] = field(default_factory=dict)
    data: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, report: TrainReport, partition: int, cut: str, *, weights: str) -> TrainReply:
        """A device's reply to its round's report."""
        return cls(
            metrics={**report.metrics(), _PARTITION: partition},
            cut=cut,
            weights=weights,
            plan=dict(report.plan or {}),
            privacy=dict(report.privacy or {}),
            data=dict(report.data or {}),
        )

    @property
    def partition(self) -> int:
        """The device's partition (-1: a reply that does not say)."""
        return int(self.metrics.get(_PARTITION, -1))

    @property
    def num_examples(self) -> int:
        """The reply's weight: the examples it trained on (the server's count, once weighed)."""
        return int(self.metrics[NUM_EXAMPLES])

    @property
    def train_loss(self) -> float:
        return float(self.metrics["train-loss"])

    @property
    def bytes_up(self) -> int:
        """Stage-link bytes the device sent in its round."""
        return int(self.metrics["bytes-up"])

    @property
    def bytes_down(self) -> int:
        """Stage-link bytes the device received in its round."""
        return int(self.metrics["bytes-down"])

    def weighed(self, examples: int) -> TrainReply:
        """This reply weighing ``examples`` (the StageServer's count, where it is lower)."""
        return replace(self, metrics={**self.metrics, NUM_EXAMPLES: examples})

    def named(self, profile: str) -> TrainReply:
        return replace(self, profile=profile)

    def write(self, adapters: Mapping[str, torch.Tensor]) -> RecordDict:
        """The reply's content: ``adapters`` as its ``arrays`` and these records."""
        content = RecordDict({"arrays": ArrayRecord(dict(adapters))})
        self.write_into(content)
        return content

    def write_into(self, content: RecordDict) -> None:
        """Set (or replace) these records in ``content``; its ``arrays`` are left as they are."""
        content[_METRICS] = MetricRecord(dict(self.metrics))
        for name, values in ((_PLAN, self.plan), (_PRIVACY, self.privacy), (_DATA, self.data)):
            if values:
                content[name] = ConfigRecord(dict(values))
        device = {"cut": self.cut, "weights": self.weights, "profile": self.profile}
        content[_DEVICE] = ConfigRecord({k: v for k, v in device.items() if v})

    @classmethod
    def read(cls, content: RecordDict) -> TrainReply:
        """The records of a reply's ``content`` (one :func:`check_reply` let through, or one
        whose metrics are all that is read: a missing optional record reads as empty)."""
        device = cast(ConfigRecord, content.get(_DEVICE, ConfigRecord()))

        def record(name: str) -> dict[str, Any]:
            return dict(cast(ConfigRecord, content[name])) if name in content else {}

        return cls(
            metrics=dict(cast(MetricRecord, content[_METRICS])),
            cut=str(device.get("cut", "")),
            weights=str(device.get("weights", "")),
            profile=str(device.get("profile", "")),
            plan=record(_PLAN),
            privacy=record(_PRIVACY),
            data=record(_DATA),
        )

    def log_fields(self) -> dict[str, Any]:
        """The reply as a metrics.jsonl ``train`` record's fields (``train_loss``; the device's
        partition and profile are the record's device fields, not repeated here)."""
        fields_: dict[str, Any] = _snake_case(dict(self.metrics))
        fields_.pop("partition_id", None)
        if self.plan:
            fields_["plan"] = dict(self.plan)
        fields_ |= _snake_case(dict(self.privacy))
        if self.data:
            counts = _snake_case(dict(self.data))
            fields_["examples"] = {k.removeprefix("examples_"): v for k, v in counts.items()}
        if self.cut:  # head+tail blocks the device ran (model.cuts)
            fields_["cut"] = self.cut
        if self.weights:  # how it stored its frozen weights (device.weights)
            fields_["weights"] = self.weights
        return fields_


def _snake_case(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Flower's metric keys (``train-loss``, kept for the strategies' ``num-examples``) as
    metrics.jsonl keys (``train_loss``)."""
    return {k.replace("-", "_"): v for k, v in metrics.items()}


def _arrays_problem(arrays: ArrayRecord, expected: Mapping[str, tuple[int, ...]], cut: str) -> str:
    keys = set(arrays.keys())
    deltas = sorted(k for k in keys if k.endswith(DELTA_SUFFIX))
    if deltas:
        return f"it sends folded base deltas ({deltas[0]}, ...), which only the ServerApp makes"
    unknown = sorted(keys - set(expected))
    if unknown:
        return (
            f"it sends {len(unknown)} adapter keys its cut {cut} does not hold ({unknown[0]}, ...)"
        )
    missing = sorted(set(expected) - keys)
    if missing:
        return f"it lacks {len(missing)} adapter keys of its cut {cut} ({missing[0]}, ...)"
    for key, value in arrays.to_torch_state_dict().items():
        if tuple(value.shape) != expected[key]:
            return f"{key} has shape {tuple(value.shape)}, the global adapter {expected[key]}"
        if not value.is_floating_point():
            return f"{key} holds {value.dtype} values, not floats"
        if not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            return f"device adapter not aggregated: {bad} values of {key} are NaN or Inf"
    return ""
