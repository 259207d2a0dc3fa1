"""The per-round metrics, under TRL's names plus `tools/*` and `turns/*`.

Each process reduces its episodes to a small stats tensor; the trainer gathers those across
processes and computes the metrics once from the whole generation batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentgrpo.learner.advantages import group_std
from rollout import Episode

TOOL_ERROR_KINDS = ("parse", "unknown_tool", "bad_arguments", "exception", "timeout")
_COLUMNS = (
    "prompt_tokens",
    "model_tokens",
    "truncated",
    "turns",
    "rows",
    "tool_calls",
    *TOOL_ERROR_KINDS,
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
        ]
        for e in episodes
    ]
    return torch.tensor(rows, dtype=torch.float32).reshape(len(episodes), len(_COLUMNS))


def round_metrics(
    stats_N_S: torch.Tensor,
    rewards_N_F: torch.Tensor,
    rewards_N: torch.Tensor,
    reward_names: Sequence[str],
    num_generations: int,
    batch_std: bool,
) -> dict[str, float]:
    """The metrics of one generation round, from the stats and rewards of all its episodes.

    Lengths count model tokens only (tool and template tokens excluded), as TRL does with tools.
    `reward_std` is the batch std when rewards are scaled by the batch, else the mean group std.
    """
    column = dict(zip(_COLUMNS, stats_N_S.T, strict=True))
    metrics = _length_metrics(column["model_tokens"], column["truncated"].bool())
    metrics["num_tokens_round"] = float((column["prompt_tokens"] + column["model_tokens"]).sum())
    for name, values in zip(reward_names, rewards_N_F.T, strict=True):
        metrics[f"reward/{name}/mean"] = float(values.nanmean())
        metrics[f"reward/{name}/std"] = float(_nanstd(values))
    stds_G = group_std(rewards_N, num_generations)
    metrics["reward"] = float(rewards_N.nanmean())
    metrics["reward_std"] = float(rewards_N.std()) if batch_std else float(stds_G.mean())
    metrics["frac_reward_zero_std"] = float((stds_G < 1e-6).float().mean())
    metrics |= _tool_metrics(column)
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


def _tool_metrics(column: dict[str, torch.Tensor]) -> dict[str, float]:
    calls_N = column["tool_calls"]
    failures_N = torch.stack([column[kind] for kind in TOOL_ERROR_KINDS]).sum(dim=0)
    calls = float(calls_N.sum())
    metrics = {
        "tools/call_rate": float((calls_N > 0).float().mean()),
        "tools/calls_per_episode": float(calls_N.mean()),
        "tools/failure_rate": float(failures_N.sum()) / calls if calls else 0.0,
        "turns/mean": float(column["turns"].mean()),
        "turns/max": float(column["turns"].max()),
        **_fork_metrics(column["rows"], column["turns"]),
    }
    for kind in TOOL_ERROR_KINDS:
        metrics[f"tools/failure_rate/{kind}"] = float(column[kind].sum()) / calls if calls else 0.0
    return metrics


def _fork_metrics(rows_N: torch.Tensor, turns_N: torch.Tensor) -> dict[str, float]:
    """Rows per episode, and the share of the turns after an episode's first that forked.

    Every model turn after the first follows a tool turn, which either extended the row or
    forked a new one (`rollout.Episode.rows`), so `turns/fork_frequency` is forks over those
    turns: 0 for a template that always extends, 1 for one that rewrites every turn.
    """
    continued = float((turns_N - 1).clamp(min=0).sum())
    forks = float((rows_N - 1).sum())
    return {
        "episodes/rows_mean": float(rows_N.mean()),
        "turns/fork_frequency": forks / continued if continued else 0.0,
    }


def _nanstd(values_N: torch.Tensor) -> torch.Tensor:
    present = values_N[~values_N.isnan()]
    return present.std() if present.numel() > 1 else torch.tensor(0.0)
