"""Scoring episodes: `Scorer`, and `play_round`, which scores each group the moment it ends.

Scoring runs inside the engine's `on_group` hook, so slow (for example I/O-bound, async) reward
functions overlap with the generation of the groups still playing instead of adding to the step.
An episode an infrastructure failure ended (`Finish.INFRA`, `rollout.infrastructure`) is not
scored: reward functions never see it, and every one of its rewards is NaN, which leaves it out
of its group's baseline with advantage 0 (`learner.advantages.group_advantages`). Neither is a
game's seat that sampled nothing because the game ended before its turn (`rollout.match.sat_out`):
its reward would be the game's for moves it never made.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentgrpo.rewards.calls import RewardBatch, RewardFunction, score
from environments import reward_method_name
from rollout import Episode, Finish, RolloutEngine
from rollout.match import sat_out
from rollout.row_tools import carries_tools

logger = logging.getLogger(__name__)


@dataclass
class RewardLogs:
    """What reward functions logged through `log_metric` and `log_extra`, round by round.

    Reward functions run in worker threads and groups are scored as they finish, so values are
    kept per group and put back in episode order by `take_extra`.

    Attributes:
        metrics: Metric name to every value logged since the last `take_metrics`.
        extra: Column name to {group: one value per episode of that group}.
    """

    metrics: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, dict[int, list[Any]]] = field(default_factory=dict)

    def add_metric(self, name: str, value: float) -> None:
        """`log_metric(name, value)`: one scalar, averaged with the round's other values."""
        self.metrics.setdefault(name, []).append(float(value))

    def add_extra(
        self,
        group: int,
        size: int,
        column: str,
        values: Sequence[Any],
        at: Sequence[int] | None = None,
    ) -> None:
        """`log_extra(column, values)` for a group of `size` episodes: one value per episode.

        `at` lists the group positions of the completions the call scored, when it scored
        only some (not those of `Finish.INFRA` episodes): the others get None.

        Raises:
            ValueError: `values` does not hold one value per completion of the call.
        """
        scored = size if at is None else len(at)
        if isinstance(values, str) or len(values) != scored:
            count = "a string" if isinstance(values, str) else f"{len(values)} values"
            raise ValueError(
                f"log_extra({column!r}, values) got {count} for {scored} completions; pass a "
                "list with one value per completion"
            )
        spread = list(values)
        if at is not None:
            spread = [None] * size
            for position, value in zip(at, values, strict=True):
                spread[position] = value
        self.extra.setdefault(column, {})[group] = spread

    def take_metrics(self) -> dict[str, tuple[float, int]]:
        """Each metric's (sum, count) since the last call; then forget them."""
        taken = {name: (sum(values), len(values)) for name, values in self.metrics.items()}
        self.metrics = {}
        return taken

    def add_group(self, first: int, logs: RewardLogs) -> None:
        """Add `logs`, kept while one row was scored alone, as this round's groups from `first`.

        The asynchronous producer scores each row's group (one per seat in a game) into its own
        `RewardLogs`, as groups 0, 1, ... of a one-row round, and the learner adds them to its
        round's logs when it trains them: group g becomes group `first + g`.
        """
        for name, values in logs.metrics.items():
            self.metrics.setdefault(name, []).extend(values)
        for column, by_group in logs.extra.items():
            for group, values in by_group.items():
                self.extra.setdefault(column, {})[first + group] = values

    def take_extra(self, num_groups: int, num_generations: int) -> dict[str, list[Any]]:
        """Each extra column over a round's episodes in group order (None where not logged)."""
        missing = [None] * num_generations
        taken = {
            column: [v for g in range(num_groups) for v in by_group.get(g, missing)]
            for column, by_group in self.extra.items()
        }
        self.extra = {}
        return taken


