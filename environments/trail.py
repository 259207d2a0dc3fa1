"""Trail: follow a chain of boxes, each note naming the next, then submit the code in the last.

A long task whose whole history outgrows a small window: each box is described at length (about
70 tokens) and only its last line matters, so ten boxes and their calls pass 1,024 tokens. An
episode that keeps every result runs out of room before it reaches the code; one that compacts
its context (``context_policy``: the latest result is all it needs) goes on.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, ClassVar

from environments.messages import tool_turn

if TYPE_CHECKING:
    import datasets

_WORDS = (
    "dusty", "old", "brass", "wooden", "heavy", "faded", "silver", "cracked", "painted", "small",
    "coins", "maps", "letters", "buttons", "keys", "stamps", "candles", "ribbons", "shells",
    "beads", "under", "beside", "behind", "inside", "wrapped", "in", "cloth", "paper", "velvet",
)  # fmt: skip
_ROWS = {"train": 256, "eval": 64}
_HOPS = {"train": (8, 12), "eval": (10, 12)}
_PHRASINGS = {
    "train": (
        "Start at box {start}. Open it with open_box; its note names the next box. Follow the "
        "notes box by box until a note gives the code, then submit the code.",
        "The trail begins at box {start}. Open one box at a time and go where each note says. "
        "The last box holds a code: submit it.",
        "Follow the trail from box {start}: open it, read its note, open the box the note "
        "names, and so on. Submit the code you find at the end.",
    ),
    "eval": (
        "Box {start} starts a trail of notes. Open each box the notes name, in turn, and submit "
        "the code the final box holds.",
    ),
}


class Trail:
    """Open boxes one at a time (``open_box``), each note naming the next, then ``submit``.

    A row's trail is made from its ``trail_seed``: ``hops`` boxes, the last holding a
    four-digit code. Reward 1.0 when the submitted code is right, else 0.0. Each box opened in
    trail order earns a turn reward of 0.1 (``turn_reward``: credit per turn). ``submit`` ends
    the episode. Its long episodes compact by truncating old results unless the run names
    another ``context_policy``.

    Examples:
        >>> env = Trail()
        >>> env.reset(start=3, hops=2, trail_seed=1)
        >>> env.open_box(3).endswith("The note says: go to box 36.")
        True
        >>> env.turn_reward()
        0.1
        >>> env.open_box(36).endswith("The note says: the code is 2033.")
        True
        >>> env.submit("2033"), env.reward()
        ('Submitted 2033.', 1.0)

    """

    episode_limits: ClassVar[dict[str, int]] = {"max_completion_length": 4096, "max_turns": 16}
    # A 1,024-token window, which ten boxes outgrow: `agentgrpo run` and `eval` compact.
    run_defaults: ClassVar[dict[str, float]] = {
        "max_context": 1024,
        "warm_start_steps": 64,
        "learning_rate": 3e-5,
        "per_device_train_batch_size": 8,
        "max_steps": 8,
    }
    context_policy = "truncate"

    def reset(self, start: int, hops: int, trail_seed: int) -> None:
        """Lay out the trail from box `start`; nothing is added to the prompt."""
        self.boxes, self.code = _trail(start, hops, trail_seed)
        self.next = 0  # index of the box the trail goes to next
        self.earned = 0.0
        self.submitted: str | None = None
        self.done = False

    def open_box(self, box: int) -> str:
        """Open a box and read what is inside, and its note.

        Args:
            box: The number of the box to open.

        """
        if box not in self.boxes:
            return f"There is no box {box} on this trail."
        index = self.boxes.index(box)
        if index == self.next:
            self.next += 1
            self.earned += 0.1
        last = index == len(self.boxes) - 1
        note = f"the code is {self.code}" if last else f"go to box {self.boxes[index + 1]}"
        return f"Box {box}: {_filler(box)}. The note says: {note}."

    def submit(self, code: str) -> str:
        """Submit the code from the last box; this ends the task.

        Args:
            code: The four-digit code.

        """
        if self.submitted is None:
            self.submitted = str(code).strip()
        self.done = True
        return f"Submitted {self.submitted}."

    def turn_reward(self) -> float:
        """0.1 for each box the turn opened in trail order."""
        earned, self.earned = self.earned, 0.0
        return earned

    def reward(self) -> float:
        """1.0 when the submitted code is the trail's, else 0.0."""
        return 1.0 if self.submitted == self.code else 0.0

    @classmethod
    def dataset(cls, split: str = "train") -> datasets.Dataset:
        """Task rows: ``prompt``, ``start``, ``hops`` (8 to 12; eval 10 to 12), ``trail_seed``."""
        if split not in _PHRASINGS:
            raise ValueError(f"Trail has splits {sorted(_PHRASINGS)}, not {split!r}")
        import datasets

        rng = random.Random(f"trail-{split}")
        rows: dict[str, list[Any]] = {"prompt": [], "start": [], "hops": [], "trail_seed": []}
        for _ in range(_ROWS[split]):
            start = rng.randint(1, 99)
            phrasing = rng.choice(_PHRASINGS[split])
            rows["prompt"].append([{"role": "user", "content": phrasing.format(start=start)}])
            rows["start"].append(start)
            rows["hops"].append(rng.randint(*_HOPS[split]))
            rows["trail_seed"].append(rng.randrange(2**31))
        return datasets.Dataset.from_dict(rows)

    @classmethod
    def demonstrations(cls, n: int, seed: int = 0) -> list[list[dict[str, Any]]]:
        """Whole trails of two to four boxes, walked right: open each box, submit the code."""
        rng = random.Random(f"trail-demonstrations-{seed}")
        conversations = []
        for _ in range(n):
            env, start = cls(), rng.randint(100, 199)  # boxes the task rows never start at
            env.reset(start=start, hops=rng.randint(2, 4), trail_seed=rng.randrange(2**31))
            messages = [
                {"role": "user", "content": rng.choice(_PHRASINGS["train"]).format(start=start)}
            ]
            for box in env.boxes:
                messages += tool_turn("open_box", {"box": box}, env.open_box(box))
            messages += tool_turn("submit", {"code": env.code}, env.submit(env.code))
            messages.append({"role": "assistant", "content": f"The code is {env.code}."})
            conversations.append(messages)
        return conversations


def _trail(start: int, hops: int, seed: int) -> tuple[list[int], str]:
    """The boxes in trail order (from `start`, all different) and the code in the last."""
    rng = random.Random(seed)
    boxes = [start, *rng.sample([b for b in range(1, 200) if b != start], hops - 1)]
    return boxes, f"{rng.randint(1000, 9999)}"


def _filler(box: int) -> str:
    """A long, fixed description of what box `box` holds: words that do not matter."""
    rng = random.Random(box)
    return "it holds " + " ".join(rng.choice(_WORDS) for _ in range(48))
