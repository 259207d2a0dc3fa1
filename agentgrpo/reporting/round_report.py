"""What a played round reports: its metrics, its episode records, and a sample of completions."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from agentgrpo.reporting.metrics import episode_stats, round_metrics
from agentgrpo.round import Gather, Round
from rollout import Episode, EpisodeRecord


def gathered_metrics(
    round_: Round,
    gather: Gather,
    reward_names: Sequence[str],
    num_generations: int,
    batch_std: bool,
) -> dict[str, float]:
    """`metrics.round_metrics` over every process's episodes (`num_tokens_round` included)."""
    return round_metrics(
        gather(episode_stats(round_.episodes)),
        gather(round_.rewards_N_F),
        gather(round_.rewards_N),
        reward_names,
        num_generations,
        batch_std,
    )


def episode_records(
    round_: Round, reward_names: Sequence[str], policy_version: int, process: int
) -> list[EpisodeRecord]:
    """The round's episodes with their scores, as the episode record holds them.

    Args:
        round_: The round, on this process.
        reward_names: One name per reward column.
        policy_version: The global step whose weights generated the round.
        process: This process's index.
    """
    scores = zip(
        round_.rewards_N_F.tolist(),
        round_.rewards_N.tolist(),
        round_.advantages_N.tolist(),
        strict=True,
    )
    return [
        EpisodeRecord(
            episode,
            {n: None if math.isnan(r) else r for n, r in zip(reward_names, rewards_F, strict=True)},
            reward,
            advantage,
            policy_version=policy_version,
            process=process,
        )
        for episode, (rewards_F, reward, advantage) in zip(round_.episodes, scores, strict=True)
    ]


def print_completions(
    shown: Sequence[tuple[Episode, float]], decode: Callable[[list[int]], str], step: int
) -> None:
    """Print each episode's completion with its reward; tokens the model did not write are dim.

    A forked episode shows each row's completion in turn, separated by a dim `[fork]`.
    """
    print(f"--- completions at step {step}")
    for episode, reward in shown:
        text = " \x1b[2m[fork]\x1b[0m ".join(
            "".join(
                decode([token]) if mask else f"\x1b[2m{decode([token])}\x1b[0m"
                for token, mask in zip(row.completion_ids, row.loss_mask, strict=True)
            )
            for row in episode.rows
        )
        print(f"[reward {reward:+.3f} | {episode.finish}] {text}")
