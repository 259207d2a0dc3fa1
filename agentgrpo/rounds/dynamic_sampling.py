"""Dynamic sampling: groups that teach nothing are replaced by freshly played ones (DAPO's).

A group whose episodes all got the same reward has advantage 0 everywhere: the update learns
nothing from it, yet it fills the batch. With `dynamic_sampling=True`, a round's uninformative
groups (equal rewards, or fewer than two scored episodes: an episode an infrastructure failure
ended, `Finish.INFRA`, is not scored) are left out and replaced by groups of fresh rows, drawn
at random from the training rows and played, for at most `max_resample_rounds` more plays a
round. Groups still uninformative then stay in (advantage 0), so a round always has its planned
size and the loss's normalisers do not change.

Every process plays the same number of times (the count of groups still missing is gathered;
a process already full plays as many fresh rows as the process missing most, and keeps none),
since generation may be collective and a round's later stages gather over all processes. Fresh
rows are drawn with a seed fixed by the round's seed and the attempt, so a resumed run replays
the same draws.

With `async_grpo` the producer plays row after row anyway: it drops an uninformative group as
it ends and plays the next row in its place (`GroupFilter`), keeping one again after
`max_resample_rounds` times the round's groups were dropped in a row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from agentgrpo.rounds.data import without_unused_columns
from agentgrpo.rounds.scoring import RewardLogs, Scorer
from rollout import Episode

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig

Rows = Sequence[Mapping[str, Any]]
# (rows, num_generations, seed) -> (episodes, rewards_N_F, what its reward functions logged).
PlayAlone = Callable[[Rows, int, int], tuple[list[Episode], torch.Tensor, RewardLogs]]


@dataclass(frozen=True)
class DynamicSampling:
    """What replacing a round's uninformative groups needs.

    Attributes:
        draw_rows: `(count, seed) -> rows`: `count` training rows drawn at random.
        play: Plays and scores rows as the round does, its reward logs kept apart.
        max_rounds: Plays of fresh rows a round may add (`max_resample_rounds`).
        logs: The round's reward logs: a replacing group's take the replaced one's place, and
            the scalar metrics of every fresh play join them.
    """

    draw_rows: Callable[[int, int], Rows]
    play: PlayAlone
    max_rounds: int
    logs: RewardLogs


@dataclass
class GroupFilter:
    """Dynamic sampling under `async_grpo`: which of the producer's groups to drop as they end.

    Attributes:
        combine: rewards_N_F -> rewards_N (the run's weighting).
        num_generations: Episodes per group.
        max_in_a_row: Uninformative groups dropped in a row before one is kept.
        in_a_row: Uninformative groups dropped since the last group kept.
        dropped: Groups dropped so far.
    """

    combine: Callable[[torch.Tensor], torch.Tensor]
    num_generations: int
    max_in_a_row: int
    in_a_row: int = 0
    dropped: int = 0

    @classmethod
    def of(
        cls, args: GRPOConfig, combine: Callable[[torch.Tensor, int], torch.Tensor], groups: int
    ) -> GroupFilter | None:
        """The filter of a run of `args` whose rounds take `groups` groups (None: keep all)."""
        if not args.dynamic_sampling:
            return None
        num_generations = args.num_generations

        def weighted(rewards_N_F: torch.Tensor) -> torch.Tensor:
            return combine(rewards_N_F, num_generations)

        return cls(weighted, num_generations, args.max_resample_rounds * groups)

    def drops(self, rewards_G_F: torch.Tensor) -> bool:
        """Whether to drop the row scored `rewards_G_F` (counted), and play another row.

        A game's row is a group per seat (its rows in order): it is kept if any of them informs.
        """
        informs = bool(informative_groups(self.combine(rewards_G_F), self.num_generations).any())
        if informs or self.in_a_row >= self.max_in_a_row:
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.dropped += 1
        return True


# (rows, num_generations, seed, scorer) -> (episodes, rewards_N_F): a round's play, scored by
# `scorer`.
PlayScored = Callable[[Rows, int, int, Scorer], tuple[list[Episode], torch.Tensor]]


def dynamic_sampling_of(
    args: GRPOConfig, dataset: Any, play: PlayScored, scorer: Scorer
) -> DynamicSampling | None:
    """The dynamic sampling a run of `args` asks for (None without `dynamic_sampling`).

    Args:
        args: The run's config.
        dataset: The training rows (map-style); fresh rows are drawn from them at random.
        play: Plays and scores rows as the trainer's rounds do.
        scorer: The run's scorer: each fresh play is scored by a copy with logs of its own.
    """
    if not args.dynamic_sampling:
        return None
    rows = without_unused_columns(dataset, args.remove_unused_columns)

    def draw(count: int, seed: int) -> Rows:
        generator = torch.Generator().manual_seed(seed)
        return [rows[i] for i in torch.randint(len(rows), (count,), generator=generator).tolist()]

    def play_alone(
        rows: Rows, num_generations: int, seed: int
    ) -> tuple[list[Episode], torch.Tensor, RewardLogs]:
        alone = dataclasses.replace(scorer, logs=RewardLogs())
        return (*play(rows, num_generations, seed, alone), alone.logs)

    return DynamicSampling(draw, play_alone, args.max_resample_rounds, scorer.logs)


@dataclass(frozen=True)
class Resampled:
    """A round after dynamic sampling, and what it took.

    Attributes:
        episodes: N episodes in group order, renumbered.
        rewards_N_F: Their reward columns.
        replaced: Uninformative groups replaced by fresh ones.
        rounds: Plays of fresh rows made (on this process).
        informative: Groups of the final round whose rewards differ.
    """

    episodes: list[Episode]
    rewards_N_F: torch.Tensor
    replaced: int
    rounds: int
    informative: int


def informative_groups(rewards_N: torch.Tensor, num_generations: int) -> torch.Tensor:
    """informative_Q: whether each group's scored (non-NaN) rewards hold two different values.

    NaN marks an episode no reward scored, a `Finish.INFRA` one among them: a group of
    infrastructure failures only, or of one scored episode and such failures, informs nothing.

    >>> informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, float("nan"), 2.0]), 2)
    tensor([False,  True, False])
    """
    rewards_Q_G = rewards_N.view(-1, num_generations)
    scored_Q_G = ~torch.isnan(rewards_Q_G)
    high_Q = torch.where(scored_Q_G, rewards_Q_G, -torch.inf).amax(dim=1)
    low_Q = torch.where(scored_Q_G, rewards_Q_G, torch.inf).amin(dim=1)
    return (scored_Q_G.sum(dim=1) >= 2) & (high_Q > low_Q)


def resample(
    sampling: DynamicSampling,
    combine: Callable[[torch.Tensor], torch.Tensor],
    gather: Callable[[torch.Tensor], torch.Tensor],
    played: tuple[list[Episode], torch.Tensor],
    num_generations: int,
    seed: int,
) -> Resampled:
    """Replace the uninformative groups of a played round, up to `sampling.max_rounds` plays.

    Args:
        sampling: Where fresh rows come from, how they are played, and the budget.
        combine: rewards_N_F -> rewards_N (the round's weighting).
        gather: This process's tensor -> every process's (the identity on one process).
        played: The round's episodes and rewards_N_F.
        num_generations: Episodes per group.
        seed: The round's seed.
    """
    groups = _groups(*played, num_generations)
    informative_Q = informative_groups(combine(played[1]), num_generations)
    replaced = rounds = 0
    for attempt in range(1, sampling.max_rounds + 1):
        missing = [q for q, informs in enumerate(informative_Q.tolist()) if not informs]
        most = int(gather(torch.tensor([len(missing)])).max())
        if most == 0:
            break  # every process is full: all stop here together
        # A full process plays too, and keeps nothing: generation may be collective (ZeRO-3's
        # gathered weights, tensor-parallel vLLM), so every process plays as often.
        fresh_seed = hash((seed, attempt)) % 2**31
        rows = sampling.draw_rows(len(missing) or most, fresh_seed)
        episodes, rewards_N_F, fresh_logs = sampling.play(rows, num_generations, fresh_seed)
        rounds += 1
        if not missing:
            continue
        _add_metrics(sampling.logs, fresh_logs)
        fresh_Q = informative_groups(combine(rewards_N_F), num_generations).tolist()
        fresh = [
            (g, group)
            for g, (group, informs) in enumerate(
                zip(_groups(episodes, rewards_N_F, num_generations), fresh_Q, strict=True)
            )
            if informs
        ]
        for q, (g, group) in zip(missing, fresh, strict=False):
            groups[q] = group
            informative_Q[q] = True
            _move_extra(fresh_logs, g, sampling.logs, q)
            replaced += 1
    episodes, rewards_N_F = _renumbered(groups, num_generations)
    return Resampled(episodes, rewards_N_F, replaced, rounds, int(informative_Q.sum()))


def _add_metrics(logs: RewardLogs, fresh: RewardLogs) -> None:
    for name, values in fresh.metrics.items():
        logs.metrics.setdefault(name, []).extend(values)


def _move_extra(fresh: RewardLogs, g: int, logs: RewardLogs, q: int) -> None:
    """Group `g`'s `log_extra` columns of a fresh play become group `q`'s of the round."""
    for by_group in logs.extra.values():
        by_group.pop(q, None)
    for column, by_group in fresh.extra.items():
        if g in by_group:
            logs.extra.setdefault(column, {})[q] = by_group[g]


Group = tuple[list[Episode], torch.Tensor]


def _groups(
    episodes: list[Episode], rewards_N_F: torch.Tensor, num_generations: int
) -> list[Group]:
    """The round cut into groups: each group's episodes and rewards_G_F."""
    return [
        (episodes[n : n + num_generations], rewards_N_F[n : n + num_generations])
        for n in range(0, len(episodes), num_generations)
    ]


def _renumbered(groups: list[Group], num_generations: int) -> tuple[list[Episode], torch.Tensor]:
    """The groups as one round: episode k of group q becomes group q, index q * G + k."""
    episodes = [
        dataclasses.replace(e, group=q, index=q * num_generations + k)
        for q, (group, _) in enumerate(groups)
        for k, e in enumerate(group)
    ]
    return episodes, torch.cat([rewards_G_F for _, rewards_G_F in groups])
