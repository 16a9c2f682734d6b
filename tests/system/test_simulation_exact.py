"""Exact aggregation in a real Flower simulation, and a resume that continues it exactly.

Three Flower simulations: run A trains 2 rounds under
``federated.aggregation = exact``; run B trains 1, then resumes to 2. Both sides' checkpoints
carry the folded base deltas, and B's losses and checkpoints equal A's round by round: the
resume restored what the aggregation changed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fedpipe.config import load_config
from fedpipe.launch.run import simulate
from fedpipe.models import resolve_model

SMALL = {
    "model.name": "tiny-llama",
    "train.local_steps": 2,
    "train.seq_len": 32,
    "train.batch_size": 2,
    "train.lr": 1e-2,
    "pipeline.microbatches": 1,
    "federated.profiles": "loopback",
    "federated.partition": "by-source",
    "federated.num_devices": 2,
    "federated.aggregation": "exact",
}


def _checkpoint(run: Path, round_: int, side: str) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"round-{round_:04d}" / f"{side}.safetensors"))


def _losses(summary: dict[str, Any]) -> dict[int, float]:
    return {e["round"]: e["eval_loss"] for e in summary["rounds"] if "eval_loss" in e}


@pytest.mark.timeout(1800)
def test_exact_aggregation_resumes_exactly(tmp_path: Path) -> None:
    resolve_model("tiny-llama")  # the model cache, converted before the two runs start
    with ThreadPoolExecutor(2) as pool:  # A and B's first call are independent: at once
        first = [
            pool.submit(
                simulate,
                load_config(None, {**SMALL, "federated.rounds": r}),
                name=n,
                runs_dir=tmp_path,
            )
            for n, r in (("a", 2), ("b", 1))
        ]
        a = first[0].result()
        first[1].result()
    b = simulate(
        load_config(None, {"federated.rounds": 2}),
        name="b",
        runs_dir=tmp_path,
        resume=True,
        explicit={"federated.rounds"},
    )
    assert _losses(b) == _losses(a) and sorted(_losses(a)) == [0, 1, 2]
    for side in ("device", "server"):
        state_a, state_b = (
            _checkpoint(tmp_path / "a", 2, side),
            _checkpoint(tmp_path / "b", 2, side),
        )
        assert any(k.endswith(".base_delta") for k in state_a), side
        assert set(state_a) == set(state_b)
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a), side
