"""Episodes that infrastructure failures end: replayed from scratch, then kept as failed.

A tool, the environment or an MCP server raises `tools.InfrastructureError` when the machinery
behind it failed (a sandbox that died, a server that is gone). That says nothing about the
model, so the engine plays the episode again from scratch, up to `infra_retries` times
(`play_retrying`), and then keeps it as a failed episode (`infra_episode`) that holds nothing
to train on and that reward functions never see: its rewards are NaN, which leaves it out of
its group's baseline, with advantage 0 (`agentgrpo.rounds.scoring`), and the round's metrics
count it (`episodes/infra_failures`, `episodes/infra_retries`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rollout.prompts import prompt_messages
from rollout.types import Episode, EpisodeRow, EpisodeStats, Finish
from tools import InfrastructureError, infrastructure_failure

logger = logging.getLogger(__name__)


async def play_retrying(
    play: Callable[[], Awaitable[Episode]],
    retries: int,
    failed: Callable[[InfrastructureError], Episode],
    where: str,
) -> Episode:
    """`play()`, called again while an infrastructure failure ends it, at most `retries` times.

    Args:
        play: Plays the episode from scratch (a fresh environment, the same row and seed).
        retries: The most replays after the first play.
        failed: The episode to keep when every play failed, from the last failure.
        where: Names the episode in the warning logged for each failure.

    Returns:
        The first play that ends without an infrastructure failure, its
        `EpisodeStats.infra_retries` the plays that failed before it; else `failed(...)`.

    Raises:
        Exception: Whatever else a play raises (`tools.infrastructure_failure` tells them
            apart), at once and as it was raised.

    """
    failures: list[InfrastructureError] = []
    while len(failures) <= retries:
        try:
            episode = await play()
        except Exception as error:
            if (failure := infrastructure_failure(error)) is None:
                raise
            failures.append(failure)
            logger.warning(
                "%s: infrastructure failure on play %d of at most %d: %s",
                where,
                len(failures),
                retries + 1,
                failure,
            )
            continue
        if not failures:
            return episode
        stats = dataclasses.replace(episode.stats, infra_retries=len(failures))
        return dataclasses.replace(episode, stats=stats)
    return failed(failures[-1])


def infra_episode(
    row: Mapping[str, Any],
    group: int,
    index: int,
    failure: InfrastructureError,
    retries: int,
    token: int,
) -> Episode:
    """The episode kept after each of its `retries + 1` plays met an infrastructure failure.

    It holds nothing of the policy's: one row of the single prompt token `token`
    (`placeholder_token`) and no completion, so the loss trains on none of it; the row's
    prompt messages (none when the environment states the task); `Finish.INFRA`; and the last
    failure as `error`.
    """
    return Episode(
        rows=(EpisodeRow([token], [], [], []),),
        messages=prompt_messages(row) if "prompt" in row else [],
        finish=Finish.INFRA,
        stats=EpisodeStats(0, 0, {}, infra_retries=retries),
        row=row,
        group=group,
        index=index,
        error=f"infrastructure failure on each of {retries + 1} plays; the last: {failure}",
    )


def placeholder_token(tokenizer: Any) -> int:
    """The token a failed episode's row holds: the pad token, else end-of-text, else 0."""
    ids = (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))
    return next((token for token in ids if token is not None), 0)
