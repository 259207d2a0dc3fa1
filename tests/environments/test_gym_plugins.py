"""Observations that are not text, step limits as turn limits, and MiniGrid through `gym:`."""

from __future__ import annotations

import anyio
import gymnasium
import numpy as np
import pytest
from gymnasium.spaces import Box, Dict, Discrete, Tuple

from agentgrpo.cli import main
from environments import (
    EnvironmentSpecError,
    GymEnvironment,
    check_environment,
    gym_environment,
    resolve_environment,
    tool_names,
)
from environments.contract import episode_limits
from environments.gym_adapter import TURN_TOKENS
from environments.gym_ids import MAX_TURNS
from environments.observations import observation_text
from rollout import Finish
from tests.support.episodes import chatml_engine, scripted_backend, tool_call


class Room(gymnasium.Env):
    """A dict observation: a mission (text), a direction, a 2x3 view; step 1 ends it."""

    def __init__(self) -> None:
        self.action_space = Discrete(2)
        self.observation_space = Dict(
            {"direction": Discrete(4), "view": Box(0, 9, (2, 3), np.int64)}
        )

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._observation(0), {}

    def step(self, action):
        return self._observation(action), float(action), action == 1, False, {}

    def _observation(self, direction):
        view = np.arange(6).reshape(2, 3)
        return {"mission": "find the exit", "direction": direction, "view": view}


class Pair(Room):
    """A tuple observation: a number and a short vector."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_space = Tuple((Discrete(4), Box(0.0, 1.0, (2,))))

    def _observation(self, direction):
        return (direction, np.array([0.5, 0.25], np.float32))


ROOM_TEXT = "mission: find the exit\ndirection: 0\nview:\n  0 1 2\n  3 4 5"


def test_a_dict_observation_is_rendered_by_default_one_labelled_line_per_key():
    env = gym_environment(Room, action_doc="Turn.")()
    assert env.reset(seed=0) == ROOM_TEXT
    assert env.act(1).startswith("mission: find the exit\ndirection: 1\n")


def test_a_tuple_observation_is_rendered_by_default_labelled_by_index():
    env = gym_environment(Pair, action_doc="Turn.")()
    assert env.reset(seed=0) == "0: 0\n1: 0.5 0.25"


def test_an_observe_function_takes_precedence_over_the_default():
    env = gym_environment(Room, action_doc="Turn.", observe=lambda o: o["mission"])()
    assert env.reset(seed=0) == "find the exit"


@pytest.mark.parametrize(
    ("observation", "text"),
    [
        ({"a": {"b": 1, "c": "x"}}, "a:\n  b: 1\n  c: x"),
        ([1.23456, True], "0: 1.235\n1: True"),
        (np.array([[[2, 5, 0], [1, 0, 0]]]), "2,5,0 1,0,0"),
        (np.zeros((40, 40)), "an array of shape (40, 40), float64, from 0 to 0"),
        (np.array(["a", "b"]), "a b"),
        (np.full((2000,), "z"), "an array of shape (2000,), <U1"),
    ],
)
def test_the_default_rendering_of_nested_values_and_arrays(observation, text):
    assert observation_text(observation) == text


def test_max_episode_steps_becomes_the_episodes_turn_limit():
    Limited = gym_environment(Room, action_doc="Turn.", max_episode_steps=5)
    frame_tokens = len(ROOM_TEXT) * 3 // 4
    assert episode_limits(Limited) == {
        "max_turns": 5,
        "max_completion_length": 5 * (TURN_TOKENS + frame_tokens),
    }
    assert not hasattr(gym_environment(Room, action_doc="Turn."), "episode_limits")


def test_with_options_the_step_limit_gives_the_turn_limit_alone():
    Limited = gym_environment(Room, action_doc="Turn.", max_episode_steps=3, options=["size"])
    assert episode_limits(Limited) == {"max_turns": 3}


def test_an_object_that_is_not_a_gymnasium_env_is_refused_saying_what_to_do():
    class TextGame:  # GEM's shape: reset and step, no spaces
        def reset(self, seed=None):
            return "Guess.", {}

    with pytest.raises(TypeError, match=r"returned a TextGame, not a gymnasium\.Env") as error:
        gym_environment(TextGame, action_doc="Guess.")
    assert "gem:ENV_ID" in str(error.value)


def test_a_space_with_no_default_rendering_still_needs_observe():
    class Line(Room):
        def __init__(self) -> None:
            super().__init__()
            self.observation_space = Box(0, 9, (3,))

    with pytest.raises(TypeError, match="not Text, Dict or Tuple; pass observe="):
        gym_environment(Line, action_doc="Turn.")


# MiniGrid, a plugin package: its ids exist once minigrid is imported

minigrid = pytest.importorskip("minigrid")
EMPTY = "gym:minigrid:MiniGrid-Empty-5x5-v0"
# From (1, 1) facing east to the goal at (3, 3): forward, forward, right, forward, forward.
TO_THE_GOAL = [2, 2, 1, 2, 2]
FIRST_VIEW = """Mission: get to the green goal square
You face east (right). Your view (you are ^^ at the bottom centre, facing the top row; \
forward moves you up):
## ## ## ## ## ## ##
## ## ## ## ## ## ##
## ## ## ## ## ## ##
## ## ## ## ## ## ##
## ## ## .. .. GG ##
## ## ## .. .. .. ##
## ## ## ^^ .. .. ##
Legend: ## wall, .. empty, GG goal, ^^ you."""


