"""reasoning-gym tasks as environments: ``rg:TASK`` answers a generated question with ``submit``.

reasoning-gym (``pip install 'agentgrpo[reasoning-gym]'``) generates questions procedurally
from a seed and scores answers with a scorer of its own; that scorer is the reward. It is
imported only when an ``rg:`` task is used, so it stays an optional dependency.

Rows name their question by where it came from (the generator's seed, size and index), not by
a copy of reasoning-gym's entry: some entries do not survive a round trip through JSON or Arrow
(tuples become lists and the scorer then disagrees), so `reset` regenerates the exact entry.
Train, eval and demonstrations use seeds a billion apart, so their generators never share a
random stream, and eval rows and demonstrations skip any question the default train rows ask.
"""

from __future__ import annotations

import difflib
import functools
import textwrap
from collections.abc import Set as AbstractSet
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from environments.errors import EnvironmentSpecError
from environments.messages import tool_turn

if TYPE_CHECKING:
    import datasets

INSTALL = "pip install 'agentgrpo[reasoning-gym]'"
SEEDS = {"train": 0, "eval": 1_000_000_000, "demonstrations": 2_000_000_000}
"""The generator seed of each split; a demonstration seed `s` uses ``2e9 + 1000 * s``."""
DEFAULT_SIZES = {"train": 256, "eval": 64}
_INSTRUCTION = "Give your final answer with the submit tool."
_NOT_TASKS = frozenset({"composite"})  # registered, but needs a config naming other tasks


def reasoning_gym_module() -> ModuleType:
    """``import reasoning_gym``, or an `EnvironmentSpecError` that says how to install it."""
    try:
        import reasoning_gym
    except ModuleNotFoundError as error:
        raise EnvironmentSpecError(
            f"rg: tasks need the reasoning-gym package, which is not installed: {INSTALL}"
        ) from error
    return reasoning_gym


def task_names() -> list[str]:
    """The reasoning-gym tasks ``rg:TASK`` can name, sorted.

    Raises:
        EnvironmentSpecError: reasoning-gym is not installed.

    """
    reasoning_gym_module()
    from reasoning_gym.factory import DATASETS

    return sorted(set(DATASETS) - _NOT_TASKS)


class ReasoningGymTask:
    """Answer a reasoning-gym question with ``submit``; reasoning-gym's own scorer is the reward.

    `reasoning_gym_environment` makes one subclass per task (``task`` set). Reward: the task's
    ``score_answer`` on the first submitted answer (1.0 when right; some tasks give partial
    credit), 0.0 when nothing was submitted. ``submit`` ends the episode.
    """

    task: ClassVar[str] = ""
    # One submit turn, with room to think first; a second turn lets a malformed call be retried.
    episode_limits: ClassVar[dict[str, int]] = {"max_completion_length": 256, "max_turns": 2}

    def reset(self, question: str, rg_seed: int, rg_size: int, rg_index: int) -> None:
        """Regenerate the row's reasoning-gym entry, checking it is the row's question."""
        self.entry: dict[str, Any] = _generator(self.task, rg_seed, rg_size)[rg_index]
        if self.entry["question"] != question:
            raise ValueError(
                f"reasoning-gym's {self.task} item {rg_index} (seed {rg_seed}) is not the row's "
                f"question: the rows were made by another reasoning-gym version; make them again"
            )
        self.submitted: str | None = None
        self.done = False

    def submit(self, answer: str | int | float) -> str:
        """Submit your final answer; this ends the task, so call it once.

        Args:
            answer: The answer, written the way the question asks for it.

        Raises:
            ValueError: An answer was already submitted (only the first one counts).

        """
        if self.submitted is not None:
            raise ValueError("an answer was already submitted; only the first one counts")
        self.submitted, self.done = str(answer), True
        return "Submitted."

    def reward(self) -> float:
        """reasoning-gym's score of the submitted answer; 0.0 when nothing was submitted."""
        if self.submitted is None:
            return 0.0
        return float(_scorer(self.task).score_answer(self.submitted, self.entry))

    @classmethod
    def dataset(cls, split: str = "train", size: int | None = None) -> datasets.Dataset:
        """Generated questions: ``prompt``, ``question``, ``answer`` and where they came from.

        ``answer`` is reasoning-gym's reference answer as text (for logs; the reward uses the
        task's scorer). ``rg_seed``, ``rg_size`` and ``rg_index`` let `reset` regenerate the
        entry. The same rows come back on every call.

        Args:
            split: ``"train"`` or ``"eval"`` (another seed, and no question of the default
                train rows).
            size: How many rows (default: 256 for train, 64 for eval).

        """
        if split not in DEFAULT_SIZES:
            raise ValueError(f"rg:{cls.task} has splits {sorted(DEFAULT_SIZES)}, not {split!r}")
        size = DEFAULT_SIZES[split] if size is None else size
        if size < 1:
            raise ValueError(f"the dataset size must be at least 1, got {size}")
        import datasets  # here, not at the top: importing it takes about a second

        skip = frozenset() if split == "train" else _train_questions(cls.task)
        picked = _entries(cls.task, SEEDS[split], size, skip)
        return datasets.Dataset.from_list(
            [
                {
                    "prompt": [{"role": "user", "content": _prompt(entry["question"])}],
                    "question": entry["question"],
                    "answer": _text(entry["answer"]),
                    "rg_seed": SEEDS[split],
                    "rg_size": generator_size,
                    "rg_index": index,
                }
                for entry, generator_size, index in picked
            ]
        )

    @classmethod
    def demonstrations(cls, n: int, seed: int = 0) -> list[list[dict[str, Any]]]:
        """Conversations that show the format: the question, a ``submit`` call, its result.

        Their questions come from a seed of their own and skip every question of the default
        train and eval rows, so no demonstration answers a task row.

        Args:
            n: How many conversations.
            seed: Picks the questions; equal seeds give equal conversations.

        """
        skip = _train_questions(cls.task) | {
            entry["question"]
            for entry, _, _ in _entries(
                cls.task, SEEDS["eval"], DEFAULT_SIZES["eval"], _train_questions(cls.task)
            )
        }
        start = SEEDS["demonstrations"] + 1000 * seed
        conversations = []
        for entry, generator_size, index in _entries(cls.task, start, n, skip, with_answer=True):
            answer = str(entry["answer"])
            env = cls()
            env.reset(entry["question"], rg_seed=start, rg_size=generator_size, rg_index=index)
            result = env.submit(answer)  # what the real tool returns
            conversations.append(
                [
                    {"role": "user", "content": _prompt(entry["question"])},
                    *tool_turn("submit", {"answer": answer}, result),
                    {"role": "assistant", "content": f"My answer is {answer}."},
                ]
            )
        return conversations


