"""Line charts as PNG files, in pure Python (zlib and struct): no imaging library needed.

The project keeps its dependencies to the training stack, so the reward chart a run leaves behind
is drawn here: an RGB canvas, a 5x7 bitmap font, lines two pixels thick, and a PNG encoder.
Output is deterministic: the same series give the same bytes.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

Colour = tuple[int, int, int]

COLOURS: tuple[Colour, ...] = (
    (31, 119, 180),  # blue
    (255, 127, 14),  # orange
    (44, 160, 44),  # green
    (214, 39, 40),  # red
    (148, 103, 189),  # purple
    (140, 86, 75),  # brown
)
"""Series colours, in the order series are given (they repeat after the last)."""

_WHITE, _BLACK, _GRID = (255, 255, 255), (0, 0, 0), (225, 225, 225)

# 5x7 glyphs: seven rows, two hex digits each, bit 4 the leftmost pixel. Lowercase letters are
# drawn with the uppercase glyphs; any other character is drawn as "?".
# fmt: off
_FONT = {
    "0": "0e11131519110e", "1": "040c040404040e", "2": "0e11010204081f", "3": "1f02040201110e",
    "4": "02060a121f0202", "5": "1f101e0101110e", "6": "0608101e11110e", "7": "1f010204080808",
    "8": "0e11110e11110e", "9": "0e11110f01020c", "A": "0e11111f111111", "B": "1e11111e11111e",
    "C": "0e11101010110e", "D": "1c12111111121c", "E": "1f10101e10101f",
    "F": "1f10101e101010", "G": "0e11101711110f", "H": "1111111f111111",
    "I": "0e04040404040e", "J": "0702020202120c", "K": "11121418141211", "L": "1010101010101f",
    "M": "111b1515111111", "N": "11111915131111", "O": "0e11111111110e", "P": "1e11111e101010",
    "Q": "0e11111115120d", "R": "1e11111e141211", "S": "0f10100e01011e", "T": "1f040404040404",
    "U": "1111111111110e", "V": "11111111110a04", "W": "1111111515150a",
    "X": "11110a040a1111", "Y": "1111110a040404", "Z": "1f01020408101f", " ": "00000000000000",
    ".": "00000000000c0c", ",": "000000000c0408", "-": "0000001f000000",
    "+": "0004041f040400", "=": "00001f001f0000", "/": "00010204081000", "_": "0000000000001f",
    ":": "000c0c000c0c00", "%": "18190204081303", "(": "02040808080402", ")": "08040202020408",
    "?": "0e110102040004",
}
# fmt: on
_GLYPH_W, _GLYPH_H = 5, 7


class _Canvas:
    """An RGB image, row-major, 3 bytes a pixel; drawing outside it is clipped."""

    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(_WHITE * (width * height))

    def dot(self, x: int, y: int, colour: Colour, size: int = 1) -> None:
        """A `size` x `size` square whose top-left pixel is (x, y)."""
        for row in range(max(y, 0), min(y + size, self.height)):
            start, stop = max(x, 0), min(x + size, self.width)
            if start < stop:
                self.pixels[3 * (row * self.width + start) : 3 * (row * self.width + stop)] = bytes(
                    colour
                ) * (stop - start)

    def line(self, x0: int, y0: int, x1: int, y1: int, colour: Colour, size: int = 1) -> None:
        """Bresenham's line from (x0, y0) to (x1, y1), `size` pixels thick."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        error = dx + dy
        while True:
            self.dot(x0, y0, colour, size)
            if (x0, y0) == (x1, y1):
                return
            twice = 2 * error
            if twice >= dy:
                error, x0 = error + dy, x0 + sx
            if twice <= dx:
                error, y0 = error + dx, y0 + sy

    def text(self, x: int, y: int, text: str, colour: Colour, scale: int = 1) -> None:
        """`text` in the bitmap font with its top-left corner at (x, y)."""
        for i, char in enumerate(text.upper()):
            glyph = bytes.fromhex(_FONT.get(char, _FONT["?"]))
            left = x + i * text_width(" ", scale)
            for row, bits in enumerate(glyph):
                for col in range(_GLYPH_W):
                    if bits >> (_GLYPH_W - 1 - col) & 1:
                        self.dot(left + col * scale, y + row * scale, colour, scale)

    def png(self) -> bytes:
        """The image encoded as an 8-bit RGB PNG."""
        stride = 3 * self.width
        raw = b"".join(
            b"\x00" + self.pixels[y * stride : (y + 1) * stride] for y in range(self.height)
        )
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(raw, 9))
            + _chunk(b"IEND", b"")
        )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def text_width(text: str, scale: int = 1) -> int:
    """Width in pixels of `text` in the bitmap font (one blank column after each glyph).

    >>> text_width("0.5")
    18
    """
    return len(text) * (_GLYPH_W + 1) * scale


def ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round values (1, 2 or 5 times a power of ten apart) covering [low, high], about `count`.

    >>> ticks(0, 1)
    [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    >>> ticks(-3, 12, 3)
    [0.0, 5.0, 10.0]
    """
    rough = (high - low) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(rough))
    step = min((m * power for m in (1, 2, 5, 10)), key=lambda step: abs(step - rough))
    first = math.ceil(low / step - 1e-9)
    last = math.floor(high / step + 1e-9)
    return [round(k * step, 12) + 0.0 for k in range(first, last + 1)]


def _label(value: float) -> str:
    """A tick label: whole numbers in full (step 12000, not 1.2e+04), others to 4 digits.

    >>> _label(12000.0), _label(0.25), _label(1 / 3)
    ('12000', '0.25', '0.3333')
    """
    return str(int(value)) if value.is_integer() and abs(value) < 1e9 else f"{value:.4g}"


def _span(values: Sequence[float]) -> tuple[float, float]:
    """The range of `values`, widened where it would be empty: a lone value sits mid-axis."""
    if not values:
        return 0.0, 1.0
    low, high = min(values), max(values)
    if low == high:
        return low - 1.0, high + 1.0
    return low, high


@dataclass(frozen=True)
class _Frame:
    """The plot area, in pixels, and the data ranges it shows."""

    left: int
    top: int
    right: int
    bottom: int
    x_span: tuple[float, float]
    y_span: tuple[float, float]
    whole_x: bool  # every x is a whole number (steps): label only whole x ticks

    def x(self, value: float) -> int:
        low, high = self.x_span
        return round(self.left + (value - low) / (high - low) * (self.right - self.left))

    def y(self, value: float) -> int:
        low, high = self.y_span
        return round(self.bottom - (value - low) / (high - low) * (self.bottom - self.top))


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
    """Write a PNG line chart of `series` (name -> (x, y) points) to `path`.

    Each series is drawn in the next of `COLOURS` and named in that colour in a legend under
    the title; a series with a single point is drawn as a dot, an empty one only in the legend.
    Points with a non-finite coordinate are skipped. The x axis spans the points (ticked at
    whole numbers only when every x is whole, as steps are); the y axis spans `y_range`, or the
    points when None.
    """
    clean = {
        name: [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
        for name, points in series.items()
    }
    everything = [point for points in clean.values() for point in points]
    frame = _Frame(
        left=64,
        top=40,
        right=width - 16,
        bottom=height - 40,
        x_span=_span([x for x, _ in everything]),
        y_span=y_range or _span([y for _, y in everything]),
        whole_x=all(float(x).is_integer() for x, _ in everything),
    )
    canvas = _Canvas(width, height)
    _draw_axes(canvas, frame)
    canvas.text((width - text_width(title, 2)) // 2, 6, title, _BLACK, scale=2)
    canvas.text((frame.left + frame.right - text_width(x_label)) // 2, height - 14, x_label, _BLACK)
    legend_x = frame.left
    for i, (name, points) in enumerate(clean.items()):
        colour = COLOURS[i % len(COLOURS)]
        canvas.dot(legend_x, frame.top - 13, colour, 7)
        canvas.text(legend_x + 11, frame.top - 13, name, colour)
        legend_x += 11 + text_width(name) + 16
        _draw_series(canvas, [(frame.x(x), frame.y(y)) for x, y in points], colour)
    Path(path).write_bytes(canvas.png())


def _draw_axes(canvas: _Canvas, frame: _Frame) -> None:
    """Both axes, y grid lines, and tick labels."""
    for value in ticks(*frame.y_span):
        y, label = frame.y(value), _label(value)
        canvas.line(frame.left, y, frame.right, y, _GRID)
        canvas.text(frame.left - 6 - text_width(label), y - 3, label, _BLACK)
    for value in ticks(*frame.x_span):
        if frame.whole_x and not value.is_integer():
            continue
        x, label = frame.x(value), _label(value)
        canvas.line(x, frame.bottom, x, frame.bottom + 4, _BLACK)
        canvas.text(x - text_width(label) // 2, frame.bottom + 8, label, _BLACK)
    canvas.line(frame.left, frame.top, frame.left, frame.bottom, _BLACK)
    canvas.line(frame.left, frame.bottom, frame.right, frame.bottom, _BLACK)


def _draw_series(canvas: _Canvas, pixels: list[tuple[int, int]], colour: Colour) -> None:
    if len(pixels) == 1:
        canvas.dot(pixels[0][0] - 2, pixels[0][1] - 2, colour, 5)
    for (x0, y0), (x1, y1) in itertools.pairwise(pixels):
        canvas.line(x0, y0, x1, y1, colour, size=2)
