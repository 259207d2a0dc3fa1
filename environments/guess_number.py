"""GuessNumber: a text game written as a real `gymnasium.Env`, played through the gym adapter.

`GuessNumberGame` is the game: plain gymnasium, usable without agentgrpo. `GuessNumber` is the
built-in ``env:GuessNumber``: the game from 1 to 100 made an environment by `gym_environment`,
with task rows and format demonstrations.
"""

from __future__ import annotations

import functools
import random
import string
from typing import TYPE_CHECKING, Any, ClassVar

import gymnasium
from gymnasium.spaces import Discrete, Text

from environments.gym_adapter import gym_environment
from environments.messages import tool_turn

if TYPE_CHECKING:
    import datasets

_PHRASINGS = {  # eval phrasings are held out: a policy must not just memorise the train wording
    "train": (
        "Find my secret number with the guess tool.",
        "Play a guessing game: call guess with a number and I will say if it is too low, "
        "too high or correct.",
        "There is a hidden number. Use guess to find it in as few tries as you can.",
        "Guess the secret number. After each guess you hear whether it is too low or too high.",
    ),
    "eval": (
        "Work out the hidden number by calling guess; each answer tells you which way to go.",
        "A number has been picked for you. Use the guess tool until you get it right.",
    ),
}
LOST_SHARE = 0.5
"""A lost game's reward per share of the range its answers ruled out (all of it: 0.5)."""
_DEMO_PHRASING = "Example game: find the number I picked, using guess."
_ROWS = {"train": 256, "eval": 64}
_FIRST_SEED = {"train": 0, "eval": 1_000_000}
_TOOL: dict[str, Any] = {
    "action_tool": "guess",
    "argument": "number",
    "action_doc": "Guess the secret number; the answer says if it is too low, too high or correct.",
}


class GuessNumberGame(gymnasium.Env):
    """Guess a secret whole number from ``low`` to ``high``; reward 1.0 for finding it.

    Observations are text: the rules after `reset`, then ``"Correct!"`` or ``"Too low."`` or
    ``"Too high."`` after each guess, followed by the range the answers so far leave open (e.g.
    ``"Too low. It is from 51 to 100."``). The secret is drawn from the reset seed. The episode is
    terminated by a correct guess (reward 1.0; every other step 0.0) and truncated after
    ``max_guesses`` guesses, by default just enough for a binary search. ``open_low`` and
    ``open_high`` are the range the answers so far leave open.

    Examples:
        >>> game = GuessNumberGame(low=1, high=3)
        >>> game.reset(seed=0)[0]
        "I'm thinking of a whole number from 1 to 3. You have 2 guesses."
        >>> [game.step(guess)[:3] for guess in (1, 2, 3)][game.secret - 1]
        ('Correct!', 1.0, True)
        >>> _ = game.reset(seed=0)  # the secret is 3
        >>> game.step(1)[0]
        'Too low. It is from 2 to 3.'

    """

    def __init__(self, low: int = 1, high: int = 100, max_guesses: int | None = None) -> None:
        if high < low:
            raise ValueError(f"GuessNumberGame needs low <= high, got {low} > {high}")
        self.low, self.high = low, high
        self.max_guesses = max_guesses or (high - low + 1).bit_length()
        self.action_space = Discrete(high - low + 1, start=low)
        self.observation_space = Text(max_length=200, charset=string.printable)
        self.secret = low
        self.guesses = 0
        self.open_low, self.open_high = low, high

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Draw a new secret from the seed; the observation states the rules."""
        super().reset(seed=seed)
        self.secret = int(self.np_random.integers(self.low, self.high + 1))
        self.guesses = 0
        self.open_low, self.open_high = self.low, self.high
        rules = (
            f"I'm thinking of a whole number from {self.low} to {self.high}. "
            f"You have {self.max_guesses} guesses."
        )
        return rules, {}

    def step(self, action: int) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Compare a guess with the secret."""
        guess = int(action)
        self.guesses += 1
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {}
        if guess < self.secret:
            answer, self.open_low = "Too low.", max(self.open_low, guess + 1)
        else:
            answer, self.open_high = "Too high.", min(self.open_high, guess - 1)
        answer += f" It is from {self.open_low} to {self.open_high}."
        return answer, 0.0, False, self.guesses >= self.max_guesses, {}