@functools.cache
def reasoning_gym_environment(task: str) -> type[ReasoningGymTask]:
    """The environment class of reasoning-gym task `task` (the same class on every call).

    Raises:
        EnvironmentSpecError: reasoning-gym is not installed, or has no task `task`; the
            message names the closest tasks.

    """
    names = task_names()
    if task not in names:
        close = difflib.get_close_matches(task, names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(f'rg:{name}' for name in close)}?" if close else ""
        raise EnvironmentSpecError(
            f"reasoning-gym has no task {task!r}{hint} (`agentgrpo envs` lists all {len(names)})"
        )
    doc = f"reasoning-gym's {task}: answer with ``submit``; its own scorer is the reward."
    return type(
        f"ReasoningGym_{task}",
        (ReasoningGymTask,),
        {"task": task, "__doc__": doc, "__module__": __name__},
    )


def task_listing(width: int = 100) -> str:
    """The task names as ``agentgrpo envs`` prints them, wrapped to `width` columns."""
    names = task_names()
    return textwrap.fill(
        f"rg:TASK, reasoning-gym's generated tasks ({len(names)}), for TASK in: "
        + ", ".join(names),
        width=width,
        subsequent_indent="    ",
        break_on_hyphens=False,
    )


@functools.cache
def _generator(task: str, seed: int, size: int) -> Any:
    """reasoning-gym's dataset for `task`; its item ``i`` is the same on every call."""
    return reasoning_gym_module().create_dataset(task, size=size, seed=seed)


@functools.cache
def _scorer(task: str) -> Any:
    """A dataset of `task`, for its ``score_answer`` (the default config, as rows use)."""
    return _generator(task, SEEDS["train"], 1)


@functools.cache
def _train_questions(task: str) -> frozenset[str]:
    """The questions of the default train rows, which eval rows and demonstrations avoid."""
    picked = _entries(task, SEEDS["train"], DEFAULT_SIZES["train"], frozenset())
    return frozenset(entry["question"] for entry, _, _ in picked)


def _entries(
    task: str, seed: int, size: int, skip: AbstractSet[str], with_answer: bool = False
) -> list[tuple[dict[str, Any], int, int]]:
    """The first `size` items of the seed's generator whose question is not in `skip`.

    Returns (entry, generator size, index) triples. The generator holds twice `size` plus 16
    items, room for the skipped ones.
    """
    generator_size = size if not skip and not with_answer else 2 * size + 16
    generator = _generator(task, seed, generator_size)
    picked: list[tuple[dict[str, Any], int, int]] = []
    for index in range(generator_size):
        entry = generator[index]
        if entry["question"] in skip or (with_answer and entry["answer"] is None):
            continue
        picked.append((entry, generator_size, index))
        if len(picked) == size:
            return picked
    raise ValueError(
        f"reasoning-gym's {task} gave only {len(picked)} new questions of the {size} asked "
        f"for (seed {seed}); its question space is too small for that many"
    )


def _prompt(question: str) -> str:
    return f"{question.strip()}\n\n{_INSTRUCTION}"


def _text(answer: Any) -> str | None:
    return None if answer is None else str(answer)
