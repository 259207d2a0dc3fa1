"""The per-round metrics, under the names TRL 1.16's GRPOTrainer logs, plus `turns/*`.

Each process reduces its episodes to a small stats tensor; the trainer gathers those across
processes and computes the metrics once from the whole generation batch.

| metric | meaning |
|---|---|
| `rewards/<name>/mean`, `/std` | each reward column over the episodes it applies to |
| `reward`, `reward_std` | the weighted sum of the raw reward columns: batch mean and std |
| `frac_reward_zero_std` | share of episodes whose advantage scale (group or batch std) is 0 |
| `tools/call_frequency` | tool calls per episode (only when the run has tools) |
| `tools/failure_frequency` | failed tool calls over tool calls; `/<kind>` per kind of failure |
| `turns/mean`, `turns/max` | model turns per episode (only when the run has tools) |
| `episodes/rows_mean` | training rows per episode (above 1 where the template forks) |
| `turns/fork_frequency` | share of the turns after an episode's first that forked a new row |
|  | (only when the run has tools, as the other `turns/` metrics) |
| `episodes/infra_failures` | episodes of the round kept as infrastructure failures |
|  | (`Finish.INFRA`: not scored, not trained on) |
| `episodes/infra_retries` | replays of the round's episodes after infrastructure failures |

The sampler/trainer mismatch metrics (`sampling/*`) come from the loss forward instead:
`reporting.sampling`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agentgrpo.learner.advantages import group_std, nanstd
from rollout import Episode, Finish
from tools import ToolErrorKind

if TYPE_CHECKING:
    from agentgrpo.rounds.pipeline import RewardShaping

# A call the model wrote that did not parse, then why a parsed call failed (`tools.ToolErrorKind`).
TOOL_ERROR_KINDS = ("parse", *(kind.value for kind in ToolErrorKind))
_COLUMNS = (
    "prompt_tokens",
    "model_tokens",
    "truncated",
    "turns",
    "rows",
    "tool_calls",
    *TOOL_ERROR_KINDS,
    "compactions",
    "compaction_rows",
    "context_before",
    "context_after",
    "responses",
    "infra_failures",
    "infra_retries",
)


@dataclass(frozen=True)
class RewardLayout:
    """How a round's reward columns are named, weighted and scaled, for its metrics.

    Attributes:
        names: One name per reward column.
        weights_F: One weight per reward column.
        num_generations: Episodes per group (groups contiguous).
        batch_scaled: Advantages are scaled by the batch std (`scale_rewards="batch"`, or
            `multi_objective_aggregation="normalize_then_sum"`), not by each group's.
        with_tools: The run offers tools, so tool and turn metrics are logged.
    """

    names: Sequence[str]
    weights_F: Sequence[float]
    num_generations: int
    batch_scaled: bool = False
    with_tools: bool = False

    @classmethod
    def of(
        cls, names: Sequence[str], shaping: RewardShaping, num_generations: int, with_tools: bool
    ) -> RewardLayout:
        """The layout of a run's rounds: its reward names and shaping (weights, scaling)."""
        return cls(
            names=names,
            weights_F=[float(w) for w in shaping.weights_or_ones(len(names))],
            num_generations=num_generations,
            batch_scaled=shaping.scale == "batch" or shaping.aggregation == "normalize_then_sum",
            with_tools=with_tools,
        )


def episode_stats(episodes: Sequence[Episode]) -> torch.Tensor:
    """stats_N_S: one row per episode, columns as in `_COLUMNS`.

    `prompt_tokens` sums the prompts of all the episode's rows (what the learner reads).
    """
    rows = [
        [
            sum(len(row.prompt_ids) for row in e.rows),
            e.model_tokens,
            float(e.finish.truncated),
            e.stats.turns,
            len(e.rows),
            e.stats.tool_calls,
            *(e.stats.tool_errors.get(kind, 0) for kind in TOOL_ERROR_KINDS),
            len(e.stats.compactions),
            sum(c.rows for c in e.stats.compactions),
            sum(c.tokens_before for c in e.stats.compactions),
            sum(c.tokens_after for c in e.stats.compactions),
            e.stats.responses,
            float(e.finish is Finish.INFRA),
            e.stats.infra_retries,
        ]
        for e in episodes
    ]
    return torch.tensor(rows, dtype=torch.float32).reshape(len(episodes), len(_COLUMNS))


def round_metrics(
    stats_N_S: torch.Tensor,
    rewards_N_F: torch.Tensor,
    rewards_N: torch.Tensor,
    layout: RewardLayout,
) -> dict[str, float]:
    """The metrics of one generation round, from the stats and rewards of all its episodes.

    Lengths count model tokens only (tool and template tokens excluded), as TRL does with tools,
    of the episodes that were played (infrastructure failures left out, unless all were).

    Args:
        stats_N_S: `episode_stats` of every episode.
        rewards_N_F: The raw reward columns (NaN where a function returned None).
        rewards_N: The combined rewards the advantages were computed from.
        layout: Names, weights and scaling of the reward columns.
    """
    column = dict(zip(_COLUMNS, stats_N_S.T, strict=True))
    played_N = column["infra_failures"] == 0  # a failed play has no length of its own
    if not played_N.any():
        played_N = torch.ones_like(played_N)
    metrics = _length_metrics(
        column["model_tokens"][played_N], column["truncated"][played_N].bool()
    )
    metrics["num_tokens_round"] = float((column["prompt_tokens"] + column["model_tokens"]).sum())
    metrics |= reward_metrics(rewards_N_F, rewards_N, layout)
    metrics["episodes/rows_mean"] = float(column["rows"].mean())
    metrics["episodes/infra_failures"] = float(column["infra_failures"].sum())
    metrics["episodes/infra_retries"] = float(column["infra_retries"].sum())
    if layout.with_tools:
        metrics |= tool_metrics(column)
    return metrics


