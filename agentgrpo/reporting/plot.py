"""Line charts as PNG files, drawn by matplotlib.

A run's `reward.png` is redrawn during training, from the trainer's thread, so charts are drawn
on a `matplotlib.figure.Figure` of their own (the Agg renderer): no pyplot, no global state,
no window. matplotlib is imported on first use, so importing this module stays fast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

COLOURS: tuple[str, ...] = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
"""Series colours, in the order series are given (they repeat after the last)."""

_DPI = 100


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
    figure.savefig(path, format="png", metadata={"Software": None})
