"""Rewards for a step: a tool that returns `Rewarded`, and a gym env's step rewards, per turn.

A turn's reward is what its tools' `Rewarded` results gave (summed) plus the environment's
``turn_reward()``; the model reads only the results' text. The episodes are scripted
(`ScriptedBackend`), so every turn, and every number below, is known by hand.
"""

from __future__ import annotations

import anyio
import gymnasium
import pytest
import torch
from gymnasium.spaces import Discrete, Text

from agentgrpo.rounds.turn_credit import TurnCredit
from environments import gym_environment
from rollout import EpisodeConfig, Finish, RolloutEngine, ScriptedBackend
from tests.support.episodes import scripted_backend, tool_call
from tools import Rewarded, ToolErrorKind, ToolRewardError, as_tool, call_tool

TURNS = [
    tool_call("open_box", box=1) + tool_call("open_box", box=2),
    tool_call("open_box", box=3) + tool_call("hint"),
    "Done.",
]


class Boxes:
    """Each box opened earns ``box * worth / 4``; every turn earns 0.125 more (``turn_reward``)."""

    def reset(self, worth: int = 1, **row):
        self.worth = worth

    def open_box(self, box: int) -> Rewarded:
        """Open a box.

        Args:
            box: Which box.
        """
        return Rewarded(f"Box {box} is empty.", box * self.worth / 4)

    def turn_reward(self) -> float:
        return 0.125

    def reward(self) -> float:
        return 1.0


def hint() -> Rewarded:
    """Ask for a hint; it costs a little."""
    return Rewarded("Look left.", -0.25)


def by_turn(tokenizer, turns: list[str]) -> ScriptedBackend:
    """Answer turn k with turns[k] (k: the model turns in the context), however many calls."""
    eos = tokenizer.eos_token_id

    def respond(context: list[int]) -> list[int]:
        k = tokenizer.decode(context).count("<|im_start|>assistant") - 1
        return tokenizer.encode(turns[min(k, len(turns) - 1)], add_special_tokens=False) + [eos]

    return ScriptedBackend(respond, [eos])


def play(tokenizer, backend, env, rows, tools=(hint,)):
    """One episode of each row: `env` and the plain `tools`, in the chatml_tools template."""
    engine = RolloutEngine(
        backend,
        tokenizer,
        environment_factory=env,
        tools=tools,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=512),
    )
    return anyio.run(engine.run, rows)


ROWS = [{"prompt": "Open the boxes.", "worth": 1}, {"prompt": "Open the boxes.", "worth": 0}]


@pytest.fixture(scope="module")
def boxes(tokenizer):
    """The episodes of ROWS (boxes worth something, boxes worth nothing): a group of two below."""
    return play(tokenizer, by_turn(tokenizer, TURNS), Boxes, ROWS)


def test_a_turn_earns_its_tools_rewards_summed_plus_its_turn_reward(boxes):
    worth, worthless = boxes
    assert worth.finish is Finish.STOP and worth.stats.tool_calls == 4
    # Turn 0: boxes 1 and 2 (0.25 + 0.5), turn 1: box 3 and the hint (0.75 - 0.25), turn 2:
    # no calls; 0.125 from turn_reward on each.
    assert [t.reward for t in worth.turns] == [0.875, 0.625, 0.125]
    assert [t.reward for t in worthless.turns] == [0.125, -0.125, 0.125]
    assert worth.env_reward == worthless.env_reward == 1.0  # the episode's reward is reward()'s


def test_the_model_reads_only_the_text_of_a_rewarded_result(boxes, tokenizer):
    worth = boxes[0]
    results = [m["content"] for m in worth.messages if m["role"] == "tool"]
    assert results == ["Box 1 is empty.", "Box 2 is empty.", "Box 3 is empty.", "Look left."]
    assert [c.result for c in worth.tool_calls] == results
    [row] = worth.rows
    shown = tokenizer.decode(row.completion_ids)
    assert "<tool_response>Look left.</tool_response>" in shown
    assert "Rewarded" not in shown and "reward" not in shown


