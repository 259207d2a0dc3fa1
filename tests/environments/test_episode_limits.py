"""What an environment's episodes need (`episode_limits`), and the command line using it."""

from __future__ import annotations

import json
import re

import anyio
import pytest

from agentgrpo.cli import build_parser
from agentgrpo.cli.commands import _run_settings
from agentgrpo.cli.eval_command import eval_config
from agentgrpo.cli.options import RUN_DEFAULTS
from environments import (
    BUILTIN_ENVIRONMENTS,
    Arithmetic,
    Chain,
    Counter,
    GuessNumber,
    Questions,
    Trail,
)
from environments.contract import check_environment, episode_limits, run_defaults
from environments.errors import EnvironmentSpecError
from environments.questions import ANIMALS
from environments.questions import QUESTION_OF as QUESTION
from rollout import EpisodeConfig, RolloutEngine
from rollout.backends.scripted import ScriptedBackend
from tests.support.episodes import tool_call


def solver(tokenizer, env_class: type, rows) -> ScriptedBackend:
    """A backend that solves any row of the built-in `env_class`, in as few turns as it can."""
    eos = tokenizer.eos_token_id
    by_prompt = {row["prompt"][0]["content"]: row for row in rows}

    def respond(context: list[int]) -> list[int]:
        text = tokenizer.decode(context)
        row = next(row for prompt, row in by_prompt.items() if prompt in text)
        if env_class is Questions:
            return tokenizer.encode(questions_turn(text), add_special_tokens=False) + [eos]
        results = re.findall(r"<tool_response>(.*?)</tool_response>", text, re.DOTALL)
        turn = solve(env_class, row, results)
        return tokenizer.encode(turn, add_special_tokens=False) + [eos]

    return ScriptedBackend(respond, [eos])


def solve(env_class: type, row: dict, results: list[str]) -> str:
    """The next turn of a perfect player, given the tool results so far."""
    if env_class is Counter:
        return tool_call("increment", step=row["target"]) if not results else "Done."
    if env_class is Arithmetic:
        if not results:
            return tool_call("calculate", expression=row["expression"])
        return tool_call("submit", answer=float(results[0])) if len(results) == 1 else "Done."
    if env_class is Chain:
        return chain_turn(row, results)
    if env_class is Trail:
        return trail_turn(row, results)
    if env_class is GuessNumber:
        low, high = 1, 100
        for guess_result in results:
            guess = (low + high) // 2
            if guess_result.startswith("Too low"):
                low = guess + 1
            elif guess_result.startswith("Too high"):
                high = guess - 1
        return tool_call("guess", number=(low + high) // 2)
    raise AssertionError(f"no solver for {env_class.__name__}")


def chain_turn(row: dict, results: list[str]) -> str:
    """A step's call on the last result (the start first), then `submit`, then the end."""
    steps = re.findall(r"(add|subtract|multiply by) (\d+)", row["steps"])
    value = float(results[-1]) if results else row["start"]
    if len(results) < len(steps):
        name, number = steps[len(results)]
        return tool_call(name.split()[0], a=value, b=int(number))
    return tool_call("submit", answer=value) if len(results) == len(steps) else "Done."


def trail_turn(row: dict, results: list[str]) -> str:
    """Open the box the last note names (the start first), submit the code, then the end."""
    if results and results[-1].startswith("Submitted"):
        return "Done."
    if results and (code := re.search(r"the code is (\d+)", results[-1])):
        return tool_call("submit", code=code.group(1))
    box = int(re.findall(r"go to box (\d+)", results[-1])[0]) if results else row["start"]
    return tool_call("open_box", box=box)


def questions_turn(text: str) -> str:
    """Ask what halves the animals the answers so far leave, or name the one left."""
    exchanges = re.findall(r"assistant\n(.*?)<\|im_end\|>\n<\|im_start\|>user\n(.*?)<", text)
    candidates = sorted(ANIMALS)
    for question, answer in exchanges:
        feature = next(f for f, q in QUESTION.items() if q == question)
        candidates = [c for c in candidates if (feature in ANIMALS[c]) == (answer == "Yes.")]
    if len(candidates) == 1:
        return f"Is it a {candidates[0]}?"
    split = lambda f: abs(2 * sum(f in ANIMALS[c] for c in candidates) - len(candidates))  # noqa: E731
    return QUESTION[min(QUESTION, key=split)]


# ColourSquare shows a picture, so it needs a vision-language model
# (tests/environments/test_vlm_environments.py); TicTacToe is a game with seats, played as
# matches (tests/rollout/test_match.py)
@pytest.mark.parametrize("name", sorted(set(BUILTIN_ENVIRONMENTS) - {"ColourSquare", "TicTacToe"}))
def test_every_row_of_each_builtin_can_reach_its_reward_within_the_limits_it_states(
    name, tokenizer
):
    env_class = BUILTIN_ENVIRONMENTS[name]
    limits = {**RUN_DEFAULTS, **episode_limits(env_class)}  # what `agentgrpo run` plays with
    rows = [*env_class.dataset("train"), *env_class.dataset("eval")]
    if env_class is Trail:  # the longest trails only: the others need fewer turns and tokens
        rows = [row for row in rows if row["hops"] == max(r["hops"] for r in rows)]
    engine = RolloutEngine(
        solver(tokenizer, env_class, rows),
        tokenizer,
        environment_factory=env_class,
        chat_template="chatml_tools",
        config=EpisodeConfig(
            max_completion_length=limits["max_completion_length"], max_turns=limits["max_turns"]
        ),
    )
    episodes = anyio.run(engine.run, rows)
    if env_class is Questions:  # its reward falls with each question asked: solved is the aim
        assert all(episode.environment.solved for episode in episodes)
        return
    rewards = [episode.env_reward for episode in episodes]
    assert rewards == [1.0] * len(rows), [e.finish for e in episodes if e.env_reward != 1]


def test_the_builtins_that_need_more_than_the_run_defaults_say_so():
    assert episode_limits(Counter) == {}  # one call: the run defaults fit
    assert (
        episode_limits(Arithmetic)["max_completion_length"] > RUN_DEFAULTS["max_completion_length"]
    )
    assert episode_limits(GuessNumber)["max_turns"] >= 8  # 7 guesses, then the end


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ([256], r"must be a dict such as"),
        ({"max_tokens": 256}, r"has \['max_tokens'\]; its keys are"),
        ({"max_turns": 0}, r"\['max_turns'\] must be a whole number >= 1, not 0"),
        ({"max_completion_length": "256"}, r"must be a whole number >= 1, not '256'"),
    ],
)
def test_wrong_episode_limits_are_refused_naming_the_fix(limits, message):
    class Game:
        episode_limits = limits

        def reset(self) -> None:
            pass

    with pytest.raises(EnvironmentSpecError, match=message):
        check_environment(Game)


