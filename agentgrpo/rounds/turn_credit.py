"""A round's credit per turn (`turn_advantage`): episodes' turns to per-token advantages.

The maths is `agentgrpo.learner.turn_credit`'s; this lays a round's episodes out for it (each
turn's return and state, gathered over every process, since a group may span processes) and
spreads each turn's advantage over its tokens (`TurnRecord` spans). Tokens of an episode the
engine did not play turn by turn (no `Episode.turns`) keep the episode's advantage. The
episode's reward is added to its last turn's, less what its turns earned when its environment's
``reward()`` is their sum (`sums_turns`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from agentgrpo.learner.turn_credit import discounted_returns, turn_advantages
from rollout import Episode

Gather = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TurnCredit:
    """How turns are credited: `mode` ``"return"`` or ``"same_state"``, `gamma`, scaling."""

    mode: str
    gamma: float = 1.0
    scale: bool = True

    def token_advantages(
        self,
        episodes: Sequence[Episode],
        rewards_N: torch.Tensor,
        advantages_N: torch.Tensor,
        gather: Gather,
        process_index: int,
        num_generations: int,
    ) -> list[torch.Tensor]:
        """advantages_C per row of `episodes` (in order): each turn's advantage on its tokens.

        `rewards_N` and `advantages_N` are this process's; every process calls this at once.
        """
        width = int(gather(torch.tensor([_width(episodes)])).max())
        returns_N_T, states_N_T = self.tables(episodes, rewards_N, width)
        everyone_N_T = turn_advantages(
            self.mode,
            gather(returns_N_T),
            gather(states_N_T),
            gather(advantages_N.float()),
            num_generations,
            self.scale,
        )
        start = process_index * len(episodes)
        local_N_T = everyone_N_T[start : start + len(episodes)]
        return [
            row_advantages
            for n, episode in enumerate(episodes)
            for row_advantages in spread(episode, local_N_T[n], float(advantages_N[n]))
        ]

    def tables(
        self, episodes: Sequence[Episode], rewards_N: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """returns_N_T (NaN past the last turn, or for a NaN reward) and states_N_T (-1: none)."""
        returns_N_T = torch.full((len(episodes), width), math.nan)
        states_N_T = torch.full((len(episodes), width), -1, dtype=torch.long)
        for n, episode in enumerate(episodes):
            reward = float(rewards_N[n])
            if math.isnan(reward):
                continue
            turn_rewards = [turn.reward for turn in episode.turns]
            final = reward - sum(turn_rewards) if sums_turns(episode) else reward
            returns = discounted_returns(turn_rewards, final, self.gamma)
            returns_N_T[n, : len(returns)] = torch.tensor(returns)
            for t, turn in enumerate(episode.turns):
                states_N_T[n, t] = state_id(turn.state) if turn.state is not None else -1
        return returns_N_T, states_N_T


def sums_turns(episode: Episode) -> bool:
    """Whether the episode's environment's ``reward()`` already sums its turns' rewards.

    Such an environment (the gymnasium and OpenEnv adapters: ``reward_sums_turns = True``)
    earned its reward in its turns, so the last turn's return adds only what no turn earned:
    counting the reward there too would credit every step twice.
    """
    return bool(getattr(type(episode.environment), "reward_sums_turns", False))


def spread(episode: Episode, advantages_T: torch.Tensor, advantage: float) -> list[torch.Tensor]:
    """advantages_C of each row of `episode`: `advantage`, then each turn's on its span."""
    rows = [torch.full((len(row.completion_ids),), advantage) for row in episode.rows]
    for t, turn in enumerate(episode.turns):
        rows[turn.row][turn.start : turn.end] = advantages_T[t]
    return rows


def state_id(state: str) -> int:
    """A non-negative integer naming `state`, the same in every process (not Python's hash)."""
    return int.from_bytes(hashlib.blake2b(state.encode(), digest_size=7).digest(), "big")


def _width(episodes: Sequence[Episode]) -> int:
    return max((len(episode.turns) for episode in episodes), default=0) or 1
