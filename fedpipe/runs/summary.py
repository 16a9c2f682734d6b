"""A run's ``summary.json`` and plots, built from its ``metrics.jsonl``.

Records (one JSON object per line, ``event`` says which):

- ``start`` (``round``: the last complete round, ``resumed``): a ServerApp began; records of
  later rounds from an earlier attempt (a crash between commit and checkpoint) are dropped,
  so every round's bytes and losses are counted once;
- ``train``: one device's reply (``partition``, ``profile``, ``train_loss``, ``bytes_up``...,
  and with ``pipeline.plan = "auto"`` its ``plan``: choices, predicted and measured step time;
  ``cut``: the head+tail blocks it ran; on instruction data, ``examples``: its rows made,
  truncated and dropped);
- ``failure``: one failed device (``device``, ``round``, ``reason``);
- ``eval``: the round's record (held-out loss, device counts, ``wall_s`` of the round itself,
  ``elapsed_s`` since the start; with StageServer replicas, ``sessions_per_replica`` and
  ``replica_mb_per_s``: each replica's sessions and training microbatches per second);
- ``waiting``: whom a round waits for (while replies are out: the late devices, and ``why``
  for each); ``stop``: the run was stopped early, and why;
- ``progress``: while a round's replies are out, each device's ``steps_done`` (the
  StageServer's count) of the round's ``steps`` and its ``state`` (:mod:`fedpipe.fl.progress`).

- ``routes``: with StageServer replicas, which replica each device (Flower node id) was told
  to use in the round.

``waiting`` and ``progress`` are for the live console only: the summary leaves them out (the
``train``, ``failure`` and ``eval`` records hold each round's outcome).

Runs written before the keys were snake_case (``train-loss``, ``partition-id``...) still read.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from fedpipe.runs.folder import RunFolder
from fedpipe.runs.plots import plot_devices, plot_losses, plot_step_times, plot_timeline
from fedpipe.trace import Event

__all__ = ["build_summary", "finish_run", "judge"]

_EVAL_KEYS = (
    "eval_loss",
    "eval_ppl",
    "eval_exact_match",  # federated.eval_generate
    "eval_contains",
    "wall_s",
    "elapsed_s",
    "merged",
    "discarded",
    "devices_sampled",
    "sessions_per_replica",  # with StageServer replicas: per replica, from its own counts
    "replica_mb_per_s",
)


def _get(rec: dict[str, Any], key: str, default: Any = None) -> Any:
    """``rec[key]``, or the key as older runs wrote it (``train-loss`` for ``train_loss``)."""
    return rec.get(key, rec.get(key.replace("_", "-"), default))


def current_records(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that count: a ``start`` record drops the earlier ones of later rounds."""
    kept: list[dict[str, Any]] = []
    for rec in history:
        if rec.get("event") == "start":
            after = int(rec.get("round", 0)) if rec.get("resumed") else -1
            kept = [r for r in kept if "round" not in r or int(r["round"]) <= after]
        kept.append(rec)
    return kept


def _device_name(rec: dict[str, Any]) -> str:
    partition = _get(rec, "partition", _get(rec, "partition_id", -1))
    profile = rec.get("profile")
    return f"partition {int(partition)}" + (f" ({profile})" if profile else "")


def _add_train(entry: dict[str, Any], rec: dict[str, Any], names: dict[str, str]) -> None:
    device = str(int(_get(rec, "partition", _get(rec, "partition_id", -1))))
    names[device] = _device_name(rec)
    entry["step_times_s"][device] = _get(rec, "step_time_median_s")
    if rec.get("plan"):  # pipeline.plan = auto: plan, predicted and measured step time
        entry.setdefault("plans", {})[device] = rec["plan"]
    if rec.get("cut"):  # the device's head+tail blocks (model.cuts, federated.device_cuts)
        entry.setdefault("cuts", {})[device] = rec["cut"]
    if rec.get("weights"):  # how it stored its frozen weights (device.weights)
        entry.setdefault("weights", {})[device] = rec["weights"]
    if rec.get("examples"):  # instruction data: rows made, truncated, dropped
        entry.setdefault("examples", {})[device] = rec["examples"]
    entry["_losses"].append(_get(rec, "train_loss"))
    entry["bytes_up"] = entry.get("bytes_up", 0) + int(_get(rec, "bytes_up", 0))
    entry["bytes_down"] = entry.get("bytes_down", 0) + int(_get(rec, "bytes_down", 0))
    entry["devices_trained"] += 1
    if _get(rec, "peak_rss_mb") is not None:  # each device's peak resident memory
        entry.setdefault("peak_rss_mb", {})[device] = _get(rec, "peak_rss_mb")
    if _get(rec, "delta_hit_rate") is not None:  # pipeline.delta: cache resumed? rows hit
        entry.setdefault("delta", {})[device] = {
            "resumed": bool(_get(rec, "delta_resumed")),
            "hit_rate": float(_get(rec, "delta_hit_rate")),
        }
    privacy = {k: v for k, v in rec.items() if k.startswith("privacy_")}
    if privacy:  # the stage link's (epsilon, delta) so far, per device (fedpipe.privacy)
        entry.setdefault("privacy", {})[device] = privacy


