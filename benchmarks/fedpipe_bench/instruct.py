"""`fedpipe bench instruct`: did federated instruction tuning teach what was asked?

It runs ``examples/instruct.toml`` as ``fedpipe simulate --config examples/instruct.toml`` does
(fedpipe's own :func:`fedpipe.launch.run.simulate`: Flower's simulation engine, the StageServer,
the devices of the example's profiles, each with the questions of its own books), then
``fedpipe eval`` (:func:`fedpipe.runs.evaluate.evaluate_run`) on the held-out questions
(``examples/instruct/test.jsonl``: verses no device trained on): the base model and the run's
last checkpoint, merged, side by side. One JSON object: ``base`` and ``finetuned`` (answer loss,
exact match, contains, examples), the gain in exact match in points, the settings, the rounds
and the wall time of training and of evaluation.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedpipe.config import FedpipeConfig, list_text, load_config
from fedpipe.runs.evaluate import evaluate_run

__all__ = ["EXAMPLE", "HELD_OUT", "instruct_config", "instruct_report", "run_instruct_bench"]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "instruct.toml"
HELD_OUT = ROOT / "examples" / "instruct" / "test.jsonl"
_FIGURES = ("answer_loss", "exact_match", "contains", "examples", "answered", "samples")

Simulate = Callable[..., dict[str, Any]]


def instruct_config(overrides: dict[str, Any] | None = None) -> FedpipeConfig:
    """The example's settings, its data path made absolute, then ``overrides``."""
    base = load_config(EXAMPLE)
    data = Path(base.federated.data)
    absolute = {"federated.data": str(data if data.is_absolute() else ROOT / data)}
    return load_config(EXAMPLE, {**absolute, **(overrides or {})})


def _points(share: float | None) -> float | None:
    return None if share is None else round(100 * share, 1)


def instruct_report(
    config: FedpipeConfig,
    summary: dict[str, Any],
    record: dict[str, Any],
    *,
    train_wall_s: float,
    eval_wall_s: float,
) -> dict[str, Any]:
    """The bench's JSON object from the run's summary and ``fedpipe eval``'s record."""
    base = {k: record["base"][k] for k in _FIGURES}
    tuned = {k: record["finetuned"][k] for k in _FIGURES}
    gain = None
    if base["exact_match"] is not None and tuned["exact_match"] is not None:
        gain = round(100 * (tuned["exact_match"] - base["exact_match"]), 1)
    fed, train = config.federated, config.train
    return {
        "bench": "instruct",
        "example": str(EXAMPLE.relative_to(ROOT)),
        "held_out": str(Path(record["data"]).resolve().relative_to(ROOT))
        if Path(record["data"]).resolve().is_relative_to(ROOT)
        else record["data"],
        "model": config.model.name,
        "settings": {
            "devices": fed.num_devices,
            "profiles": list_text("federated.profiles", fed.profiles),
            "partition": fed.partition,
            "strategy": fed.strategy,
            "aggregation": fed.aggregation,
            "rounds": fed.rounds,
            "local_steps": train.local_steps,
            "batch_size": train.batch_size,
            "seq_len": train.seq_len,
            "lr": train.lr,
            "lora_r": config.model.lora_r,
            "loss_on": config.data.loss_on,
            "max_new_tokens": record["max_new_tokens"],
            "limit": record["limit"],
        },
        "rounds": record["round"],
        "run_ok": bool(summary.get("ok", False)),
        "run_problems": list(summary.get("problems", [])),
        "base": base,
        "finetuned": tuned,
        "exact_match_gain_points": gain,
        "base_exact_match_pct": _points(base["exact_match"]),
        "finetuned_exact_match_pct": _points(tuned["exact_match"]),
        "train_wall_s": round(train_wall_s, 1),
        "eval_wall_s": round(eval_wall_s, 1),
        "wall_s": round(train_wall_s + eval_wall_s, 1),
    }


def run_instruct_bench(
    *,
    overrides: dict[str, Any] | None = None,
    limit: int | None = None,
    max_new_tokens: int = 16,
    runs_dir: Path | None = None,
    held_out: Path = HELD_OUT,
    simulate: Simulate | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Train the example's federation, then evaluate base and fine-tuned on ``held_out``.

    ``simulate`` (default: fedpipe's own) is called as :func:`fedpipe.launch.run.simulate`;
    ``runs_dir`` None: a temporary folder, removed afterwards.
    """
    config = instruct_config(overrides)
    if simulate is None:
        from fedpipe.launch.run import simulate as simulate  # deferred: Flower, Ray

    with tempfile.TemporaryDirectory(prefix="fedpipe-bench-instruct-") as tmp:
        where = Path(runs_dir) if runs_dir is not None else Path(tmp)
        name = f"instruct-{time.strftime('%Y%m%d-%H%M%S')}"
        start = time.perf_counter()
        summary = simulate(config, name=name, runs_dir=where, progress=progress)
        train_wall = time.perf_counter() - start
        if not summary.get("ok", False):
            problems = "; ".join(map(str, summary.get("problems", []))) or "no reason given"
            raise RuntimeError(f"instruct bench: the federated run failed: {problems}")
        start = time.perf_counter()
        record = evaluate_run(
            where / name,
            held_out,
            max_new_tokens=max_new_tokens,
            limit=limit,
            command=f"fedpipe bench instruct (run {name})",
        )
        eval_wall = time.perf_counter() - start
    return instruct_report(config, summary, record, train_wall_s=train_wall, eval_wall_s=eval_wall)
