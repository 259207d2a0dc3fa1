"""Episodes that infrastructure failures end are replayed from scratch, then kept as failed."""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

import pytest

from environments import Counter
from rollout import EpisodeConfig, Finish, RolloutEngine
from tests.support.episodes import COUNTER_ROW, COUNTER_TURNS, scripted_backend, tool_call
from tools import InfrastructureError

pytestmark = pytest.mark.anyio


class Preemptible(Counter):
    """Counter whose sandbox is preempted for the next `preemptions` calls of any instance."""

    preemptions = 0  # increment calls still to fail
    reset_preemptions = 0  # reset calls still to fail
    closed: ClassVar[list[Preemptible]] = []  # every instance closed, in order

    def reset(self, target: int) -> str:
        """Reset, unless the sandbox is down."""
        if Preemptible.reset_preemptions > 0:
            Preemptible.reset_preemptions -= 1
            raise InfrastructureError("the sandbox did not come up")
        return super().reset(target)

    def increment(self, step: int) -> int:
        """Add step to the counter and return its new value.

        Args:
            step: Value to add.

        """
        if Preemptible.preemptions > 0:
            Preemptible.preemptions -= 1
            raise InfrastructureError("the sandbox was preempted")
        return super().increment(step)

    def explode(self, x: int) -> int:
        """Raise, always: the tool's own bug.

        Args:
            x: Ignored.
        """
        raise RuntimeError("boom")

    def close(self) -> None:
        """Record that this instance was closed."""
        Preemptible.closed.append(self)


@pytest.fixture(autouse=True)
def fresh_counts(monkeypatch):
    monkeypatch.setattr(Preemptible, "preemptions", 0)
    monkeypatch.setattr(Preemptible, "reset_preemptions", 0)
    monkeypatch.setattr(Preemptible, "closed", [])


def engine(tokenizer, turns=COUNTER_TURNS, **kwargs) -> RolloutEngine:
    return RolloutEngine(
        scripted_backend(tokenizer, turns),
        tokenizer,
        environment_factory=Preemptible,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=512, max_turns=5),
        **kwargs,
    )


async def test_a_tool_preempted_once_is_replayed_and_the_episode_is_a_clean_play(tokenizer):
    [clean] = await engine(tokenizer).run([COUNTER_ROW], seed=3)
    Preemptible.closed.clear()
    Preemptible.preemptions = 1
    [replayed] = await engine(tokenizer).run([COUNTER_ROW], seed=3)
    assert replayed.stats.infra_retries == 1
    assert dataclasses.replace(replayed, stats=clean.stats) == clean  # token for token
    assert replayed.finish is Finish.STOP and replayed.env_reward == 1.0
    first_play, second_play = Preemptible.closed  # a fresh environment, the failed one closed
    assert first_play is not second_play and replayed.environment is second_play


async def test_a_reset_whose_sandbox_does_not_come_up_is_replayed(tokenizer):
    Preemptible.reset_preemptions = 2
    [episode] = await engine(tokenizer).run([COUNTER_ROW])
    assert episode.finish is Finish.STOP and episode.stats.infra_retries == 2


async def test_an_episode_that_fails_on_every_play_is_kept_as_an_infra_failure(tokenizer, caplog):
    Preemptible.preemptions = 10**6
    with caplog.at_level(logging.WARNING, logger="rollout.infrastructure"):
        [episode] = await engine(tokenizer).run([COUNTER_ROW])
    assert episode.finish is Finish.INFRA and episode.finish.truncated
    assert episode.stats.infra_retries == 2  # the default: three plays in all
    assert len(Preemptible.closed) == 3
    assert "the sandbox was preempted" in episode.error
    assert episode.model_tokens == 0 and episode.completion_ids == []
    assert all(mask == 0 for row in episode.rows for mask in row.loss_mask)
    assert episode.env_reward is None and episode.environment is None
    assert episode.messages == [{"role": "user", "content": COUNTER_ROW["prompt"]}]
    assert len(caplog.records) == 3 and "play 3 of at most 3" in caplog.messages[-1]


async def test_infra_retries_zero_keeps_the_first_failure(tokenizer):
    Preemptible.preemptions = 10**6
    [episode] = await engine(tokenizer, infra_retries=0).run([COUNTER_ROW])
    assert episode.finish is Finish.INFRA and episode.stats.infra_retries == 0
    assert len(Preemptible.closed) == 1


async def test_a_tool_that_raises_anything_else_is_still_a_message_for_the_model(tokenizer):
    [episode] = await engine(tokenizer, [tool_call("explode", x=1), "Sorry."]).run([COUNTER_ROW])
    assert episode.finish is Finish.STOP and episode.stats.infra_retries == 0
    assert episode.stats.tool_errors == {"exception": 1}
    assert "RuntimeError: boom" in episode.messages[2]["content"]


def test_a_negative_infra_retries_is_refused_with_what_works(tokenizer):
    with pytest.raises(ValueError, match=r"infra_retries=-1 must be 0 \(no replay\) or more"):
        engine(tokenizer, infra_retries=-1)
