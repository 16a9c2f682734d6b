"""What a device's train reply may carry: refused replies name why, honest ones pass as sent."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedpipe.config import FedpipeConfig, ModelConfig
from fedpipe.fl.replies import METRIC_KEYS, ReplyRules, TrainReply, check_reply, device_keys

L = 4  # blocks of the model in these tests


def _key(block: int, part: str = "A") -> str:
    return f"model.layers.{block}.self_attn.q_proj.lora_{part}.weight"


def _initial() -> dict[str, torch.Tensor]:
    out = {}
    for block in range(L):
        out[_key(block, "A")] = torch.zeros(2, 8)
        out[_key(block, "B")] = torch.zeros(8, 2)
    return out


def _rules(cuts: str = "") -> ReplyRules:
    cfg = FedpipeConfig(model=ModelConfig(head_layers=1, tail_layers=1, cuts=cuts))
    return ReplyRules(device_keys(cfg, _initial(), L), default_cut="1+1", max_examples=16)


def _honest() -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    arrays = {k: torch.randn(v.shape) for k, v in _initial().items() if k.split(".")[2] in "03"}
    metrics = dict.fromkeys(METRIC_KEYS, 1.0) | {"num-examples": 16}
    return arrays, metrics


def _reply(arrays: dict[str, torch.Tensor], metrics: dict[str, Any], cut: str = "") -> Any:
    content = RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord(metrics)})
    if cut:
        content["device"] = ConfigRecord({"cut": cut})
    return SimpleNamespace(content=content, has_error=lambda: False)


def test_an_honest_reply_passes() -> None:
    arrays, metrics = _honest()
    assert check_reply(_reply(arrays, metrics), _rules()) == ""
    with_privacy = _reply(arrays, metrics)
    with_privacy.content["privacy"] = ConfigRecord({"privacy-epsilon": 3.0})
    assert check_reply(with_privacy, _rules()) == ""


def test_privacy_figures_travel_apart_from_the_metrics_and_are_checked() -> None:
    """Devices may run different defences: their figures are not in the metrics (Flower
    aggregates those only when all devices send the same keys) but in a record of their own."""
    arrays, metrics = _honest()
    why = check_reply(_reply(arrays, metrics | {"privacy-epsilon": 3.0}), _rules())
    assert "metrics carry keys no fedpipe device sends: privacy-epsilon" in why
    for record, expected in (
        ({"privacy-epsilon": float("nan")}, "privacy figure privacy-epsilon is nan"),
        ({"privacy-decorrelation": "low"}, "privacy figure privacy-decorrelation is 'low'"),
        ({"privacy-leak": 1.0}, "privacy record carries keys no fedpipe device sends"),
    ):
        reply = _reply(arrays, metrics)
        reply.content["privacy"] = ConfigRecord(record)
        assert expected in check_reply(reply, _rules()), record


def test_a_device_of_another_offered_cut_holds_its_own_blocks() -> None:
    rules = _rules(cuts="2+1")
    arrays, metrics = _honest()
    arrays |= {_key(1, "A"): torch.zeros(2, 8), _key(1, "B"): torch.zeros(8, 2)}
    assert check_reply(_reply(arrays, metrics, cut="2+1"), rules) == ""
    assert "does not hold" in check_reply(_reply(arrays, metrics, cut="1+1"), rules)
    assert "does not offer" in check_reply(_reply(arrays, metrics, cut="3+0"), rules)


@pytest.mark.parametrize(
    ("tamper", "why"),
    [
        (lambda a, m: a.update({"model.extra.lora_A.weight": torch.zeros(2)}), "does not hold"),
        (lambda a, m: a.update({_key(0, "A") + ".base_delta": torch.zeros(8, 8)}), "base deltas"),
        (lambda a, m: a.pop(_key(3, "B")), "lacks 1 adapter keys"),
        (lambda a, m: a.update({_key(0, "A"): torch.zeros(3, 8)}), "has shape (3, 8)"),
        (lambda a, m: a.update({_key(0, "A"): torch.full((2, 8), math.nan)}), "NaN or Inf"),
        (lambda a, m: m.update({"num-examples": 10**12}), "claims 1e+12 examples"),
        (lambda a, m: m.update({"num-examples": math.nan}), "not a finite number"),
        (lambda a, m: m.update({"num-examples": -1}), "claims -1 examples"),
        (lambda a, m: m.pop("bytes-up"), "lack bytes-up"),
        (lambda a, m: m.update({"my-own-metric": 1.0}), "no fedpipe device sends"),
    ],
    ids=[
        "extra-key",
        "base-delta",
        "missing-key",
        "shape",
        "nan",
        "huge-weight",
        "nan-weight",
        "negative-weight",
        "missing-metric",
        "extra-metric",
    ],
)
def test_a_tampered_reply_is_refused_saying_why(tamper: Any, why: str) -> None:
    arrays, metrics = _honest()
    tamper(arrays, metrics)
    assert why in check_reply(_reply(arrays, metrics), _rules())


def test_a_reply_without_arrays_or_metrics_is_refused() -> None:
    content = RecordDict({"metrics": MetricRecord({"num-examples": 1})})
    reply = SimpleNamespace(content=content, has_error=lambda: False)
    assert "no adapters" in check_reply(reply, _rules())


def test_a_device_is_named_by_the_profile_it_runs_inline_specs_included() -> None:
    """The name a device's reply and errors carry is the profile DeviceWork gives it: inline
    specs hold commas of their own (``phone-lte,up=10,down=25,rtt=50ms,rpi-wifi`` is three)."""
    from flwr.app import Context, RecordDict

    from fedpipe.config import FedpipeConfig
    from fedpipe.fl.client_app import _device_profile_name
    from fedpipe.fl.device_work import partition_profile

    profiles = "phone-lte,up=10,down=25,rtt=50ms,rpi-wifi"
    cfg = FedpipeConfig().with_overrides({"federated.profiles": profiles})
    named = []
    for partition in range(4):
        context = Context(
            run_id=1,
            node_id=partition,
            node_config={"partition-id": partition},
            state=RecordDict(),
            run_config=cfg.to_flat(),  # what Flower hands the ClientApp: scalars
        )
        named.append(_device_profile_name(context)[1])
    assert named == ["phone-lte", "up=10,down=25,rtt=50ms", "rpi-wifi", "phone-lte"]
    assert named == [partition_profile(cfg.federated.profiles, p) for p in range(4)]


def test_example_counts_travel_in_a_data_record_and_are_checked() -> None:
    """Instruction data: the device's rows made, truncated and dropped, apart from the metrics
    (a device on plain text sends none)."""
    arrays, metrics = _honest()
    counts = {"examples-rows": 11, "examples-truncated": 1, "examples-dropped-overlong": 0}
    reply = _reply(arrays, metrics)
    reply.content["data"] = ConfigRecord({**counts, "examples-dropped-unanswered": 2})
    assert check_reply(reply, _rules()) == ""
    for record, expected in (
        ({"examples-rows": -1}, "data count examples-rows is -1"),
        ({"examples-rows": 1.5}, "data count examples-rows is 1.5"),
        ({"examples-secret": 1}, "data record carries keys no fedpipe device sends"),
    ):
        reply = _reply(arrays, metrics)
        reply.content["data"] = ConfigRecord(record)
        assert expected in check_reply(reply, _rules()), record


def test_a_train_reply_reads_back_as_written_and_passes_the_checks() -> None:
    """The device's writer and the ServerApp's reader are one record: every field survives
    Flower's records, the ClientApp's naming adds only the profile, and what the writer makes
    passes the checks the ServerApp applies."""
    arrays, metrics = _honest()
    sent = TrainReply(
        metrics=metrics | {"partition-id": 3},
        cut="1+1",
        weights="int8",
        plan={"schedule": "1f1b", "microbatches": 4},
        privacy={"privacy-epsilon": 2.5},
        data={"examples-rows": 12, "examples-truncated": 1},
    )
    content = sent.write(arrays)
    assert sorted(content) == ["arrays", "data", "device", "metrics", "plan", "privacy"]
    assert TrainReply.read(content) == sent
    sent.named("phone-lte").write_into(content)
    back = TrainReply.read(content)
    assert back == sent.named("phone-lte") and (back.partition, back.profile) == (3, "phone-lte")
    assert sorted(content["arrays"].keys()) == sorted(arrays)  # left as they were
    reply = SimpleNamespace(content=content, has_error=lambda: False)
    assert check_reply(reply, _rules()) == ""
    fields = back.log_fields()
    assert fields["examples"] == {"rows": 12, "truncated": 1}
    assert fields["train_loss"] == 1.0 and "partition_id" not in fields
    assert (fields["cut"], fields["weights"], fields["privacy_epsilon"]) == ("1+1", "int8", 2.5)
    bare = TrainReply.read(RecordDict({"metrics": MetricRecord({"num-examples": 4})}))
    assert (bare.partition, bare.num_examples, bare.cut, bare.plan) == (-1, 4, "", {})
