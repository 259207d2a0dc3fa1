"""The tool calls of one turn: on one environment, one at a time in the model's order.

Calls on an environment instance share its state, so they run one after another, in the order the
model wrote them; calls to plain tool functions may overlap. Results keep the calls' order.
"""

from __future__ import annotations

import threading
import time

import gymnasium
import pytest
from gymnasium.spaces import Discrete

from environments import gym_environment
from rollout import EpisodeConfig, RolloutEngine
from tests.support.episodes import scripted_backend, tool_call

pytestmark = pytest.mark.anyio


def engine(tokenizer, turn: str, **kwargs) -> RolloutEngine:
    """An engine whose model writes `turn`, then says it is done."""
    return RolloutEngine(
        scripted_backend(tokenizer, [turn, "Done."]),
        tokenizer,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=1024, max_turns=3, tool_timeout_s=30.0),
        **kwargs,
    )


def tool_replies(episode) -> list[str]:
    return [m["content"] for m in episode.messages if m["role"] == "tool"]


class Tally:
    """A running total whose `add` reads, pauses, then writes: overlapping calls lose updates."""

    def reset(self, **row) -> None:
        self.total, self.seen = 0, []

    def add(self, n: int) -> int:
        """Add n to the total.

        Args:
            n: The amount to add.
        """
        total = self.total
        time.sleep(0.001)  # release the GIL mid-update, as real tools do (I/O, numpy...)
        self.total = total + n
        self.seen.append(n)
        return self.total


async def test_ten_add_calls_in_one_turn_add_up_to_ten(tokenizer):
    turn = "\n".join(tool_call("add", n=1) for _ in range(10))
    [episode] = await engine(tokenizer, turn, environment_factory=Tally).run([{"prompt": "Add."}])
    assert episode.environment.total == 10
    assert tool_replies(episode) == [str(k) for k in range(1, 11)]


async def test_the_environment_sees_the_calls_in_the_order_the_model_wrote_them(tokenizer):
    written = [3, 1, 4, 1, 5, 9, 2, 6]
    turn = "\n".join(tool_call("add", n=n) for n in written)
    [episode] = await engine(tokenizer, turn, environment_factory=Tally).run([{"prompt": "Add."}])
    assert episode.environment.seen == written
    running = [sum(written[: k + 1]) for k in range(len(written))]
    assert tool_replies(episode) == [str(total) for total in running]


async def test_calls_to_plain_tools_in_one_turn_overlap(tokenizer):
    meeting = threading.Barrier(2, timeout=20)  # both calls must be in flight at once

    def meet(who: str) -> str:
        """Wait for the other caller to arrive.

        Args:
            who: Who arrives.
        """
        meeting.wait()
        return f"{who} met"

    turn = tool_call("meet", who="a") + "\n" + tool_call("meet", who="b")
    [episode] = await engine(tokenizer, turn, tools=[meet]).run([{"prompt": "Meet."}])
    assert tool_replies(episode) == ["a met", "b met"]


class Stairs(gymnasium.Env):
    """Climb 3 steps; each move costs 0.1, the top pays 1.0."""

    def __init__(self):
        self.action_space = Discrete(2)  # 0: down, 1: up
        self.observation_space = Discrete(4)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.step_on = 0
        return self.step_on, {}

    def step(self, action):
        time.sleep(0.001)  # mid-step, as a real simulator is
        self.step_on = max(0, self.step_on + (1 if action == 1 else -1))
        top = self.step_on == 3
        return self.step_on, 1.0 if top else -0.1, top, False, {}


Climb = gym_environment(
    Stairs,
    name="Climb",
    action_tool="move",
    action_doc="Move one step.",
    argument_doc="1 to go up, 0 to go down.",
    observe=lambda step: f"step {step}",
    max_episode_steps=10,
)


async def test_a_gymnasium_game_played_several_moves_a_turn_gives_the_same_result_every_time(
    tokenizer,
):
    turn = "\n".join(tool_call("move", action=a) for a in [1, 0, 1, 1, 1])
    eng = engine(tokenizer, turn, environment_factory=Climb)
    episodes = await eng.run([{"prompt": "Climb."}], num_generations=8)
    for episode in episodes:
        assert tool_replies(episode) == [
            "step 1",
            "step 0",
            "step 1",
            "step 2",
            "step 3 (episode over)",
        ]
        assert round(episode.env_reward, 6) == 0.6
