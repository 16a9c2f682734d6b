"""What ``fedpipe simulate`` and ``fedpipe run`` print: live lines as the run goes, then a report.

The ServerApp runs in Flower's processes; what it records in ``metrics.jsonl`` (see
:mod:`fedpipe.runs.summary`) is the channel back to the user. :class:`LiveReport` tails
that file and prints one line per round, failure, wait and stop, on stderr, as they happen.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

__all__ = ["LiveReport", "format_record", "plan_line", "report_lines"]


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _round_line(rec: dict[str, Any], total: int) -> str:
    r = int(rec["round"])
    head = f"round {r}/{total}: eval loss {rec['eval_loss']:.4f} (ppl {rec['eval_ppl']:.1f})"
    if r == 0:
        return f"{head} before training"
    parts = [head]
    if rec.get("train_loss") is not None:
        parts.append(f"train loss {rec['train_loss']:.4f}")
    trained, failed = rec.get("devices_trained", 0), rec.get("devices_failed", 0)
    parts.append(
        f"{trained}/{trained + failed} devices trained" + (f", {failed} failed" if failed else "")
    )
    parts.append(f"up {_mb(rec.get('bytes_up', 0))}, down {_mb(rec.get('bytes_down', 0))}")
    parts.append(f"{rec.get('wall_s', 0.0):.1f} s")
    return ", ".join(parts)


def _waiting_line(rec: dict[str, Any]) -> str:
    r, who = rec.get("round"), ", ".join(rec.get("waiting_for", [])) or "devices not seen yet"
    if rec.get("phase") == "replies":
        return (
            f"round {r}: waiting for {who} ({rec['waited_s']:.0f} s; goes on without them "
            f"after {rec['deadline_s']:g} s)"
        )
    have, want = rec.get("connected", 0), rec.get("want", 0)
    if rec.get("phase") == "start":
        return f"round {r}: starting with {have} of {want} devices after {rec['waited_s']:.0f} s"
    return (
        f"round {r}: {have} of {want} devices connected, waiting for {who} "
        f"({rec['waited_s']:.0f} s of {rec['deadline_s']:g} s)"
    )


def plan_line(device: str, plan: dict[str, Any]) -> str:
    """One device's plan, its predicted and measured step time (``pipeline.plan = "auto"``)."""
    grads = plan.get("gradient_codec", plan.get("codec"))
    codecs = plan.get("codec", "?") + (f"/{grads}" if grads != plan.get("codec") else "")
    cap = f" <= {plan['max_in_flight']} live" if plan.get("max_in_flight") else ""
    text = (
        f"{device}: plan {plan.get('cut', '?')} M={plan.get('microbatches')} "
        f"{plan.get('schedule')}{cap} {codecs}, predicted {float(plan['predicted_s']):.3f} s"
    )
    if "measured_s" in plan:
        text += f", measured {float(plan['measured_s']):.3f} s ({float(plan['error']):+.0%})"
    if str(plan.get("why", "")).startswith("re-planned"):
        text += f"; {plan['why']}"
    return text


def format_record(rec: dict[str, Any], *, rounds: int) -> str | None:
    """The console line for one metrics record, or None for records not shown live."""
    event = rec.get("event")
    if event == "train" and rec.get("plan"):
        return f"round {rec.get('round')}: " + plan_line(str(rec.get("device")), rec["plan"])
    if event == "eval" and "eval_loss" in rec:
        return _round_line(rec, rounds)
    if event == "failure":
        return f"device {rec.get('device')} failed in round {rec.get('round')}: {rec.get('reason')}"
    if event == "waiting":
        return _waiting_line(rec)
    if event == "stop":
        return f"run stopped: {rec.get('reason')}"
    if event == "start" and rec.get("resumed"):
        return f"resuming after round {rec.get('round')}"
    return None


class LiveReport:
    """Prints the lines of records appended to ``metrics.jsonl`` after it was created.

    ``quiet`` prints only failures and stops (``--no-progress``): a failure is never silent.
    """

    def __init__(
        self, metrics: Path, *, rounds: int, out: TextIO | None = None, quiet: bool = False
    ) -> None:
        self.path, self.rounds, self.out = Path(metrics), rounds, out or sys.stderr
        self.quiet = quiet
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        """Print the lines of complete records written since the last poll."""
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a record being written is read next time
        self.offset += end
        for raw in data[:end].splitlines():
            try:
                record = json.loads(raw)
                line = format_record(record, rounds=self.rounds)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            if self.quiet and record.get("event") not in ("failure", "stop"):
                continue
            if line:
                print(f"fedpipe: {line}", file=self.out, flush=True)

    def start(self, every_s: float = 1.0) -> LiveReport:
        def loop() -> None:
            while not self._stop.wait(every_s):
                self.poll()

        self._thread = threading.Thread(target=loop, name="fedpipe-live-report", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and print what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll()


_EPSILONS = (
    ("privacy_epsilon", "stage link epsilon"),
    ("privacy_epsilon_activations", "stage link epsilon (activations only)"),
    ("privacy_epsilon_gradients", "stage link epsilon (gradients only)"),
)


def _privacy_text(per_device: dict[str, dict[str, float]]) -> str:
    """The round's largest per-sample epsilon over devices (fedpipe.privacy), if noised."""
    for key, label in _EPSILONS:
        values = [d[key] for d in per_device.values() if key in d]
        if values:
            delta = max(d.get("privacy_delta", 0.0) for d in per_device.values())
            return f", {label} {max(values):.3g} per sample (delta {delta:g})"
    return ""


def _delta_lines(rounds: list[dict[str, Any]], names: dict[str, str]) -> list[str]:
    """Per device, one line: in how many rounds the server resumed its delta cache."""
    seen: dict[str, list[dict[str, Any]]] = {}
    for entry in rounds:
        for device, delta in entry.get("delta", {}).items():
            seen.setdefault(device, []).append(delta)
    return [
        f"{names.get(device, f'device {device}')}: delta cache resumed in "
        f"{sum(d['resumed'] for d in ds)} of {len(ds)} rounds; last round "
        f"{ds[-1]['hit_rate']:.0%} of activation rows sent as differences"
        for device, ds in seen.items()
    ]


def report_lines(summary: dict[str, Any]) -> list[str]:
    """The final report: one line per round (losses, devices trained of sampled), then totals."""
    lines = []
    for entry in summary["rounds"]:
        loss, train = entry.get("eval_loss"), entry.get("train_loss")
        text = f"round {entry['round']}: eval loss " + ("-" if loss is None else f"{loss:.4f}")
        if train is not None:
            text += f", train loss {train:.4f}"
        if entry["round"] > 0:
            trained, failed = entry.get("devices_trained", 0), entry.get("devices_failed", 0)
            text += f", {trained}/{trained + failed} devices trained"
        text += _privacy_text(entry.get("privacy") or {})
        lines.append(text)
    if "eval_loss_drop_pct" in summary:
        lines.append(
            f"held-out loss {summary['first_eval_loss']:.4f} -> {summary['last_eval_loss']:.4f} "
            f"({summary['eval_loss_drop_pct']:.1f}% lower)"
        )
    names = summary.get("devices", {})
    for device, plan in summary.get("plans", {}).items():
        lines.append(plan_line(names.get(device, f"device {device}"), plan))
    lines += _delta_lines(summary["rounds"], names)
    if summary.get("failures"):
        lines.append(f"{len(summary['failures'])} device failures (summary.json: failures)")
    return lines
