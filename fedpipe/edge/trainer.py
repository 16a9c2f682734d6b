"""One device's side of split training: its stages, adapters, optimizer and runs over the link.

A :class:`DeviceTrainer` holds only the device's layers (embeddings + head blocks, and in
the U-shaped split the tail blocks + final norm + LM head), with LoRA adapters on them. Each
round it opens a session on the StageServer, runs its local steps as pipelined split training,
and hands back its adapters and metrics; Flower aggregates the adapters.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedpipe.compress.delta import DeltaEncoder
from fedpipe.config import FedpipeConfig
from fedpipe.edge.planner.auto import DevicePlanner
from fedpipe.edge.runtime import DeviceRuntime, StepResult
from fedpipe.emulation import ComputeThrottle, DeviceProfile, LinkProfile, RealClock
from fedpipe.lora import (
    apply_lora,
    load_lora_state_dict,
    lora_parameters,
    lora_settings,
    lora_state_dict,
)
from fedpipe.lora.aggregation import BaseFold, split_deltas
from fedpipe.lora.freezing import freeze_blocks
from fedpipe.models import load_config, model_family, model_fingerprint, resolve_model
from fedpipe.models.cache import write_atomic
from fedpipe.privacy import Decorrelation, LabelResample, LinkDefence
from fedpipe.split import SplitTerms, build_device_stages, split_layout
from fedpipe.split.memory import device_param_bytes
from fedpipe.trace import Tracer
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.link_client import StageClient, StageSession

__all__ = [
    "DeviceTrainer",
    "TrainReport",
    "initial_device_adapters",
    "split_terms",
]

log = logging.getLogger(__name__)


def split_terms(config: FedpipeConfig, folder: Path) -> SplitTerms:
    """What a device built from ``config`` and ``folder`` (model fingerprint and cut)."""
    hf_config = load_config(folder)
    layout = split_layout(
        hf_config,
        head_layers=config.model.head_layers,
        tail_layers=config.model.tail_layers,
        mode=config.model.split,  # type: ignore[arg-type]
    )
    return SplitTerms.of(
        layout, fingerprint=model_fingerprint(folder), hidden_size=int(hf_config.hidden_size)
    )


def initial_device_adapters(config: FedpipeConfig, folder: Path) -> dict[str, torch.Tensor]:
    """The seeded device adapters of every cut the server offers (``model.cuts``), together.

    The ServerApp's global device state holds them all, so that a device of any offered cut
    finds its blocks; each cut's stages are built once, here, to read their adapters.
    """
    hf_config = load_config(folder)
    family = model_family(hf_config)
    settings = lora_settings(config)
    out: dict[str, torch.Tensor] = {}
    for head_layers, tail_layers in config.model.offered_cuts:
        layout = split_layout(
            hf_config,
            head_layers=head_layers,
            tail_layers=tail_layers,
            mode=config.model.split,  # type: ignore[arg-type]
        )
        for stage in build_device_stages(folder, layout):
            if stage is not None:
                state = lora_state_dict(apply_lora(stage, settings, family))
                out |= {k: v.detach().clone() for k, v in state.items() if k not in out}
    return out


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB (0 where the platform does not say).

    A device process's own peak; devices simulated in one process share one number.
    """
    try:
        import resource
    except ImportError:  # not on Windows
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes vs KiB


def _add_proximal_term(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], mu: float
) -> None:
    """FedProx: before each step, grad += mu * (w - w0), the gradient of mu/2 * ||w - w0||^2."""
    anchors = [p.detach().clone() for p in params]

    def pre_step(*_: object) -> None:
        with torch.no_grad():
            for p, anchor in zip(params, anchors, strict=True):
                if p.grad is not None:
                    p.grad.add_(p - anchor, alpha=mu)

    optimizer.register_step_pre_hook(pre_step)


