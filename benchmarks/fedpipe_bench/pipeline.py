"""``fedpipe bench pipeline``: step times of every schedule at every reference link setting.

The StageServer runs in a child process and the device in this one; each is pinned to its own
core with one torch thread (two threads per process on two cores fight over the cores and
blur every timing: docs/design/pipeline-bound.md). Links are emulated inside the device's
transport.

For every link setting the benchmark keeps one session per run open and walks them round robin,
step by step (``round_robin``), so that drift on a shared machine hits every schedule alike:

- ``solo``: the GPipe schedule in phases on an un-emulated loopback (:class:`PhasedChannel`):
  the device runs all head forwards back to back, then the server all its forwards, then the
  device all tails, the server all backwards, the device all head backwards. Only one side
  computes at a time and each computation follows one of its own kind, so its trace holds every
  component measured alone and warm, under the same pinning as the pipelined runs (timing each
  microbatch after an idle gap, as stop-and-wait does, measured components slower than inside
  the pipeline: efficiency above 1). The bound (``t_bound_s``) is built from these and from the
  link model's occupancy (bytes / bandwidth) and latency.
- ``sequential``: stop-and-wait over the microbatches on the emulated link (``t_seq_s``).
- ``sequential-whole``: stop-and-wait on the whole batch, one microbatch (``t_seq_whole_s``),
  what split-learning systems run today.
- the pipelined schedules; the best gives ``t_pipe_s``. Its trace gives the in-run components
  and ``t_bound_inrun_s`` (a finding: contention inflates them; not the bound).

Each traced step also gives its end (``step_end_share``): on the device, the time from the
end of the step's last backward (its last head backward, or its last tail where the head
trains nothing) to the end of the optimizer step; on the server, its optimizer step (the
``STEP_DONE`` reply's compute). Their medians over the best schedule's steps, summed, as a share
of its median step: the most a step could gain from stepping each adapter as soon as its
gradient is final (Optimizer Fusion), since what the server's step costs is at most hidden
behind the device's next forward.

Every run's trace also gives the device's wait per microbatch for its input gradient: from
sending OUTPUT_GRAD (the uplink's ``g`` event starts) to receiving INPUT_GRAD (the downlink's
``i`` event ends), median per run (``input_grad_wait_s``). With ``input_grad_first`` a second
StageServer, with ``server.input_grad_first = true`` (its reply goes out before the adapters'
weight gradients), serves one more run of the compared schedule (1F1B where measured) in the
same round robin, and ``input_grad_first`` holds both runs' waits and step times side by side.

``speedup`` and ``ceiling`` are taken against the faster stop-and-wait. A wide spread of the
solo timings sets ``noisy`` and warns on stderr.

With ``frozen_head`` one more session runs ``pipeline.schedule`` (or the last pipelined
schedule asked for) with the head frozen (frozen-device mode, what ``pipeline.freeze`` switches
a device to once its head blocks froze: head forward only, no input gradient down), walked in
the same round robin; the entry's ``frozen_head`` holds its step time and downlink bytes per
step beside the same schedule's trained run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from fedpipe.config import FedpipeConfig
from fedpipe.edge.planner.bound import (
    Components,
    bound_terms,
    link_occupancy,
    pipeline_bound,
    relative_spread,
    sequential_model,
)
from fedpipe.edge.runtime import DeviceRuntime, StageChannel
from fedpipe.edge.trainer import DeviceTrainer
from fedpipe.emulation import LinkProfile, parse_link
from fedpipe.launch.processes import with_parent_death_signal
from fedpipe.messages import Kind, StageMsg
from fedpipe.trace import Event, Tracer
from fedpipe.wire.backend import SessionRequest
from fedpipe.wire.link_client import StageClient, StageSession
from fedpipe.wire.tensors import encoded_nbytes

__all__ = [
    "BENCH_SCHEDULES",
    "NOISE_THRESHOLD",
    "device_step_end",
    "round_robin",
    "run_pipeline_bench",
    "step_end",
]

log = logging.getLogger(__name__)

BENCH_SCHEDULES = ("sequential", "gpipe", "1f1b", "greedy")
SOLO = "solo"
WHOLE = "sequential-whole"
FROZEN = "frozen-head"
NOISE_THRESHOLD = 0.2
IGF = "+input-grad-first"  # the suffix of the run on the input_grad_first server
"""Solo timings whose IQR/median (or per-step max/min - 1) exceeds this mark the run noisy."""


def _pin(cpus: list[int]) -> str:
    """Pin this (device) process to the first core, one torch thread; returns what was done."""
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (or parallel work already ran) in this process
        pass
    if len(cpus) < 2:
        return f"one CPU available ({cpus}): device and server share it, 1 torch thread each"
    os.sched_setaffinity(0, {cpus[0]})
    return (
        f"device on CPU {cpus[0]}, server on CPU {cpus[1]} (sched_setaffinity), 1 torch thread each"
    )


def _start_server(
    config: FedpipeConfig, workdir: Path, cpus: list[int], *extra: str
) -> tuple[subprocess.Popen[bytes], str]:
    workdir.mkdir(exist_ok=True)
    port_file = workdir / "port"
    cmd = [
        sys.executable,
        "-m",
        "fedpipe.cli",
        "server",
        "--model",
        config.model.name,
        "--set",
        f"model.head_layers={config.model.head_layers}",
        "--set",
        f"model.tail_layers={config.model.tail_layers}",
        "--set",
        f"model.split={config.model.split}",
        "--set",
        "server.threads=1",
        "--device",
        "cpu",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        *(arg for setting in extra for arg in ("--set", setting)),
    ]
    if len(cpus) >= 2:
        cmd += ["--cpu", str(cpus[1])]
    log_path = workdir / "server.log"
    # The server dies with the bench, even one killed by SIGKILL or Ctrl-C mid-run.
    proc = subprocess.Popen(
        with_parent_death_signal(cmd), stdout=subprocess.DEVNULL, stderr=log_path.open("wb")
    )
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"bench server did not start:\n{log_path.read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def _batches(vocab: int, batch: int, seq: int, n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def round_robin(runs: Sequence[str], steps: int) -> list[tuple[int, str]]:
    """``(step, run)`` in the order the bench executes them: every run's step k before any k+1."""
    return [(step, name) for step in range(steps) for name in runs]