@pytest.fixture
def minigrid_not_imported(monkeypatch):
    """As in a fresh process: minigrid neither imported nor its ids registered (both restored)."""
    import sys

    for name in [name for name in sys.modules if name.split(".")[0] == "minigrid"]:
        monkeypatch.delitem(sys.modules, name)
    for env_id in [key for key, spec in gymnasium.registry.items() if "minigrid" in str(spec)]:
        monkeypatch.delitem(gymnasium.registry, env_id)


@pytest.mark.usefixtures("minigrid_not_imported")
def test_a_plugin_id_without_its_module_names_the_spec_that_imports_it():
    with pytest.raises(EnvironmentSpecError) as error:
        resolve_environment("gym:MiniGrid-Empty-5x5-v0,size=5")
    message = str(error.value)
    assert "doesn't exist" in message
    assert "the installed package 'minigrid' registers it" in message
    assert message.endswith("use gym:minigrid:MiniGrid-Empty-5x5-v0,size=5")


@pytest.mark.usefixtures("minigrid_not_imported")
def test_the_cli_says_the_same_in_one_error_line(capsys):
    assert main(["run", "gym:MiniGrid-Empty-5x5-v0"]) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert line.endswith("use gym:minigrid:MiniGrid-Empty-5x5-v0")


def test_a_minigrid_id_meets_the_contract_and_reads_its_view_as_a_grid():
    cls = resolve_environment(EMPTY)
    assert issubclass(cls, GymEnvironment)
    check_environment(cls)
    assert tool_names(cls) == ["act"]
    env = cls()
    assert env.reset(seed=0) == FIRST_VIEW
    assert episode_limits(cls)["max_turns"] == MAX_TURNS  # its own limit, 100 steps, capped
    prompt = cls.dataset("train")[0]["prompt"][0]["content"]
    assert "mission" in prompt and "act tool" in prompt
    env.close()


def test_walking_to_the_goal_ends_the_episode_with_minigrids_reward():
    env = resolve_environment(EMPTY)()
    env.reset(seed=0)
    shown = [env.act(action) for action in TO_THE_GOAL]
    assert shown[1].splitlines()[-2] == "## ## ## ^^ .. GG ##"  # the goal two squares right
    assert shown[-1].endswith("(episode over)")
    assert env.terminated and env.reward() == pytest.approx(1 - 0.9 * 5 / 100)
    env.close()


def test_a_door_key_view_names_the_key_and_the_locked_door():
    env = resolve_environment("gym:minigrid:MiniGrid-DoorKey-5x5-v0")()
    shown = env.reset(seed=1)
    assert "Ky yellow key" in shown and "Ly locked yellow door" in shown
    assert "You face south (down)" in shown
    env.close()


def test_a_scripted_group_reaches_minigrids_goal_through_the_engine(tokenizer):
    cls = resolve_environment(EMPTY)
    turns = [tool_call("act", action=action) for action in TO_THE_GOAL] + ["never"]
    engine = chatml_engine(
        scripted_backend(tokenizer, turns), tokenizer, cls, **episode_limits(cls)
    )
    episodes = anyio.run(engine.run, [cls.dataset("eval")[0]], 2, 10)
    for episode in episodes:
        assert episode.finish is Finish.ENV_DONE
        assert episode.env_reward == pytest.approx(0.955)
        assert episode.messages[0]["content"].endswith(FIRST_VIEW)
