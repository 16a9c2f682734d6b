"""Instruction data through a device's round and the held-out evaluation, over a real
StageServer on 127.0.0.1 (tiny-llama): a chats JSONL becomes one masked row per example, the
first step's loss and the held-out loss are the unsplit model's answer loss on those rows."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fedpipe.config import FedpipeConfig
from fedpipe.data import (
    IGNORE_INDEX,
    BlockSampler,
    default_corpus,
    partition,
    tokenize_blocks,
    train_eval_split,
)
from fedpipe.fl.device_work import DeviceWork, RunSettings, evaluate_split
from fedpipe.models import load_causal_lm, load_tokenizer
from fedpipe.server.stage_server import StageServer


def _chats(path: Path, n: int = 24) -> Path:
    lines = []
    for i in range(n):
        chat = [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": f"What comes after {i}?"},
            {"role": "assistant", "content": f"{i + 1}."},
        ]
        lines.append(json.dumps({"messages": chat, "source": f"s{i % 3}"}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _config(data: Path, loss_on: str = "answers") -> FedpipeConfig:
    return FedpipeConfig().with_overrides(
        {
            "model.name": "tiny-llama",
            "train.seq_len": 96,
            "train.batch_size": 4,
            "train.local_steps": 2,
            "train.eval_batches": 2,
            "pipeline.microbatches": 2,
            "federated.data": str(data),
            "federated.partition": "iid",
            "federated.profiles": "loopback",
            "data.loss_on": loss_on,
        }
    )


def _unsplit_loss(work: DeviceWork, batches: list[dict[str, torch.Tensor]]) -> float:
    """The whole model's mean loss over the batches' counted tokens (fresh LoRA: the base)."""
    model = load_causal_lm(work.trainer.folder)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
            total += float(model(**batch).loss) * n
            tokens += n
    return total / tokens


def test_a_chat_round_trains_and_evaluates_on_the_answers(
    serve: Callable[..., StageServer], tmp_path: Path
) -> None:
    cfg = _config(_chats(tmp_path / "chats.jsonl"))
    server = serve(cfg)
    address = f"127.0.0.1:{server.port}"
    work = DeviceWork(cfg, device_id="dev-0", partition=0, num_partitions=2)
    assert work.labels is not None and work.counts is not None
    assert work.counts.rows == len(work.blocks) == 11  # its half of the 22 training chats
    pads = work.blocks == 256  # tiny-llama's byte tokenizer pads with its eos
    assert ((work.labels == IGNORE_INDEX) & ~pads).any(dim=1).all()  # the prompts are out
    evaluator = DeviceWork(cfg, device_id="evaluator", partition=-1, num_partitions=2)
    assert evaluator.labels is not None and len(evaluator.blocks) == 2  # 2 held-out chats
    adapters = work.trainer.adapters()
    held_out, tokens = evaluate_split(evaluator, adapters, RunSettings(stage_address=address), 0)
    assert tokens == int((evaluator.labels[:, 1:] != IGNORE_INDEX).sum())
    assert held_out == pytest.approx(_unsplit_loss(evaluator, list(evaluator.batches(4))), rel=1e-5)

    report = work.train(address, round_=0, token="")
    assert report.data == work.counts.metrics()
    sampler = BlockSampler(work.blocks, 4, seed=cfg.model.seed * 1000, labels=work.labels)
    first = sampler.batch(0)  # the round's first batch, trained from the initial adapters
    assert report.steps[0].tokens == int((first["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert report.steps[0].loss == pytest.approx(_unsplit_loss(work, [first]), rel=1e-5)


def test_loss_on_all_counts_the_prompts_too(tmp_path: Path) -> None:
    cfg = _config(_chats(tmp_path / "chats.jsonl"), loss_on="all")
    work = DeviceWork(cfg, device_id="dev-0", partition=0, num_partitions=2)
    assert work.labels is not None
    pads = work.blocks == 256
    assert torch.equal(work.labels[~pads], work.blocks[~pads])


def test_plain_text_stays_in_blocks_whose_labels_are_their_ids() -> None:
    """The bundled corpus (plain text): blocks GPT-2 style, as before there were rows."""
    cfg = FedpipeConfig().with_overrides({"model.name": "tiny-llama"})
    work = DeviceWork(cfg, device_id="dev-0", partition=0, num_partitions=4)
    assert work.labels is None and work.counts is None
    tok = load_tokenizer(work.trainer.folder)
    train, _ = train_eval_split(default_corpus(), eval_fraction=0.1, seed=0)
    mine = partition(train, 4, scheme="by-source", seed=0)[0]
    assert torch.equal(work.blocks, tokenize_blocks(mine, tok, cfg.train.seq_len))
    for batch in work.batches(8):
        assert torch.equal(batch["labels"], batch["input_ids"])


def test_packed_rows_train_and_evaluate_as_padded_rows(
    serve: Callable[..., StageServer], tmp_path: Path
) -> None:
    """data.packing through a device's round and the held-out evaluation: fewer rows with their
    segments; the held-out answer loss is the one of the same examples padded one per row."""
    data = _chats(tmp_path / "chats.jsonl")
    longer = {"train.eval_batches": "8", "train.seq_len": "256"}  # a few chats fit a row
    cfg = _config(data).with_overrides({**longer, "data.packing": "true"})
    padded_cfg = _config(data).with_overrides(longer)
    server = serve(cfg)
    address = f"127.0.0.1:{server.port}"
    work = DeviceWork(cfg, device_id="dev-0", partition=0, num_partitions=2)
    padded = DeviceWork(padded_cfg, device_id="dev-0", partition=0, num_partitions=2)
    assert work.segments is not None and padded.segments is None
    assert len(work.blocks) < len(padded.blocks) == 11
    evaluator = DeviceWork(cfg, device_id="evaluator", partition=-1, num_partitions=2)
    reference = DeviceWork(padded_cfg, device_id="evaluator", partition=-1, num_partitions=2)
    assert evaluator.segments is not None and len(reference.blocks) == 2
    adapters = work.trainer.adapters()
    held_out, tokens = evaluate_split(evaluator, adapters, RunSettings(stage_address=address), 0)
    assert tokens == int((reference.labels[:, 1:] != IGNORE_INDEX).sum())  # type: ignore[index]
    expected = _unsplit_loss(reference, list(reference.batches(4)))
    assert held_out == pytest.approx(expected, rel=1e-5)
    report = work.train(address, round_=0, token="")
    assert all(math.isfinite(step.loss) for step in report.steps)
    assert report.data == work.counts.metrics()  # type: ignore[union-attr]
