"""``fedpipe bench privacy``: what an honest-but-curious server learns, and what defences cost.

For every cut (head blocks) and every defence setting, one device trains on its private text
through a real StageServer over loopback gRPC; the server records what the stage link carries
(:mod:`fedpipe_bench.privacy_traffic`) and attacks it (:mod:`fedpipe_bench.privacy_attacks`)
twice:

- **fixed**: fitted once on what the public base weights make of the server's own public text,
  undefended (an attacker that ignores the defence);
- **adaptive**: fitted after the round on what the server then holds: the device's adapters
  (they reach the ServerApp through Flower every round) run on the public text, the server's
  own middle output for it, and the defence the device runs (its settings are the run's, known
  to the server), with the attacker's own noise draws. A defence counts only against this one.

Text: the bundled corpus (ten books of the King James Bible). The held-out set is the one the
run's evaluator uses (``federated.eval_fraction`` of the documents, seeded by ``model.seed``);
of the rest, the device's books are its private text and the other books the server's public
text. Held-out loss is fedpipe's evaluator's: clean activations through the trained model.

Defences (``privacy.*``; a strength is the noise multiplier, the penalty's weight or the rate):

- ``clip``: per-token clipping at the median token norm the undefended run sent (activations
  and output gradients each), then isotropic Gaussian noise of ``strength * clip``;
  ``clip-activations`` the same on the activations only;
- ``token`` / ``token-dim``: noise scaled to each token (and dimension), nothing clipped;
- ``decorrelation``: the head trained against a distance-correlation penalty (NoPeek);
- ``label-resample``: the gradient sent up taken against labels drawn from the device's own
  prediction at that rate;
- combinations joined with ``+`` (the second part's strength in its own column).
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
from fedpipe.data import (
    BlockSampler,
    default_corpus,
    held_out_blocks,
    tokenize_blocks,
    train_eval_split,
)
from fedpipe.edge.runtime import split_batch
from fedpipe.messages import Kind
from fedpipe.models import load_config as load_hf_config
from fedpipe.models import load_tokenizer, resolve_model
from fedpipe.privacy import LabelResample, LinkAccountant, LinkDefence, releases_so_far
from fedpipe.split import HeadStage, MiddleStage, TailStage, build_stage, split_layout
from fedpipe_bench.privacy_attacks import (
    LabelAttack,
    Prior,
    PublicGradients,
    ReconstructionAttack,
    label_features,
)
from fedpipe_bench.privacy_traffic import RunResult, record_training

__all__ = ["DEFAULT", "QUICK", "BenchSize", "Setting", "run_privacy_bench"]

log = logging.getLogger(__name__)

ATTACKERS = ("fixed", "adaptive")
_ATTACKER_SEED = 1234  # the attacker's own random draws
_NOISE = ("clip", "clip-activations", "token", "token-dim")  # the parts that add noise
_PRIOR_ONLY = 1e6  # a prior weight at which the model's own prediction decides alone
_DEVICE_SEED = 0  # the device's draws, seeded here for repeatable rows (a real device: the OS)


@dataclass(frozen=True)
class Setting:
    """One defence at one strength, as the bench sets it in ``[privacy]``.

    ``defence`` joins parts with ``+``: ``clip`` (both channels) or ``clip-activations``,
    ``token``, ``token-dim`` (noise at the multiplier ``strength``), ``decorrelation`` (without
    noise: weight ``strength``) and ``label-resample`` (without noise: rate ``strength``).
    Beside noise, the penalty's weight and the rate are ``decorrelation`` and
    ``label_resample``.
    """

    defence: str
    strength: float = 0.0
    decorrelation: float = 0.0
    label_resample: float = 0.0

    def overrides(self, clips: tuple[float, float]) -> dict[str, Any]:
        """``privacy.*`` of this setting; ``clips`` are the undefended run's median norms."""
        s, out = self.strength, {}
        parts = self.defence.split("+")
        noise = any(p in _NOISE for p in parts)  # then strength is the noise multiplier
        for part in parts:
            if part == "none":
                continue
            if part in ("clip", "clip-activations"):
                out |= {"mechanism": "clip", "activation_clip": clips[0], "activation_noise": s}
                if part == "clip":
                    out |= {"gradient_clip": clips[1], "gradient_noise": s}
            elif part in ("token", "token-dim"):
                out |= {"mechanism": part, "activation_noise": s, "gradient_noise": s}
            elif part == "decorrelation":
                out["decorrelation"] = self.decorrelation if noise else s
            elif part == "label-resample":
                out["label_resample"] = self.label_resample if noise else s
            else:
                raise ValueError(f"unknown defence {part!r} in {self.defence!r}")
        return out


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
    settings: tuple[Setting, ...]  # the defended rows (an undefended run comes first)
    lr: float = 2e-3
    # Deeper cuts, each run undefended and with these settings only (a sample of the sweep)
    deeper_cuts: tuple[int, ...] = ()
    deeper_settings: tuple[Setting, ...] = ()
    # Settings trained again with other device seeds (first cut, no attacks): how much the
    # held-out loss moves from one draw of the device's noise to the next
    spread: tuple[Setting, ...] = ()
    spread_seeds: tuple[int, ...] = (1, 2, 3)


