"""``fedpipe bench quality``: the run list is data, seeds combine, and a setting the bench does
not model is refused. (A ``--quick`` run and its JSON contract: tests/system/test_bench_runs.py.)"""

from __future__ import annotations

import math

import pytest
from fedpipe_bench.quality import (
    COMPRESSION,
    DEVICE_WEIGHTS,
    EXTRA_RUNS,
    RUNS,
    over_seeds,
    run_names,
    run_quality_bench,
)

from fedpipe.config import FedpipeConfig


def test_every_run_is_a_valid_setting_and_codec_runs_are_named_by_codec() -> None:
    for run in RUNS:
        FedpipeConfig().with_overrides({k: v for k, v in run.items() if k != "name"})
    for run in EXTRA_RUNS:
        FedpipeConfig().with_overrides({k: v for k, v in run.items() if k != "name"})
    for run in COMPRESSION + [r for r in EXTRA_RUNS if "pipeline.uplink_codec" in r]:
        # the activation codec, then the gradient codec where it differs ("ef": error feedback)
        grads = run.get("pipeline.gradient_codec")
        ef = "ef" if run.get("pipeline.error_feedback") else ""
        expected = run["pipeline.uplink_codec"] + (f"-{grads}{ef}" if grads else "")
        if run.get("pipeline.delta"):  # delta coding's runs: the codecs, then "-delta..."
            assert run["name"].startswith(f"{expected}-delta")
        else:
            assert run["name"] == expected
    names = run_names()
    assert names[:3] == ["centralized", "lossless", "noniid"] and "frozen" in names


def test_the_device_weights_runs_store_each_devices_weights_and_change_nothing_else() -> None:
    names = run_names()
    for run in DEVICE_WEIGHTS:
        assert run["name"] in names and run["name"] not in {r["name"] for r in RUNS}  # extras
        assert set(run) == {"name", "device.weights"}  # lossless but for the storage
        weights = run["device.weights"]
        assert run["name"] == f"device-{weights}"
        config = FedpipeConfig().with_overrides({"device.weights": weights})
        assert [config.device_weights(p) for p in range(4)] == [weights] * 4
        assert config.device_weights(-1) == "fp32"  # the evaluator
    assert [r["name"] for r in DEVICE_WEIGHTS] == ["device-bf16", "device-int8", "device-int4"]


def test_seeds_combine_into_means_with_each_seed_and_the_spread() -> None:
    rows = [
        {"name": "noniid", "eval_loss": loss, "bytes_up": 100, "wall_s": wall, "steps": 6}
        for loss, wall in ((3.0, 10.0), (3.2, 20.0), (3.1, 30.0))
    ]
    row = over_seeds(rows, [0, 1, 2])
    assert row["eval_loss"] == pytest.approx(3.1) and row["eval_ppl"] == pytest.approx(
        math.exp(3.1)
    )
    assert row["eval_loss_seeds"] == [3.0, 3.2, 3.1] and row["seeds"] == [0, 1, 2]
    assert (row["eval_loss_min"], row["eval_loss_max"]) == (3.0, 3.2)
    assert row["eval_loss_std"] == pytest.approx(0.1)  # sample std
    assert row["wall_s"] == pytest.approx(20.0) and row["steps"] == 6 and row["bytes_up"] == 100
    one = over_seeds(rows[:1], [0])
    assert one["eval_loss"] == 3.0 and one["eval_loss_std"] == 0.0


def test_bench_quality_refuses_a_setting_it_does_not_model() -> None:
    with pytest.raises(ValueError) as refused:
        run_quality_bench(quick=True, overrides={"federated.straggler_s": 5.0})
    message = str(refused.value)
    assert "federated.straggler_s=5.0" in message and "\n" not in message
    assert "round_deadline_s" not in message  # only what was given is named