@pytest.mark.parametrize(
    ("defaults", "message"),
    [
        ((96,), r"run_defaults must be a dict such as"),
        ({"epochs": 3}, r"has \['epochs'\]; its keys are \['max_steps'"),
        ({"warm_start_steps": 0}, r"\['warm_start_steps'\] must be a whole number > 0, not 0"),
        ({"warm_start_steps": 9.5}, r"must be a whole number > 0, not 9.5"),
        ({"learning_rate": -1e-5}, r"\['learning_rate'\] must be a number > 0, not -1e-05"),
        ({"learning_rate": "3e-5"}, r"must be a number > 0, not '3e-5'"),
        ({"max_steps": True}, r"must be a whole number > 0, not True"),
    ],
)
def test_wrong_run_defaults_are_refused_naming_the_fix(defaults, message):
    class Game:
        run_defaults = defaults

        def reset(self) -> None:
            pass

    with pytest.raises(EnvironmentSpecError, match=message):
        check_environment(Game)


def test_a_run_uses_the_environments_run_defaults_unless_told_otherwise(tmp_path):
    parser, _ = build_parser()
    chain = _run_settings(parser.parse_args(["run", "env:Chain"]), Chain)["config"]
    assert chain["warm_start_steps"] == run_defaults(Chain)["warm_start_steps"]
    assert chain["learning_rate"] == run_defaults(Chain)["learning_rate"]
    argv = ["run", "env:Chain", "--learning-rate", "1e-6", "--warm-start-steps", "4"]
    told = _run_settings(parser.parse_args(argv), Chain)
    assert told["config"]["learning_rate"] == 1e-6 and told["config"]["warm_start_steps"] == 4
    untold = {"max_steps", "per_device_train_batch_size"}
    assert set(told["recipe"]) == untold  # what the command line set is not the environment's
    own_model = _run_settings(parser.parse_args(["run", "env:Chain", "--model", "m"]), Chain)
    assert "warm_start_steps" not in own_model["config"]  # no warm start for a model of one's own
    assert set(own_model["recipe"]) == untold | {"learning_rate"}
    counter = _run_settings(parser.parse_args(["run", "env:Counter"]), Counter)
    assert counter["recipe"] == {} and counter["config"]["learning_rate"] == 1e-5


def test_run_and_eval_use_the_environments_limits_unless_told_otherwise(tmp_path):
    parser, _ = build_parser()
    run = _run_settings(parser.parse_args(["run", "env:Arithmetic"]), Arithmetic)
    assert run["config"]["max_completion_length"] == 192 and run["config"]["max_turns"] == 3
    assert run["from_environment"] == ["max_completion_length", "max_turns"]
    config_file = tmp_path / "run.yaml"
    config_file.write_text("max_turns: 5\n")
    argv = ["run", "env:Arithmetic", "--config", str(config_file), "--max-completion-length", "96"]
    told = _run_settings(parser.parse_args(argv), Arithmetic)
    assert told["config"]["max_completion_length"] == 96 and told["config"]["max_turns"] == 5
    assert told["from_environment"] == []
    assert eval_config(parser.parse_args(["eval", "env:GuessNumber"]), GuessNumber).max_turns == 8
    assert (
        eval_config(
            parser.parse_args(["eval", "env:GuessNumber", "--max-turns", "2"]), GuessNumber
        ).max_turns
        == 2
    )
    counter = eval_config(parser.parse_args(["eval", "env:Counter"]), Counter)
    assert counter.max_completion_length == RUN_DEFAULTS["max_completion_length"]


def test_the_start_up_summary_shows_the_limits_and_where_they_came_from(tiny_model_dir, tmp_path):
    from tests.support.cli import tiny_run

    out = tmp_path / "out"
    result = tiny_run(
        "env:Arithmetic", tiny_model_dir, out,
        "--max-steps", "1", "--per-device-train-batch-size", "2", "--num-generations", "2",
        "--max-turns", "2", "--save-steps", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    line = "episodes     up to 192 tokens, 2 turns (the environment's max_completion_length)"
    assert line in result.stdout
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("reward" in entry for entry in logged)


def test_the_start_up_summary_names_the_environments_run_defaults(tiny_model_dir, tmp_path):
    from tests.support.cli import tiny_run

    result = tiny_run(
        "env:Chain", tiny_model_dir, tmp_path / "o",
        "--max-steps", "1", "--per-device-train-batch-size", "2", "--num-generations", "2",
        "--max-turns", "1", "--max-completion-length", "16", "--save-strategy", "no",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "lr 3e-05" in result.stdout  # no warm start for a model of one's own: only the lr
    assert "defaults     learning_rate 3e-05 (the environment's run_defaults)" in result.stdout