@dataclass
class Scorer:
    """Rates a group's episodes with the reward functions and the environment's own reward.

    Attributes:
        funcs: The user's reward functions.
        env_reward_classes: The environment classes that score themselves (`reward()` or
            `get_reward()`), one reward column each, named after the class. An episode gets
            its environment's reward in its class's column and None (NaN) in the others.
        with_environments: Episodes have environments: reward functions may name them.
        text_completions: Completions are text (TRL's standard format) rather than messages.
        decode: Token ids to text, for text completions.
        trainer_state: Returns the current `TrainerState`, passed to reward functions.
        logs: Collects what reward functions pass to `log_metric` and `log_extra`.
        agent_columns: The reward columns an agent fills with what it returns
            (`rollout.agents.Agent.columns`; empty without an agent), after the others.
    """

    funcs: Sequence[RewardFunction]
    env_reward_classes: Sequence[type]
    with_environments: bool
    text_completions: bool
    decode: Callable[[list[int]], str]
    trainer_state: Callable[[], Any]
    logs: RewardLogs = field(default_factory=RewardLogs)
    agent_columns: Sequence[str] = ()

    @property
    def names(self) -> list[str]:
        """One name per reward column, in the column order of `score_group`'s result."""
        own = [c.__name__ for c in self.env_reward_classes]
        return [f.name for f in self.funcs] + own + list(self.agent_columns)

    async def score_group(self, episodes: Sequence[Episode]) -> torch.Tensor:
        """rewards_G_F: one column per name in `names`; NaN where a function returned None.

        `Finish.INFRA` episodes, and seats that sat out their game (`rollout.match.sat_out`),
        are left out of what the reward functions see, and their rows are NaN.
        """
        at = [g for g, e in enumerate(episodes) if not unscored(e)]
        rewards_G_F = torch.full((len(episodes), len(self.names)), math.nan)
        if at:
            scored = [episodes[g] for g in at]
            whole = len(at) == len(episodes)
            rewards_G_F[at] = await self._score(scored, None if whole else at, len(episodes))
        return rewards_G_F

    async def _score(
        self, episodes: Sequence[Episode], at: Sequence[int] | None, size: int
    ) -> torch.Tensor:
        """rewards_S_F of the `episodes` scored, at group positions `at` (None: all `size`)."""
        prompts, completions = zip(*(self.views(e) for e in episodes), strict=True)
        batch = RewardBatch(
            prompts=list(prompts),
            completions=list(completions),
            completion_ids=[e.completion_ids for e in episodes],
            rows=[e.row for e in episodes],
            environments=[e.environment for e in episodes] if self.with_environments else None,
            trainer_state=self.trainer_state(),
            log_extra=functools.partial(self.logs.add_extra, episodes[0].group, size, at=at),
            log_metric=self.logs.add_metric,
        )
        columns = [await score(list(self.funcs), batch)] if self.funcs else []
        for env_class in self.env_reward_classes:
            rewards = [_own_reward(e, env_class) for e in episodes]
            columns.append(torch.tensor(rewards, dtype=torch.float32).unsqueeze(1))
        for name in self.agent_columns:
            rewards = [_agent_reward(e, name) for e in episodes]
            columns.append(torch.tensor(rewards, dtype=torch.float32).unsqueeze(1))
        return torch.cat(columns, dim=1) if columns else torch.zeros(len(episodes), 0)

    def views(self, episode: Episode) -> tuple[Any, Any]:
        """The (prompt, completion) a reward function sees for an episode (text or messages)."""
        text = self.text_completions and not carries_tools(episode.row)  # row tools: chat
        if text and isinstance(episode.row.get("prompt"), str):
            return episode.row["prompt"], self.decode(episode.completion_ids)
        replies = (i for i, m in enumerate(episode.messages) if m["role"] == "assistant")
        first_reply = next(replies, len(episode.messages))  # a seat may end without a turn
        return episode.messages[:first_reply], episode.messages[first_reply:]


def unscored(episode: Episode) -> bool:
    """Whether no reward rates `episode`: an infrastructure failure, or a seat that sat out."""
    return episode.finish is Finish.INFRA or sat_out(episode)


def _own_reward(episode: Episode, env_class: type) -> float:
    """The episode's environment reward if `env_class` played it (exactly), else NaN."""
    if type(episode.environment) is not env_class or episode.env_reward is None:
        return math.nan
    return episode.env_reward


def _agent_reward(episode: Episode, name: str) -> float:
    """The agent's reward in column `name`; NaN when it returned None (or failed)."""
    value = (episode.agent_rewards or {}).get(name)
    return math.nan if value is None else value


def environment_reward_classes(factory: Any) -> tuple[type, ...]:
    """The environment classes that score themselves, for one factory or a dict of them.

    Each class counts once, in the dict's order, even when several names map to it.
    """
    factories = factory.values() if isinstance(factory, Mapping) else [factory]
    classes = [f for f in factories if environment_reward_name(f) is not None]
    return tuple(dict.fromkeys(classes))