def _sweep(defence: str, strengths: tuple[float, ...], **beside: float) -> list[Setting]:
    return [Setting(defence, s, **beside) for s in strengths]


DEFAULT = BenchSize(
    "default",
    32,
    4,
    2,
    16,
    64,
    16,
    (1,),
    (
        *_sweep("clip", (0.01, 0.03, 0.1)),
        *_sweep("token", (0.01, 0.03, 0.1)),
        *_sweep("token-dim", (0.01, 0.03, 0.1)),
        *_sweep("decorrelation", (1.0, 10.0, 100.0)),
        *_sweep("label-resample", (0.5, 0.7, 0.9)),
        *_sweep("clip-activations+label-resample", (0.03, 0.1), label_resample=0.7),
        Setting("decorrelation+token-dim", 0.03, decorrelation=10.0),
    ),
    deeper_cuts=(2,),
    deeper_settings=(
        Setting("clip", 0.03),
        Setting("clip", 0.1),
        Setting("token-dim", 0.03),
        Setting("label-resample", 0.7),
    ),
    spread=(Setting("clip", 0.03), Setting("token-dim", 0.03), Setting("label-resample", 0.7)),
)
QUICK = BenchSize(
    "tiny-llama",
    16,
    4,
    2,
    2,
    32,
    4,
    (1,),
    (
        Setting("clip", 0.3),
        Setting("token-dim", 0.3),
        Setting("label-resample", 0.7),
        Setting("decorrelation+token-dim", 0.3, decorrelation=1.0),
    ),
    spread=(Setting("clip", 0.3),),
    spread_seeds=(1, 2),
)


@dataclass
class _Data:
    batches: list[dict[str, Tensor]]
    releases: int  # how often the most-used private block was sent
    public: Tensor  # (N, T)
    held_out: Tensor  # (N, T)
    eval_fraction: float


@dataclass
class _Base:
    """The attacker's copy of the public base weights at one cut, and the fixed attacks."""

    head: HeadStage
    tail: TailStage
    public_hidden: Tensor  # the public text's base head output, (N, T, C)
    public_grads: PublicGradients  # and what training on it would send up
    reconstruction: ReconstructionAttack  # both fitted on all of the public text
    label: LabelAttack
    eval_loss: float  # the base model's held-out loss (before any training)

    def fixed_on(self, public: Tensor, blocks: int) -> _Attacker:
        """The fixed attacks fitted on the first ``blocks`` public blocks only."""
        grads, labels = self.public_grads, (public.shape[1] - 1) * blocks
        prior = Prior(grads.prior.values[:labels], grads.prior.indices[:labels])
        return _Attacker(
            ReconstructionAttack.fit(self.head, public[:blocks], self.public_hidden[:blocks]),
            LabelAttack.fit(self.tail, grads.features(None)[:labels], prior, grads.labels[:labels]),
            self.tail,
        )


