"""What a played round reports: its metrics, its episode records, and its completions table."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from agentgrpo.reporting.completions import CompletionsTable
from agentgrpo.reporting.metrics import RewardLayout, episode_stats, round_metrics
from agentgrpo.rounds.pipeline import Gather, Round
from rollout import EpisodeRecord

# A list of this process's objects -> every process's, in process order.
GatherObjects = Callable[[list[Any]], list[Any]]


def gathered_metrics(round_: Round, gather: Gather, layout: RewardLayout) -> dict[str, float]:
    """`metrics.round_metrics` over every process's episodes (`num_tokens_round` included).

    With dynamic sampling, also over every process: `dynamic_sampling/groups_replaced`
    (uninformative groups replaced by fresh ones), `dynamic_sampling/resample_rounds` (plays of
    fresh rows, the most any process made) and `dynamic_sampling/effective_batch` (episodes of
    groups whose rewards differ). With a curriculum, its pool's `curriculum/*` metrics (the
    same on every process).
    """
    metrics = round_metrics(
        gather(episode_stats(round_.episodes)),
        gather(round_.rewards_N_F),
        gather(round_.rewards_N),
        layout,
    )
    resampled = round_.resampled
    if resampled is not None:
        counts = [resampled.replaced, resampled.rounds, resampled.informative]
        replaced, rounds, informative = gather(torch.tensor([counts])).T.tolist()
        metrics["dynamic_sampling/groups_replaced"] = float(sum(replaced))
        metrics["dynamic_sampling/resample_rounds"] = float(max(rounds))
        effective = sum(informative) * layout.num_generations
        metrics["dynamic_sampling/effective_batch"] = float(effective)
    return metrics | round_.curriculum


def logged_metrics(
    sums: Mapping[str, tuple[float, int]], gather: Gather, gather_objects: GatherObjects
) -> dict[str, float]:
    """The round's mean of each metric reward functions logged, over every process's values.

    Args:
        sums: This process's (sum, count) per metric name (`RewardLogs.take_metrics`).
        gather: Gathers tensors across processes.
        gather_objects: Gathers lists across processes (names may differ between processes).
    """
    names = sorted(set(gather_objects(list(sums))))
    if not names:
        return {}
    local_M_2 = torch.tensor([sums.get(name, (0.0, 0)) for name in names], dtype=torch.float64)
    everyone_P_M_2 = gather(local_M_2.unsqueeze(0)).view(-1, len(names), 2)
    totals_M_2 = everyone_P_M_2.sum(dim=0)
    return {
        name: total / count
        for name, (total, count) in zip(names, totals_M_2.tolist(), strict=True)
        if count
    }


def completions_table(
    round_: Round,
    views: Sequence[tuple[Any, Any]],
    reward_names: Sequence[str],
    extra: Mapping[str, list[Any]],
    gather_objects: GatherObjects,
    step: int,
) -> CompletionsTable:
    """Every process's rows of the round, for `log_completions`.

    Args:
        round_: The round, on this process.
        views: (prompt, completion) of each episode, as reward functions saw them.
        reward_names: One name per reward column.
        extra: `log_extra` columns over this process's episodes (`RewardLogs.take_extra`).
        gather_objects: Gathers lists across processes.
        step: The global step the round is logged at.
    """
    prompts, completions = zip(*views, strict=True) if views else ((), ())
    columns = round_.rewards_N_F.T.tolist() if len(views) else [[] for _ in reward_names]
    # Every process takes part in every gather, in the same order, whatever it logged.
    extra_names = sorted(set(gather_objects(list(extra))))
    unlogged = [None] * len(views)
    return CompletionsTable(
        step=step,
        prompts=gather_objects(list(prompts)),
        completions=gather_objects(list(completions)),
        rewards={
            name: gather_objects(values) for name, values in zip(reward_names, columns, strict=True)
        },
        advantages=gather_objects(round_.advantages_N.tolist()),
        extra={name: gather_objects(extra.get(name, unlogged)) for name in extra_names},
    )


def episode_records(
    round_: Round, reward_names: Sequence[str], policy_version: int | Sequence[int], process: int
) -> list[EpisodeRecord]:
    """The round's episodes with their scores, as the episode record holds them.

    Args:
        round_: The round, on this process.
        reward_names: One name per reward column.
        policy_version: The global step whose weights generated the round, or one per episode
            (an asynchronous round's groups were played at different steps).
        process: This process's index.
    """
    versions = policy_version
    if isinstance(versions, int):
        versions = [versions] * len(round_.episodes)
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
            policy_version=version,
            process=process,
        )
        for episode, version, (rewards_F, reward, advantage) in zip(
            round_.episodes, versions, scores, strict=True
        )
    ]
