"""What the benches' plots share: a matplotlib Figure as the SVG text the docs inline."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["figure_svg"]


def figure_svg(fig: Any) -> str:
    """``fig`` as SVG text without a date (the docs build it from a record: same record, same
    bytes), the figure closed."""
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buffer.getvalue()