@dataclass
class _Run:
    """One open session of the bench and what it measured."""

    name: str
    link: LinkProfile
    microbatches: int
    session: StageSession
    runtime: DeviceRuntime
    tracer: Tracer
    walls: list[float]
    step_ends: list[float]  # per traced step: the device's last backward to its optimizer's end


def _open_run(
    trainer: DeviceTrainer,
    client: StageClient,
    stack: contextlib.ExitStack,
    *,
    name: str,
    schedule: str,
    link: LinkProfile,
    microbatches: int,
    frozen_head: bool = False,
) -> _Run:
    """A session of its own (its own device id, so the server keeps them all open); with
    ``frozen_head`` the head runs forward only and no input gradient comes down."""
    cfg = trainer.config
    tracer = Tracer()
    session = client.open(
        SessionRequest(
            device_id=f"bench-{name}",
            round=0,
            learning_rate=cfg.train.lr,
            weight_decay=cfg.train.weight_decay,
            uplink_codec=cfg.pipeline.uplink_codec,
            downlink_codec=cfg.pipeline.downlink_codec,
            gradient_codec=cfg.pipeline.gradient_codec,
            split=trainer.split,
            microbatch_size=-(-cfg.train.batch_size // microbatches),
            seq_len=cfg.train.seq_len,
            frozen_head=frozen_head,
        ),
        link=link,
        link_seed=f"bench-{name}",
        tracer=tracer,
        timeout_s=cfg.pipeline.timeout_s,
    )
    stack.enter_context(session)
    phased = name == SOLO
    runtime = DeviceRuntime(
        trainer.head,
        trainer.tail,
        PhasedChannel(session, microbatches) if phased else session,
        optimizer=torch.optim.AdamW(trainer.parameters(), lr=cfg.train.lr),
        schedule=schedule,
        microbatches=microbatches,
        max_in_flight=None if phased else cfg.pipeline.max_in_flight or None,
        tracer=tracer,
        frozen_head=frozen_head,
    )
    return _Run(name, link, microbatches, session, runtime, tracer, [], [])


class PhasedChannel:
    """A session's channel that makes each side compute a whole phase while the other waits.

    Sends are held until the device next waits for a reply; a reply is handed over only once
    all ``microbatches`` replies of its kind for that step have arrived. So the server receives
    a phase's messages in one burst and computes them back to back, and the device's next phase
    starts only after the server's has ended.
    """

    def __init__(self, channel: StageChannel, microbatches: int) -> None:
        self._channel = channel
        self._microbatches = microbatches
        self._held: list[StageMsg] = []
        self._arrived: set[tuple[Kind, int]] = set()  # phases whose replies all came

    def send(self, msg: StageMsg) -> None:
        self._held.append(msg)

    def ready(self, kind: Kind, step: int, microbatch: int) -> bool:
        self._flush()
        return self._channel.ready(kind, step, microbatch)

    def receive(self, kind: Kind, step: int, microbatch: int) -> StageMsg:
        self._flush()
        count = 1 if kind is Kind.STEP_DONE else self._microbatches
        while (kind, step) not in self._arrived:
            if all(self._channel.ready(kind, step, mb) for mb in range(count)):
                self._arrived.add((kind, step))
            else:
                self._channel.wait_any(0.05)
        return self._channel.receive(kind, step, microbatch)

    def wait_any(self, timeout: float) -> None:
        self._flush()
        self._channel.wait_any(timeout)

    def _flush(self) -> None:
        held, self._held = self._held, []
        for msg in held:
            self._channel.send(msg)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def input_grad_waits(tracer: Tracer) -> list[float]:
    """The device's wait for each input gradient: from sending a microbatch's OUTPUT_GRAD (its
    uplink event starts) to receiving its INPUT_GRAD (its downlink event ends), in order."""
    sent: dict[str, list[float]] = {}
    got: dict[str, list[float]] = {}
    for e in tracer.events:
        if e.lane == "uplink" and re.fullmatch(r"g\d+", e.name):
            sent.setdefault(e.name[1:], []).append(e.start)
        elif e.lane == "downlink" and re.fullmatch(r"i\d+", e.name):
            got.setdefault(e.name[1:], []).append(e.end)
    return [
        end - start
        for mb, starts in sent.items()
        for start, end in zip(starts, got.get(mb, []), strict=False)
    ]


def _occupancy(tracer: Tracer, records: list[Any], lane: str) -> dict[str, float]:
    """Median wire occupancy per transfer kind (``a``, ``g`` up; ``o``, ``i`` down).

    The link's records and the tracer's events of a lane are appended in the same order by the
    same thread, so zipping them names each record's message kind.
    """
    names = [e.name for e in tracer.events if e.lane == lane]
    spans: dict[str, list[float]] = {}
    for name, record in zip(names, records, strict=False):
        spans.setdefault(name[:1], []).append(record.end - record.start)
    return {kind: _median(values) for kind, values in spans.items()}


def _compute_samples(tracer: Tracer) -> dict[str, list[float]]:
    """Every timed computation of a run, per component name."""
    return {
        "c_f": tracer.durations("F", "device"),
        "c_t": tracer.durations("T", "device"),
        "c_b": tracer.durations("B", "device"),
        "s_f": tracer.durations("Sf", "server"),
        "s_b": tracer.durations("Sb", "server"),
        "c_opt": tracer.durations("O", "device"),
        "s_opt": tracer.durations("So", "server"),
    }


def _inrun_components(run: _Run, split: str) -> Components:
    """Components as measured inside a pipelined run (transfers from the link's records)."""
    up = _occupancy(run.tracer, run.session.link.up.records(), "uplink")
    down = _occupancy(run.tracer, run.session.link.down.records(), "downlink")
    med = {k: _median(v) for k, v in _compute_samples(run.tracer).items()}
    lat = run.link.one_way_s + run.link.overhead_s
    return Components(
        **med,
        tau_up=up.get("a", 0.0),
        tau_down=down.get("o", 0.0),
        tau_up_grad=up.get("g", 0.0),
        tau_down_grad=down.get("i", 0.0),
        lat_up=lat,
        lat_down=lat,
        split=split,
    )


def solo_components(
    samples: dict[str, list[float]], link: LinkProfile, nbytes: dict[str, int], split: str
) -> Components:
    """Components from solo timings plus the link model's occupancy and latency.

    ``nbytes`` holds the encoded bytes of each transfer kind: ``a`` (activation up), ``o``
    (output down), ``g`` (its gradient up), ``i`` (the head's gradient down).
    """
    lat = link.one_way_s + link.overhead_s
    return Components(
        **{k: _median(v) for k, v in samples.items()},
        tau_up=link_occupancy(nbytes["a"], link.up_mbps),
        tau_down=link_occupancy(nbytes["o"], link.down_mbps),
        tau_up_grad=link_occupancy(nbytes["g"], link.up_mbps),
        tau_down_grad=link_occupancy(nbytes["i"], link.down_mbps),
        lat_up=lat,
        lat_down=lat,
        split=split,
    )


def noise_report(samples: dict[str, list[float]], solo_walls: Sequence[float]) -> dict[str, Any]:
    """Spread of the solo timings; ``noisy`` when a compute's or the steps' is too wide."""
    spread = {k: round(relative_spread(v), 3) for k, v in samples.items() if len(v) >= 4}
    walls = [w for w in solo_walls if w > 0]
    step_spread = max(walls) / min(walls) - 1 if len(walls) >= 2 else 0.0
    # The optimizer steps are a few ms, once per step: too short and too few to judge by.
    judged = [v for k, v in spread.items() if k not in ("c_opt", "s_opt")]
    worst = max([*judged, step_spread], default=0.0)
    return {
        "solo_spread": spread,
        "solo_step_spread": round(step_spread, 3),
        "noisy": worst > NOISE_THRESHOLD,
    }


def device_step_end(events: Sequence[Event]) -> float:
    """Seconds from the end of a step's last backward to the end of its optimizer step.

    ``events``: the step's own trace. The last backward is the latest device event (a head
    backward ``B``, or a tail ``T``, which holds the tail's backward) that ended before the
    optimizer step (``O``) began; 0 when the step has no optimizer event.
    """
    device = [e for e in events if e.lane == "device"]
    steps = [e for e in device if e.name == "O"]
    if not steps:
        return 0.0
    opt = steps[-1]
    backwards = [e.end for e in device if e.name[:1] in "BT" and e.end <= opt.start]
    return opt.end - max(backwards, default=opt.start)


def step_end(
    run_walls: Sequence[float], device_ends: Sequence[float], server_opts: Sequence[float]
) -> dict[str, float]:
    """The step's end as the bench reports it: device and server seconds, and their share."""
    device, server, wall = _median(device_ends), _median(server_opts), _median(run_walls)
    return {
        "device_s": round(device, 5),
        "server_s": round(server, 5),
        "share": round((device + server) / wall, 5) if wall > 0 else 0.0,
    }


def _step_end_of(run: _Run) -> dict[str, float]:
    return step_end(run.walls, run.step_ends, run.tracer.durations("So", "server"))


def _transfer_bytes(config: FedpipeConfig, hidden: int, microbatches: int) -> dict[str, int]:
    """Encoded payload bytes of each transfer kind of one microbatch (labels not counted)."""
    p = config.pipeline
    shape = (-(-config.train.batch_size // microbatches), config.train.seq_len, hidden)
    grad = p.gradient_codec or ""
    return {
        "a": encoded_nbytes(shape, p.uplink_codec),
        "o": encoded_nbytes(shape, p.downlink_codec),
        "g": encoded_nbytes(shape, grad or p.uplink_codec),
        "i": encoded_nbytes(shape, grad or p.downlink_codec),
    }


def _walk_runs(
    runs: list[_Run], batches: list[dict[str, torch.Tensor]], warmup: int, link: str
) -> None:
    """Every run's steps, round robin; traces and link records start after the warm-up."""
    by_name = {run.name: run for run in runs}
    for step, name in round_robin([r.name for r in runs], len(batches)):
        run = by_name[name]
        if step == warmup:
            run.tracer.clear()
            run.session.link.up.clear_records()
            run.session.link.down.clear_records()
        first = len(run.tracer.events)
        result = run.runtime.train_step(batches[step], step=step)
        if step >= warmup:
            run.walls.append(result.wall_s)
            run.step_ends.append(device_step_end(run.tracer.events[first:]))
        print(f"  {link:>18} step {step} {name:>16}: {result.wall_s:.3f} s", file=sys.stderr)


def compared_schedule(schedules: Sequence[str]) -> str:
    """The schedule run on both servers with ``input_grad_first``: 1F1B where measured (a
    backward leaves the server before the next forward arrives), else the first pipelined."""
    pipelined = [s for s in schedules if s != "sequential"] or list(schedules)
    return "1f1b" if "1f1b" in pipelined else pipelined[0]


def _bench_link(
    trainer: DeviceTrainer,
    client: StageClient,
    link: LinkProfile,
    schedules: Sequence[str],
    batches: list[dict[str, torch.Tensor]],
    warmup: int,
    first_client: StageClient | None = None,
    frozen_head: bool = False,
) -> dict[str, Any]:
    cfg = trainer.config
    m, split = cfg.pipeline.microbatches, cfg.model.split
    plan = [(SOLO, "gpipe", LinkProfile.unlimited(), m, client, False)]
    plan += [(name, name, link, m, client, False) for name in schedules]
    if "sequential" in schedules:
        plan.append((WHOLE, "sequential", link, 1, client, False))
    compared = compared_schedule(schedules)
    if first_client is not None:
        plan.append((compared + IGF, compared, link, m, first_client, False))
    frozen_schedule = _frozen_schedule(cfg, schedules)
    if frozen_head:
        plan.append((FROZEN, frozen_schedule, link, m, client, True))
    with contextlib.ExitStack() as stack:
        runs = [
            _open_run(trainer, c, stack, name=n, schedule=s, link=lk, microbatches=k, frozen_head=f)
            for n, s, lk, k, c, f in plan
        ]
        _walk_runs(runs, batches, warmup, link.name)
        by_name = {run.name: run for run in runs}
        times = {run.name: _median(run.walls) for run in runs}
        waits = {run.name: _median(input_grad_waits(run.tracer)) for run in runs}
        pipelined = [s for s in schedules if s != "sequential"] or list(schedules)
        best = min(pipelined, key=times.__getitem__)
        inrun = _inrun_components(by_name[best], split)
        solo_run = by_name[SOLO]
        samples = _compute_samples(solo_run.tracer)
        frozen = (
            _frozen_entry(by_name[frozen_schedule], by_name[FROZEN], len(batches))
            if frozen_head
            else None
        )
        # the schedules' step ends (a frozen head's step ends at its tail: not comparable)
        ends = {
            run.name: _step_end_of(run)
            for run in runs
            if run.name not in (SOLO, FROZEN) and not run.name.endswith(IGF)
        }
    solo = solo_components(samples, link, _transfer_bytes(cfg, trainer.split.hidden_size, m), split)
    first = times.pop(compared + IGF, None)
    entry = _entry(link, m, times, best, solo, inrun, noise_report(samples, solo_run.walls))
    if frozen is not None:
        entry["frozen_head"] = frozen
    entry |= {
        "step_end_share": ends[best]["share"],
        "step_end_s": {k: v for k, v in ends[best].items() if k != "share"},
        "step_end_by_schedule": {name: end["share"] for name, end in ends.items()},
    }
    entry["input_grad_wait_s"] = {
        k: round(v, 4) for k, v in waits.items() if k not in (SOLO, FROZEN) and not k.endswith(IGF)
    }
    if first is not None:
        entry["input_grad_first"] = input_grad_first_entry(
            compared, (waits[compared], times[compared]), (waits[compared + IGF], first)
        )
    return entry


def input_grad_first_entry(
    schedule: str, before: tuple[float, float], after: tuple[float, float]
) -> dict[str, Any]:
    """One link's figure of server.input_grad_first: the device's median wait per microbatch
    for its input gradient and the median step time, without and with it, and their ratios."""
    (wait_off, step_off), (wait_on, step_on) = before, after
    return {
        "schedule": schedule,
        "wait_s": {"off": round(wait_off, 4), "on": round(wait_on, 4)},
        "step_s": {"off": round(step_off, 4), "on": round(step_on, 4)},
        "wait_on_over_off": round(wait_on / wait_off, 3) if wait_off > 0 else None,
        "step_on_over_off": round(step_on / step_off, 3) if step_off > 0 else None,
    }


def _frozen_schedule(cfg: FedpipeConfig, schedules: Sequence[str]) -> str:
    """The schedule the frozen-head run uses: pipeline.schedule when it is measured, else the
    last pipelined one asked for (a trained run of it is the comparison)."""
    if cfg.pipeline.schedule in schedules:
        return cfg.pipeline.schedule
    pipelined = [s for s in schedules if s != "sequential"] or list(schedules)
    return pipelined[-1]


def _frozen_entry(trained: _Run, frozen: _Run, steps: int) -> dict[str, Any]:
    """The frozen-head run beside the trained run of the same schedule: median step times and
    stage-link bytes per step (every step's tensors have the same size)."""
    t_trained, t_frozen = _median(trained.walls), _median(frozen.walls)
    down = {run.name: run.session.stats.bytes_down / steps for run in (trained, frozen)}
    up = {run.name: run.session.stats.bytes_up / steps for run in (trained, frozen)}
    return {
        "schedule": trained.name,
        "t_trained_s": round(t_trained, 4),
        "t_frozen_s": round(t_frozen, 4),
        "step_saving": round(1 - t_frozen / t_trained, 3),
        "bytes_up_per_step": round(up[frozen.name]),
        "bytes_down_per_step": round(down[frozen.name]),
        "bytes_down_trained_per_step": round(down[trained.name]),
        "bytes_saving": round(
            1 - (up[frozen.name] + down[frozen.name]) / (up[trained.name] + down[trained.name]), 3
        ),
    }


def _entry(
    link: LinkProfile,
    m: int,
    times: dict[str, float],
    best: str,
    solo: Components,
    inrun: Components,
    noise: dict[str, Any],
) -> dict[str, Any]:
    """One link's JSON entry (the contract in DESIGN.md)."""
    bound, term = pipeline_bound(solo, m)
    bound_inrun, term_inrun = pipeline_bound(inrun, m)
    t_seq, t_whole = times.get("sequential", float("nan")), times.get(WHOLE, float("nan"))
    finite = [t for t in (t_seq, t_whole) if t == t]
    baseline = min(finite) if finite else float("nan")
    t_pipe = times[best]
    if noise["noisy"]:
        print(
            f"  warning: {link.name}: solo timings spread beyond {NOISE_THRESHOLD:.0%} "
            f"({noise['solo_spread']}, step spread {noise['solo_step_spread']}): the machine "
            "is busy; rerun on a quiet machine before trusting efficiency and ceiling",
            file=sys.stderr,
        )
    return {
        "link": link.name,
        "microbatches": m,
        "t_seq_s": round(t_seq, 4),
        "t_seq_whole_s": round(t_whole, 4),
        "baseline": "sequential-whole" if baseline == t_whole else "sequential",
        "t_pipe_s": round(t_pipe, 4),
        "best_schedule": best,
        "t_bound_s": round(bound, 4),
        "bound_term": term,
        "t_bound_inrun_s": round(bound_inrun, 4),
        "bound_term_inrun": term_inrun,
        "speedup": round(baseline / t_pipe, 3),
        "efficiency": round(bound / t_pipe, 3),
        "ceiling": round(baseline / bound, 3),
        "t_seq_model_s": round(sequential_model(solo, m), 4),
        "t_solo_step_s": round(times[SOLO], 4),
        "components_solo": solo.as_dict(),
        "components_inrun": inrun.as_dict(),
        "bound_terms_solo": {k: round(v, 4) for k, v in bound_terms(solo, m).items()},
        **noise,
        "schedules": {k: round(v, 4) for k, v in times.items() if k != SOLO},
    }


def run_pipeline_bench(
    config: FedpipeConfig,
    *,
    links: Sequence[str],
    schedules: Sequence[str] = BENCH_SCHEDULES,
    steps: int = 4,
    warmup: int = 1,
    input_grad_first: bool = False,
    frozen_head: bool = False,
) -> dict[str, Any]:
    """Measure every schedule at every link; returns the JSON-ready report.

    ``input_grad_first``: a second server with ``server.input_grad_first = true`` serves one
    more run of the compared schedule (see :func:`compared_schedule`). ``frozen_head``: one
    more run with the head frozen (see the module's docstring).
    """
    profiles = [parse_link(name) for name in links]  # a typo fails now, not after the server
    cpus = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="fedpipe-bench-") as tmp, contextlib.ExitStack() as on:
        server, address = _start_server(config, Path(tmp) / "main", cpus)
        servers = [server]
        if input_grad_first:
            first, first_address = _start_server(
                config, Path(tmp) / "first", cpus, "server.input_grad_first=true"
            )
            servers.append(first)
        pinning = _pin(cpus)
        try:
            trainer = DeviceTrainer(config, device_id="bench")
            vocab = (
                int(cast(torch.nn.Embedding, trainer.head.embed_tokens).num_embeddings)
                if hasattr(trainer.head, "embed_tokens")
                else 256
            )
            batches = _batches(
                min(vocab, 256), config.train.batch_size, config.train.seq_len, warmup + steps
            )
            entries = []
            client = on.enter_context(StageClient(address))
            first_client = (
                on.enter_context(StageClient(first_address)) if input_grad_first else None
            )
            for link in profiles:
                entries.append(
                    _bench_link(
                        trainer,
                        client,
                        link,
                        schedules,
                        batches,
                        warmup,
                        first_client,
                        frozen_head=frozen_head,
                    )
                )
        finally:
            on.close()
            for proc in servers:
                proc.terminate()
                proc.wait(timeout=30)
    return {
        "model": config.model.name,
        "split": f"{config.model.split}: head {config.model.head_layers}, "
        f"tail {config.model.tail_layers}",
        "batch": [config.train.batch_size, config.train.seq_len],
        "microbatches": config.pipeline.microbatches,
        "codec": config.pipeline.uplink_codec,
        "gradient_codec": config.pipeline.gradient_codec or config.pipeline.uplink_codec,
        "steps": steps,
        "warmup": warmup,
        "pinning": pinning,
        "noisy": any(e["noisy"] for e in entries),
        "input_grad_first": input_grad_first,
        "bound": BOUND_TEXT,
        "links": entries,
    }


BOUND_TEXT = (
    "components measured alone and back to back in this invocation (GPipe in phases on an "
    "un-emulated loopback, same pinning: one side computes a whole phase while the other "
    "waits) plus the link model's occupancy "
    "(bytes/bandwidth) and latency; max over the device row (with its fill and drain), uplink, "
    "server, downlink, the server's steady state and one microbatch's critical path; "
    "4 transfers per microbatch U-shaped, 2 two-part; the device's optimizer step after its "
    "last backward; no STEP_END/STEP_DONE round trip (fedpipe.edge.planner.bound)"
)
