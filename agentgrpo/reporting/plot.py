"""Line charts as PNG files or SVG text, drawn by matplotlib.

A run's `reward.png` is redrawn during training, from the trainer's thread, so charts are drawn
on a `matplotlib.figure.Figure` of their own (the Agg renderer): no pyplot, no window. The SVG
writer (the charts of `agentgrpo view`) sets two SVG settings for the length of one save, under
a lock. matplotlib is imported on first use, so importing this module stays fast.
"""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

COLOURS: tuple[str, ...] = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
"""Series colours, in the order series are given (they repeat after the last)."""

_DPI = 100
_SVG_SETTINGS = threading.Lock()


def line_chart(
    path: str | Path,
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    x_label: str,
    y_range: tuple[float, float] | None = None,
    width: int = 640,
    height: int = 400,
) -> None:
    """Write a PNG line chart of `series` (name -> (x, y) points), `width` x `height` pixels.

    Each series is drawn in the next of `COLOURS` and named in the legend; a series with a
    single point is drawn as a dot, an empty one only in the legend. Points with a non-finite
    coordinate are skipped. The x axis is ticked at whole numbers only when every x is whole
    (as steps are); the y axis spans `y_range`, or the points when None. The same series give
    the same bytes.
    """
    figure = _draw(series, title, x_label, y_range, width, height)
    figure.savefig(path, format="png", metadata={"Software": None})


def line_chart_svg(
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    x_label: str,
    y_range: tuple[float, float] | None = None,
    width: int = 640,
    height: int = 400,
) -> str:
    """The chart `line_chart` draws, as an `<svg>` element to put inline in an HTML page.

    The text is `<svg ...>...</svg>` without an XML prolog; its labels are SVG text (not
    paths), and its internal ids are derived from `title`, so two charts with different titles
    can share a page. The same series and title give the same text.
    """
    import matplotlib

    figure = _draw(series, title, x_label, y_range, width, height)
    buffer = io.StringIO()
    with _SVG_SETTINGS, matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": title}):
        figure.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def _draw(
    series: Mapping[str, Sequence[tuple[float, float]]],
    title: str,
    x_label: str,
    y_range: tuple[float, float] | None,
    width: int,
    height: int,
) -> Any:
    """The `matplotlib.figure.Figure` of `line_chart`."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI, layout="constrained")
    axes = figure.subplots()
    whole_x = True
    for i, (name, points) in enumerate(series.items()):
        clean = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
        whole_x = whole_x and all(float(x).is_integer() for x, _ in clean)
        marker = "o" if len(clean) == 1 else None
        axes.plot(
            [x for x, _ in clean],
            [y for _, y in clean],
            color=COLOURS[i % len(COLOURS)],
            linewidth=2,
            marker=marker,
            label=name,
        )
    if y_range is not None:
        axes.set_ylim(*y_range)
    axes.xaxis.set_major_locator(MaxNLocator(integer=whole_x))
    axes.grid(axis="y", color="#e1e1e1")
    axes.set_title(title)
    axes.set_xlabel(x_label)
    if series:
        axes.legend(loc="best")
    return figure
