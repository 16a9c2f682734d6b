"""``pipeline.plan = "auto"``: a device measures, plans, trains with its plan, and re-plans.

At its first session the device probes the link on the session's stream, runs its first two
steps with the configured settings (the server's compute comes from the second step's replies:
the first warms both sides), times its own ops per microbatch size, and plans. The plan's
microbatches, schedule and in-flight cap apply from the next step. Codecs are fixed per
session on the server's side (its downlink codec is agreed at OpenSession, and a token opens
one session per round), so within a session the plan keeps the session's codecs, and a better
codec pair takes effect from the next session. Each later session probes the link again (11
ECHOs); when its RTT or the time a message takes either way has moved by more than
``pipeline.replan_drift`` since the plan, the device re-plans and logs why.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from fedpipe.config import FedpipeConfig
from fedpipe.edge.planner.measure import (
    calibrate,
    probe_link,
    server_times,
    time_block,
    time_codecs,
    time_device_ops,
)
from fedpipe.edge.planner.plan import (
    LinkFigures,
    Measured,
    Options,
    StepPlan,
    divisors,
    figures_for_cut,
    link_drift,
    plan_step,
    with_frozen_head,
)
from fedpipe.edge.runtime import DeviceRuntime, StepResult
from fedpipe.emulation import ComputeThrottle
from fedpipe.split.agreement import SplitTerms
from fedpipe.split.layout import SplitLayout
from fedpipe.split.memory import device_param_bytes
from fedpipe.trace import Event, Tracer
from fedpipe.wire.link_client import StageSession

__all__ = ["DevicePlanner", "PlannedDevice"]

log = logging.getLogger(__name__)


class PlannedDevice(Protocol):
    """What the planner reads of the device it plans for (a :class:`~fedpipe.edge.trainer.
    DeviceTrainer`): its settings and cut, its stages to time, its trace, where to keep a cut."""

    config: FedpipeConfig
    device_id: str
    folder: Path
    layout: SplitLayout
    weights: str  # device.weights: the storage its parameters are counted at
    split: SplitTerms
    tracer: Tracer
    throttle: ComputeThrottle | None
    head: nn.Module
    tail: nn.Module | None

    @property
    def cut(self) -> tuple[int, int]: ...

    @property
    def frozen(self) -> bool: ...

    def remember_cut(self, cut: tuple[int, int]) -> None: ...


class DevicePlanner:
    """One device's plan across its sessions (kept by its device trainer)."""

    def __init__(self, trainer: PlannedDevice) -> None:
        self.trainer = trainer
        cfg = trainer.config
        self.pipe, self.train = cfg.pipeline, cfg.train
        layout = trainer.layout
        self.cut = f"{layout.mode}:{layout.head_layers}+{layout.tail_layers}"
        # Cuts the server offers (model.cuts): the first plan picks one; it applies from the
        # next round, whose adapters the device then loads into stages built for it.
        self.cuts = {f"{trainer.layout.mode}:{h}+{t}": (h, t) for h, t in cfg.model.offered_cuts}
        self.per_cut: dict[str, Measured] = {}
        self.next_cut: tuple[int, int] | None = None
        self.cut_plan: StepPlan | None = None  # the best plan over every offered cut
        self.cut_chosen = len(self.cuts) < 2
        self.figures: Measured | None = None  # compute figures (the link is replaced per plan)
        self.plan: StepPlan | None = None  # what this session runs
        self.best: StepPlan | None = None  # the best plan, whatever the session's codecs
        self.link: LinkFigures | None = None  # this session's probe
        self.why = ""  # why the last plan was made
        self.walls: list[float] = []  # this session's steps under the plan
        self.replan = ""  # why the next session must plan anew (its figures changed)
        self._mark: int | None = None  # trace events before the step the plan reads
        self._run_mark: int | None = None  # trace events before the plan's steps to learn from

    # -- what a session is opened with ---------------------------------------------------------
    def session_codecs(self) -> tuple[str, str]:
        """(activation, gradient) codecs to open the next session with."""
        if self.best is not None:
            return self.best.codec, self.best.gradient_codec
        return self.pipe.uplink_codec, self.pipe.gradient_codec or self.pipe.uplink_codec

    def declared_rows(self) -> int:
        """Rows to declare at OpenSession: the whole batch, so any microbatch count fits."""
        return self.train.batch_size

    # -- the session's life --------------------------------------------------------------------
    def begin(self, session: StageSession, runtime: DeviceRuntime) -> None:
        """Probe the link; re-plan if it drifted since the plan; apply the plan to ``runtime``."""
        self.walls, self._mark = [], None  # an unplanned device starts over each session
        shape = (self.declared_rows(), self.train.seq_len, self.trainer.split.hidden_size)
        self.link = probe_link(session, shape)  # the largest message the session may send
        log.info("[device %s] link probe: %s", self.trainer.device_id, self.link)
        if self.plan is None or self.plan.link is None:
            return  # the first session: the plan follows its first step
        assert self.figures is not None
        rows = self.train.batch_size // self.plan.microbatches
        nbytes = self.figures.message_bytes[self.plan.codec, rows]
        why = link_drift(self.plan.link, self.link, self.pipe.replan_drift, nbytes)
        why, self.replan = why or self.replan, ""
        if why:
            self._make(session, f"re-planned: {why}")
        else:  # the same link: the same plan, priced with the calibrated figures
            self.best = self._best(self.plan.link)
            self.plan = self._within(session, self.plan.link)
        self._apply(runtime)

    def after_step(
        self,
        session: StageSession,
        runtime: DeviceRuntime,
        result: StepResult,
        batch: dict[str, torch.Tensor],
    ) -> None:
        """StepPlan after the first session's second step; record later steps' times.

        The first step warms both sides (allocators, caches, the server's new adapter); its
        server times run slow, so the plan reads the second step's replies only.
        """
        if self.figures is not None:
            if not self.walls:  # the first step under the plan warms its sizes
                self._run_mark = len(self.trainer.tracer.events)
            self.walls.append(result.wall_s)
            return
        if self._mark is None:
            self._mark = len(self.trainer.tracer.events)  # step 0 ends here
            return
        rows = self.train.batch_size // result.microbatches
        self.figures = self._measure(batch, rows, self.trainer.tracer.events[self._mark :])
        self._make(session, "first plan, from this session's measurements")
        self._apply(runtime)

    def head_froze(self) -> None:
        """The head trains nothing from this round on (pipeline.freeze): its backward and the
        gradient down leave the figures, and the next session plans anew."""
        if self.figures is not None and not self.figures.frozen_head:
            self.figures = with_frozen_head(self.figures)
            self.replan = "the head froze (pipeline.freeze): no head backward, no gradient down"

    def take_cut(self) -> tuple[int, int]:
        """The cut chosen for the next round; the planner starts over with it (measures anew)."""
        assert self.next_cut is not None
        cut, self.next_cut = self.next_cut, None
        self.cut = f"{self.trainer.layout.mode}:{cut[0]}+{cut[1]}"
        self.figures = self.plan = self.best = None
        return cut

    def report(self) -> dict[str, str | int | float]:
        """The plan this session ran, its predicted and measured step time, the link probed.

        Called once at the session's end (it also calibrates the figures for the next one).
        """
        if self.plan is None:
            return {}
        out = self.plan.as_dict()
        if self.walls:
            measured = statistics.median(self.walls)
            out["measured_s"] = round(measured, 4)
            out["error"] = round(self.plan.predicted_s / measured - 1, 4)
        if self.best is not None and self._codecs(self.best) != self._codecs(self.plan):
            out["next"] = str(self.best)  # codecs change from the next session
        if self.cut_plan is not None and self.cut_plan.cut != self.plan.cut:
            out["next"] = str(self.cut_plan)  # the cut changes from the next round
        out["why"] = self.why
        self._calibrate()  # the next session's plan uses what these steps took
        return out

    # -- planning ------------------------------------------------------------------------------
    def _measure(self, batch: dict[str, torch.Tensor], rows: int, events: list[Event]) -> Measured:
        trainer, pipe = self.trainer, self.pipe
        sizes = [self.train.batch_size // m for m in divisors(self.train.batch_size)]
        throttle = trainer.throttle.run if trainer.throttle else None
        device, stash = time_device_ops(trainer.head, trainer.tail, batch, sizes, throttle=throttle)
        shape = (1, self.train.seq_len, trainer.split.hidden_size)
        nbytes, codec_s = time_codecs(shape, pipe.codec_choices, sizes)
        rows = min(device, key=lambda b: abs(b - rows))  # the step's size (or the nearest)
        step = Tracer()
        step.events = list(events)
        server, s_opt, c_opt = server_times(step, device, rows)
        budget = 0
        if pipe.memory_cap_mb > 0:
            params = device_param_bytes(trainer.folder, trainer.layout, trainer.weights)
            budget = max(1, int(pipe.memory_cap_mb * 2**20) - params)
        assert self.link is not None, "begin() probes the link first"
        figures = Measured(
            batch_size=self.train.batch_size,
            device=device,
            server=server,
            link=self.link,
            message_bytes=nbytes,
            codec_s=codec_s,
            stash_bytes=stash,
            memory_budget_bytes=budget,
            c_opt=c_opt,
            s_opt=s_opt,
            split=trainer.layout.mode,
            frozen_head=trainer.frozen,
        )
        if not self.cut_chosen:
            self.per_cut = self._per_cut(figures, sizes, throttle)
        return figures

    def _per_cut(
        self, figures: Measured, sizes: list[int], throttle: object
    ) -> dict[str, Measured]:
        """Every offered cut's figures, from this cut's and one head block's measured times."""
        trainer = self.trainer
        shape = (self.train.seq_len, trainer.split.hidden_size)
        block = time_block(trainer.head, shape, sizes, throttle=throttle)  # type: ignore[arg-type]
        out = {}
        for name, cut in self.cuts.items():
            budget = 0
            if self.pipe.memory_cap_mb > 0:
                layout = SplitLayout(trainer.layout.num_layers, cut[0], cut[1], trainer.layout.mode)
                params = device_param_bytes(trainer.folder, layout, trainer.weights)
                budget = max(1, int(self.pipe.memory_cap_mb * 2**20) - params)
            out[name] = figures_for_cut(
                figures,
                current=trainer.cut,
                cut=cut,
                num_layers=trainer.layout.num_layers,
                block=block,
                memory_budget_bytes=budget,
            )
        return out

    def _choose_cut(self, link: LinkFigures) -> None:
        """The first plan picks the offered cut with the shortest predicted step (once)."""
        self.cut_chosen = True
        if not self.per_cut:
            return
        figures = {name: replace(f, link=link) for name, f in self.per_cut.items()}
        self.cut_plan = plan_step(figures, self._options())
        if self.cut_plan.cut != self.cut:
            self.next_cut = self.cuts[self.cut_plan.cut]
        self.trainer.remember_cut(self.cuts[self.cut_plan.cut])  # for the next round's process
        log.info(
            "[device %s] best over the offered cuts %s: %s",
            self.trainer.device_id,
            ", ".join(self.cuts),
            self.cut_plan,
        )

    def _calibrate(self) -> None:
        """Rescale the compute figures to what the last session's planned steps took."""
        if self.figures is None or self.plan is None or self._run_mark is None:
            return
        if len(self.walls) < 3:  # the first planned step is left out: at least two to learn from
            return
        events = self.trainer.tracer.events[self._run_mark :]
        self._run_mark = None
        rows = self.train.batch_size // self.plan.microbatches
        calibrated = calibrate(self.figures, events, rows)
        if calibrated is not None:
            self.figures = calibrated
            log.info(
                "[device %s] compute figures calibrated from %d trace events of the last "
                "session's steps",
                self.trainer.device_id,
                len(events),
            )

    def _options(self, pair: tuple[str, str] | None = None) -> Options:
        return Options(
            microbatches=divisors(self.train.batch_size),
            codecs=self.pipe.codec_choices,
            max_in_flight=self.pipe.max_in_flight,
            codec_pair=pair,
        )

    def _within(self, session: StageSession, link: LinkFigures) -> StepPlan:
        """The best plan with the codecs ``session`` was opened with."""
        assert self.figures is not None
        pair = (session.codec, session.gradient_codec or session.codec)
        figures = {self.cut: replace(self.figures, link=link)}
        return plan_step(figures, self._options(pair))

    @staticmethod
    def _codecs(plan: StepPlan) -> tuple[str, str]:
        return plan.codec, plan.gradient_codec

    def _best(self, link: LinkFigures) -> StepPlan:
        """The best plan for ``link`` over every allowed codec pair."""
        assert self.figures is not None
        return plan_step({self.cut: replace(self.figures, link=link)}, self._options())

    def _make(self, session: StageSession, why: str) -> None:
        assert self.figures is not None and self.link is not None
        if not self.cut_chosen:
            self._choose_cut(self.link)
        self.best = self._best(self.link)
        self.plan = self._within(session, self.link)
        self.why = why
        same = self._codecs(self.best) == self._codecs(self.plan)
        later = "" if same else f"; from the next session: {self.best}"
        log.info(
            "[device %s] %s (%s): %s%s", self.trainer.device_id, why, self.link, self.plan, later
        )

    def _apply(self, runtime: DeviceRuntime) -> None:
        assert self.plan is not None
        runtime.microbatches = self.plan.microbatches
        runtime.schedule_name = self.plan.schedule
        runtime.max_in_flight = self.plan.max_in_flight or None