# A checker cannot see through a base class made by a call, hence the ignore.
class GuessNumber(gym_environment(GuessNumberGame, name="GuessNumberGym", **_TOOL)):  # type: ignore[misc]
    """Find a secret number from 1 to 100 with ``guess`` in 7 tries; reward 1.0 when found.

    A `GuessNumberGame` through `gym_environment`: the group's seed picks the secret, so the
    members of a group play the same game. Rows have a ``prompt`` column and a ``seed`` column
    used only when the engine gives no seed of its own. Each answer names the range still open.
    A game lost still earns a little: half the share of the range its answers ruled out (below
    0.5), so GRPO can prefer the searches that use the answers while none of a group finds the
    number; success is reward 1.0.
    """

    # A binary search takes up to 7 guesses, about 57 tokens each with the tool's answer.
    episode_limits: ClassVar[dict[str, int]] = {"max_completion_length": 416, "max_turns": 8}
    # More warm-start steps than the run's 24: the demonstrations are games of seven sizes. GRPO
    # keeps the run's lr of 1e-5: at 3e-5 it broke the call format (docs/measurements.md).
    run_defaults: ClassVar[dict[str, float]] = {"warm_start_steps": 64}

    def reward(self) -> float:
        """1.0 when the number was found, else `LOST_SHARE` times the share of the range ruled out.

        Examples:
            >>> env = GuessNumber()
            >>> _ = env.reset(seed=0)  # the secret is 86
            >>> env.guess(50), env.reward()  # 1 to 50 ruled out: half the range
            ('Too low. It is from 51 to 100.', 0.25)
            >>> env.guess(25), env.reward()  # rules out nothing new
            ('Too low. It is from 51 to 100.', 0.25)
            >>> env.guess(86), env.reward()
            ('Correct! (episode over)', 1.0)

        """
        if self.terminated:  # only a right guess ends the game early
            return 1.0
        game = self.env.unwrapped
        ruled_out = 1 - (game.open_high - game.open_low + 1) / (game.high - game.low + 1)
        return LOST_SHARE * ruled_out

    @classmethod
    def dataset(cls, split: str = "train") -> datasets.Dataset:
        """Task rows: ``prompt`` (one user message) and ``seed``; the same rows on every call.

        Args:
            split: ``"train"`` (256 rows) or ``"eval"`` (64 rows, phrased differently, with
                seeds of their own).

        """
        if split not in _PHRASINGS:
            raise ValueError(f"GuessNumber has splits {sorted(_PHRASINGS)}, not {split!r}")
        import datasets  # here, not at the top: importing it takes about a second

        rng = random.Random(f"guess-number-{split}")
        seeds = list(range(_FIRST_SEED[split], _FIRST_SEED[split] + _ROWS[split]))
        prompts = [[{"role": "user", "content": rng.choice(_PHRASINGS[split])}] for _ in seeds]
        return datasets.Dataset.from_dict({"prompt": prompts, "seed": seeds})

    @classmethod
    def demonstrations(cls, n: int, seed: int = 0) -> list[list[dict[str, Any]]]:
        """Conversations that show the tool-call format: binary searches on games of other sizes.

        Each game runs from 1 to one of `DEMO_HIGHS` (never 100, the task's), so no
        demonstration is a task row; they show the strategy, guessing the middle of the range
        the last answer leaves open. Every tool result is what ``guess`` answers for that guess
        and secret.

        Args:
            n: How many conversations.
            seed: Picks the games; equal seeds give equal conversations.

        Returns:
            Chat messages per conversation: the user's prompt with the rules, then
            ``guess`` calls and their results, then a final assistant message.

        """
        rng = random.Random(f"guess-number-demonstrations-{seed}")
        return [_play_demo(rng.choice(DEMO_HIGHS), rng.randrange(2**31)) for _ in range(n)]


DEMO_HIGHS = (20, 30, 50, 64, 80, 120, 200)
"""The tops of the demonstration games, all from 1: sizes around the task's 100, never it."""


@functools.cache
def _demo_game(high: int) -> type:
    """The game from 1 to `high` as an environment class."""
    game = functools.partial(GuessNumberGame, low=1, high=high)
    return gym_environment(game, name=f"GuessNumberDemo{high}", **_TOOL)


def _play_demo(high: int, seed: int) -> list[dict[str, Any]]:
    """One binary search on a game from 1 to `high`, as chat messages."""
    env = _demo_game(high)()
    rules = env.reset(seed=seed)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"{_DEMO_PHRASING}\n{rules}"}]
    low = 1
    try:
        while not env.done:
            guess = (low + high) // 2
            answer = getattr(env, _TOOL["action_tool"])(guess)  # the tool gym_environment made
            messages += tool_turn("guess", {"number": guess}, answer)
            if answer.startswith("Too low"):
                low = guess + 1
            elif answer.startswith("Too high"):
                high = guess - 1
    finally:
        env.close()
    messages.append({"role": "assistant", "content": f"Found it: the number is {guess}."})
    return messages