@dataclass
class TrainReport:
    """What a device did in one round."""

    steps: list[StepResult] = field(default_factory=list)
    bytes_up: int = 0
    bytes_down: int = 0
    examples: int = 0
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0  # the process's peak resident memory so far (ru_maxrss)
    plan: dict[str, str | int | float] = field(default_factory=dict)  # pipeline.plan = auto
    # The device's own defences' figures (LinkAccountant.report(), the head's dCor); sent in a
    # record of their own, not with the metrics (devices may run different defences)
    privacy: dict[str, float] = field(default_factory=dict)
    # Instruction data: what became of the device's examples (ExampleCounts.metrics()), in a
    # record of its own (a device on plain text has none)
    data: dict[str, int] = field(default_factory=dict)
    # pipeline.delta: activation rows sent as differences / whole, and whether the server
    # resumed the device's cache from its last round (None: no delta coding)
    delta_rows: tuple[int, int] = (0, 0)
    delta_resumed: bool | None = None
    delta_reset_reason: str = ""  # why the server did not resume it

    @property
    def mean_loss(self) -> float:
        return statistics.fmean(s.loss for s in self.steps) if self.steps else float("nan")

    def metrics(self) -> dict[str, float | int]:
        """Flat metrics for Flower's MetricRecord (same keys from every device)."""
        times = [s.wall_s for s in self.steps] or [0.0]
        return {
            "num-examples": self.examples,
            "train-loss": self.mean_loss,
            "step-time-median-s": statistics.median(times),
            "step-time-max-s": max(times),
            "bytes-up": self.bytes_up,
            "bytes-down": self.bytes_down,
            "steps": len(self.steps),
            "wall-s": self.wall_s,
            "peak-rss-mb": self.peak_rss_mb,
            "stash-peak": max((s.stash_peak for s in self.steps), default=0),
            **self._delta_metrics(),
        }

    def _delta_metrics(self) -> dict[str, float | int]:
        if self.delta_resumed is None:
            return {}
        hits, misses = self.delta_rows
        return {
            "delta-hit-rate": hits / max(hits + misses, 1),
            "delta-resumed": int(self.delta_resumed),
        }


