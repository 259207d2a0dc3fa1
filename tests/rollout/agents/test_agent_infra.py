"""Agents whose infrastructure fails: replayed like environment episodes, then kept as INFRA.

Real agent functions, written against the `openai` client, play Counter against the engine's
endpoint; they raise `tools.InfrastructureError` on the plays the test tells them to fail. A
verifiers environment whose harness raises verifiers' own `vf.SandboxError` is played for real
too.
"""

from __future__ import annotations

import json
import math
import textwrap

import anyio
import openai
import pytest
import torch

from agentgrpo.learner.advantages import group_advantages
from agentgrpo.rounds.pipeline import RewardShaping
from agentgrpo.rounds.scoring import Scorer
from rollout import EpisodeConfig, Finish, RolloutEngine
from rollout.agents import Agent
from rollout.agents.verifiers_env import verifiers_agent
from tests.rollout.agents.test_agents import COUNTER_TOOLS
from tests.rollout.agents.test_verifiers import LOG, SUM_ENV
from tests.support.episodes import COUNTER_ROW, COUNTER_TURNS, scripted_backend, scripted_episode
from tools import InfrastructureError


class Flaky:
    """Counter's agent whose sandbox fails on the plays listed in `failing` (0: the first).

    Each play that does not fail returns the next reward of `rewards`.
    """

    def __init__(self, failing: set[int], rewards=(1.0,)):
        self.failing, self.rewards = failing, list(rewards)
        self.plays = 0
        self.__name__ = "flaky"

    def start(self) -> bool:
        """Count a play; whether this one fails."""
        self.plays += 1
        return self.plays - 1 in self.failing

    async def __call__(self, client: openai.AsyncOpenAI, row: dict) -> float:
        """Play Counter; a failing play asks the model once, then its sandbox goes."""
        failing = self.start()
        messages = [{"role": "user", "content": f"{row['prompt']}\nThe counter is at 0."}]
        value = 0
        while True:
            reply = await client.chat.completions.create(
                model="any", messages=messages, tools=COUNTER_TOOLS
            )
            if failing:
                raise RuntimeError("could not run increment") from InfrastructureError(
                    "the sandbox was preempted"
                )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return self.rewards.pop(0)
            for call in message.tool_calls:
                value += json.loads(call.function.arguments)["step"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})


def sync_flaky(client: openai.OpenAI, row: dict) -> float:
    """A sync agent whose first play fails before it asks the model; the second plays Counter."""
    sync_flaky.plays += 1  # type: ignore[attr-defined]
    if sync_flaky.plays == 1:  # type: ignore[attr-defined]
        raise InfrastructureError("the sandbox did not come up")
    messages = [{"role": "user", "content": f"{row['prompt']}\nThe counter is at 0."}]
    value = 0
    while True:
        message = (
            client.chat.completions.create(model="any", messages=messages, tools=COUNTER_TOOLS)
            .choices[0]
            .message
        )
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return 1.0
        for call in message.tool_calls:
            value += json.loads(call.function.arguments)["step"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})


def play(tokenizer, function, num_generations=1, infra_retries=2, rows=(COUNTER_ROW,)):
    engine = RolloutEngine(
        scripted_backend(tokenizer, COUNTER_TURNS),
        tokenizer,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=512, max_turns=5),
        max_concurrent_episodes=1,  # one at a time: the plays fail in the order listed
        player=(function if isinstance(function, Agent) else Agent(function)).player,
        infra_retries=infra_retries,
    )
    try:
        return anyio.run(engine.run, list(rows), num_generations)
    finally:
        engine.close()


@pytest.mark.parametrize("make", [lambda: Flaky({0}), lambda: sync_flaky], ids=["async", "sync"])
def test_an_agent_whose_sandbox_fails_once_is_replayed_and_its_replay_kept(tokenizer, make):
    function = make()
    function.plays = 0
    [episode] = play(tokenizer, function)
    assert function.plays == 2
    assert (episode.finish, episode.stats.infra_retries) == (Finish.STOP, 1)
    assert episode.rows == scripted_episode(tokenizer, COUNTER_TURNS).rows  # the replay's only
    assert episode.agent_rewards == {function.__name__: 1.0} and episode.error is None


