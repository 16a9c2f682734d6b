"""The privacy bench's Pareto plot: attack accuracy against held-out loss cost, per defence.

Two panels (input reconstruction, label inference), one curve per defence through its
strengths, against the adaptive attacker (the one a defence must beat), for one cut. The
undefended run is the point at zero cost; dashed lines mark half its accuracy and the 2% loss
budget, so a setting that reaches the target lies in the lower left box of both panels.

    fedpipe bench privacy --json --plot pareto.png    # written by the bench
    python -m fedpipe_bench.privacy_plot RECORD.json OUT.svg   # again from a bench record
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from fedpipe_bench.plots import figure_svg

__all__ = ["pareto_figure", "write_pareto"]

_PANELS = (("reconstruction_acc", "input reconstruction"), ("label_acc", "label inference"))


def _curves(rows: list[dict[str, Any]], cut: int) -> dict[str, list[dict[str, Any]]]:
    curves: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("attacker") == "adaptive" and row.get("head_layers") == cut:
            curves.setdefault(str(row["defence"]), []).append(row)
    for points in curves.values():
        points.sort(key=lambda r: float(r.get("strength") or 0.0))
    return curves


def pareto_figure(report: dict[str, Any], cut: int | None = None) -> Any:
    """A matplotlib Figure of ``report`` (the bench's JSON) for head ``cut`` (default: the
    smallest cut in it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.get("rows", [])
    cuts = sorted({int(r["head_layers"]) for r in rows})
    if not cuts:
        raise ValueError("the report has no rows to plot")
    cut = cuts[0] if cut is None else cut
    curves = _curves(rows, cut)
    none = curves.pop("none", [])
    fig, axes = plt.subplots(1, 2, figsize=(10, 5), sharex=True)
    for ax, (key, title) in zip(axes, _PANELS, strict=True):
        for name, points in sorted(curves.items()):
            xs = [float(p["eval_loss_cost_pct"]) for p in points]
            ys = [float(p[key]) for p in points]
            ax.plot(xs, ys, marker="o", label=name)
            for p, x, y in zip(points, xs, ys, strict=True):
                ax.annotate(f"{p['strength']:g}", (x, y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")  # fmt: skip
        if none:
            base = float(none[0][key])
            ax.plot([0.0], [base], marker="*", markersize=12, color="black", label="none")
            ax.axhline(base / 2, color="grey", linestyle="--", linewidth=0.8)
        ax.axvline(2.0, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("symlog", linthresh=2.0)  # linear to 2%, then logarithmic: the far
        # costs (a ruined model) leave room for the ones that matter
        ax.set_title(f"{title} (adaptive attacker)")
        ax.set_xlabel("held-out loss cost, % over undefended (linear to 2, then log)")
        ax.set_ylabel("attack accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"{report.get('model')}, {cut} head block(s): privacy against loss")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


def write_pareto(report: dict[str, Any], path: str | Path, cut: int | None = None) -> Path:
    """Save the plot to ``path`` (the suffix picks the format: .png, .svg)."""
    import matplotlib.pyplot as plt

    fig = pareto_figure(report, cut)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def svg_text(report: dict[str, Any], cut: int | None = None) -> str:
    """The plot as SVG text (the docs inline it at build time, from the bench record)."""
    return figure_svg(pareto_figure(report, cut))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m fedpipe_bench.privacy_plot RECORD.json OUT.png", file=sys.stderr)
        return 2
    record = json.loads(Path(args[0]).read_text())
    write_pareto(record.get("result", record), args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
