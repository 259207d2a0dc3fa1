"""Registered gymnasium envs by id (`gym:ENV_ID`): resolution, play, rows, limits, the CLI."""

from __future__ import annotations

import anyio
import gymnasium
import pytest

from agentgrpo.cli import main
from environments import (
    EnvironmentSpecError,
    GymEnvironment,
    check_environment,
    class_tools,
    resolve_environment,
    tool_names,
)
from environments.contract import episode_limits
from environments.gym_ids import MAX_TURNS, parse_spec
from rollout import Finish
from tests.support.cli import agentgrpo_here, eval_figures, tiny_run
from tests.support.episodes import chatml_engine, scripted_backend, tool_call

TOY_TEXT = ["gym:FrozenLake-v1", "gym:Taxi-v4", "gym:CliffWalking-v1", "gym:FrozenLake8x8-v1"]
FROZEN = "gym:FrozenLake-v1,is_slippery=false"
TO_THE_GOAL = [2, 2, 1, 1, 1, 2]  # right, right, down, down, down, right: around the holes


def action_doc(cls: type) -> str:
    return class_tools(cls)["act"].schema["function"]["parameters"]["properties"]["action"][
        "description"
    ]


@pytest.mark.parametrize("spec", TOY_TEXT)
def test_toy_text_ids_resolve_to_classes_that_meet_the_contract(spec):
    cls = resolve_environment(spec)
    assert issubclass(cls, GymEnvironment)
    check_environment(cls)
    assert tool_names(cls) == ["act"]
    assert resolve_environment(spec) is cls  # built once per spec


def test_the_action_tool_takes_an_int_and_says_what_each_action_does():
    properties = class_tools(resolve_environment("gym:FrozenLake-v1")).get("act")
    assert properties.schema["function"]["parameters"]["properties"]["action"]["type"] == "integer"
    assert action_doc(resolve_environment("gym:FrozenLake-v1")) == (
        "0: move left, 1: move down, 2: move right, 3: move up."
    )
    assert action_doc(resolve_environment("gym:CliffWalking-v1")).startswith("0: move up,")
    assert "4: pick up the passenger" in action_doc(resolve_environment("gym:Taxi-v4"))


def test_an_action_out_of_range_is_an_error_for_the_model_and_the_env_is_not_stepped():
    env = resolve_environment(FROZEN)()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action 4 is out of range: it must be from 0 to 3"):
        env.act(4)
    assert env.steps == 0
    env.close()


def test_the_ansi_frame_is_the_observation_with_the_players_cell_in_brackets():
    env = resolve_environment(FROZEN)()
    assert env.reset(seed=0) == "[S]FFF\nFHFH\nFFFH\nHFFG"
    assert env.act(2) == "  (Right)\nS[F]FF\nFHFH\nFFFH\nHFFG"
    assert "\x1b" not in env.act(1)
    env.close()


def test_taxi_states_its_state_in_words_as_the_frame_loses_its_colours():
    env = resolve_environment("gym:Taxi-v4")()
    frame = env.reset(seed=0)
    assert frame.startswith("+---------+\n")
    assert frame.splitlines()[-1].startswith("Taxi at row ")
    assert "destination" in frame
    env.close()


def test_the_reward_is_the_episode_return():
    env = resolve_environment("gym:CliffWalking-v1")()
    env.reset(seed=0)
    for action in [0] + [1] * 11 + [2]:  # up, along the top of the cliff, down onto the goal
        env.act(action)
    assert env.done and env.terminated
    assert env.reward() == -13.0
    env.close()


def test_python_literals_are_the_values_they_name_as_json_ones_are():
    assert parse_spec("FrozenLake-v1,is_slippery=False,map_name=4x4,seed=None,n= 8") == (
        "FrozenLake-v1",
        {"is_slippery": False, "map_name": "4x4", "seed": None, "n": 8},
    )


def test_make_arguments_follow_the_id_and_give_another_class():
    slippery, steady = resolve_environment("gym:FrozenLake-v1"), resolve_environment(FROZEN)
    assert slippery is not steady
    assert steady().reset(seed=0) == "[S]FFF\nFHFH\nFFFH\nHFFG"
    big = resolve_environment("gym:FrozenLake-v1,map_name=8x8")()
    assert len(big.reset(seed=0).splitlines()) == 8
    big.close()


def test_rows_are_one_prompt_per_seed_with_train_and_eval_seeds_apart():
    cls = resolve_environment("gym:Taxi-v4")
    train, held_out = cls.dataset("train"), cls.dataset("eval")
    assert train["seed"][:3] == [0, 1, 2]
    assert not set(train["seed"]) & set(held_out["seed"])
    [message] = train[0]["prompt"]
    assert message["role"] == "user"
    assert "Taxi-v4" in message["content"] and "act tool" in message["content"]


def test_episode_limits_follow_the_envs_step_limit_capped():
    frozen = episode_limits(resolve_environment("gym:FrozenLake-v1"))
    assert frozen["max_turns"] == MAX_TURNS  # its own limit, 100 steps, is more than the cap
    cliff = episode_limits(resolve_environment("gym:CliffWalking-v1"))
    assert cliff["max_turns"] == MAX_TURNS  # no limit of its own
    assert cliff["max_completion_length"] > frozen["max_completion_length"]  # a larger frame


