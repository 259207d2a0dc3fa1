"""Evaluation without training: play held-out rows and summarise how the agent did.

`evaluate` plays each row through the same engine and scorer a training round uses, so the
figures mean the same thing in `agentgrpo eval` and in training logs. `report` is the pure part:
episodes and their rewards in, one `EvalReport` out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from agentgrpo.rounds.pipeline import RewardShaping
from agentgrpo.rounds.scoring import Scorer, play_round
from rollout import Episode, RolloutEngine


@dataclass(frozen=True)
class EvalReport:
    """What a set of episodes shows about the agent.

    Attributes:
        episodes: How many episodes were played.
        success_rate: Share of episodes whose reward reached the success threshold.
        mean_reward: Mean total reward per episode.
        tool_call_rate: Share of episodes with at least one tool call.
        tool_calls: Mean number of tool calls per episode, failed ones included.
        tool_error_rate: Failed tool calls (bad JSON, unknown tool, wrong arguments, raised,
            timed out) over all tool calls; 0 when there were none.
        mean_turns: Mean number of model turns per episode.
        finished_rate: Share of episodes that ended on their own (not cut off).

    """

    episodes: int
    success_rate: float
    mean_reward: float
    tool_call_rate: float
    tool_calls: float
    tool_error_rate: float
    mean_turns: float
    finished_rate: float

    def table(self) -> str:
        """The figures as aligned `name  value` lines."""
        rows = {k: v for k, v in asdict(self).items() if k != "episodes"}
        lines = [f"{'episodes':<16}{self.episodes:>8}"]
        lines += [f"{name:<16}{value:>8.3f}" for name, value in rows.items()]
        return "\n".join(lines)


def report(
    episodes: Sequence[Episode], rewards_N: Sequence[float], success_threshold: float = 1.0
) -> EvalReport:
    """Summarise episodes and their total rewards (one per episode, same order).

    Examples:
        >>> from rollout import EpisodeRow, EpisodeStats, Finish
        >>> def episode(calls, failures):
        ...     stats = EpisodeStats(2, calls, {"exception": failures} if failures else {})
        ...     rows = (EpisodeRow([1], [2], [1], [0.0]),)
        ...     return Episode(rows, [], Finish.STOP, stats, {}, 0, 0)
        >>> r = report([episode(1, 0), episode(2, 1), episode(0, 0)], [1.0, 0.5, 0.0])
        >>> r.success_rate, r.tool_call_rate, r.tool_calls, r.tool_error_rate, r.mean_turns
        (0.3333333333333333, 0.6666666666666666, 1.0, 0.3333333333333333, 2.0)

    """
    if not episodes or len(episodes) != len(rewards_N):
        raise ValueError(f"need one reward per episode: {len(episodes)} and {len(rewards_N)}")
    n = len(episodes)
    calls = sum(e.stats.tool_calls for e in episodes)
    failures = sum(e.stats.tool_failures for e in episodes)
    return EvalReport(
        episodes=n,
        success_rate=sum(r >= success_threshold for r in rewards_N) / n,
        mean_reward=sum(rewards_N) / n,
        tool_call_rate=sum(e.stats.tool_calls > 0 for e in episodes) / n,
        tool_calls=calls / n,
        tool_error_rate=failures / calls if calls else 0.0,
        mean_turns=sum(e.stats.turns for e in episodes) / n,
        finished_rate=sum(not e.finish.truncated for e in episodes) / n,
    )


async def evaluate(
    engine: RolloutEngine,
    scorer: Scorer,
    rows: Sequence[Mapping[str, Any]],
    reward_weights: Sequence[float] | None = None,
    success_threshold: float = 1.0,
    seed: int = 0,
) -> tuple[EvalReport, list[Episode], list[float]]:
    """Play one episode per row and report; also returns the episodes and their rewards.

    Rewards are the weighted sum of the scorer's columns (the environment's own reward among
    them), combined as a training round combines them (`RewardShaping.combine`, in groups of
    one). An episode no reward function applies to counts as reward 0.
    """
    episodes, rewards_N_F = await play_round(engine, rows, 1, seed, scorer)
    rewards_N = RewardShaping(reward_weights or None).combine(rewards_N_F, num_generations=1)
    rewards = [0.0 if math.isnan(r) else r for r in rewards_N.tolist()]
    return report(episodes, rewards, success_threshold), episodes, rewards
