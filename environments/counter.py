"""Counter: the smallest tool-calling task, the environment on the design card."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

_PHRASINGS = {  # eval phrasings are held out: a policy must not just memorise the train wording
    "train": (
        "Use the increment tool to make the counter reach {target}.",
        "The counter starts at 0. Call increment until it shows exactly {target}.",
        "Bring the counter to {target} with the increment tool.",
        "Make the counter equal {target}; the only way to change it is increment.",
    ),
    "eval": (
        "Get the counter to {target} using increment, then stop.",
        "Your job: the counter must end at {target}. Use the increment tool.",
    ),
}
_ROWS = {"train": 320, "eval": 64}
# Demonstrations teach the call FORMAT only: their prompts name no target and the step shown is
# random, so a model warm-started on them still has to learn to read the target from the prompt.
_DEMO_PROMPTS = (
    "Use the increment tool.",
    "Call increment once.",
    "Change the counter with the increment tool.",
    "Please increment the counter.",
)


class Counter:
    """Reach a target number by calling ``increment``; reward 1.0 for hitting it exactly.

    Rows have a ``target`` column (1-9) read by `reset`, and a ``prompt`` column the engine uses.
    """

    def reset(self, target: int) -> str:
        """Set the counter to 0 and remember the target; the text is added to the prompt."""
        self.value = 0
        self.target = target
        return "The counter is at 0."

    def increment(self, step: int) -> int:
        """Add step to the counter and return its new value.

        Args:
            step: Value to add.

        """
        self.value += step
        return self.value

    def reward(self) -> float:
        """1.0 if the counter equals the target, else 0.0."""
        return 1.0 if self.value == self.target else 0.0

    @classmethod
    def dataset(cls, split: str = "train") -> datasets.Dataset:
        """Task rows: ``prompt`` (one user message) and ``target``; the same rows on every call.

        Args:
            split: ``"train"`` (320 rows) or ``"eval"`` (64 rows, phrased differently).

        """
        if split not in _PHRASINGS:
            raise ValueError(f"Counter has splits {sorted(_PHRASINGS)}, not {split!r}")
        import datasets  # here, not at the top: importing it takes about a second

        rng = random.Random(f"counter-{split}")
        targets = [rng.randint(1, 9) for _ in range(_ROWS[split])]
        prompts = [
            [{"role": "user", "content": rng.choice(_PHRASINGS[split]).format(target=target)}]
            for target in targets
        ]
        return datasets.Dataset.from_dict({"prompt": prompts, "target": targets})

    @classmethod
    def demonstrations(cls, n: int, seed: int = 0) -> list[list[dict[str, Any]]]:
        """`n` conversations that show how to call `increment`, not which step solves a row.

        Each is a user request that names no target (with reset's text, as episodes show it),
        one call with a random step from 1 to 9, the tool's real result and a short answer.

        Args:
            n: How many conversations.
            seed: Seeds the prompts and steps; the same seed gives the same conversations.

        """
        rng = random.Random(f"counter-demonstrations-{seed}")
        conversations: list[list[dict[str, Any]]] = []
        for _ in range(n):
            env, step = cls(), rng.randint(1, 9)
            observation = env.reset(target=0)
            call = {
                "type": "function",
                "function": {"name": "increment", "arguments": {"step": step}},
            }
            conversations.append(
                [
                    {"role": "user", "content": f"{rng.choice(_DEMO_PROMPTS)}\n{observation}"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "increment", "content": str(env.increment(step))},
                    {"role": "assistant", "content": f"The counter is now {env.value}."},
                ]
            )
        return conversations
