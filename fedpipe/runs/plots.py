"""PNG plots of a run: losses per round, devices per round, a step's timeline, step times.

Failed devices are marked: rounds where devices failed get a red cross on the loss plot, the
devices plot stacks failed on trained, and a device that failed in some round has its name in
red with "(failed)" on the step-time plot. Devices are named by partition and profile.

matplotlib is imported inside each function, so importing this module costs nothing. Figures
are drawn on their own Agg canvas (no pyplot, no global backend switch), which is safe in
headless processes and in threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["plot_devices", "plot_losses", "plot_step_times", "plot_timeline"]

_LANE_ORDER = ("device", "uplink", "server", "downlink")
# By the first letter of an event's name (fedpipe.edge.runtime's F0, T0, B0, Sf0, ...).
_KIND_COLOURS = {
    "F": ("forward", "tab:blue"),
    "T": ("tail", "tab:purple"),
    "B": ("backward", "tab:orange"),
    "O": ("optimizer", "tab:green"),
    "S": ("server", "tab:red"),
    # link transfers (fedpipe.wire.link_client names them by message kind, lower case)
    "a": ("activation", "tab:cyan"),
    "o": ("output", "tab:olive"),
    "g": ("output grad", "tab:pink"),
    "i": ("input grad", "tab:brown"),
}
_OTHER = ("other", "tab:gray")
_MAX_LABELLED_EVENTS = 80  # above this, names on bars are unreadable clutter


class _Event(Protocol):
    """What a timeline needs of an event (fedpipe.trace.Event has it)."""

    @property
    def name(self) -> str: ...
    @property
    def lane(self) -> str: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...


def plot_losses(rounds: list[dict], path: Path) -> Path:
    """Eval and train loss per round (round 0 is the initial evaluation, without train loss)."""
    fig, ax = _figure(7, 4)
    for key, label, marker in (("train_loss", "train", "o"), ("eval_loss", "eval", "s")):
        points = sorted((r["round"], r[key]) for r in rounds if r.get(key) is not None)
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker=marker, label=f"{label} loss")
    failed = [
        (r["round"], r["eval_loss"])
        for r in rounds
        if r.get("devices_failed") and r.get("eval_loss") is not None
    ]
    if failed:
        xs, ys = zip(*sorted(failed), strict=True)
        ax.plot(xs, ys, "x", color="tab:red", markersize=10, mew=2, label="devices failed")
    if ax.lines:
        ax.legend()
    else:
        _no_data(ax)
    _integer_x(ax)
    ax.set(title="Loss per round", xlabel="round", ylabel="loss (nats / token)")
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def plot_timeline(events: Sequence[_Event], path: Path, *, title: str = "") -> Path:
    """One row per lane (device, uplink, server, downlink, then others); x in ms from the start."""
    from matplotlib.patches import Patch

    lanes = _lane_order({e.lane for e in events})
    t0 = min((e.start for e in events), default=0.0)
    fig, ax = _figure(11, 1.0 + 0.7 * max(len(lanes), 1))
    used: dict[str, str] = {}
    for row, lane in enumerate(lanes):
        groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for e in events:
            if e.lane == lane:
                kind = _KIND_COLOURS.get(e.name[:1], _OTHER)
                groups.setdefault(kind, []).append(((e.start - t0) * 1e3, (e.end - e.start) * 1e3))
        for (kind_name, colour), spans in groups.items():
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=colour, edgecolor="white", lw=0.5)
            used[kind_name] = colour
    if len(events) <= _MAX_LABELLED_EVENTS:
        for e in events:
            mid = ((e.start + e.end) / 2 - t0) * 1e3
            ax.text(mid, lanes.index(e.lane), e.name, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(max(len(lanes), 1) - 0.5, -0.5)  # first lane on top
    ax.set(title=title or "Pipeline timeline", xlabel="time since first event (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    if used:
        order = [kind for kind in (*_KIND_COLOURS.values(), _OTHER) if kind[0] in used]
        handles = [Patch(facecolor=colour, label=name) for name, colour in order]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    else:
        _no_data(ax)
    return _save(fig, path)


def plot_devices(rounds: list[dict], path: Path) -> Path:
    """Devices that trained (and, stacked in red, that failed) in each round."""
    fig, ax = _figure(7, 3.5)
    points = [
        (r["round"], r.get("devices_trained", 0), r.get("devices_failed", 0))
        for r in rounds
        if r["round"] > 0
    ]
    if points:
        xs, trained, failed = zip(*points, strict=True)
        ax.bar(xs, trained, width=0.6, color="tab:green", label="trained")
        ax.bar(xs, failed, width=0.6, bottom=trained, color="tab:red", label="failed")
        ax.set_xticks(xs)
        ax.set_ylim(0, max(t + f for _, t, f in points) * 1.25)  # room for the legend
        ax.legend(loc="upper right")
    else:
        _no_data(ax)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set(title="Devices per round", xlabel="round", ylabel="devices")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def plot_step_times(
    per_device: dict[str, list[float]], path: Path, *, failed: set[str] | None = None
) -> Path:
    """A box per device of its step times (seconds), with the individual steps as dots.

    Devices in ``failed`` (they failed in some round) have their label in red, marked.
    Names such as ``partition 2 (rpi-wifi)`` are drawn on two lines.
    """
    failed = failed or set()
    names = sorted(set(per_device) | failed)
    per_device = {n: per_device.get(n, []) for n in names}
    fig, ax = _figure(max(5, 1.5 * len(names) + 2), 4)
    filled = [(i, per_device[n]) for i, n in enumerate(names, start=1) if per_device[n]]
    if filled:
        positions, data = zip(*filled, strict=True)
        ax.boxplot(data, positions=positions, widths=0.5, showmeans=True)
        for x, times in filled:
            ax.plot([x] * len(times), times, ".", color="tab:blue", alpha=0.4)
    else:
        _no_data(ax)
    labels = [n.replace(" (", "\n(") + ("\nfailed" if n in failed else "") for n in names]
    ax.set_xticks(range(1, len(names) + 1), labels, rotation=30 if len(names) > 4 else 0)
    for label, name in zip(ax.get_xticklabels(), names, strict=True):
        if name in failed:
            label.set_color("tab:red")
    ax.set_xlim(0.5, max(len(names), 1) + 0.5)
    ax.set(title="Step time per device", xlabel="device", ylabel="step time (s)")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def _figure(width: float, height: float) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _lane_order(lanes: set[str]) -> list[str]:
    known = [lane for lane in _LANE_ORDER if lane in lanes]
    return known + sorted(lanes - set(_LANE_ORDER))


def _integer_x(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path