def _data(size: BenchSize, folder: Path) -> _Data:
    cfg = _config(size, 1)
    tokenizer = load_tokenizer(folder)
    docs = default_corpus()
    train, held_out = train_eval_split(  # the split the run's evaluator makes
        docs, eval_fraction=cfg.federated.eval_fraction, seed=cfg.model.seed
    )
    books = sorted({d.source for d in docs})
    private = [d for d in train if books.index(d.source) % 2 == 0]
    public = [d for d in train if books.index(d.source) % 2 == 1]
    need = size.steps * size.batch_size
    blocks = tokenize_blocks(private, tokenizer, size.seq_len, max_blocks=need)
    sampler = BlockSampler(blocks, size.batch_size, seed=0)
    return _Data(
        batches=[sampler.batch(i) for i in range(size.steps)],
        releases=releases_so_far([sampler.indices(i) for i in range(size.steps)]),
        public=tokenize_blocks(public, tokenizer, size.seq_len, max_blocks=size.public_blocks),
        held_out=held_out_blocks(held_out, tokenizer, size.seq_len, size.eval_blocks),
        eval_fraction=cfg.federated.eval_fraction,
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


def _rows_per_message(size: BenchSize) -> int:
    return max(1, size.batch_size // size.microbatches)


@torch.no_grad()
def _base(cfg: FedpipeConfig, folder: Path, data: _Data) -> _Base:
    plan = split_layout(
        load_hf_config(folder),
        head_layers=cfg.model.head_layers,
        tail_layers=cfg.model.tail_layers,
        mode="u",
    )
    head = cast(HeadStage, build_stage(folder, plan, "head"))
    middle = cast(MiddleStage, build_stage(folder, plan, "middle"))
    tail = cast(TailStage, build_stage(folder, plan, "tail"))
    n = cfg.train.batch_size
    hidden = torch.cat([head(chunk) for chunk in data.public.split(n)])
    x = torch.cat([middle(h) for h in hidden.split(n)])
    with torch.enable_grad():
        grads = PublicGradients.of(tail, x, data.public, n)
    loss_sum, tokens = 0.0, 0
    for chunk in data.held_out.split(n):
        part, count = tail(middle(head(chunk)), chunk)
        loss_sum, tokens = loss_sum + float(part), tokens + int(count)
    return _Base(
        head,
        tail,
        hidden,
        grads,
        ReconstructionAttack.fit(head, data.public, hidden),
        LabelAttack.fit(tail, grads.features(None), grads.prior, grads.labels),
        loss_sum / max(tokens, 1),
    )


def _median_norm(tensors: list[Tensor]) -> float:
    return float(torch.cat([t.norm(dim=-1).reshape(-1) for t in tensors]).median())


def _ids(run: RunResult, step: int, mb: int, microbatches: int) -> Tensor:
    return split_batch(run.batches[step], microbatches)[mb]["input_ids"]


@dataclass
class _Attacker:
    """Both attacks and the tail the label attack reads gradients through."""

    reconstruction: ReconstructionAttack
    label: LabelAttack
    tail: TailStage


Features = list[tuple[Tensor, Prior, Tensor]]  # per message: (d, prior, true next tokens)


@dataclass
class _Traffic:
    """Stage-link traffic with the token ids behind it (recorded, or the attacker's own)."""

    activations: list[tuple[Tensor, Tensor]]  # (activation (b, T, C), ids (b, T))
    grads: list[tuple[Tensor, Tensor, Tensor]]  # (output (b, T, C), grad (b, T, C), ids)
    tokens: int  # the label count per step (the device's divisor)

    def features(self, tail: TailStage) -> Features:
        """The label attack's input for every gradient, read through ``tail``."""
        out = []
        for output, grad, ids in self.grads:
            d, prior = label_features(tail, output, grad, self.tokens)
            out.append((d, prior, ids[:, 1:].reshape(-1)))
        return out


def _recorded(run: RunResult, size: BenchSize) -> _Traffic:
    m = size.microbatches
    acts = [(a, _ids(run, *key, m)) for key, a in sorted(run.tap.activations.items())]
    grads = [
        (run.tap.outputs[key], g, _ids(run, *key, m))
        for key, g in sorted(run.tap.output_grads.items())
    ]
    return _Traffic(acts, grads, size.batch_size * (size.seq_len - 1))


@torch.no_grad()
def _simulated(run: RunResult, cfg: FedpipeConfig, ids: Tensor, size: BenchSize) -> _Traffic:
    """What a device holding the released adapters would send for ``ids`` (the attacker's
    public text), defended as the run's devices are, with the attacker's own random draws."""
    privacy = cfg.privacy
    defence = LinkDefence.from_config(privacy, seed=_ATTACKER_SEED)
    resample = (
        LabelResample(privacy.label_resample, seed=_ATTACKER_SEED)
        if privacy.label_resample > 0
        else None
    )
    rows = _rows_per_message(size)
    tail = cast(TailStage, run.released.tail)
    outputs = run.released.public_outputs
    assert outputs is not None
    acts = []
    for part in ids.split(rows):
        hidden = run.released.head(part)
        if defence is not None:
            hidden = defence(Kind.ACTIVATION, hidden)
        acts.append((hidden, part))
    with torch.enable_grad():
        public = PublicGradients.of(
            tail,
            outputs,
            ids,
            size.batch_size,
            relabel=resample.relabel if resample else None,
            scale=1.0 / (1.0 - resample.rate) if resample else 1.0,
        )
    grads = []
    for out, grad, part in zip(
        outputs.split(rows), public.grads.split(rows), ids.split(rows), strict=True
    ):
        if defence is not None:
            grad = defence(Kind.OUTPUT_GRAD, grad)
        grads.append((out, grad, part))
    return _Traffic(acts, grads, public.tokens)


def _reconstruction_acc(traffic: _Traffic, attack: ReconstructionAttack) -> float:
    hits = total = 0
    for activation, ids in traffic.activations:
        hits += int((attack.predict(activation) == ids).sum())
        total += ids.numel()
    return hits / max(total, 1)


def _label_acc(features: Features, attack: LabelAttack) -> tuple[float, float]:
    """(attack accuracy, accuracy of the prior's top guess alone)."""
    hits = prior_hits = total = 0
    for d, prior, truth in features:
        hits += int((attack.predict(d, prior) == truth).sum())
        prior_hits += int((prior.indices[:, 0] == truth).sum())
        total += truth.numel()
    return hits / max(total, 1), prior_hits / max(total, 1)


def _accuracy(traffic: _Traffic, attacker: _Attacker) -> dict[str, float]:
    """Accuracy of both attacks on ``traffic`` (and of the label prior alone)."""
    label, prior = _label_acc(traffic.features(attacker.tail), attacker.label)
    return {
        "reconstruction_acc": _reconstruction_acc(traffic, attacker.reconstruction),
        "label_acc": label,
        "label_prior_acc": prior,
    }


def _fit_label(tail: TailStage, features: Features) -> LabelAttack:
    return LabelAttack.fit(
        tail,
        torch.cat([d for d, _, _ in features]),
        Prior.cat([p for _, p, _ in features]),
        torch.cat([t for _, _, t in features]),
    )


def _fit_reconstruction(
    head: HeadStage, activations: list[tuple[Tensor, Tensor]]
) -> ReconstructionAttack:
    ids = torch.cat([i for _, i in activations])
    return ReconstructionAttack.fit(head, ids, torch.cat([a for a, _ in activations]))


def _adaptive(
    cfg: FedpipeConfig, run: RunResult, base: _Base, data: _Data, size: BenchSize
) -> _Attacker:
    """The attacker after the round.

    It simulates a device that holds the released adapters and runs the run's defence (with
    the attacker's own random draws) on its public text. Per attack, it compares a refit on
    that traffic with the fixed attack (and, for labels, the model's prior alone), each fitted
    on three quarters of the public text and scored on the last quarter's simulated traffic,
    and keeps the best, fitted on all of it. It never sees the private ids.
    """
    traffic = _simulated(run, cfg, data.public, size)
    tail = cast(TailStage, run.released.tail)
    features = traffic.features(tail)  # read once, used for every fit and check below
    cut = len(traffic.activations) * 3 // 4
    check = _Traffic(traffic.activations[cut:], traffic.grads[cut:], traffic.tokens)
    fixed = base.fixed_on(data.public, cut * _rows_per_message(size))

    refit = _fit_reconstruction(base.head, traffic.activations[:cut])
    use_refit_rec = _reconstruction_acc(check, refit) >= _reconstruction_acc(
        check, fixed.reconstruction
    )
    # Label candidates: refit on this traffic, the fixed attack, or the model's prior alone
    # (where the gradients mislead: a weight so large that the prior decides)
    refit_fit = _fit_label(tail, features[:cut])
    prior_only = replace(refit_fit, prior_weight=_PRIOR_ONLY)
    scores = {
        "refit": _label_acc(features[cut:], refit_fit)[0],
        "fixed": _label_acc(check.features(base.tail), fixed.label)[0],
        "prior": _label_acc(features[cut:], prior_only)[0],
    }
    choice = max(scores, key=lambda k: (scores[k], k == "refit"))
    reconstruction = (
        _fit_reconstruction(base.head, traffic.activations)
        if use_refit_rec
        else base.reconstruction
    )
    if choice == "fixed":
        return _Attacker(reconstruction, base.label, base.tail)
    label = _fit_label(tail, features)
    if choice == "prior":
        label = replace(label, prior_weight=_PRIOR_ONLY)
    return _Attacker(reconstruction, label, tail)


def _rows(
    size: BenchSize,
    cfg: FedpipeConfig,
    data: _Data,
    base: _Base,
    run: RunResult,
    setting: Setting,
    wall_s: float,
) -> list[dict[str, Any]]:
    """One row per attacker for one training run."""
    common: dict[str, Any] = {
        "head_layers": cfg.model.head_layers,
        "defence": setting.defence,
        "strength": setting.strength,
        "decorrelation": cfg.privacy.decorrelation,
        "label_resample": cfg.privacy.label_resample,
        "mechanism": cfg.privacy.mechanism if cfg.privacy.link_defended else None,
        "activation_clip": cfg.privacy.activation_clip or None,
        "gradient_clip": cfg.privacy.gradient_clip or None,
        "head_dcor": run.decorrelation,
        "eval_loss": run.eval_loss,
        "eval_loss_defended": run.eval_loss_defended,
        "base_eval_loss": base.eval_loss,
        "train_loss": run.train_loss,
        "epsilon": None,
        "delta": cfg.privacy.delta,
        "releases": data.releases,
        "wall_s": wall_s,
    }
    accountant = LinkAccountant.from_config(cfg.privacy, seq_len=size.seq_len)
    if accountant is not None:  # epsilon: both channels, only where both are noised
        report = accountant.report(data.releases)
        common["epsilon"] = report.get("privacy-epsilon")
        common["epsilon_activations"] = report.get("privacy-epsilon-activations")
    traffic = _recorded(run, size)
    fixed = _Attacker(base.reconstruction, base.label, base.tail)
    adaptive = _adaptive(cfg, run, base, data, size)
    return [
        {**common, "attacker": "fixed", **_accuracy(traffic, fixed)},
        {**common, "attacker": "adaptive", **_accuracy(traffic, adaptive)},
    ]


def _cut_rows(
    size: BenchSize, folder: Path, data: _Data, head_layers: int, settings: tuple[Setting, ...]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The attacked rows of one cut, and the repeats of ``size.spread`` (first cut only)."""
    cfg = _config(size, head_layers)
    base = _base(cfg, folder, data)
    clips = (0.0, 0.0)
    rows: list[dict[str, Any]] = []
    for setting in (Setting("none"), *settings):
        privacy = replace(cfg.privacy, **setting.overrides(clips))
        run_cfg = replace(cfg, privacy=privacy)
        start = time.perf_counter()
        run = record_training(
            run_cfg,
            folder,
            data.batches,
            data.held_out,
            public=data.public,
            defence_seed=_DEVICE_SEED,
        )
        wall = time.perf_counter() - start
        if setting.defence == "none":  # the clip defence's norms: what this run sent
            clips = (
                _median_norm(list(run.tap.activations.values())),
                _median_norm(list(run.tap.output_grads.values())),
            )
        rows += _rows(size, run_cfg, data, base, run, setting, wall)
        for row in rows[-2:]:
            _progress(row)
    spread = []
    if head_layers == size.cuts[0]:
        for setting in size.spread:
            spread += _spread_rows(size, cfg, folder, data, setting, clips)
    for row in rows + spread:
        none = next(r for r in rows if r["defence"] == "none")  # one run for both attackers
        row["eval_loss_cost_pct"] = (
            100.0 * (row["eval_loss"] - none["eval_loss"]) / none["eval_loss"]
        )
        gain = base.eval_loss - none["eval_loss"]  # what training bought, undefended
        row["training_gain_kept"] = (base.eval_loss - row["eval_loss"]) / gain if gain else None
    return rows, spread


def _spread_rows(
    size: BenchSize,
    cfg: FedpipeConfig,
    folder: Path,
    data: _Data,
    setting: Setting,
    clips: tuple[float, float],
) -> list[dict[str, Any]]:
    """``setting`` trained again with each of ``size.spread_seeds`` (held-out loss only)."""
    run_cfg = replace(cfg, privacy=replace(cfg.privacy, **setting.overrides(clips)))
    rows = []
    for seed in size.spread_seeds:
        run = record_training(run_cfg, folder, data.batches, data.held_out, defence_seed=seed)
        rows.append(
            {
                "head_layers": cfg.model.head_layers,
                "defence": setting.defence,
                "strength": setting.strength,
                "device_seed": seed,
                "eval_loss": run.eval_loss,
            }
        )
        log.info("head %d, %s %.3g, device seed %d: eval loss %.4f", cfg.model.head_layers,
                 setting.defence, setting.strength, seed, run.eval_loss)  # fmt: skip
    return rows


def _progress(row: dict[str, Any]) -> None:
    log.info(
        "head %d, %s %.3g, %s attacker: reconstruction %.3f, label %.3f (prior %.3f), "
        "eval loss %.4f (base %.4f), train %.0f s",
        row["head_layers"],
        row["defence"],
        row["strength"],
        row["attacker"],
        row["reconstruction_acc"],
        row["label_acc"],
        row["label_prior_acc"],
        row["eval_loss"],
        row["base_eval_loss"],
        row["wall_s"],
    )


def _undefended(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any]:
    return next(
        r
        for r in rows
        if r["head_layers"] == row["head_layers"]
        and r["defence"] == "none"
        and r["attacker"] == row["attacker"]
    )


def _verdict(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adaptive-attacker rows that at least halve both attacks at <= 2% held-out loss cost."""
    out = []
    for row in rows:
        none = _undefended(rows, row)
        if (
            row["attacker"] == "adaptive"
            and row["defence"] != "none"
            and row["reconstruction_acc"] <= none["reconstruction_acc"] / 2
            and row["label_acc"] <= none["label_acc"] / 2
            and row["eval_loss_cost_pct"] <= 2.0
        ):
            out.append({k: row[k] for k in ("head_layers", "defence", "strength")})
    return out


def _best(rows: list[dict[str, Any]], max_cost_pct: float = 2.0) -> list[dict[str, Any]]:
    """Per cut, the adaptive-attacker row within ``max_cost_pct`` whose worse attack keeps the
    smallest share of its undefended accuracy (the best trade-off found)."""
    out = []
    for cut in sorted({r["head_layers"] for r in rows}):
        candidates = []
        for row in rows:
            if row["head_layers"] != cut or row["attacker"] != "adaptive":
                continue
            if row["defence"] == "none" or row["eval_loss_cost_pct"] > max_cost_pct:
                continue
            none = _undefended(rows, row)
            kept = max(
                row["reconstruction_acc"] / max(none["reconstruction_acc"], 1e-12),
                row["label_acc"] / max(none["label_acc"], 1e-12),
            )
            candidates.append((kept, row))
        if candidates:
            kept, row = min(candidates, key=lambda c: c[0])
            keys = ("head_layers", "defence", "strength", "decorrelation")
            out.append(
                {
                    **{k: row[k] for k in keys},
                    "worse_attack_keeps": kept,
                    "eval_loss_cost_pct": row["eval_loss_cost_pct"],
                }
            )
    return out


def run_privacy_bench(size: BenchSize = DEFAULT) -> dict[str, Any]:
    """Every cut x defence setting x attacker: attack accuracies, held-out loss, epsilon."""
    torch.manual_seed(0)
    folder = resolve_model(size.model)
    data = _data(size, folder)
    start = time.perf_counter()
    plan = [(cut, size.settings) for cut in size.cuts]
    plan += [(cut, size.deeper_settings) for cut in size.deeper_cuts]
    rows, spread = [], []
    for cut, settings in plan:
        attacked, repeats = _cut_rows(size, folder, data, cut, settings)
        rows += attacked
        spread += repeats
    vocab = int(load_hf_config(folder).vocab_size)
    flat = torch.cat([b["input_ids"].reshape(-1) for b in data.batches])
    return {
        "model": size.model,
        "rows": rows,
        "halves_both_within_2pct": _verdict(rows),
        "best_within_2pct": _best(rows),
        "spread": spread,
        "chance_acc": 1.0 / vocab,
        "majority_token_acc": float(flat.bincount().max()) / flat.numel(),
        "settings": {
            "seq_len": size.seq_len,
            "batch_size": size.batch_size,
            "microbatches": size.microbatches,
            "steps": size.steps,
            "lr": size.lr,
            "device_seed": _DEVICE_SEED,
            "attacker_seed": _ATTACKER_SEED,
            "public_blocks": int(data.public.shape[0]),
            "eval_blocks": int(data.held_out.shape[0]),
            "held_out": (
                f"the run's evaluator's: federated.eval_fraction = {data.eval_fraction} of the "
                "documents (seed model.seed), blocks spread over all of them"
            ),
            "tail_layers": 1,
            "epsilon_unit": "one sample (a sequence of seq_len tokens), both channels",
        },
        "wall_s": time.perf_counter() - start,
        "median_row_wall_s": statistics.median(r["wall_s"] for r in rows) if rows else math.nan,
    }
