"""``fedpipe bench privacy``: what an honest-but-curious server learns, and what defences cost.

For every cut (head blocks) and every defence setting, one device trains for a few steps on its
private text through a real StageServer over loopback gRPC; the server records what the stage
link carries (:mod:`fedpipe_bench.privacy_traffic`) and attacks it with what a server has: the
public base weights and public text of its own (:mod:`fedpipe_bench.privacy_attacks`).

Text: the bundled corpus (ten books of the King James Bible) split by book: the device's books
(private; a tenth of their chapters held out for the loss) and the server's (public). Defence:
per-token clipping to the median token norm the undefended run sent (activations and output
gradients each), plus Gaussian noise of ``strength * clip`` per coordinate on both channels.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from fedpipe.config import FedpipeConfig, load_config
from fedpipe.data import BlockSampler, default_corpus, tokenize_blocks, train_eval_split
from fedpipe.edge.runtime import split_batch
from fedpipe.models import load_config as load_hf_config
from fedpipe.models import load_tokenizer, resolve_model
from fedpipe.privacy import ChannelNoise, LinkAccountant, releases_so_far
from fedpipe.split import HeadStage, MiddleStage, TailStage, build_stage, split_layout
from fedpipe_bench.privacy_attacks import (
    LabelAttack,
    PublicGradients,
    ReconstructionAttack,
    label_features,
)
from fedpipe_bench.privacy_traffic import RunResult, record_training

__all__ = ["DEFAULT", "DEFENCE", "QUICK", "BenchSize", "run_privacy_bench"]

log = logging.getLogger(__name__)

DEFENCE = "privacy.activation_noise+privacy.gradient_noise"


@dataclass(frozen=True)
class BenchSize:
    """How big a bench run is."""

    model: str
    seq_len: int
    batch_size: int
    microbatches: int
    steps: int
    public_blocks: int
    eval_blocks: int
    cuts: tuple[int, ...]
    strengths: tuple[float, ...]  # noise multipliers of the defended rows
    lr: float = 2e-3


DEFAULT = BenchSize("default", 32, 4, 2, 4, 48, 8, (1, 2), (0.03, 0.1, 0.3))
QUICK = BenchSize("tiny-llama", 16, 4, 2, 2, 32, 4, (1,), (0.3,))


@dataclass
class _Data:
    batches: list[dict[str, Tensor]]
    releases: int  # how often the most-used private block was sent
    public: Tensor  # (N, T)
    held_out: Tensor  # (N, T)


@dataclass
class _Base:
    """The attacker's copy of the public base weights at one cut."""

    head: HeadStage
    tail: TailStage
    public_hidden: Tensor  # the public text's head output, (N, T, C)
    public_grads: PublicGradients  # and what its training would send up


def _data(size: BenchSize, folder: Path) -> _Data:
    tokenizer = load_tokenizer(folder)
    docs = default_corpus()
    books = sorted({d.source for d in docs})
    private = [d for d in docs if books.index(d.source) % 2 == 0]
    public = [d for d in docs if books.index(d.source) % 2 == 1]
    train, held_out = train_eval_split(private, eval_fraction=0.1, seed=0)
    need = size.steps * size.batch_size
    blocks = tokenize_blocks(train, tokenizer, size.seq_len, max_blocks=need)
    sampler = BlockSampler(blocks, size.batch_size, seed=0)
    return _Data(
        batches=[sampler.batch(i) for i in range(size.steps)],
        releases=releases_so_far([sampler.indices(i) for i in range(size.steps)]),
        public=tokenize_blocks(public, tokenizer, size.seq_len, max_blocks=size.public_blocks),
        held_out=tokenize_blocks(held_out, tokenizer, size.seq_len, max_blocks=size.eval_blocks),
    )


def _config(size: BenchSize, head_layers: int) -> FedpipeConfig:
    return load_config(
        None,
        {
            "model.name": size.model,
            "model.head_layers": head_layers,
            "model.tail_layers": 1,
            "train.batch_size": size.batch_size,
            "train.seq_len": size.seq_len,
            "train.lr": size.lr,
            "pipeline.microbatches": size.microbatches,
            "pipeline.schedule": "gpipe",
            "server.device": "cpu",
        },
    )


