"""A run's ``summary.json`` and plots, built from its ``metrics.jsonl``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from fedpipe.federated.plots import plot_losses, plot_step_times, plot_timeline
from fedpipe.federated.runfolder import RunFolder
from fedpipe.pipeline.trace import Event

__all__ = ["build_summary", "finish_run"]


def build_summary(history: list[dict[str, Any]], *, config: dict[str, Any]) -> dict[str, Any]:
    """Per-round eval loss, train loss, wall time, bytes up/down and per-device step times."""
    rounds: dict[int, dict[str, Any]] = {}
    for rec in history:
        entry = rounds.setdefault(
            int(rec["round"]), {"round": int(rec["round"]), "step_times_s": {}}
        )
        if rec.get("event") == "eval":
            for key in ("eval_loss", "eval_ppl", "wall_s", "merged", "discarded"):
                if key in rec:
                    entry[key] = rec[key]
        elif rec.get("event") == "train":
            device = str(int(rec.get("partition-id", -1)))
            entry["step_times_s"][device] = rec.get("step-time-median-s")
            entry.setdefault("_losses", []).append(rec.get("train-loss"))
            entry["bytes_up"] = entry.get("bytes_up", 0) + int(rec.get("bytes-up", 0))
            entry["bytes_down"] = entry.get("bytes_down", 0) + int(rec.get("bytes-down", 0))
        elif rec.get("event") == "failed":
            entry["failed_devices"] = rec.get("devices", 0)
    out = []
    for _, entry in sorted(rounds.items()):
        losses = [v for v in entry.pop("_losses", []) if v is not None]
        if losses:
            entry["train_loss"] = statistics.fmean(losses)
        out.append(entry)
    evals = [r["eval_loss"] for r in out if "eval_loss" in r]
    summary: dict[str, Any] = {"rounds": out, "config": config}
    if evals:
        first, last = evals[0], evals[-1]
        summary |= {
            "first_eval_loss": first,
            "last_eval_loss": last,
            "eval_loss_drop_pct": 100.0 * (first - last) / first if first else 0.0,
        }
    return summary


def finish_run(folder: RunFolder, *, config: dict[str, Any]) -> dict[str, Any]:
    """Write summary.json, the loss and step-time plots, and a timeline plot of one trace."""
    summary = build_summary(folder.history(), config=config)
    folder.write_summary(summary)
    plot_losses(summary["rounds"], folder.plot_path("loss"))
    per_device: dict[str, list[float]] = {}
    for entry in summary["rounds"]:
        for device, t in entry.get("step_times_s", {}).items():
            if t is not None:
                per_device.setdefault(f"device {device}", []).append(float(t))
    plot_step_times(per_device, folder.plot_path("step_times"))
    traces = sorted((folder.path / "traces").glob("device-*-round-*.json"))
    if traces:
        plot_timeline(_events(traces[-1]), folder.plot_path("timeline"), title=traces[-1].stem)
    return summary


def _events(path: Path) -> list[Event]:
    data = json.loads(path.read_text())
    lanes = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e.get("ph") == "M"}
    return [
        Event(e["name"], lanes[e["tid"]], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        for e in data["traceEvents"]
        if e.get("ph") == "X"
    ]
