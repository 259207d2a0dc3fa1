"""The files `agentgrpo init NAME` writes: an installable environment package, as templates.

Each is a `string.Template` keyed by its path in the package; ``$name`` is the package (and
import, and entry point) name, ``$class_name`` the environment class, ``$version`` the
installed agentgrpo's version, the lowest the package accepts. What the templates write is
tested by installing a package made from them and running its own tests
(tests/agentgrpo/cli/test_init_command.py).
"""

from __future__ import annotations

from string import Template

PYPROJECT = Template("""\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "$name"
version = "0.1.0"
description = "$class_name, an agentgrpo environment"
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["agentgrpo>=$version"]

[project.optional-dependencies]
test = ["pytest"]

# What makes `agentgrpo run $name` find the class once the package is installed.
[project.entry-points."agentgrpo.environments"]
$name = "$name.env:$class_name"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]

[tool.ruff]
line-length = 100
""")

INIT = Template('''\
"""$class_name, an agentgrpo environment; `agentgrpo run $name` trains on it once installed."""

from $name.env import $class_name

__all__ = ["$class_name"]
''')

ENV = Template('''\
"""$class_name: reverse a word, then submit it. Replace the task with yours.

`reset` receives the columns of a row it names, every other public method with type hints and
a docstring is a tool, `reward` scores the finished episode, `dataset` gives the task rows and
`demonstrations` shows the model the tool-call format for the warm start of `agentgrpo run`.
"""

from __future__ import annotations

import random
from typing import Any

_PROMPT = "Spell the word backwards and submit it with the submit tool."
_WORDS = {
    "train": ("stone", "river", "cloud", "maple", "tiger", "lemon", "piano", "grass"),
    "eval": ("amber", "crane", "delta", "frost"),
}
_DEMO_WORDS = ("apple", "bread", "chair", "dance", "eagle", "flame")  # in no split


class $class_name:
    """Reverse a word and submit it; reward 1.0 for the exact reversal.

    Rows have a ``word`` column, read by `reset`, and a ``prompt`` column, the user message.
    """

    episode_limits = {"max_turns": 2, "max_completion_length": 96}

    def reset(self, word: str) -> str:
        """Start an episode on `word`; the text returned is added to the prompt."""
        self.word = word
        self.answer: str | None = None
        self.done = False
        return f"The word is {word}."

    def submit(self, answer: str) -> str:
        """Submit the word spelled backwards; this ends the episode.

        Args:
            answer: The word, reversed.

        """
        self.answer = answer.strip()
        self.done = True
        return f"Submitted {self.answer}."

    def reward(self) -> float:
        """1.0 if the submitted answer is the word reversed, else 0.0."""
        return 1.0 if self.answer == self.word[::-1] else 0.0

    @classmethod
    def dataset(cls, split: str = "train") -> list[dict[str, Any]]:
        """Task rows: ``prompt`` (the user message) and ``word``.

        Args:
            split: ``"train"`` (8 rows) or ``"eval"`` (4 other words).

        """
        if split not in _WORDS:
            raise ValueError(f"{cls.__name__} has splits {sorted(_WORDS)}, not {split!r}")
        return [
            {"prompt": [{"role": "user", "content": _PROMPT}], "word": word}
            for word in _WORDS[split]
        ]

    @classmethod
    def demonstrations(cls, n: int, seed: int = 0) -> list[list[dict[str, Any]]]:
        """`n` conversations that call `submit` with the right answer, on words in no split.

        Args:
            n: How many conversations.
            seed: Seeds the words; the same seed gives the same conversations.

        """
        rng = random.Random(seed)
        conversations: list[list[dict[str, Any]]] = []
        for _ in range(n):
            env, word = cls(), rng.choice(_DEMO_WORDS)
            observation = env.reset(word=word)
            answer = {"answer": word[::-1]}
            call = {"type": "function", "function": {"name": "submit", "arguments": answer}}
            conversations.append(
                [
                    {"role": "user", "content": f"{_PROMPT}\\n{observation}"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "submit", "content": env.submit(word[::-1])},
                    {"role": "assistant", "content": f"{word} backwards is {word[::-1]}."},
                ]
            )
        return conversations
''')

TEST = Template('''\
"""$class_name against agentgrpo's environment contract, and `agentgrpo doctor` on it."""

from agentgrpo.cli import main
from environments import check_environment, resolve_environment

from $name import $class_name


def test_it_meets_the_environment_contract():
    check_environment($class_name)


def test_the_reversed_word_scores_one_and_any_other_answer_zero():
    env = $class_name()
    env.reset(word="stone")
    env.submit("enots")
    assert env.done and env.reward() == 1.0
    env.reset(word="stone")
    env.submit("stone")
    assert env.reward() == 0.0


def test_each_demonstration_submits_the_answer_that_scores():
    for conversation in $class_name.demonstrations(4):
        env = $class_name()
        env.reset(word=conversation[0]["content"].rsplit(" ", 1)[-1].rstrip("."))
        call = conversation[1]["tool_calls"][0]["function"]
        env.submit(**call["arguments"])
        assert env.reward() == 1.0


def test_the_installed_package_is_found_by_name_and_the_doctor_passes_it():
    """Needs the package installed (`pip install -e .`): its entry point names the class."""
    assert resolve_environment("$name") is $class_name
    assert main(["doctor", "$name"]) == 0
''')

README = Template("""\
# $name

`$class_name`, an agentgrpo environment: the model reverses a word and submits it with a
tool. Edit `src/$name/env.py` to make it your task.

```bash
pip install -e '.[test]'          # installs the package and its entry point
python -m pytest                  # the contract, the reward, and `agentgrpo doctor $name`
agentgrpo envs                    # lists $name among the installed environments
agentgrpo run $name               # trains the default model on it
agentgrpo eval $name --model runs/<run>/model
```

The entry point in `pyproject.toml` (group `agentgrpo.environments`) is what lets agentgrpo
find the class by the name `$name`; renaming the class means changing it there too (and
reinstalling). Published (`python -m build`, then upload the wheel), anyone who installs the
package can train on it by name.
""")

FILES = {
    "pyproject.toml": PYPROJECT,
    "README.md": README,
    "src/$name/__init__.py": INIT,
    "src/$name/env.py": ENV,
    "tests/test_env.py": TEST,
}
"""Every file of the package: its path (itself a template) and its text."""