@torch.no_grad()
def _base(cfg: FedpipeConfig, folder: Path, public: Tensor) -> _Base:
    plan = split_layout(
        load_hf_config(folder),
        head_layers=cfg.model.head_layers,
        tail_layers=cfg.model.tail_layers,
        mode="u",
    )
    head = cast(HeadStage, build_stage(folder, plan, "head"))
    middle = cast(MiddleStage, build_stage(folder, plan, "middle"))
    tail = cast(TailStage, build_stage(folder, plan, "tail"))
    hidden = torch.cat([head(chunk) for chunk in public.split(cfg.train.batch_size)])
    x = torch.cat([middle(h) for h in hidden.split(cfg.train.batch_size)])
    with torch.enable_grad():
        grads = PublicGradients.of(tail, x, public, cfg.train.batch_size)
    return _Base(head, tail, hidden, grads)


def _median_norm(tensors: list[Tensor]) -> float:
    return float(torch.cat([t.norm(dim=-1).reshape(-1) for t in tensors]).median())


def _ids(run: RunResult, step: int, mb: int, microbatches: int) -> Tensor:
    return split_batch(run.batches[step], microbatches)[mb]["input_ids"]


def _reconstruction_acc(
    run: RunResult, base: _Base, public: Tensor, defend: ChannelNoise | None, m: int
) -> float:
    attack = ReconstructionAttack.fit(base.head, public, base.public_hidden, defend)
    hits = total = 0
    for (step, mb), activation in sorted(run.tap.activations.items()):
        ids = _ids(run, step, mb, m)
        hits += int((attack.predict(activation) == ids).sum())
        total += ids.numel()
    return hits / max(total, 1)


def _label_acc(
    run: RunResult, base: _Base, defend: ChannelNoise | None, size: BenchSize
) -> tuple[float, float]:
    """(attack accuracy, accuracy of the base model's own guess: the prior alone)."""
    public = base.public_grads
    attack = LabelAttack.fit(base.tail, public.features(defend), public.prior, public.labels)
    hits = prior_hits = total = 0
    tokens = size.batch_size * (size.seq_len - 1)  # the step's label count (no padding here)
    for key, grad in sorted(run.tap.output_grads.items()):
        d, prior = label_features(base.tail, run.tap.outputs[key], grad, tokens)
        truth = _ids(run, *key, size.microbatches)[:, 1:].reshape(-1)
        hits += int((attack.predict(d, prior) == truth).sum())
        prior_hits += int((prior.indices[:, 0] == truth).sum())
        total += truth.numel()
    return hits / max(total, 1), prior_hits / max(total, 1)


def _row(
    size: BenchSize,
    cfg: FedpipeConfig,
    data: _Data,
    base: _Base,
    run: RunResult,
    strength: float,
    clips: tuple[float, float],
    wall_s: float,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1234)  # the attacker's own noise draws
    act = ChannelNoise(clips[0], strength, gen) if strength > 0 else None
    grad = ChannelNoise(clips[1], strength, gen) if strength > 0 else None
    rec = _reconstruction_acc(run, base, data.public, act, size.microbatches)
    label, prior = _label_acc(run, base, grad, size)
    row: dict[str, Any] = {
        "head_layers": cfg.model.head_layers,
        "defence": DEFENCE if strength > 0 else "none",
        "strength": strength,
        "activation_clip": clips[0] if strength > 0 else None,
        "gradient_clip": clips[1] if strength > 0 else None,
        "reconstruction_acc": rec,
        "label_acc": label,
        "label_prior_acc": prior,
        "eval_loss": run.eval_loss,
        "eval_loss_defended": run.eval_loss_defended,
        "train_loss": run.train_loss,
        "epsilon": None,
        "delta": cfg.privacy.delta,
        "releases": data.releases,
        "wall_s": wall_s,
    }
    if strength > 0:
        accountant = LinkAccountant(strength, strength, size.seq_len, cfg.privacy.delta)
        row["epsilon"] = accountant.epsilon(data.releases, ("activations", "gradients"))
        row["epsilon_activations"] = accountant.epsilon(data.releases, ("activations",))
    return row