def test_an_agent_whose_sandbox_always_fails_is_kept_as_infra_after_its_retries(tokenizer):
    function = Flaky(set(range(10)))
    [episode] = play(tokenizer, function, infra_retries=2)
    assert function.plays == 3  # the first play and two replays
    assert (episode.finish, episode.stats.infra_retries) == (Finish.INFRA, 2)
    assert episode.agent_rewards is None
    assert "on each of 3 plays" in episode.error and "sandbox was preempted" in episode.error
    [row] = episode.rows
    assert row.completion_ids == [] and row.loss_mask == []  # nothing of it to train on


def test_an_agents_infra_failure_is_left_out_of_its_groups_baseline(tokenizer):
    function = Flaky({0, 1}, rewards=[1.0, 0.0, 2.0])  # member 0: two plays, both failing
    episodes = play(tokenizer, function, num_generations=4, infra_retries=1)
    assert [e.finish for e in episodes] == [Finish.INFRA] + [Finish.STOP] * 3
    scorer = Scorer(
        funcs=[],
        env_reward_classes=(),
        with_environments=False,
        text_completions=False,
        decode=tokenizer.decode,
        trainer_state=lambda: None,
        agent_columns=("flaky",),
    )
    rewards_N_F = anyio.run(scorer.score_group, episodes)
    assert math.isnan(rewards_N_F[0, 0]) and rewards_N_F[1:, 0].tolist() == [1.0, 0.0, 2.0]
    shaping = RewardShaping()
    advantages_N = shaping.advantages(shaping.combine(rewards_N_F, 4), 4)
    assert advantages_N[0] == 0.0
    assert torch.allclose(advantages_N[1:], group_advantages(torch.tensor([1.0, 0.0, 2.0]), 3))


def test_an_agent_error_that_is_not_infrastructure_is_not_replayed(tokenizer):
    async def broken(client: openai.AsyncOpenAI, row: dict) -> float:
        await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Hi"}]
        )
        raise RuntimeError("the agent's own bug")

    [episode] = play(tokenizer, broken)
    assert (episode.finish, episode.stats.infra_retries) == (Finish.ERROR, 0)
    assert "the agent's own bug" in episode.error


# A verifiers taskset whose harness's sandbox fails on the plays listed in SANDBOX_FAILS.
FLAKY_SANDBOX_ENV = SUM_ENV.replace(
    "        if data.explode:",
    "        PLAYS.append(1)\n"
    "        if len(PLAYS) in SANDBOX_FAILS:\n"
    "            raise vf.SandboxError('the sandbox was preempted')\n"
    "        if data.explode:",
).replace("class SumData", "PLAYS = []\nSANDBOX_FAILS = {1}\n\n\nclass SumData")


@pytest.fixture(scope="module")
def flaky_vf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vf_flaky")
    (folder / "flaky_sandbox_vf.py").write_text(textwrap.dedent(LOG + FLAKY_SANDBOX_ENV))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        agent = verifiers_agent("flaky_sandbox_vf")
        import flaky_sandbox_vf  # as verifiers imported it

        yield agent, flaky_sandbox_vf


def test_a_verifiers_episode_failed_by_its_sandbox_is_replayed(tokenizer, flaky_vf):
    agent, module = flaky_vf
    module.PLAYS.clear()
    module.SANDBOX_FAILS = {1}
    engine_rows = agent.dataset("train").select([0])
    episodes = _play_vf(tokenizer, agent, engine_rows, infra_retries=2)
    [episode] = episodes
    assert len(module.PLAYS) == 2
    assert (episode.finish, episode.stats.infra_retries) == (Finish.STOP, 1)
    assert episode.agent_rewards["correct"] == 1.0


def test_a_verifiers_episode_whose_sandbox_always_fails_is_kept_as_infra(tokenizer, flaky_vf):
    agent, module = flaky_vf
    module.PLAYS.clear()
    module.SANDBOX_FAILS = set(range(1, 10))
    [episode] = _play_vf(tokenizer, agent, agent.dataset("train").select([0]), infra_retries=1)
    assert len(module.PLAYS) == 2
    assert episode.finish is Finish.INFRA and "SandboxError" in episode.error


def _play_vf(tokenizer, agent, rows, infra_retries):
    engine = RolloutEngine(
        scripted_backend(tokenizer, ["3"]),
        tokenizer,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=256, max_turns=4),
        player=agent.player,
        infra_retries=infra_retries,
    )
    try:
        return anyio.run(engine.run, list(rows), 1)
    finally:
        engine.close()
