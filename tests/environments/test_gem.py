"""GEM's environments by id (`gem:ENV_ID`), played against the real gem-llm package."""

from __future__ import annotations

import logging

import anyio
import pytest

from agentgrpo.cli import main
from environments import EnvironmentSpecError, check_environment, class_tools, resolve_environment
from environments.contract import episode_limits
from rollout import Finish
from tests.support.episodes import chatml_engine, scripted_backend, tool_call

pytest.importorskip("gem")
EASY = "gem:game:GuessTheNumber-v0-easy"  # 1 to 10, 4 guesses


def secret(env) -> int:
    return env.env.unwrapped.gem_env.game_number


def test_a_gem_id_meets_the_contract_with_one_text_tool():
    cls = resolve_environment(EASY)
    check_environment(cls)
    schema = class_tools(cls)["act"].schema["function"]["parameters"]
    assert schema["properties"]["action"]["type"] == "string"
    assert episode_limits(cls)["max_turns"] == 4  # the game's own limit
    assert resolve_environment(EASY) is cls


def test_the_instructions_are_the_first_observation_and_the_seed_picks_the_game():
    env = resolve_environment(EASY)()
    shown = env.reset(seed=3)
    assert shown.startswith("You are playing Guess The Number.")
    games = []
    for seed in (3, 3, 4, 5, 6):
        env.reset(seed=seed)
        games.append(secret(env))
    assert games[0] == games[1] and len(set(games)) > 1
    env.close()


def test_a_move_is_boxed_for_the_model_and_the_reward_is_gems():
    env = resolve_environment(EASY)()
    env.reset(seed=3)
    number = secret(env)
    wrong = 1 if number != 1 else 2
    assert env.act(str(wrong)).startswith(f"At turn 1, you guessed {wrong}")
    assert env.act(f"I guess \\boxed{{{number}}}").startswith("Congratulations!")
    assert env.done and env.terminated and env.reward() == 1.0
    env.close()


def test_importing_gem_leaves_the_root_logger_as_it_was():
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    resolve_environment("gem:game:GuessTheNumber-v0-hard")
    assert (list(root.handlers), root.level) == before


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gem:game:GuessTheNumbr-v0-easy", "close matches: game:GuessTheNumber-v0-easy"),
        ("gem:", "names no environment id; write gem:ENV_ID"),
        (f"{EASY},max_turns", "is not key=value"),
        ("gem:game:GuessTheNumber-v0-easy,max_number=abc", "failed: TypeError"),
    ],
)
def test_bad_gem_specs_are_spec_errors(spec, message):
    with pytest.raises(EnvironmentSpecError, match=message):
        resolve_environment(spec)


def test_the_cli_reports_an_unknown_gem_id_in_one_line(capsys):
    assert main(["run", "gem:game:Nope-v0"]) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "GEM has no environment 'game:Nope-v0'" in line


def test_a_scripted_group_wins_the_game_through_the_engine(tokenizer):
    cls = resolve_environment(EASY)
    row = cls.dataset("eval")[0]
    env = cls()
    env.reset(seed=row["seed"])
    turns = [tool_call("act", action=str(secret(env))), "never"]
    env.close()
    engine = chatml_engine(
        scripted_backend(tokenizer, turns), tokenizer, cls, **episode_limits(cls)
    )
    for episode in anyio.run(engine.run, [row], 2, 10):
        assert episode.finish is Finish.ENV_DONE
        assert episode.env_reward == 1.0
        assert "You are playing Guess The Number." in episode.messages[0]["content"]
