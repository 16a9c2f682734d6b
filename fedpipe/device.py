"""One device's side of split training: its stages, adapters, optimizer and runs over the link.

A :class:`DeviceTrainer` holds only the device's layers (embeddings + head blocks, and in
the U-shaped split the tail blocks + final norm + LM head), with LoRA adapters on them. Each
round it opens a session on the StageServer, runs its local steps as pipelined split training,
and hands back its adapters and metrics; Flower aggregates the adapters.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedpipe.config import FedpipeConfig
from fedpipe.link import ComputeThrottle, DeviceProfile, LinkProfile, RealClock
from fedpipe.models import load_config, model_family, model_fingerprint, resolve_model
from fedpipe.pipeline.device_runtime import DeviceRuntime, StepResult
from fedpipe.pipeline.trace import Tracer
from fedpipe.planner.auto import DevicePlanner
from fedpipe.privacy import LinkDefence
from fedpipe.split import (
    LoraSettings,
    SplitTerms,
    apply_lora,
    build_device_stages,
    load_lora_state_dict,
    lora_state_dict,
    plan_split,
)
from fedpipe.split.aggregation import BaseFold, split_deltas
from fedpipe.transport.client import StageClient, StageSession

__all__ = ["DeviceFailure", "DeviceTrainer", "RoundReport", "lora_settings", "split_terms"]

log = logging.getLogger(__name__)


def lora_settings(config: FedpipeConfig) -> LoraSettings:
    """The LoRA settings both sides derive from one config."""
    targets = tuple(t.strip() for t in config.model.lora_targets.split(",") if t.strip())
    return LoraSettings(
        r=config.model.lora_r,
        alpha=config.model.lora_alpha,
        targets=targets or None,
        seed=config.model.seed,
    )


def split_terms(config: FedpipeConfig, folder: Path) -> SplitTerms:
    """What a device built from ``config`` and ``folder`` (model fingerprint and cut)."""
    hf_config = load_config(folder)
    plan = plan_split(
        hf_config,
        head_layers=config.model.head_layers,
        tail_layers=config.model.tail_layers,
        mode=config.model.split,  # type: ignore[arg-type]
    )
    return SplitTerms.of(
        plan, fingerprint=model_fingerprint(folder), hidden_size=int(hf_config.hidden_size)
    )


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


class DeviceFailure(RuntimeError):
    """A device stopped mid-round (fault injection in simulations and tests)."""


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
class RoundReport:
    """What a device did in one round."""

    steps: list[StepResult] = field(default_factory=list)
    bytes_up: int = 0
    bytes_down: int = 0
    examples: int = 0
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0  # the process's peak resident memory so far (ru_maxrss)
    plan: dict[str, str | int | float] = field(default_factory=dict)  # pipeline.plan = auto
    privacy: dict[str, float] = field(default_factory=dict)  # LinkAccountant.report(), if noised

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
            **self.privacy,
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
        hf_config = load_config(self.folder)
        self.family = model_family(hf_config)
        self.plan = plan_split(
            hf_config,
            head_layers=config.model.head_layers,
            tail_layers=config.model.tail_layers,
            mode=config.model.split,  # type: ignore[arg-type]
        )
        # What the StageServer checks on OpenSession: the same weights, the same cut.
        self.split = SplitTerms.of(
            self.plan,
            fingerprint=model_fingerprint(self.folder),
            hidden_size=int(hf_config.hidden_size),
        )
        head, tail = build_device_stages(self.folder, self.plan)
        settings = lora_settings(config)
        self.head = apply_lora(head, settings, self.family)
        self.tail = apply_lora(tail, settings, self.family) if tail is not None else None
        self._freeze(config)
        self.fold = BaseFold(self.head, self.tail)  # base deltas of `exact` / `stack`
        self.tracer = Tracer()
        # Clipping and noise on what goes up the stage link; None (the default) sends as is.
        self.defence = LinkDefence.from_config(config.privacy)
        slowdown = profile.compute_slowdown if profile else 1.0
        self.throttle = ComputeThrottle(slowdown, RealClock()) if slowdown > 1.0 else None
        self.planner = DevicePlanner(self) if config.pipeline.plan == "auto" else None

    def _freeze(self, config: FedpipeConfig) -> None:
        """Frozen-device mode trains nothing here; FFA-LoRA trains B only (A stays at init)."""
        for stage in (self.head, self.tail):
            for name, param in stage.named_parameters() if stage is not None else ():
                if not config.pipeline.device_trains or (
                    config.federated.aggregation == "ffa" and ".lora_A." in name
                ):
                    param.requires_grad_(False)

    @property
    def frozen(self) -> bool:
        """Frozen-device mode: the head runs forward only, no input gradient comes down."""
        return not self.config.pipeline.device_trains

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
        state, deltas = split_deltas(state)
        self.fold.set(deltas)
        head_keys = set(lora_state_dict(self.head))
        load_lora_state_dict(self.head, {k: v for k, v in state.items() if k in head_keys})
        if self.tail is not None:
            load_lora_state_dict(self.tail, {k: v for k, v in state.items() if k not in head_keys})

    def parameters(self) -> list[torch.nn.Parameter]:
        params = [p for p in self.head.parameters() if p.requires_grad]
        if self.tail is not None:
            params += [p for p in self.tail.parameters() if p.requires_grad]
        return params

    # -- training ---------------------------------------------------------------------------
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
        p = cfg.pipeline
        up, down, grads = p.uplink_codec, p.downlink_codec, p.gradient_codec
        rows = -(-cfg.train.batch_size // p.microbatches)
        if self.planner is not None:  # the plan's codecs; any microbatch count fits
            (up, grads), rows = self.planner.session_codecs(), self.planner.declared_rows()
            down = up
        session = client.open_session(
            device_id=self.device_id,
            token=token,
            round_=round_,
            lr=cfg.train.lr,
            weight_decay=cfg.train.weight_decay,
            uplink_codec=up,
            downlink_codec=down,
            gradient_codec=grads,
            error_feedback=cfg.pipeline.error_feedback,
            stochastic_rounding=cfg.pipeline.stochastic_rounding,
            delta_cache_bytes=int(cfg.pipeline.delta_cache_mb * 2**20) if cfg.pipeline.delta else 0,
            link=link or (self.profile.link if self.profile else None),
            link_seed=f"{self.device_id}/{round_}",
            tracer=tracer,
            timeout_s=cfg.pipeline.timeout_s,
            split=self.split,
            # The largest tensors this device sends: the server refuses bigger ones.
            microbatch_size=rows,
            seq_len=cfg.train.seq_len,
            frozen_head=self.frozen,
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
        fail_after_steps: int | None = None,
    ) -> RoundReport:
        """Run one round's local steps as pipelined split training; returns metrics.

        ``proximal_mu`` > 0 adds FedProx's ``mu/2 * ||w - w_round_start||^2`` to the device
        adapters' loss (as a gradient term before each optimizer step). ``fail_after_steps``
        is fault injection for tests: the device drops its stream after that many steps and
        raises :class:`DeviceFailure`, as a device that vanishes would.
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
        report = RoundReport()
        start = time.perf_counter()
        session, runtime = self.connect(client, optimizer=optimizer, round_=round_, token=token)
        with session:
            if self.planner is not None:
                self.planner.begin(session, runtime)
            for step, batch in enumerate(batches):
                if fail_after_steps is not None and step >= fail_after_steps:
                    session.abort()
                    raise DeviceFailure(
                        f"device {self.device_id} vanished in round {round_} (injected)"
                    )
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
        report.plan = self.planner.report() if self.planner is not None else {}
        report.bytes_up, report.bytes_down = session.stats.bytes_up, session.stats.bytes_down
        report.wall_s = time.perf_counter() - start
        report.peak_rss_mb = peak_rss_mb()
        return report
