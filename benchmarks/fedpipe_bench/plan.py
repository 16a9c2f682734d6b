"""``fedpipe bench plan``: the planner's predicted step time against the measured one, per link.

For every link setting (the pipeline bench's reference links by default) a fresh device with
``pipeline.plan = "auto"`` trains ``sessions`` sessions against a StageServer child process,
pinned as the pipeline bench pins them (device and server on a core each, one torch thread).
In its first session the device probes the link with ECHOs, runs two steps with the configured
settings, measures its ops and plans; the steps after them run the plan. Later sessions open with
the plan's codecs (which may differ where ``--codecs`` allows lossy ones). Per session the
entry holds the plan, its predicted step time, the median measured step time of the steps that
ran the plan (after ``warmup`` of them) and the error ``predicted / measured - 1``; beside
them, the same plan priced by the same model from the compute timed inside those steps
(``predicted_inrun_s``, ``error_inrun``), which tells the model's error from the machine's
drift between planning and running.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from fedpipe.config import FedpipeConfig
from fedpipe.edge.planner.bound import Components, link_occupancy, predict_step
from fedpipe.edge.trainer import DeviceTrainer, TrainReport
from fedpipe.emulation import DeviceProfile, parse_link
from fedpipe.trace import Event, Tracer
from fedpipe.wire.link_client import StageClient
from fedpipe.wire.tensors import encoded_nbytes
from fedpipe_bench.pipeline import _batches, _compute_samples, _pin, _start_server

__all__ = ["run_plan_bench"]

_HEADER = 100  # bytes of a stage message besides its tensor's payload (ids, shape, codec)


def _inrun_prediction(trainer: DeviceTrainer, events: list[Event], plan: dict[str, Any]) -> float:
    """The plan priced by the same model with the compute measured inside its own steps.

    Separates the model's error from the machine's drift between planning and running: on a
    shared machine the two differ by as much as load changes in between.
    """
    step = Tracer()
    step.events = events
    med = {k: statistics.median(v) if v else 0.0 for k, v in _compute_samples(step).items()}
    cfg, m = trainer.config, int(plan["microbatches"])
    shape = (cfg.train.batch_size // m, cfg.train.seq_len, trainer.split.hidden_size)
    act = encoded_nbytes(shape, str(plan["codec"])) + _HEADER
    grad = encoded_nbytes(shape, str(plan["gradient_codec"])) + _HEADER
    up, down = float(plan["link_up_mbps"]), float(plan["link_down_mbps"])
    comp = Components(
        **med,
        tau_up=link_occupancy(act, up),
        tau_down=link_occupancy(act, down),
        tau_up_grad=link_occupancy(grad, up),
        tau_down_grad=link_occupancy(grad, down),
        lat_up=float(plan["link_rtt_s"]) / 2,
        lat_down=float(plan["link_rtt_s"]) / 2,
        split=trainer.layout.mode,
    )
    cap = int(plan.get("max_in_flight", 0)) or None
    return predict_step(comp, m, schedule=str(plan["schedule"]), max_in_flight=cap)[0]


def _session_entry(
    trainer: DeviceTrainer, report: TrainReport, events: list[Event], skip: int
) -> dict[str, Any]:
    """The plan of one session and its error; the first ``skip`` steps left out."""
    planned = report.steps[skip:]
    plan = dict(report.plan)
    measured = statistics.median(s.wall_s for s in planned) if planned else float("nan")
    predicted = float(plan.get("predicted_s", float("nan")))
    inrun = _inrun_prediction(trainer, events, plan) if planned else float("nan")
    return {
        "plan": plan,
        "predicted_s": round(predicted, 4),
        "measured_s": round(measured, 4),
        "error": round(predicted / measured - 1, 4) if measured == measured else None,
        "predicted_inrun_s": round(inrun, 4),
        "error_inrun": round(inrun / measured - 1, 4) if measured == measured else None,
        "steps_s": [round(s.wall_s, 4) for s in planned],
        "microbatches_run": sorted({s.microbatches for s in planned}),
    }


def _step_events(tracer: Tracer, report: TrainReport, skip: int) -> list[Event]:
    """The trace events of the session's steps after the first ``skip`` (by step times)."""
    if skip >= len(report.steps):
        return []
    # Steps run back to back: the planned ones are the last len(steps) - skip wall times.
    span = sum(s.wall_s for s in report.steps[skip:])
    end = max((e.end for e in tracer.events), default=0.0)
    return [e for e in tracer.events if e.start >= end - span]