class DeviceTrainer:
    """The device's half of the split model and its training loop."""

    def __init__(
        self,
        config: FedpipeConfig,
        *,
        device_id: str,
        profile: DeviceProfile | None = None,
        folder: Path | None = None,
    ) -> None:
        self.config = config
        self.device_id = device_id
        self.profile = profile
        self.folder = folder or resolve_model(config.model.name)
        # device.weights: how this device stores its frozen weights (fedpipe.split.quant)
        self.weights = config.device.stored
        # pipeline.freeze: the adapters of blocks below this train nothing (the ServerApp's
        # decision, set each round by freeze_below)
        self.frozen_below = 0
        self._build((config.model.head_layers, config.model.tail_layers))
        self.tracer = Tracer()
        # Clipping and noise on what goes up the stage link; None (the default) sends as is.
        self.defence = LinkDefence.from_config(config.privacy)
        # privacy.decorrelation: the head learns to hide its tokens (a penalty beside the loss)
        weight = config.privacy.decorrelation
        self.decorrelation = Decorrelation(weight) if weight > 0 else None
        # privacy.label_resample: the gradient sent up lies about a share of the labels
        rate = config.privacy.label_resample
        self.label_resample = LabelResample(rate) if rate > 0 else None
        slowdown = profile.compute_slowdown if profile else 1.0
        self.throttle = ComputeThrottle(slowdown, RealClock()) if slowdown > 1.0 else None
        self.planner = DevicePlanner(self) if config.pipeline.plan == "auto" else None
        # Delta coding's cache and salt, kept across rounds (pipeline.delta_resume), and a
        # file that keeps them across processes (None: kept in memory only).
        self.delta: DeltaEncoder | None = None
        self.delta_path: Path | None = None
        # Where the planner's choice of cut outlives this process (a deployed device runs each
        # round's ClientApp in a new one); None: kept in memory only.
        self.cut_path: Path | None = None

    def _build(self, cut: tuple[int, int]) -> None:
        """This device's stages for ``cut`` (head, tail blocks), with fresh adapters."""
        config = self.config
        hf_config = load_config(self.folder)
        self.family = model_family(hf_config)
        self.layout = split_layout(
            hf_config,
            head_layers=cut[0],
            tail_layers=cut[1],
            mode=config.model.split,  # type: ignore[arg-type]
        )
        # What the StageServer checks on OpenSession: the same weights, the same cut.
        self.split = SplitTerms.of(
            self.layout,
            fingerprint=model_fingerprint(self.folder),
            hidden_size=int(hf_config.hidden_size),
        )
        head, tail = build_device_stages(self.folder, self.layout, weights=self.weights)
        if self.weights != "fp32":
            log.info(
                "[device %s] frozen weights stored as %s: %.1f MiB",
                self.device_id,
                self.weights,
                device_param_bytes(self.folder, self.layout, self.weights) / 2**20,
            )
        if tail is not None:
            tail.loss_chunk = config.train.loss_chunk
        settings = lora_settings(config)
        self.head = apply_lora(head, settings, self.family)
        self.tail = apply_lora(tail, settings, self.family) if tail is not None else None
        self._freeze(config)
        self.fold = BaseFold(self.head, self.tail)  # base deltas of `exact` / `stack`

    @property
    def cut(self) -> tuple[int, int]:
        """(head, tail) blocks this device runs now."""
        return self.layout.head_layers, self.layout.tail_layers

    def _freeze(self, config: FedpipeConfig) -> None:
        """Frozen-device mode trains nothing here; FFA-LoRA trains B only (A stays at init);
        the blocks below ``frozen_below`` train nothing (pipeline.freeze)."""
        for stage in (self.head, self.tail):
            for name, param in stage.named_parameters() if stage is not None else ():
                if not config.pipeline.device_trains or (
                    config.federated.aggregation == "ffa" and ".lora_A." in name
                ):
                    param.requires_grad_(False)
            if stage is not None and self.frozen_below:
                freeze_blocks(lora_parameters(stage), self.frozen_below)

    def freeze_below(self, blocks: int) -> None:
        """The round's frozen blocks (pipeline.freeze): the adapters of blocks below ``blocks``
        train nothing; a head whose blocks are all frozen runs forward only this round and
        asks for no input gradient (frozen-head mode). Earlier rounds' flags are reset first."""
        was = self.frozen
        if blocks < self.frozen_below:  # a new run in this process: train again, then freeze
            for stage in (self.head, self.tail):
                for param in lora_parameters(stage).values() if stage is not None else ():
                    param.requires_grad_(True)
        self.frozen_below = blocks
        self._freeze(self.config)
        if self.frozen and not was:
            log.info("[device %s] head frozen: it runs forward only", self.device_id)
            if self.planner is not None:
                self.planner.head_froze()

    @property
    def frozen(self) -> bool:
        """Frozen-device mode, or a head whose blocks are all frozen (pipeline.freeze): the
        head runs forward only, no input gradient comes down."""
        head_frozen = self.frozen_below >= self.layout.head_layers
        return not self.config.pipeline.device_trains or head_frozen

    # -- adapters ---------------------------------------------------------------------------
    def adapters(self) -> dict[str, torch.Tensor]:
        """The device's LoRA tensors (head and tail) under global keys."""
        state = lora_state_dict(self.head)
        if self.tail is not None:
            state.update(lora_state_dict(self.tail))
        return {k: v.detach().clone() for k, v in state.items()}

    def load_adapters(self, state: dict[str, torch.Tensor]) -> None:
        """Load the global adapters, and the base deltas (``*.base_delta``) that come with them
        under ``exact`` and ``stack`` aggregation (none: the original base weights)."""
        if self.planner is not None and self.planner.next_cut is not None:
            cut = self.planner.take_cut()  # chosen last round: the new round's adapters fit it
            log.info("[device %s] switching to cut %d+%d", self.device_id, *cut)
            old = self.cut
            self._build(cut)
            if cut != old:  # activations at the old cut are no reference for the new one
                self._forget_delta()
        state, deltas = split_deltas(state)
        # A run whose devices use different cuts carries every cut's blocks: take this one's.
        self.fold.set({k: v for k, v in deltas.items() if self.fold.owns(k)})
        for stage in (self.head, self.tail):
            if stage is not None:
                keys = set(lora_state_dict(stage))
                load_lora_state_dict(stage, {k: v for k, v in state.items() if k in keys})

    def parameters(self) -> list[torch.nn.Parameter]:
        params = [p for p in self.head.parameters() if p.requires_grad]
        if self.tail is not None:
            params += [p for p in self.tail.parameters() if p.requires_grad]
        return params

    def remember_cut(self, cut: tuple[int, int]) -> None:
        """Keep the planner's choice in ``cut_path`` (owner-only, written whole) so that the
        next round's process starts from it; the model and the offered cuts go with it."""
        if self.cut_path is None:
            return
        record = {
            "model": self.config.model.name,
            "cuts": [list(c) for c in self.config.model.offered_cuts],
            "cut": list(cut),
        }
        try:
            write_atomic(self.cut_path, json.dumps(record))  # mkstemp: owner-only
        except OSError as exc:  # the choice then holds for this process only
            log.warning("[device %s] cannot keep the chosen cut: %s", self.device_id, exc)

    def recall_cut(self) -> None:
        """Take up the cut an earlier round's planner chose (``cut_path``): it applies when
        this round's adapters load. Ignored unless it was chosen for this model and these
        offered cuts, and the planner is on."""
        if self.planner is None or self.cut_path is None or not self.cut_path.exists():
            return
        offered = [list(c) for c in self.config.model.offered_cuts]
        try:
            record = json.loads(self.cut_path.read_text())
            cut = tuple(int(v) for v in record["cut"])
            same = record["model"] == self.config.model.name and record["cuts"] == offered
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("[device %s] ignoring %s: %s", self.device_id, self.cut_path, exc)
            return
        if not same or list(cut) not in offered:
            log.info(
                "[device %s] %s is from another run's cuts; planning anew",
                self.device_id,
                self.cut_path,
            )
            return
        if cut != self.cut:
            self.planner.next_cut = (cut[0], cut[1])
            log.info("[device %s] the planner chose cut %d+%d last round", self.device_id, *cut)

    def _forget_delta(self) -> None:
        """Drop the delta cache (and its file): the server then resumes nothing either."""
        self.delta = None
        if self.delta_path is not None:
            self.delta_path.unlink(missing_ok=True)

    def delta_encoder(self, nbytes: int) -> DeltaEncoder | None:
        """The device's delta encoder kept across sessions: made on first use, or read from
        ``delta_path`` where set (written back after every session).

        None without delta coding or with ``pipeline.delta_resume = false`` (each session
        then starts its own cache). The server resumes its copy only if both caches'
        histories match (:mod:`fedpipe.server.delta_store`); else both start empty.
        """
        if not nbytes or not self.config.pipeline.delta_resume:
            return None
        if self.delta_path is not None:  # the file wins: another process may have trained
            self.delta = DeltaEncoder.load(self.delta_path, nbytes)
        if self.delta is None or self.delta.cache.max_bytes != nbytes:
            self.delta = DeltaEncoder(nbytes)
        return self.delta

    # -- training ---------------------------------------------------------------------------
    def session_request(self, *, round_: int, token: str) -> SessionRequest:
        """What this device asks of the StageServer for a round's session, from its settings
        (or its planner's codecs and rows): its split and the largest tensors it sends, which
        the server refuses to exceed."""
        cfg, p = self.config, self.config.pipeline
        up, down, grads = p.uplink_codec, p.downlink_codec, p.gradient_codec
        rows = -(-cfg.train.batch_size // p.microbatches)
        if self.planner is not None:  # the plan's codecs; any microbatch count fits
            (up, grads), rows = self.planner.session_codecs(), self.planner.declared_rows()
            down = up
        return SessionRequest(
            device_id=self.device_id,
            round=round_,
            token=token,
            split=self.split,
            downlink_codec=down,
            gradient_codec=grads,
            uplink_codec=up,
            learning_rate=cfg.train.lr,
            weight_decay=cfg.train.weight_decay,
            microbatch_size=rows,
            seq_len=cfg.train.seq_len,
            frozen_head=self.frozen,
            error_feedback=p.error_feedback,
            stochastic_rounding=p.stochastic_rounding,
            delta_cache_bytes=int(p.delta_cache_mb * 2**20) if p.delta else 0,
        )

    def connect(
        self,
        client: StageClient,
        *,
        optimizer: torch.optim.Optimizer | None,
        round_: int = 0,
        token: str = "",
        link: LinkProfile | None = None,
        schedule: str | None = None,
        tracer: Tracer | None = None,
    ) -> tuple[StageSession, DeviceRuntime]:
        """Open a session on the StageServer and the runtime that walks the schedule over it.

        ``link``, ``schedule`` and ``tracer`` default to the device's profile, its config and
        its own tracer; the caller closes the session (``with session:``).
        """
        cfg = self.config
        tracer = tracer or self.tracer
        request = self.session_request(round_=round_, token=token)
        session = client.open(
            request,
            delta=self.delta_encoder(request.delta_cache_bytes),
            delta_codec=cfg.pipeline.delta_codec,
            link=link or (self.profile.link if self.profile else None),
            link_seed=f"{self.device_id}/{round_}",
            tracer=tracer,
            timeout_s=cfg.pipeline.timeout_s,
        )
        runtime = DeviceRuntime(
            self.head,
            self.tail,
            session,
            optimizer=optimizer,
            schedule=schedule or cfg.pipeline.schedule,
            microbatches=cfg.pipeline.microbatches,
            max_in_flight=cfg.pipeline.max_in_flight or None,
            throttle=self.throttle,
            tracer=tracer,
            frozen_head=self.frozen,
            recompute_head=cfg.pipeline.recompute_head,
            transform_up=self.defence,
            head_penalty=self.decorrelation,
            tail_step=self.label_resample,
            dtype=cfg.device.dtype,
        )
        return session, runtime

    def train_round(
        self,
        client: StageClient,
        batches: list[dict[str, torch.Tensor]],
        *,
        round_: int = 0,
        token: str = "",
        proximal_mu: float = 0.0,
    ) -> TrainReport:
        """Run one round's local steps as pipelined split training; returns metrics.

        ``proximal_mu`` > 0 adds FedProx's ``mu/2 * ||w - w_round_start||^2`` to the device
        adapters' loss (as a gradient term before each optimizer step).
        """
        cfg = self.config
        params = self.parameters()
        optimizer = (  # frozen-device mode: nothing to optimize here
            torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
            if params
            else None
        )
        if proximal_mu > 0 and optimizer is not None:
            _add_proximal_term(optimizer, params, proximal_mu)
        report = TrainReport()
        start = time.perf_counter()
        session, runtime = self.connect(client, optimizer=optimizer, round_=round_, token=token)
        self._log_delta(session, round_)
        try:
            self._train_steps(session, runtime, batches, report, round_)
        finally:
            if self.delta is not None and self.delta_path is not None:
                self.delta.save(self.delta_path)  # for the next round's process
        report.plan = self.planner.report() if self.planner is not None else {}
        report.bytes_up, report.bytes_down = session.stats.bytes_up, session.stats.bytes_down
        if cfg.pipeline.delta:
            report.delta_rows, report.delta_resumed = session.delta_rows, session.delta_resumed
            report.delta_reset_reason = session.delta_reset_reason
        report.wall_s = time.perf_counter() - start
        report.peak_rss_mb = peak_rss_mb()
        dcor = self.decorrelation.take_mean() if self.decorrelation is not None else None
        if dcor is not None:  # the head's mean distance correlation with its tokens this round
            report.privacy["privacy-decorrelation"] = dcor
        return report

    def _train_steps(
        self,
        session: StageSession,
        runtime: DeviceRuntime,
        batches: list[dict[str, torch.Tensor]],
        report: TrainReport,
        round_: int,
    ) -> None:
        """The round's steps over ``session``, which this closes."""
        with session:
            if self.planner is not None:
                self.planner.begin(session, runtime)
            for step, batch in enumerate(batches):
                result = runtime.train_step(batch, step=step)
                if self.planner is not None:
                    self.planner.after_step(session, runtime, result, batch)
                report.steps.append(result)
                report.examples += int(batch["input_ids"].shape[0])
                log.info(
                    "[device %s] round %d step %d loss %.4f in %.2f s",
                    self.device_id,
                    round_,
                    step,
                    result.loss,
                    result.wall_s,
                )
            runtime.finish()  # the last step's server update, confirmed before reporting

    def _log_delta(self, session: StageSession, round_: int) -> None:
        """One line per round: whether the server resumed this device's delta cache."""
        if self.delta is None or not self.config.pipeline.delta:
            return
        if session.delta_resumed:
            log.info(
                "[device %s] round %d: delta cache resumed (%d samples)",
                self.device_id,
                round_,
                len(self.delta.cache),
            )
        else:
            log.info(
                "[device %s] round %d: delta cache starts empty: %s",
                self.device_id,
                round_,
                session.delta_reset_reason,
            )
