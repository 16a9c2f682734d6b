"""What ``fedpipe simulate`` and ``fedpipe run`` print: live lines as the run goes, then a report.

The ServerApp runs in Flower's processes; what it records in ``metrics.jsonl`` (see
:mod:`fedpipe.runs.summary`) is the channel back to the user. :class:`LiveReport` tails
that file and prints one line per round, failure, wait and stop, on stderr, as they happen,
and the round's progress (each device's steps done): on a terminal one live line per round,
redrawn in place; elsewhere (CI, a log file) a plain line at most every ``every_s``.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["LiveReport", "format_record", "plan_line", "progress_line", "report_lines"]


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _round_line(rec: dict[str, Any], total: int) -> str:
    r = int(rec["round"])
    word = rec.get("unit", "round")  # "version" in async runs (federated.mode = async)
    head = f"{word} {r}/{total}: eval loss {rec['eval_loss']:.4f} (ppl {rec['eval_ppl']:.1f})"
    if rec.get("eval_exact_match") is not None:  # federated.eval_generate
        head += (
            f", exact {100 * rec['eval_exact_match']:.0f}% contains "
            f"{100 * rec['eval_contains']:.0f}% of {int(rec['eval_answered'])}"
        )
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
    if rec.get("sessions_per_replica"):  # StageServer replicas
        per = "/".join(str(n) for n in rec["sessions_per_replica"])
        parts.append(f"sessions per replica {per}")
    parts.append(f"{rec.get('wall_s', 0.0):.1f} s")
    return ", ".join(parts)


def _waiting_line(rec: dict[str, Any]) -> str:
    r, who = rec.get("round"), ", ".join(rec.get("waiting_for", [])) or "devices not seen yet"
    if rec.get("phase") == "replies" and rec.get("why"):  # the late devices, each with why
        who = "; ".join(f"{d}: {w}" for d, w in zip(rec["waiting_for"], rec["why"], strict=False))
        return (
            f"round {r}: waiting for {who} (waited {rec['waited_s']:.0f} s; goes on without "
            f"them after {rec['deadline_s']:g} s)"
        )
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


def _device_label(dev: dict[str, Any]) -> str:
    """``partition 2``; before a device's first reply its Flower node id, cut short."""
    partition, node = dev.get("partition"), str(dev.get("node_id"))
    if partition is not None:
        return f"partition {partition}"
    return f"node {node[:6]}…" if len(node) > 7 else f"node {node}"


def _device_progress(dev: dict[str, Any], steps: int) -> str:
    """One device in a progress line: ``partition 1 2/4``, ``... starting``, ``... done``."""
    label, state, done = _device_label(dev), dev.get("state"), dev.get("steps_done", 0)
    if state == "starting":
        return f"{label} starting"
    suffix = {"done": " done", "failed": " failed", "late": " late"}.get(str(state), "")
    return f"{label} {done}/{steps}{suffix}"


def progress_devices(rec: dict[str, Any]) -> tuple[int, int, str]:
    """A ``progress`` record's steps done, steps owed, and its devices as text."""
    devices, steps = rec.get("devices", []), int(rec.get("steps", 0))
    done = sum(int(d.get("steps_done", 0)) for d in devices)
    return done, steps * len(devices), ", ".join(_device_progress(d, steps) for d in devices)


