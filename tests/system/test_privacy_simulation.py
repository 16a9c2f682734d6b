"""`fedpipe simulate` with a different stage-link defence on each device, end to end.

Flower's simulation engine runs three devices of the tiny model for one round, each with its
own defences from ``privacy.devices`` on top of the run's ``[privacy]`` (none): per-token
clipping with noise (the only one with an epsilon); noise scaled to each token, with resampled
labels; noise scaled to each token and dimension, with the head's decorrelation penalty. Every
device trains and is aggregated, the round's evaluation is finite, and the summary reports
each device's own privacy figures.
"""

from __future__ import annotations

import math
from pathlib import Path

from fedpipe.config import load_config
from fedpipe.launch.run import simulate

DEFENCES = (
    "activation_clip=2,activation_noise=0.05,gradient_clip=0.01,gradient_noise=0.05",
    "mechanism=token,activation_noise=0.05,gradient_noise=0.05,label_resample=0.5",
    "mechanism=token-dim,activation_noise=0.05,gradient_noise=0.05,decorrelation=1",
)
SETTINGS = {
    "model.name": "tiny-llama",
    "federated.num_devices": 3,
    "federated.rounds": 1,
    "federated.profiles": "loopback",
    "train.local_steps": 2,
    "train.seq_len": 32,
    "train.batch_size": 4,
    "pipeline.microbatches": 2,
    "privacy.devices": "; ".join(DEFENCES),
}


def test_each_device_runs_its_own_defence_through_a_round(tmp_path: Path) -> None:
    config = load_config(None, SETTINGS)
    summary = simulate(config, name="privacy", runs_dir=tmp_path, progress=False)
    assert summary["flower_run"]["status"] == "finished:completed", summary["problems"]
    rounds = {entry["round"]: entry for entry in summary["rounds"]}
    assert rounds[1]["devices_trained"] == 3 and rounds[1]["merged"] == 3, rounds[1]
    assert math.isfinite(rounds[1]["eval_loss"])
    privacy = rounds[1]["privacy"]  # per partition, what each device reported
    clipped = privacy["0"]
    assert clipped["privacy_epsilon"] > 0 and clipped["privacy_releases"] >= 1
    assert "1" not in privacy  # token noise, resampled labels: no figure to report (no epsilon)
    assert 0 < privacy["2"]["privacy_decorrelation"] <= 1
    assert not any(k.startswith("privacy_epsilon") for k in privacy["2"])