def test_an_env_with_a_short_step_limit_gets_that_many_turns():
    gymnasium.register("ShortLake-v0", "gymnasium.envs.toy_text:FrozenLakeEnv", max_episode_steps=5)
    try:
        assert episode_limits(resolve_environment("gym:ShortLake-v0"))["max_turns"] == 5
    finally:
        del gymnasium.registry["ShortLake-v0"]


def test_an_unknown_id_is_refused_with_close_matches():
    with pytest.raises(EnvironmentSpecError) as error:
        resolve_environment("gym:FrozenLak-v1")
    assert "close matches: FrozenLake-v1" in str(error.value)
    assert "Taxi-v4" in str(error.value)  # the toy-text ids are listed


def test_an_outdated_version_points_at_the_current_one():
    with pytest.warns(DeprecationWarning), pytest.raises(EnvironmentSpecError, match="Taxi-v4"):
        resolve_environment("gym:Taxi-v3")


def test_an_env_without_a_text_observation_is_refused_saying_why():
    with pytest.raises(EnvironmentSpecError, match="has no text observation") as error:
        resolve_environment("gym:CartPole-v1")  # an array, no ansi
    assert "not Text, Dict or Tuple, and it has no 'ansi' render mode" in str(error.value)
    assert "observe=" in str(error.value)  # the way out: write an observe function


def test_a_tuple_observation_is_rendered_one_labelled_line_per_element():
    env = resolve_environment("gym:Blackjack-v1")()
    shown = env.reset(seed=0)
    player, dealer, usable_ace = env.env.unwrapped._get_obs()
    assert shown == f"0: {player}\n1: {dealer}\n2: {usable_ace}"
    env.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gym:", "names no environment id"),
        ("gym:FrozenLake-v1,slippery", "is not key=value"),
        ("gym:FrozenLake-v1,colour=1", "refused its arguments"),
        ("gym:FrozenLake-v1,map_name=9x9", "refused its arguments: KeyError: '9x9'"),
        ("gym:nosuchmod:Echo-v0", "could not import .*No module named 'nosuchmod'"),
    ],
)
def test_malformed_or_refused_arguments_are_spec_errors(spec, message):
    with pytest.raises(EnvironmentSpecError, match=message):
        resolve_environment(spec)


# Through the real rollout engine


def test_a_scripted_group_reaches_the_goal_and_scores_the_episode_return(tokenizer):
    cls = resolve_environment(FROZEN)
    turns = [tool_call("act", action=action) for action in TO_THE_GOAL] + ["never"]
    backend = scripted_backend(tokenizer, turns)
    engine = chatml_engine(backend, tokenizer, cls, **episode_limits(cls))
    row = cls.dataset("eval")[0]
    episodes = anyio.run(engine.run, [row], 2, 10)
    for episode in episodes:
        assert episode.finish is Finish.ENV_DONE
        assert episode.env_reward == 1.0 == episode.environment.total_reward
        tool_results = [m["content"] for m in episode.messages if m["role"] == "tool"]
        assert len(tool_results) == len(TO_THE_GOAL)
        assert tool_results[-1].endswith("\nHFF[G] (episode over)")
        assert episode.messages[0]["content"].endswith("\n[S]FFF\nFHFH\nFFFH\nHFFG")
        assert episode.environment.env is None  # closed


def test_each_episode_resets_with_its_rows_seed_so_eval_plays_the_held_out_games(tokenizer):
    cls = resolve_environment("gym:Taxi-v4")
    rows = [cls.dataset("eval")[i] for i in (0, 1)]  # seeds 1,000,000 and 1,000,001
    engine = chatml_engine(scripted_backend(tokenizer, ["No move."]), tokenizer, cls, max_turns=1)
    episodes = anyio.run(engine.run, rows, 1, 10)  # the engine's seeds would be 10 and 11

    def frame(seed):
        env = cls()
        shown = env.reset(seed=seed)
        env.close()
        return shown

    assert [frame(r["seed"]) for r in rows] != [frame(10), frame(11)]  # so the check tells
    for episode, row in zip(episodes, rows, strict=True):
        assert episode.messages[0]["content"].endswith(frame(row["seed"]))


# The command line


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("gym:CartPole-v1", "error: gym:CartPole-v1 has no text observation"),
        ("gym:FrozenLak-v1", "error: gym:FrozenLak-v1: Environment `FrozenLak` doesn't exist"),
    ],
)
def test_a_gym_id_the_cli_cannot_play_is_one_error_line(capsys, spec, expected):
    assert main(["run", spec]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith(expected)


@pytest.mark.slow
def test_run_and_eval_take_a_gym_id(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result = tiny_run(
        "gym:FrozenLake-v1", tiny_model_dir, out,
        "--max-steps", "1", "--per-device-train-batch-size", "2", "--num-generations", "2",
        "--max-completion-length", "24", "--max-turns", "2", "--warm-start-steps", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gym:FrozenLake-v1" in result.stdout
    assert (out / "model" / "config.json").is_file()
    result = agentgrpo_here(
        "eval", "gym:FrozenLake-v1,is_slippery=false", "--model", str(out / "model"),
        "--num-episodes", "2", "--max-completion-length", "24", "--max-turns", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    figures = eval_figures(result.stdout)
    assert figures["episodes"] == "2"
