"""Exact aggregation in a real Flower simulation, and a resume that continues it exactly.

Three Flower simulations: run A trains 2 rounds under
``federated.aggregation = exact``; run B trains 1, then resumes to 2. Both sides' checkpoints
carry the folded base deltas, and B's losses and checkpoints equal A's round by round: the
resume restored what the aggregation changed. The resumed run exported as a merged model
loads in transformers alone and gives the held-out loss the run recorded.
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
    _exported_model_gives_the_runs_loss(tmp_path / "b", _losses(b)[2])


def _exported_model_gives_the_runs_loss(run: Path, eval_loss: float) -> None:
    """The resumed run's last checkpoint, exported merged (its base deltas folded in) and
    loaded by transformers alone, gives the held-out loss the run recorded; the checkpoint
    that the real ServerApp wrote names the base model's fingerprint."""
    import json

    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from fedpipe.fl.device_work import DeviceWork
    from fedpipe.models import model_fingerprint
    from fedpipe.runs.export import export_run

    state = json.loads((run / "checkpoints" / "round-0002" / "state.json").read_text())
    assert state["model_fingerprint"] == model_fingerprint(resolve_model("tiny-llama"))
    out = run.parent / "b-merged"
    export_run(run, out, format="merged")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    cfg = load_config(None, {**SMALL, "federated.rounds": 2})
    work = DeviceWork(cfg, device_id="evaluator", partition=-1, num_partitions=2)
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in work.batches(cfg.train.batch_size):
            logits = model(batch["input_ids"]).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            loss_sum += float(
                F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            )
            tokens += int((labels != -100).sum())
    assert loss_sum / tokens == pytest.approx(eval_loss, rel=1e-5)