def environment_reward_name(factory: Any) -> str | None:
    """The reward column of an environment class that scores itself (its class name), or None.

    An environment scores itself with a `reward` or `get_reward` method (a `reward` attribute
    is its state); a factory that is not a class cannot be inspected before it runs, so it is
    taken not to.
    """
    env_class = factory if isinstance(factory, type) else None
    if env_class is None or reward_method_name(env_class) is None:
        return None
    return env_class.__name__


async def play_round(
    engine: RolloutEngine,
    rows: Sequence[Mapping[str, Any]],
    num_generations: int,
    seed: int,
    scorer: Scorer,
) -> tuple[list[Episode], torch.Tensor]:
    """Play `num_generations` episodes per row and score them group by group.

    Returns:
        The episodes (grouped, as `RolloutEngine.run` returns them) and rewards_N_F.
    """
    rewards_by_group: dict[int, torch.Tensor] = {}

    async def on_group(episodes: list[Episode]) -> None:
        rewards_by_group[episodes[0].group] = await scorer.score_group(episodes)

    episodes = await engine.run(rows, num_generations, seed=seed, on_group=on_group)
    groups = len(episodes) // num_generations  # a game gives a group per seat (MatchEngine)
    rewards_N_F = torch.cat([rewards_by_group[g] for g in range(groups)])
    warn_if_unscored(episodes, rewards_N_F, scorer)
    return episodes, rewards_N_F


async def score_played(
    scorer: Scorer, episodes: Sequence[Episode], num_generations: int
) -> torch.Tensor:
    """rewards_N_F of episodes already played (in groups of `num_generations`), group by group."""
    groups = [episodes[g : g + num_generations] for g in range(0, len(episodes), num_generations)]
    rewards_N_F = torch.cat([await scorer.score_group(group) for group in groups])
    warn_if_unscored(episodes, rewards_N_F, scorer)
    return rewards_N_F


def warn_if_unscored(
    episodes: Sequence[Episode], rewards_N_F: torch.Tensor, scorer: Scorer
) -> None:
    """Log a warning, with the first such episode, when every reward is None for some episode.

    The text starts as TRL's does, with the arguments the reward functions received for that
    completion (its row's columns, its environment, then its prompt and completion). Such an
    episode's reward is NaN: left out of its group's baseline, with advantage 0, as in TRL
    1.16 (`learner.advantages.group_advantages`). The warning goes through this
    module's logger, as TRL logs its own, so the same log filters catch it.
    """
    skipped_N = torch.tensor([unscored(e) for e in episodes], dtype=torch.bool)
    unscored_N = rewards_N_F.isnan().all(dim=1) & ~skipped_N  # not scored on purpose
    if not rewards_N_F.shape[1] or not unscored_N.any():
        return
    first = episodes[int(unscored_N.nonzero()[0])]
    arguments = {name: value for name, value in first.row.items() if name != "prompt"}
    if scorer.with_environments:
        arguments["environments"] = first.environment
    arguments["prompt"], arguments["completion"] = scorer.views(first)
    logger.warning(
        "All reward functions returned None for the following kwargs:\n%s\nPlease ensure that at "
        "least one reward function returns a valid reward. (%d of %d completions had no reward; "
        "they are left out of the baselines, with advantage 0.)",
        arguments,
        int(unscored_N.sum()),
        len(episodes),
    )


def environment_reward(env_class: type) -> Callable[..., Any]:
    """TRL's reward function for an environment class that scores itself.

    `get_reward(environments, **kwargs)` calls `get_reward()` (or `reward()`) of each
    environment that is exactly `env_class`, None for the others; it is `async` when that
    method is.
    """
    method = reward_method_name(env_class) or "reward"

    if inspect.iscoroutinefunction(getattr(env_class, method)):

        async def get_reward(environments: list[Any], **kwargs: Any) -> list[float | None]:
            return [
                await getattr(env, method)() if type(env) is env_class else None
                for env in environments
            ]

    else:

        def get_reward(environments: list[Any], **kwargs: Any) -> list[float | None]:  # type: ignore[misc]
            return [
                getattr(env, method)() if type(env) is env_class else None for env in environments
            ]

    return get_reward