def reward_metrics(
    rewards_N_F: torch.Tensor, rewards_N: torch.Tensor, layout: RewardLayout
) -> dict[str, float]:
    """`rewards/<name>/mean|std`, `reward`, `reward_std` and `frac_reward_zero_std`, as TRL.

    `reward` and `reward_std` are the batch mean and std of the weighted sum of the raw
    columns, whatever `multi_objective_aggregation` is (an episode no function applies to is
    left out; a std over fewer than two episodes is NaN, as TRL's). `frac_reward_zero_std` is
    the share of episodes whose advantage was divided by a zero std: its group's std of
    `rewards_N`, or the batch's when `layout.batch_scaled` (NaN rewards left out).

    Examples:
        >>> nan = float("nan")
        >>> rewards_N_F = torch.tensor([[1.0, 0.0], [1.0, nan], [0.0, 1.0], [1.0, 1.0]])
        >>> layout = RewardLayout(["a", "b"], [1.0, 0.5], num_generations=2)
        >>> m = reward_metrics(rewards_N_F, torch.tensor([1.0, 1.0, 0.5, 1.5]), layout)
        >>> round(m["rewards/b/mean"], 4), m["reward"], m["frac_reward_zero_std"]
        (0.6667, 1.0, 0.5)
    """
    metrics = {}
    for name, values_N in zip(layout.names, rewards_N_F.T, strict=True):
        metrics[f"rewards/{name}/mean"] = float(values_N.nanmean())
        metrics[f"rewards/{name}/std"] = float(nanstd(values_N, dim=0))
    weights_F = torch.tensor(list(layout.weights_F), dtype=rewards_N_F.dtype)
    weighted_N = (rewards_N_F * weights_F).nansum(dim=1)
    weighted_N = weighted_N.masked_fill(rewards_N_F.isnan().all(dim=1), float("nan"))
    metrics["reward"] = float(weighted_N.nanmean())
    metrics["reward_std"] = float(nanstd(weighted_N, dim=0))
    if layout.num_generations < 2:  # a lone episode: nothing to scale by
        zero_std_N = torch.ones_like(rewards_N)
    elif layout.batch_scaled:
        zero_std_N = torch.full_like(rewards_N, float(nanstd(rewards_N, dim=0) < 1e-8))
    else:
        stds_M = group_std(rewards_N, layout.num_generations)
        zero_std_N = (stds_M < 1e-8).float().repeat_interleave(layout.num_generations)
    metrics["frac_reward_zero_std"] = float(zero_std_N.mean())
    return metrics


def tool_metrics(column: dict[str, torch.Tensor]) -> dict[str, float]:
    """Tool and turn metrics from the stats columns of every episode.

    `tools/call_frequency` is tool calls per episode; `tools/failure_frequency` is failed calls
    over calls (0 without calls), as TRL; `tools/failure_frequency/<kind>` splits it by kind.
    """
    calls_N = column["tool_calls"]
    calls = float(calls_N.sum())
    failures = sum(float(column[kind].sum()) for kind in TOOL_ERROR_KINDS)
    metrics = {
        "tools/call_frequency": calls / len(calls_N),
        "tools/failure_frequency": failures / calls if calls else 0.0,
    }
    for kind in TOOL_ERROR_KINDS:
        share = float(column[kind].sum()) / calls if calls else 0.0
        metrics[f"tools/failure_frequency/{kind}"] = share
    metrics["turns/mean"] = float(column["turns"].mean())
    metrics["turns/max"] = float(column["turns"].max())
    template_rows_N = column["rows"] - column["compaction_rows"]
    metrics["turns/fork_frequency"] = _fork_frequency(template_rows_N, column["turns"])
    return metrics | context_metrics(column)


def context_metrics(column: dict[str, torch.Tensor]) -> dict[str, float]:
    """Compactions per episode, and the environment's replies in words when it gave any.

    `context/tokens_before_mean` and `context/tokens_after_mean` (the context's tokens when a
    compaction applied, and the compacted context's) are logged when the round had one.
    """
    compactions = float(column["compactions"].sum())
    metrics = {"context/compactions_mean": compactions / len(column["compactions"])}
    if compactions:
        metrics["context/tokens_before_mean"] = float(column["context_before"].sum()) / compactions
        metrics["context/tokens_after_mean"] = float(column["context_after"].sum()) / compactions
    if column["responses"].any():
        metrics["episodes/responses_mean"] = float(column["responses"].mean())
    return metrics


def _length_metrics(lengths_N: torch.Tensor, truncated_N: torch.Tensor) -> dict[str, float]:
    terminated_N = lengths_N[~truncated_N]
    if terminated_N.numel() == 0:
        terminated_N = torch.zeros(1)
    return {
        "completions/mean_length": float(lengths_N.mean()),
        "completions/min_length": float(lengths_N.min()),
        "completions/max_length": float(lengths_N.max()),
        "completions/mean_terminated_length": float(terminated_N.mean()),
        "completions/min_terminated_length": float(terminated_N.min()),
        "completions/max_terminated_length": float(terminated_N.max()),
        "completions/clipped_ratio": float(truncated_N.float().mean()),
    }


def _fork_frequency(rows_N: torch.Tensor, turns_N: torch.Tensor) -> float:
    """The share of the turns after an episode's first that forked a new row.

    Every model turn after the first follows a tool turn, which either extended the row or
    forked a new one (`rollout.Episode.rows`): 0 for a template that always extends, 1 for one
    that rewrites every turn.
    """
    continued = float((turns_N - 1).clamp(min=0).sum())
    return float((rows_N - 1).sum()) / continued if continued else 0.0
