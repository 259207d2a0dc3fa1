"""Observations that are not text, rendered as the text a model reads.

`observation_text(observation)` is the default rendering `gym_environment` and ``gym:ENV_ID``
give a `~gymnasium.spaces.Dict` or `~gymnasium.spaces.Tuple` observation:

- text is itself; whole numbers and booleans are their numbers; other numbers have 4
  significant digits;
- a dict is one line per key, ``key: value``, in the observation's order; a tuple or a list is
  one line per element, labelled by its index (``0: value``); a value of several lines starts on
  the line after its label, indented by two spaces;
- an array of at most `ARRAY_CELLS` values is its values: a vector on one line, a matrix one
  row per line, and an array of three or more axes one row per line of its first two axes,
  each cell its remaining values joined by commas (``2,5,0``); a larger array (a picture) is
  summarized by its shape, type and (for numbers) range.

`minigrid_text(observation)` renders MiniGrid's observation (``gym:minigrid:MiniGrid-...``): the
mission, the direction in words, and the agent's view as a grid of two-character codes with a
legend of the codes it shows, decoded with minigrid's own tables (needs minigrid).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

ARRAY_CELLS = 1024
"""The most numbers an array may have to be written out; a larger one is summarized."""

_DIRECTIONS = ("east (right)", "south (down)", "west (left)", "north (up)")  # minigrid's 0..3
_CODES = {"unseen": "??", "empty": "..", "wall": "##", "floor": "__", "goal": "GG", "lava": "~~"}
_LETTERS = {"key": "K", "ball": "O", "box": "X", "agent": "A"}
_DOORS = {"open": "d", "closed": "D", "locked": "L"}  # a door's letter says its state
_COLOUR_LETTERS = {"red": "r", "green": "g", "blue": "b", "purple": "p", "yellow": "y", "grey": "e"}
_YOU = "^^"


def observation_text(observation: Any) -> str:
    """The default text of an observation: dicts, tuples, arrays and numbers as the module says.

    Examples:
        >>> print(observation_text({"mission": "open the door", "direction": 2}))
        mission: open the door
        direction: 2
        >>> print(observation_text((15, np.int64(10), False)))
        0: 15
        1: 10
        2: False
        >>> print(observation_text({"view": np.array([[2, 2], [1, 8]])}))
        view:
          2 2
          1 8
        >>> observation_text(np.zeros((64, 64, 3), np.uint8))
        'an array of shape (64, 64, 3), uint8, from 0 to 0'

    """
    if isinstance(observation, str):
        return observation
    if isinstance(observation, Mapping):
        return _labelled((str(key), value) for key, value in observation.items())
    if isinstance(observation, tuple | list):
        return _labelled((str(index), value) for index, value in enumerate(observation))
    if isinstance(observation, np.ndarray):
        return _array_text(observation)
    return _number(observation)


def minigrid_text(observation: Mapping[str, Any]) -> str:
    """MiniGrid's observation (``image``, ``direction``, ``mission``) as text.

    The view is egocentric, as MiniGrid's ``image`` is: the agent (``^^``) is at the bottom
    centre and faces the top of the view, so ``forward`` moves up the grid. The top row is the
    farthest; ``??`` squares are hidden (behind walls or closed doors).

    Raises:
        KeyError: The observation lacks ``image``, ``direction`` or ``mission``.
        ModuleNotFoundError: minigrid is not installed.

    """
    from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT, STATE_TO_IDX

    states = {index: state for state, index in STATE_TO_IDX.items()}
    image = np.asarray(observation["image"])
    width, height = image.shape[:2]
    legend: dict[str, str] = {}
    rows = []
    for y in range(height):  # minigrid indexes the image [x, y]: column first
        cells = []
        for x in range(width):
            kind, colour, state = (int(v) for v in image[x, y])
            if (x, y) == (width // 2, height - 1):
                legend[_YOU] = "you"
                cells.append(_YOU)
                continue
            code, words = _cell(IDX_TO_OBJECT[kind], IDX_TO_COLOR[colour], states.get(state))
            legend.setdefault(code, words)
            cells.append(code)
        rows.append(" ".join(cells))
    carried = _carried(image[width // 2, height - 1], IDX_TO_OBJECT, IDX_TO_COLOR)
    direction = int(observation["direction"])
    return "\n".join(
        [
            f"Mission: {observation['mission']}",
            f"You face {_DIRECTIONS[direction % 4]}{carried}. Your view (you are {_YOU} at the "
            "bottom centre, facing the top row; forward moves you up):",
            *rows,
            "Legend: " + ", ".join(f"{code} {words}" for code, words in legend.items()) + ".",
        ]
    )


def _cell(kind: str, colour: str, state: str | None) -> tuple[str, str]:
    """One square's two-character code and its words, e.g. ``("Ly", "locked yellow door")``."""
    if kind in _CODES:
        return _CODES[kind], "not visible" if kind == "unseen" else kind
    letter = _COLOUR_LETTERS.get(colour, "?")
    if kind == "door":
        state = state or "closed"
        return _DOORS.get(state, "D") + letter, f"{state} {colour} door"
    return _LETTERS.get(kind, "?") + letter, f"{colour} {kind}"


def _carried(square: Any, objects: Mapping[int, str], colours: Mapping[int, str]) -> str:
    """What the agent's own square holds: what it carries (MiniGrid puts it there), in words."""
    kind, colour = objects[int(square[0])], colours[int(square[1])]
    return "" if kind in ("empty", "unseen") else f", carrying a {colour} {kind}"


def _labelled(items: Any) -> str:
    lines = []
    for label, value in items:
        text = observation_text(value)
        if "\n" in text:
            lines.append(f"{label}:")
            lines.extend("  " + line for line in text.split("\n"))
        else:
            lines.append(f"{label}: {text}")
    return "\n".join(lines)


def _array_text(array: np.ndarray) -> str:
    if array.ndim == 0:
        return _number(array.item())
    if array.size > ARRAY_CELLS:
        if not np.issubdtype(array.dtype, np.number):
            return f"an array of shape {array.shape}, {array.dtype}"
        low, high = _number(array.min()), _number(array.max())
        return f"an array of shape {array.shape}, {array.dtype}, from {low} to {high}"
    if array.ndim == 1:
        return " ".join(_number(value) for value in array.tolist())
    cells = array.reshape(array.shape[0], array.shape[1], -1)
    return "\n".join(
        " ".join(",".join(_number(value) for value in cell) for cell in row.tolist())
        for row in cells
    )


def _number(value: Any) -> str:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
