"""The device-memory bench's plot: the device's peak over training steps at each
``device.weights``, beside the whole model fine-tuned with peft LoRA on the same batch.

One panel per model of the record (``fedpipe bench memory --json`` without ``--model``): a bar
per weights setting (the device's step peak, MiB), the process's baseline (Python, torch and
transformers loaded) marked inside it, and a dashed line at whole-model LoRA's peak.

    python -m fedpipe_bench.memory_plot RECORD.json OUT.svg   # from a bench record
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from fedpipe_bench.plots import figure_svg

__all__ = ["memory_figure", "svg_text"]

_MIB = 2**20


def _models(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    models: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("device_step_peak_bytes"):
            models.setdefault(str(row["model"]), []).append(row)
    return models


def memory_figure(report: dict[str, Any]) -> Any:
    """A matplotlib Figure of ``report`` (the bench's JSON), one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = _models(report.get("rows", []))
    if not models:
        raise ValueError("the memory record has no rows with device_step_peak_bytes to plot")
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, (model, rows) in zip(axes[0], models.items(), strict=True):
        names = [str(r["weights"]) for r in rows]
        peaks = [r["device_step_peak_bytes"] / _MIB for r in rows]
        base = [(r.get("baseline_rss_bytes") or 0) / _MIB for r in rows]
        ax.bar(names, peaks, color="#4c72b0", label="device step peak")
        ax.bar(names, base, color="#9fb6d8", label="process baseline")
        for x, peak in enumerate(peaks):
            ax.text(x, peak, f"{peak:.0f}", ha="center", va="bottom", fontsize=8)
        whole = rows[0].get("whole_lora_step_peak_bytes")
        if whole:
            ax.axhline(whole / _MIB, color="#c44e52", linestyle="--", label="whole-model LoRA")
            ax.set_ylim(0, whole / _MIB * 1.12)
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("device.weights")
        ax.set_ylabel("peak resident memory (MiB)")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def svg_text(report: dict[str, Any]) -> str:
    """The plot as SVG text (the docs inline it at build time, from the bench record)."""
    return figure_svg(memory_figure(report))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m fedpipe_bench.memory_plot RECORD.json OUT.svg", file=sys.stderr)
        return 2
    record = json.loads(Path(args[0]).read_text())
    Path(args[1]).write_text(svg_text(record.get("result", record)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
