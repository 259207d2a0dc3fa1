"""The environment shapes of TRL's OpenEnv examples, trained with only the import changed.

TRL's examples (echo, Wordle, several environments in one class) keep the score as an attribute
the tools update (`self.reward = 0.0`) and read it in `reward_func(environments, **kwargs)`;
the game's own client is replaced here by a few lines of local state, the shapes are theirs:
reset routing on a dataset column and returning the first observation, tools that raise when
the game is over, `done`, reward functions returning None for other environments' rows.
"""

from __future__ import annotations

import anyio
import pytest
from datasets import Dataset

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.rounds.scoring import environment_reward_name
from environments import EnvironmentRewardError, check_environment, read_reward
from tests.support.episodes import chatml_engine, scripted_backend, tool_call
from tests.support.runs import one_step
from tests.support.teach import teach
from tests.support.tiny_model import tiny_llama

SECRET = "crane"


class WordleShape:
    """TRL's Wordle example's shape: the score is an attribute the `guess` tool sets."""

    def __init__(self):
        self.reward = 0.0
        self.done = False

    def reset(self, **kwargs) -> str | None:
        self.reward = 0.0
        self.done = False
        self.guesses = 0
        return "Guess the five-letter word."

    def guess(self, guess: str) -> str:
        """Make a guess.

        Args:
            guess: The guessed word.

        Returns:
            The feedback.
        """
        if self.done:
            raise ValueError("Game over.")
        self.guesses += 1
        self.reward = 1.0 if guess == SECRET else 0.0
        self.done = guess == SECRET or self.guesses >= 6
        return "GGGGG" if guess == SECRET else "XXXXX"


def wordle_reward(environments, **kwargs) -> list[float]:
    return [env.reward for env in environments]


class MultiShape(WordleShape):
    """TRL's MultiEnv shape: one class, the row's `env` column picks the game at reset."""

    def reset(self, **kwargs) -> str | None:
        self.active = kwargs.get("env", "wordle")
        self.position = 0
        return super().reset() if self.active == "wordle" else "Reach position 2."

    def step_right(self) -> str:
        """Move one step right.

        Returns:
            The new position.
        """
        if self.active != "walk":
            raise ValueError("step_right is only available in the walk game")
        self.position += 1
        self.reward, self.done = float(self.position == 2), self.position >= 2
        return str(self.position)


def only(game: str):
    def reward(environments, **kwargs) -> list[float | None]:
        return [env.reward if env.active == game else None for env in environments]

    reward.__name__ = f"{game}_reward"
    return reward


def test_a_reward_attribute_is_the_classs_state_and_a_reward_method_is_still_read():
    check_environment(WordleShape)  # passed before too; the first episode then stopped
    assert environment_reward_name(WordleShape) is None  # no reward column of its own
    env = WordleShape()
    env.reset()
    assert anyio.run(read_reward, env) is None

    class ClassLevelScore(WordleShape):
        reward = 0.5

    check_environment(ClassLevelScore)  # was "reward must be a method"
    assert anyio.run(read_reward, ClassLevelScore()) is None

    class Shadowed:
        def reset(self) -> None:
            self.reward = 1.0  # hides the method below

        def reward(self) -> float:
            return 0.0

    shadowed = Shadowed()
    shadowed.reset()
    with pytest.raises(EnvironmentRewardError, match="set an attribute of that name over it"):
        anyio.run(read_reward, shadowed)


def test_with_no_reward_function_the_missing_reward_names_trls_shape(tokenizer, tmp_path):
    args = GRPOConfig(**one_step(tmp_path, chat_template="chatml_tools"))
    dataset = Dataset.from_dict({"prompt": ["Play."] * 2})
    with pytest.raises(ValueError, match=r"\[env\.reward for env in environments\]"):
        GRPOTrainer(
            tiny_llama(tokenizer),
            args=args,
            processing_class=tokenizer,
            train_dataset=dataset,
            environment_factory=WordleShape,
        )


def wordle_player(tokenizer):
    """The tiny Llama taught to guess the secret in its first turn, then stop."""
    backend = scripted_backend(tokenizer, [tool_call("guess", guess=SECRET), "Solved."])
    engine = chatml_engine(backend, tokenizer, WordleShape, max_completion_length=256)
    [episode] = anyio.run(engine.run, [{"prompt": "Play Wordle."}])
    model = tiny_llama(tokenizer, seed=3)
    teach(model, [episode], 1e-2, 150, True)
    return model


def test_the_wordle_shape_trains_on_the_score_its_tool_set(tokenizer, tmp_path):
    args = GRPOConfig(
        **one_step(tmp_path, max_completion_length=96, max_turns=3, chat_template="chatml_tools")
    )
    trainer = GRPOTrainer(
        wordle_player(tokenizer),
        args=args,
        processing_class=tokenizer,
        reward_funcs=wordle_reward,
        train_dataset=Dataset.from_dict({"prompt": ["Play Wordle."] * 2}),
        environment_factory=WordleShape,
    )
    trainer.train()
    [log] = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert log["tools/call_frequency"] >= 1
    assert log["rewards/wordle_reward/mean"] > 0  # the attribute `guess` set reached the reward


def test_the_multi_environment_shape_routes_rows_and_scores_each_game_apart(tokenizer, tmp_path):
    seen: list[tuple[str, str | None]] = []
    wordle, walk = only("wordle"), only("walk")

    def recording(environments, **kwargs):
        seen.extend((env.active, kwargs["env"][i]) for i, env in enumerate(environments))
        return [None] * len(environments)

    args = GRPOConfig(**one_step(tmp_path, chat_template="chatml_tools"))
    dataset = Dataset.from_dict({"prompt": ["Play."] * 2, "env": ["wordle", "walk"]})
    trainer = GRPOTrainer(
        tiny_llama(tokenizer),
        args=args,
        processing_class=tokenizer,
        reward_funcs=[wordle, walk, recording],
        train_dataset=dataset,
        environment_factory=MultiShape,
    )
    trainer.train()
    assert sorted(seen) == [("walk", "walk")] * 2 + [("wordle", "wordle")] * 2
    [log] = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert log["rewards/wordle_reward/mean"] == 0.0 and log["rewards/walk_reward/mean"] == 0.0