def _close_round(entry: dict[str, Any]) -> dict[str, Any]:
    losses = [v for v in entry.pop("_losses") if v is not None]
    if losses:
        entry["train_loss"] = statistics.fmean(losses)
    if entry["round"] == 0:
        for key in ("step_times_s", "devices_trained", "devices_failed"):
            entry.pop(key)
    return entry


def build_summary(history: list[dict[str, Any]], *, config: dict[str, Any]) -> dict[str, Any]:
    """Per-round eval loss, train loss, durations, bytes, devices trained/failed; failures."""
    rounds: dict[int, dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    summary: dict[str, Any] = {}
    for rec in current_records(history):
        event = rec.get("event")
        if event == "stop":
            summary["stopped"] = {"round": rec.get("round"), "reason": rec.get("reason")}
        if event not in ("eval", "train", "failure", "failed"):
            continue
        r = int(rec["round"])
        entry = rounds.setdefault(
            r,
            {"round": r, "step_times_s": {}, "_losses": [], "devices_trained": 0,
             "devices_failed": 0},
        )  # fmt: skip
        if event == "eval":
            entry |= {key: rec[key] for key in _EVAL_KEYS if key in rec}
        elif event == "train":
            _add_train(entry, rec, names)
        elif event == "failure":
            entry["devices_failed"] += 1
            failures.append({k: rec.get(k) for k in ("device", "round", "reason", "partition")})
        else:  # "failed": a count, as runs before per-device failure records wrote it
            entry["devices_failed"] += int(rec.get("devices", 0))
    out = [_close_round(entry) for _, entry in sorted(rounds.items())]
    summary |= {"rounds": out, "failures": failures, "devices": names, "config": config}
    if config.get("federated.mode") == "async":  # each entry is a version, not a round
        summary["unit"] = "version"
    plans = {d: p for entry in out for d, p in entry.get("plans", {}).items()}  # the latest
    if plans:
        summary["plans"] = plans
    cuts = {d: c for entry in out for d, c in entry.get("cuts", {}).items()}  # the latest
    if cuts:
        summary["cuts"] = cuts
    weights = {d: w for entry in out for d, w in entry.get("weights", {}).items()}
    if weights:  # per device, how it stored its frozen weights (device.weights)
        summary["weights"] = weights
    examples = {d: e for entry in out for d, e in entry.get("examples", {}).items()}
    if examples:  # per device, the latest (its data does not change between rounds)
        summary["examples"] = examples
    evals = [r["eval_loss"] for r in out if "eval_loss" in r]
    if evals:
        first, last = evals[0], evals[-1]
        summary |= {
            "first_eval_loss": first,
            "last_eval_loss": last,
            "eval_loss_drop_pct": 100.0 * (first - last) / first if first else 0.0,
        }
    return summary


def judge(summary: dict[str, Any], *, rounds: int, max_failures: int) -> list[str]:
    """What went wrong in a run, one line each; empty when the run did all it should."""
    problems = []
    if "stopped" in summary:
        problems.append(f"stopped early: {summary['stopped']['reason']}")
    for entry in summary["rounds"]:
        if entry["round"] > 0 and entry.get("devices_trained", 0) == 0:
            unit, failed = summary.get("unit", "round"), entry["devices_failed"]
            text = f"{unit} {entry['round']}: no device trained ({failed} failed)"
            if not any(text in said for said in problems):  # the stop reason says it already
                problems.append(text)
    failed = len(summary["failures"])
    if 0 <= max_failures < failed:
        problems.append(
            f"{failed} device failures, more than federated.max_failures={max_failures}"
        )
    done = max((e["round"] for e in summary["rounds"] if "eval_loss" in e), default=0)
    if done < rounds and not problems:
        unit = summary.get("unit", "round")
        problems.append(f"only {done} of {rounds} {unit}s completed")
    return problems


def finish_run(folder: RunFolder, *, config: dict[str, Any]) -> dict[str, Any]:
    """Write summary.json, the loss, device and step-time plots, and one trace's timeline."""
    summary = build_summary(folder.history(), config=config)
    folder.write_summary(summary)
    plot_losses(summary["rounds"], folder.plot_path("loss"))
    plot_devices(summary["rounds"], folder.plot_path("devices"))
    per_device: dict[str, list[float]] = {}
    for entry in summary["rounds"]:
        for device, t in entry.get("step_times_s", {}).items():
            if t is not None:
                per_device.setdefault(summary["devices"].get(device, device), []).append(float(t))
    failed = {f["device"] for f in summary["failures"] if f.get("device")}
    plot_step_times(per_device, folder.plot_path("step_times"), failed=failed)
    traces = sorted((folder.path / "traces").glob("device-*-round-*.json"))
    if traces:
        plot_timeline(_events(traces[-1]), folder.plot_path("timeline"), title=traces[-1].stem)
    return summary


def _events(path: Path) -> list[Event]:
    data = json.loads(path.read_text())
    lanes = {
        e["tid"]: e["args"]["name"]
        for e in data["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    return [
        Event(
            e.get("args", {}).get("code", e["name"]),
            lanes[e["tid"]],
            e["ts"] / 1e6,
            (e["ts"] + e["dur"]) / 1e6,
        )
        for e in data["traceEvents"]
        if e.get("ph") == "X"
    ]
