"""``fedpipe bench quality``: the run list is data, and a ``--quick`` run keeps the JSON contract
(DESIGN.md): every named run with its loss, perplexity, bytes, wall time and steps."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from fedpipe_bench.quality import COMPRESSION, EXTRA_RUNS, RUNS, over_seeds, run_names

from fedpipe.config import FedpipeConfig

FIELDS = {"name", "eval_loss", "eval_ppl", "bytes_up", "bytes_down", "bytes_per_token", "wall_s"}


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


@pytest.mark.slow
def test_quick_run_keeps_the_json_contract() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fedpipe.cli", "bench", "quality", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    runs = {r["name"]: r for r in json.loads(done.stdout)["runs"]}
    assert set(runs) == {"centralized", *(r["name"] for r in RUNS)}
    for run in runs.values():
        assert FIELDS | {"steps"} <= set(run) and math.isfinite(run["eval_loss"])
        assert run["eval_ppl"] == pytest.approx(math.exp(run["eval_loss"]))
    assert len({r["steps"] for r in runs.values()}) == 1  # the same optimizer steps everywhere
    assert runs["centralized"]["bytes_up"] == 0
    lossless = runs["lossless"]
    assert (
        runs["int8"]["bytes_per_token"]
        < runs["fp16"]["bytes_per_token"]
        < (lossless["bytes_per_token"])
    )
    assert runs["frozen"]["bytes_down"] < 0.6 * lossless["bytes_down"]  # no INPUT_GRAD tensors
    assert runs["noniid-exact"]["adapter_bytes_down"] > runs["noniid"]["adapter_bytes_down"]


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