def _cut_rows(size: BenchSize, folder: Path, data: _Data, head_layers: int) -> list[dict[str, Any]]:
    cfg = _config(size, head_layers)
    base = _base(cfg, folder, data.public)
    start = time.perf_counter()
    plain = record_training(cfg, folder, data.batches, data.held_out)
    clips = (
        _median_norm(list(plain.tap.activations.values())),
        _median_norm(list(plain.tap.output_grads.values())),
    )
    rows = [_row(size, cfg, data, base, plain, 0.0, clips, time.perf_counter() - start)]
    _progress(rows[-1])
    for strength in size.strengths:
        defended = replace(
            cfg.privacy,
            activation_clip=clips[0],
            activation_noise=strength,
            gradient_clip=clips[1],
            gradient_noise=strength,
        )
        start = time.perf_counter()
        run = record_training(replace(cfg, privacy=defended), folder, data.batches, data.held_out)
        rows.append(_row(size, cfg, data, base, run, strength, clips, time.perf_counter() - start))
        _progress(rows[-1])
    none = rows[0]["eval_loss"]
    for row in rows:
        row["eval_loss_cost_pct"] = 100.0 * (row["eval_loss"] - none) / none
    return rows


def _progress(row: dict[str, Any]) -> None:
    log.info(
        "head %d, %s %.3g: reconstruction %.3f, label %.3f (prior %.3f), eval loss %.4f "
        "(defended link %.4f), train %.0f s",
        row["head_layers"],
        row["defence"],
        row["strength"],
        row["reconstruction_acc"],
        row["label_acc"],
        row["label_prior_acc"],
        row["eval_loss"],
        row["eval_loss_defended"],
        row["wall_s"],
    )


def _verdict(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Defended rows that at least halve both attacks at <= 2% held-out loss cost."""
    out = []
    for row in rows:
        none = next(
            r for r in rows if r["head_layers"] == row["head_layers"] and r["defence"] == "none"
        )
        if (
            row["defence"] != "none"
            and row["reconstruction_acc"] <= none["reconstruction_acc"] / 2
            and row["label_acc"] <= none["label_acc"] / 2
            and row["eval_loss_cost_pct"] <= 2.0
        ):
            out.append({k: row[k] for k in ("head_layers", "defence", "strength")})
    return out


def run_privacy_bench(size: BenchSize = DEFAULT) -> dict[str, Any]:
    """Every cut x defence setting: attack accuracies, held-out loss and epsilon (rows)."""
    torch.manual_seed(0)
    folder = resolve_model(size.model)
    data = _data(size, folder)
    start = time.perf_counter()
    rows = [row for cut in size.cuts for row in _cut_rows(size, folder, data, cut)]
    vocab = int(load_hf_config(folder).vocab_size)
    flat = torch.cat([b["input_ids"].reshape(-1) for b in data.batches])
    return {
        "model": size.model,
        "rows": rows,
        "halves_both_within_2pct": _verdict(rows),
        "chance_acc": 1.0 / vocab,
        "majority_token_acc": float(flat.bincount().max()) / flat.numel(),
        "settings": {
            "seq_len": size.seq_len,
            "batch_size": size.batch_size,
            "microbatches": size.microbatches,
            "steps": size.steps,
            "lr": size.lr,
            "public_blocks": int(data.public.shape[0]),
            "eval_blocks": int(data.held_out.shape[0]),
            "tail_layers": 1,
            "epsilon_unit": "one sample (a sequence of seq_len tokens), both channels",
        },
        "wall_s": time.perf_counter() - start,
        "median_row_wall_s": statistics.median(r["wall_s"] for r in rows) if rows else math.nan,
    }