def progress_line(rec: dict[str, Any], *, rounds: int) -> str:
    """A round's progress as one plain line: steps done of all owed, then each device."""
    done, total, devices = progress_devices(rec)
    return (
        f"round {rec.get('round')}/{rounds}: {done}/{total} steps, "
        f"{float(rec.get('elapsed_s', 0.0)):.0f} s; {devices}"
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
    if event == "progress":
        return progress_line(rec, rounds=rounds)
    if event == "refused":  # async: a stale or second update, counted, not aggregated
        return (
            f"device {rec.get('device')}: update of version {rec.get('version')} refused: "
            + str(rec.get("reason"))
        )
    if event == "stop":
        return f"run stopped: {rec.get('reason')}"
    if event == "start" and rec.get("resumed"):
        return f"resuming after round {rec.get('round')}"
    return None


_BAR_FORMAT = "{desc} |{bar:10}| {n_fmt}/{total_fmt} steps [{elapsed}]{postfix}"


class LiveReport:
    """Prints the lines of records appended to ``metrics.jsonl`` after it was created.

    ``progress`` records: on a terminal (``tty``; default: whether ``out`` is one) one live
    line per round, redrawn in place until the round's result line replaces it; elsewhere a
    plain line at most every ``every_s`` (the round's latest). ``quiet`` prints only failures
    and stops (``--no-progress``): a failure is never silent.
    """

    def __init__(
        self,
        metrics: Path,
        *,
        rounds: int,
        out: TextIO | None = None,
        quiet: bool = False,
        every_s: float = 30.0,
        tty: bool | None = None,
    ) -> None:
        self.path, self.rounds, self.out = Path(metrics), rounds, out or sys.stderr
        self.quiet, self.every_s = quiet, every_s
        self.tty = _is_tty(self.out) if tty is None else tty
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: tqdm | None = None  # the live line of the round in progress (terminal)
        self._bar_round: Any = None
        self._said_at = -math.inf  # when the last plain progress line was printed
        self._unsaid: dict[str, Any] | None = None  # a progress record not printed yet

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
                self._show(record)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                continue
        self._say_progress()
        if self._bar is not None:
            self._bar.refresh()  # its clock goes on between records

    def _show(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if self.quiet and event not in ("failure", "stop"):
            return
        if event == "progress":
            self._progress(record)
            return
        line = format_record(record, rounds=self.rounds)
        if event == "eval" and record.get("round") == self._bar_round:
            self._close_bar()  # the round's result line takes its place
        if event == "eval" and self._unsaid and self._unsaid.get("round") == record.get("round"):
            self._unsaid = None  # the round is over: its result says it all
        if line:
            self._print(line)

    def _progress(self, record: dict[str, Any]) -> None:
        if not self.tty:
            self._unsaid = record
            return
        if self._bar is not None and self._bar_round != record.get("round"):
            self._close_bar()
        done, total, devices = progress_devices(record)
        if self._bar is None:
            self._bar = tqdm(
                total=total,
                initial=done,
                desc=f"fedpipe: round {record.get('round')}/{self.rounds}",
                file=self.out,
                leave=False,
                dynamic_ncols=True,
                mininterval=0,
                bar_format=_BAR_FORMAT,
            )
            self._bar_round = record.get("round")
        self._bar.total, self._bar.n = total, done
        self._bar.set_postfix_str(devices, refresh=False)
        self._bar.refresh()

    def _say_progress(self) -> None:
        """Off a terminal: the latest progress line, if none was printed for ``every_s``."""
        now = time.monotonic()
        if self._unsaid is None or now - self._said_at < self.every_s:
            return
        self._print(progress_line(self._unsaid, rounds=self.rounds))
        self._unsaid, self._said_at = None, now

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.clear()
        print(f"fedpipe: {line}", file=self.out, flush=True)
        if self._bar is not None:
            self._bar.refresh()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar, self._bar_round = None, None

    def start(self, poll_s: float = 1.0) -> LiveReport:
        """Poll every ``poll_s`` on a thread of its own, until :meth:`stop`."""

        def loop() -> None:
            while not self._stop.wait(poll_s):
                self.poll()

        self._thread = threading.Thread(target=loop, name="fedpipe-live-report", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and print what is left; the live line goes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll()
        self._close_bar()


def _is_tty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):  # no such method, or closed
        return False


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
    unit = summary.get("unit", "round")  # "version" in async runs
    for entry in summary["rounds"]:
        loss, train = entry.get("eval_loss"), entry.get("train_loss")
        text = f"{unit} {entry['round']}: eval loss " + ("-" if loss is None else f"{loss:.4f}")
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
