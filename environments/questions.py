"""Questions: guess the animal by asking yes-or-no questions; the environment answers in words.

A dialogue task with no tools: the model asks in plain text, and the environment's ``respond``
answers each question as the next user turn (a scripted answerer), until the model names the
animal or runs out of questions.
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import datasets

ANIMALS: dict[str, frozenset[str]] = {
    "cat": frozenset({"fur", "pet", "four legs"}),
    "dog": frozenset({"fur", "pet", "four legs", "bark"}),
    "horse": frozenset({"fur", "four legs", "big"}),
    "elephant": frozenset({"four legs", "big", "trunk"}),
    "tiger": frozenset({"fur", "four legs", "big", "stripes"}),
    "zebra": frozenset({"four legs", "big", "stripes"}),
    "eagle": frozenset({"fly", "feathers"}),
    "parrot": frozenset({"fly", "feathers", "pet"}),
    "penguin": frozenset({"feathers", "swim"}),
    "shark": frozenset({"swim", "big"}),
    "goldfish": frozenset({"swim", "pet"}),
    "frog": frozenset({"swim", "four legs"}),
}
"""The animals, and the features the answerer knows of each."""

# The words of a question that ask about each feature.
_ASKS = {
    "fur": ("fur", "furry", "hair"),
    "pet": ("pet", "home", "house"),
    "four legs": ("four legs", "4 legs", "legs"),
    "big": ("big", "large", "huge"),
    "stripes": ("stripe", "striped"),
    "fly": ("fly", "flies", "wings"),
    "feathers": ("feather",),
    "swim": ("swim", "water", "sea"),
    "bark": ("bark",),
    "trunk": ("trunk",),
}
_MAX_QUESTIONS = 8
_PROMPT = (
    "I am thinking of an animal: one of {animals}. Ask me yes-or-no questions about it (does "
    "it have fur, is it a pet, four legs, is it big, stripes, can it fly, feathers, does it "
    "swim), one per message, then guess with 'Is it a ...?'. You have {n} questions."
)


class Questions:
    """Twenty questions in miniature: a secret animal, yes-or-no questions, one guess at a time.

    The model writes a question per turn; ``respond`` answers "Yes." or "No." for a feature it
    knows (`ANIMALS`), says which features it knows for anything else, and ends the episode
    when the model names the animal ("Is it a cat?") or after eight questions. Reward 1.0 for
    a right guess, less 0.05 for each question before it; 0.0 otherwise.

    Examples:
        >>> env = Questions()
        >>> env.reset(animal="zebra")
        >>> env.respond("Does it have stripes?"), env.respond("Is it a tiger?")
        ('Yes.', 'No, it is not a tiger.')
        >>> env.respond("Is it a zebra?") is None, env.reward()
        (True, 0.9)

    """

    episode_limits: ClassVar[dict[str, int]] = {"max_completion_length": 512, "max_turns": 9}

    def reset(self, animal: str) -> None:
        """Think of `animal`; nothing is added to the prompt."""
        self.animal = animal
        self.questions = 0
        self.solved = False
        self.done = False

    def respond(self, message: str) -> str | None:
        """Answer the model's message; None when it guessed right or has no questions left."""
        self.questions += 1
        text = message.lower()
        guess = re.search(r"is it an? (\w+)", text)
        if guess and guess.group(1) in ANIMALS:
            self.solved = guess.group(1) == self.animal
            if self.solved or self.questions >= _MAX_QUESTIONS:
                self.done = True
                return None
            return f"No, it is not a {guess.group(1)}."
        if self.questions >= _MAX_QUESTIONS:
            self.done = True
            return None
        asked = [f for f, words in _ASKS.items() if any(w in text for w in words)]
        if len(asked) != 1:
            known = ", ".join(_ASKS)
            return f"Ask about one of: {known}; or guess with 'Is it a ...?'."
        return "Yes." if asked[0] in ANIMALS[self.animal] else "No."

    def reward(self) -> float:
        """1.0 for a right guess, less 0.05 per earlier question; 0.0 without one."""
        return round(1.0 - 0.05 * (self.questions - 1), 2) if self.solved else 0.0

    @classmethod
    def dataset(cls, split: str = "train") -> datasets.Dataset:
        """Task rows: ``prompt`` and ``animal``; train 192 rows, eval 48, every animal alike."""
        sizes = {"train": 192, "eval": 48}
        if split not in sizes:
            raise ValueError(f"Questions has splits {sorted(sizes)}, not {split!r}")
        import datasets

        rng = random.Random(f"questions-{split}")
        names = sorted(ANIMALS)
        animals = [names[i % len(names)] for i in range(sizes[split])]
        rng.shuffle(animals)
        prompts = []
        for _ in animals:
            shown = rng.sample(names, len(names))
            text = _PROMPT.format(animals=", ".join(shown), n=_MAX_QUESTIONS)
            prompts.append([{"role": "user", "content": text}])
        return datasets.Dataset.from_dict({"prompt": prompts, "animal": animals})

    @classmethod
    def demonstrations(cls, n: int, seed: int = 0) -> list[list[dict[str, Any]]]:
        """Games played by halving the candidates: ask the feature that splits them most evenly."""
        rng = random.Random(f"questions-demonstrations-{seed}")
        return [_demonstration(cls, rng) for _ in range(n)]


QUESTION_OF = {
    "fur": "Does it have fur?", "pet": "Is it a pet?", "four legs": "Does it have four legs?",
    "big": "Is it big?", "stripes": "Does it have stripes?", "fly": "Can it fly?",
    "feathers": "Does it have feathers?", "swim": "Does it swim?", "bark": "Does it bark?",
    "trunk": "Does it have a trunk?",
}  # fmt: skip


def _demonstration(cls: type[Questions], rng: random.Random) -> list[dict[str, Any]]:
    """One game: the most even split each turn, then a guess once one candidate is left."""
    names = sorted(ANIMALS)
    env = cls()
    env.reset(animal=rng.choice(names))
    text = _PROMPT.format(animals=", ".join(rng.sample(names, len(names))), n=_MAX_QUESTIONS)
    messages: list[dict[str, Any]] = [{"role": "user", "content": text}]
    candidates = names
    while True:
        if len(candidates) == 1:
            messages.append({"role": "assistant", "content": f"Is it a {candidates[0]}?"})
            env.respond(messages[-1]["content"])
            return messages
        feature = min(
            QUESTION_OF,
            key=lambda f: abs(sum(f in ANIMALS[c] for c in candidates) * 2 - len(candidates)),
        )
        answer = env.respond(QUESTION_OF[feature])
        messages += [
            {"role": "assistant", "content": QUESTION_OF[feature]},
            {"role": "user", "content": answer},
        ]
        candidates = [c for c in candidates if (feature in ANIMALS[c]) == (answer == "Yes.")]