def _bench_link(
    config: FedpipeConfig,
    address: str,
    link_name: str,
    batches: list[dict[str, torch.Tensor]],
    *,
    sessions: int,
    warmup: int,
) -> dict[str, Any]:
    link = parse_link(link_name)
    trainer = DeviceTrainer(
        config, device_id=f"plan-{link.name}", profile=DeviceProfile(link.name, link)
    )
    entries = []
    with StageClient(address) as client:
        for session in range(sessions):
            trainer.tracer.clear()
            report = trainer.train_round(client, batches, round_=session)
            skip = (2 if session == 0 else 0) + warmup  # planning steps, warm-up
            events = _step_events(trainer.tracer, report, skip)
            entry = _session_entry(trainer, report, events, skip)
            entries.append(entry)
            print(
                f"  {link.name:>18} session {session}: {entry['plan'].get('schedule')} "
                f"M={entry['plan'].get('microbatches')} {entry['plan'].get('codec')}: predicted "
                f"{entry['predicted_s']:.3f} s, measured {entry['measured_s']:.3f} s "
                f"({entry['error']:+.1%}; from in-run compute {entry['predicted_inrun_s']:.3f} s, "
                f"{entry['error_inrun']:+.1%})",
                file=sys.stderr,
            )
    last = entries[-1]
    return {
        "link": link.name,
        "plan": last["plan"],
        "predicted_s": last["predicted_s"],
        "measured_s": last["measured_s"],
        "error": last["error"],
        "predicted_inrun_s": last["predicted_inrun_s"],
        "error_inrun": last["error_inrun"],
        "within_15pct": last["error"] is not None and abs(last["error"]) <= 0.15,
        "sessions": entries,
    }


def run_plan_bench(
    config: FedpipeConfig,
    *,
    links: Sequence[str],
    steps: int = 4,
    warmup: int = 1,
    sessions: int = 2,
) -> dict[str, Any]:
    """Plan, run and compare at every link; returns the JSON-ready report."""
    for name in links:
        parse_link(name)  # a typo fails now, not after the server started
    cpus = sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fedpipe-bench-plan-") as tmp:
        server, address = _start_server(config, Path(tmp), cpus)
        pinning = _pin(cpus)
        try:
            probe = DeviceTrainer(config, device_id="plan-vocab")
            embed = getattr(probe.head, "embed_tokens", None)
            vocab = int(cast(torch.nn.Embedding, embed).num_embeddings) if embed else 256
            n = 2 + warmup + steps  # the planning steps, warm-up, measured steps
            batches = _batches(min(vocab, 256), config.train.batch_size, config.train.seq_len, n)
            entries = [
                _bench_link(config, address, name, batches, sessions=sessions, warmup=warmup)
                for name in links
            ]
        finally:
            server.terminate()
            server.wait(timeout=30)
    return {
        "model": config.model.name,
        "split": f"{config.model.split}: head {config.model.head_layers}, "
        f"tail {config.model.tail_layers}",
        "batch": [config.train.batch_size, config.train.seq_len],
        "configured_microbatches": config.pipeline.microbatches,
        "codecs": list(config.pipeline.codec_choices),
        "steps": steps,
        "warmup": warmup,
        "sessions": sessions,
        "pinning": pinning,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "max_abs_error": max(abs(e["error"]) for e in entries if e["error"] is not None),
        "links": entries,
    }
