"""ColourSquare: a task only the picture answers, for vision-language models.

`reset` draws a small picture with Pillow (a coloured square on a grey ground, nothing
downloaded) and returns it with the question; the prompt names no colour, so a model must read
the image to earn the reward.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 180, 60),
    "blue": (40, 60, 220),
    "yellow": (240, 220, 40),
}
_ROWS = {"train": 256, "eval": 64}
_SIDE = 32  # pixels: a tiny picture is a handful of image tokens


class ColourSquare:
    """Name the colour of the square in the picture with ``answer``; reward 1.0 when right.

    Rows have a ``colour`` column (a key of `COLOURS`), read by `reset`, and a ``prompt``.
    """

    def reset(self, colour: str, seed: int | None = None) -> list[Any]:
        """Draw the square (where, seeded) and return the question and the picture."""
        if colour not in COLOURS:
            raise ValueError(f"colour must be one of {sorted(COLOURS)}, not {colour!r}")
        self.colour, self.done = colour, False
        self.answered: str | None = None
        return ["Here is the picture.", draw_square(COLOURS[colour], random.Random(seed))]

    def answer(self, colour: str) -> str:
        """Give your answer; the episode ends.

        Args:
            colour: The colour of the square, one word (red, green, blue or yellow).

        """
        self.answered, self.done = colour.strip().lower(), True
        return "Answer recorded."

    def reward(self) -> float:
        """1.0 if the answer names the square's colour, else 0.0."""
        return 1.0 if self.answered == self.colour else 0.0

    @classmethod
    def dataset(cls, split: str = "train") -> datasets.Dataset:
        """Task rows: ``prompt`` and ``colour``; the same rows on every call.

        Args:
            split: ``"train"`` (256 rows) or ``"eval"`` (64 rows).

        """
        if split not in _ROWS:
            raise ValueError(f"ColourSquare has splits {sorted(_ROWS)}, not {split!r}")
        import datasets  # here, not at the top: importing it takes about a second

        rng = random.Random(f"colour-square-{split}")
        colours = [rng.choice(sorted(COLOURS)) for _ in range(_ROWS[split])]
        question = "What colour is the square in the picture? Call answer with one word."
        prompts = [[{"role": "user", "content": question}]] * len(colours)
        return datasets.Dataset.from_dict({"prompt": prompts, "colour": colours})


def draw_square(rgb: tuple[int, int, int], rng: random.Random) -> Any:
    """A `_SIDE`-pixel grey picture with a square of colour `rgb` somewhere in it (PIL image)."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (_SIDE, _SIDE), (128, 128, 128))
    size = rng.randint(_SIDE // 3, _SIDE // 2)
    x, y = rng.randint(0, _SIDE - size), rng.randint(0, _SIDE - size)
    ImageDraw.Draw(picture).rectangle((x, y, x + size - 1, y + size - 1), fill=rgb)
    return picture