def test_return_credit_of_tool_rewards_matches_the_hand_computed_advantages(boxes):
    # gamma 0.5, the episode reward (1.0) added to the last turn's reward:
    #   worth:     G_2 = 0.125 + 1 = 1.125, G_1 = 0.625 + 0.5 * 1.125 = 1.1875,
    #              G_0 = 0.875 + 0.5 * 1.1875 = 1.46875
    #   worthless: G_2 = 1.125, G_1 = -0.125 + 0.5 * 1.125 = 0.4375,
    #              G_0 = 0.125 + 0.5 * 0.4375 = 0.34375
    # centred against the group at each turn index: +-0.5625, +-0.375, 0.
    credit = TurnCredit("return", gamma=0.5, scale=False)
    rewards_N = torch.tensor([1.0, 1.0])
    returns_N_T, _ = credit.tables(boxes, rewards_N, width=3)
    assert returns_N_T.tolist() == [[1.46875, 1.1875, 1.125], [0.34375, 0.4375, 1.125]]
    rows_C = credit.token_advantages(boxes, rewards_N, torch.zeros(2), lambda t: t, 0, 2)
    for episode, row_C, sign in zip(boxes, rows_C, (1.0, -1.0), strict=True):
        spans = [row_C[t.start : t.end] for t in episode.turns]
        assert [set(span.tolist()) for span in spans] == [{0.5625 * sign}, {0.375 * sign}, {0.0}]
        [row] = episode.rows
        assert not row_C[torch.tensor(row.loss_mask) == 0].any()  # tool tokens: not trained


def test_a_failed_call_earns_nothing(tokenizer):
    turns = [tool_call("open_box", box="one") + tool_call("open_box", box=2), "Done."]
    [episode] = play(tokenizer, by_turn(tokenizer, turns), Boxes, ROWS[:1])
    assert episode.stats.tool_errors == {"bad_arguments": 1}
    assert [t.reward for t in episode.turns] == [0.5 + 0.125, 0.125]


@pytest.mark.parametrize(
    ("reward", "says"),
    [(float("nan"), "reward=nan"), (True, "reward=True"), ("1", "reward='1'")],
)
def test_a_reward_that_is_not_a_finite_number_stops_the_run_naming_the_tool(
    tokenizer, reward, says
):
    def bad() -> Rewarded:
        """A tool with a broken reward."""
        return Rewarded("ok", reward)

    backend = by_turn(tokenizer, [tool_call("bad"), "Done."])
    with pytest.raises(ToolRewardError, match=rf"bad\(\) returned .*{says}.*finite int or float"):
        play(tokenizer, backend, None, [{"prompt": "Go."}], tools=(bad,))


@pytest.mark.anyio
async def test_a_rewarded_inside_a_list_is_refused_and_plain_results_earn_nothing():
    def nested() -> list:
        """Two results, one rewarded."""
        return ["a", Rewarded("b", 1.0)]

    def plain() -> str:
        """A plain result."""
        return "c"

    tools = {"nested": as_tool(nested), "plain": as_tool(plain)}
    with pytest.raises(ToolRewardError, match=r"nested\(\) returned a Rewarded inside a list"):
        await call_tool(tools, "nested", {}, timeout_s=None)
    result = await call_tool(tools, "plain", {}, timeout_s=None)
    assert (result.content, result.error, result.reward) == ("c", None, 0.0)
    missing = await call_tool(tools, "open", {}, timeout_s=None)
    assert missing.error is ToolErrorKind.UNKNOWN_TOOL and missing.reward == 0.0


class Steps(gymnasium.Env):
    """Three steps; each pays ``action / 4``, and the third ends the episode."""

    def __init__(self) -> None:
        self.action_space = Discrete(4)
        self.observation_space = Text(max_length=40)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.steps = 0
        return "Step 0.", {}

    def step(self, action):
        self.steps += 1
        return f"Step {self.steps}.", action / 4, self.steps == 3, False, {}


StepsEnvironment = gym_environment(Steps, action_doc="Take a step.")


def test_a_gym_envs_step_rewards_are_its_turns_rewards_and_their_sum_the_episodes(tokenizer):
    turns = [tool_call("act", action=a) for a in (2, 0, 3)]
    [episode] = play(
        tokenizer, scripted_backend(tokenizer, turns), StepsEnvironment, [{"prompt": "Go."}], ()
    )
    assert episode.finish is Finish.ENV_DONE
    assert [t.reward for t in episode.turns] == [0.5, 0.0, 0.75]
    assert episode.env_reward == 1.25  # turn_advantage="episode" sees the sum, as before


def test_steps_taken_in_one_turn_add_up_in_that_turns_reward():
    env = StepsEnvironment()
    env.reset(seed=0)
    env.act(1), env.act(2)
    assert (env.turn_reward(), env.turn_reward(), env.reward()) == (0.75, 0.0, 0.75)
    env.act(3)
    assert (env.turn_reward(), env.reward(), env.done) == (0.75, 1.5, True)
    env.reset(seed=0)
    assert env.turn_reward() == 0.0  # a new episode starts with nothing earned
