"""OpenEnv environments in this process (`openenv:module:Class`), against the real openenv-core."""

from __future__ import annotations

import json

import anyio
import pytest

pytest.importorskip("openenv.core")

from agentgrpo import GRPOTrainer
from environments import EnvironmentSpecError, check_environment, class_tools, resolve_environment
from environments.contract import episode_limits
from environments.openenv_sessions import observation_step
from rollout import Finish
from tests.support.episodes import chatml_engine, scripted_backend, tool_call
from tests.support.tiny_model import tiny_llama
from tests.support.trainer import short_run_config

ENVS = "tests.support.openenv_envs"
WALK = f"openenv:{ENVS}:Walk"


def test_the_action_models_fields_become_typed_arguments_with_enums_as_enums():
    cls = resolve_environment(WALK)
    check_environment(cls)
    assert list(class_tools(cls)) == ["act"]
    parameters = class_tools(cls)["act"].schema["function"]["parameters"]
    assert parameters["required"] == ["direction"]  # squares has a default; metadata is left out
    assert parameters["properties"]["direction"] == {
        "type": "string",
        "enum": ["left", "right"],
        "description": "Which way to walk.",
    }
    squares = parameters["properties"]["squares"]
    assert squares["type"] == "integer"
    assert squares["description"].endswith("(at least 1, at most 2, default 1)")
    assert episode_limits(cls)["max_turns"] == 20
    assert resolve_environment(WALK) is cls


def test_step_rewards_are_turn_rewards_and_done_ends_the_episode():
    env = resolve_environment(WALK)()
    assert env.reset(seed=0) == "You are on square 0; walk to square 3."
    assert env.act(direction="right", squares=2) == "You are on square 2."
    assert env.turn_reward() == 0.5 and env.turn_reward() == 0.0  # read once per turn
    assert env.act(direction="left") == "You are on square 1."
    assert env.turn_reward() == -0.25 and not env.done
    assert (
        env.act(direction="right", squares=2)
        == "You are on square 3. You are there! (episode over)"
    )
    assert env.done and env.reward() == 0.75 and env.steps == 3
    with pytest.raises(ValueError, match="the episode is over"):
        env.act(direction="left")
    env.close()


def test_row_columns_reach_reset_and_constructor_arguments_follow_the_class():
    env = resolve_environment(f"{WALK},goal=5")()
    assert env.reset(seed=0, start=4, prompt="ignored") == "You are on square 4; walk to square 5."
    assert env.act(direction="right").endswith("(episode over)")
    env.close()


def test_an_action_the_model_refuses_is_an_error_for_the_model_and_takes_no_step():
    env = resolve_environment(WALK)()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="squares: Input should be less than or equal to 2"):
        env.act(direction="right", squares=3)
    assert env.steps == 0
    assert env.act(direction="right", squares=2) == "You are on square 2."  # from square 0
    env.close()


def test_a_picture_in_the_observation_is_shown_as_an_image():
    env = resolve_environment(f"openenv:{ENVS}:Look")()
    caption, picture = env.reset(seed=0)
    assert caption == "A square." and picture.size == (4, 4)
    assert picture.getpixel((0, 0)) == (255, 0, 0)
    closer, _ = env.act(closer=True)
    assert closer == "Closer. (episode over)" and env.reward() == 1.0
    env.close()


def test_an_mcp_environments_tools_are_the_tools():
    cls = resolve_environment(f"openenv:{ENVS}:Notes")
    check_environment(cls)
    tools = class_tools(cls)
    assert list(tools) == ["add_note", "count_notes", "fail"]
    add = tools["add_note"].schema["function"]
    assert add["description"] == "Write a note down."
    assert add["parameters"]["properties"]["priority"]["enum"] == ["left", "right"]
    assert add["parameters"]["required"] == ["text"]
    env = cls()
    env.reset(seed=0)
    assert env.add_note(text="milk") == "1 notes."
    assert env.add_note(text="eggs", priority="right") == "2 notes."
    assert env.count_notes() == "2"
    with pytest.raises(ValueError, match="the page is torn"):
        env.fail()
    env.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            f"openenv:{ENVS}:NotAnOpenEnvEnvironment",
            "not an OpenEnv Environment .* drop the openenv: prefix",
        ),
        (f"openenv:{ENVS}:Wlak", "did you mean 'Walk'"),
        ("openenv:", "names no environment id"),
        (f"{WALK},size=3", "starting the environment failed: TypeError"),
    ],
)
def test_bad_openenv_specs_are_spec_errors(spec, message):
    with pytest.raises(EnvironmentSpecError, match=message):
        resolve_environment(spec)


def test_an_observation_of_several_fields_is_written_one_field_a_line():
    step = observation_step({"board": "X.\n.O", "turn": 2, "done": True}, 1, True)
    assert step.shown == "board:\n  X.\n  .O\nturn: 2"
    assert (step.reward, step.done) == (1.0, True)


def test_a_missing_openenv_names_the_extra_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "openenv.core", None)  # import fails as when not installed
    with pytest.raises(EnvironmentSpecError, match=r"pip install 'agentgrpo\[openenv\]'"):
        resolve_environment(f"{WALK},goal=4")


def test_a_scripted_group_walks_to_the_goal_through_the_engine(tokenizer):
    cls = resolve_environment(WALK)
    row = cls.dataset("eval")[0]
    turns = [
        tool_call("act", direction="right", squares=2),
        tool_call("act", direction="right", squares=3),  # the Action model refuses it
        tool_call("act", direction="right"),
        "never",
    ]
    engine = chatml_engine(
        scripted_backend(tokenizer, turns), tokenizer, cls, **episode_limits(cls)
    )
    for episode in anyio.run(engine.run, [row], 2, 10):
        assert episode.finish is Finish.ENV_DONE
        assert episode.env_reward == 0.75
        assert "You are on square 0; walk to square 3." in episode.messages[0]["content"]
        tool_texts = [m["content"] for m in episode.messages if m["role"] == "tool"]
        assert "the action was refused: squares: Input should be less" in tool_texts[1]


def test_a_short_grpo_run_trains_on_an_openenv_environment(tokenizer, tmp_path):
    cls = resolve_environment(WALK)
    args = short_run_config(
        tmp_path, num_generations=2, max_steps=1, max_completion_length=32, max_turns=2,
        chat_template="chatml_tools", log_episodes=True,
    )  # fmt: skip
    trainer = GRPOTrainer(
        tiny_llama(tokenizer),
        args=args,
        train_dataset=cls.dataset("train").select(range(4)),
        processing_class=tokenizer,
        environment_factory=cls,
    )
    trainer.train()
    assert trainer.state.global_step == 1
    [episodes] = list(tmp_path.rglob("step-00001.jsonl"))
    first = json.loads(episodes.read_text().splitlines()[0])
    assert "You are on square 0; walk to square 3." in json.dumps(first["messages"])
