"""A curriculum over the training rows: rows drawn by how much they can still teach.

With `curriculum=True` the run keeps, for every training row (keyed by its index in the
training dataset), how many of its episodes were scored and how many passed. An episode
passes when the weighted sum of its raw reward columns (the run's `reward_weights`, columns
that returned None left out) is at least `curriculum_pass_reward`; an episode no column scored
is not counted. A row's pass rate p is passes / episodes, 0.5 while it is unseen.

Each training round draws its rows, without replacement, with weights max(floor, p(1 - p)):
a row solved about half the time (whose groups differ most) is drawn most, a row always or
never solved least, but never less than `curriculum_floor`, so no row starves. The draw's
generator is seeded by the run's seed and the number of draws made before, so every process
draws the same rows (each plays its own slice) and a resumed run draws as the uninterrupted
one. After the round is played, every process's rewards are gathered and every process adds
the same counts to its pool. Rows are drawn when the round starts, not by the DataLoader
(which reads ahead), so each draw sees every earlier round's results.

With `async_grpo` the producer draws each group's row as it starts it (one at a time, seeded
by the run's seed and the rows taken) and adds the group's results as it ends, whether or not
dynamic sampling then drops it; each process's producer keeps its own counts, and the main
process's are saved. Evaluation rows are never drawn by the curriculum. The pool is saved in
each checkpoint (`curriculum.pt`) and loaded on resume.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from agentgrpo.learner.advantages import combine_rewards

# The file a checkpoint holds the pool in.
CURRICULUM_FILE = "curriculum.pt"
# p(1 - p) at its largest (p = 0.5): the floor cannot exceed it.
MAX_WEIGHT = 0.25


class RowPool:
    """Per-row counts of scored and passing episodes, and the draw weights they give.

    Args:
        num_rows: Rows in the training dataset (R).
        floor: The least weight a row is drawn with, in (0, 0.25].

    Attributes:
        episodes_R: Scored episodes of each row so far.
        passes_R: Passing episodes of each row so far.
        draws: Draws made so far (each seeded by the run's seed and this count).
    """

    def __init__(self, num_rows: int, floor: float):
        if not 0.0 < floor <= MAX_WEIGHT:
            raise ValueError(
                f"curriculum_floor={floor} must be in (0, {MAX_WEIGHT}]: above 0 so no row "
                f"starves, at most {MAX_WEIGHT} (the weight of a row solved half the time)"
            )
        self.floor = floor
        self.episodes_R = torch.zeros(num_rows, dtype=torch.long)
        self.passes_R = torch.zeros(num_rows, dtype=torch.long)
        self.draws = 0

    @property
    def num_rows(self) -> int:
        """Rows in the pool."""
        return len(self.episodes_R)

    def pass_rates(self) -> torch.Tensor:
        """p_R: each row's share of passing episodes; 0.5 (the prior) for a row not yet scored.

        >>> pool = RowPool(3, floor=0.05)
        >>> pool.record([0, 1], passes_Q=[2, 1], episodes_Q=[2, 4])
        >>> pool.pass_rates().tolist()
        [1.0, 0.25, 0.5]
        """
        seen_R = self.episodes_R > 0
        rates_R = self.passes_R.double() / self.episodes_R.clamp(min=1).double()
        return torch.where(seen_R, rates_R, torch.full_like(rates_R, 0.5))

    def weights(self) -> torch.Tensor:
        """w_R = max(floor, p(1 - p)): how likely each row is to be drawn (unnormalised).

        >>> pool = RowPool(3, floor=0.05)
        >>> pool.record([0, 1], passes_Q=[2, 1], episodes_Q=[2, 4])
        >>> pool.weights().tolist()
        [0.05, 0.1875, 0.25]
        """
        p_R = self.pass_rates()
        return (p_R * (1 - p_R)).clamp(min=self.floor)

    def draw(self, count: int, seed: int) -> list[int]:
        """`count` distinct row indices drawn by `weights()`, from a generator seeded `seed`.

        Counts the draw (`draws`). The same pool and seed give the same rows on every machine.
        """
        if count > self.num_rows:
            raise ValueError(f"cannot draw {count} distinct rows from {self.num_rows}")
        generator = torch.Generator().manual_seed(seed)
        drawn = torch.multinomial(self.weights(), count, replacement=False, generator=generator)
        self.draws += 1
        return drawn.tolist()

    def record(
        self, keys_Q: Sequence[int], passes_Q: Sequence[int], episodes_Q: Sequence[int]
    ) -> None:
        """Add each row's passing and scored episodes (`keys_Q[q]` is the row of group q)."""
        keys = torch.as_tensor(list(keys_Q), dtype=torch.long)
        self.passes_R.index_add_(0, keys, torch.as_tensor(list(passes_Q), dtype=torch.long))
        self.episodes_R.index_add_(0, keys, torch.as_tensor(list(episodes_Q), dtype=torch.long))

    def metrics(self) -> dict[str, float]:
        """The pool's state, under `curriculum/`: see docs/metrics.md.

        >>> pool = RowPool(4, floor=0.05)
        >>> pool.record([0, 1, 2], passes_Q=[2, 0, 1], episodes_Q=[2, 2, 2])
        >>> metrics = pool.metrics()
        >>> metrics["curriculum/rows_solved_always"], metrics["curriculum/rows_never_solved"]
        (1.0, 1.0)
        """
        seen_R = self.episodes_R > 0
        p_R, w_R = self.pass_rates(), self.weights()
        seen = int(seen_R.sum())
        return {
            "curriculum/rows_solved_always": float(
                (seen_R & (self.passes_R == self.episodes_R)).sum()
            ),
            "curriculum/rows_never_solved": float((seen_R & (self.passes_R == 0)).sum()),
            "curriculum/rows_unseen": float(self.num_rows - seen),
            "curriculum/pass_rate_mean": float(p_R[seen_R].mean()) if seen else 0.5,
            "curriculum/weight_mean": float(w_R.mean()),
            "curriculum/weight_min": float(w_R.min()),
        }

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds: the counts and the number of draws."""
        episodes_R, passes_R = self.episodes_R.clone(), self.passes_R.clone()
        return {"episodes_R": episodes_R, "passes_R": passes_R, "draws": self.draws}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the counts and draws of `state_dict()`.

        Raises:
            ValueError: The state counts another number of rows than this pool.
        """
        saved = len(state["episodes_R"])
        if saved != self.num_rows:
            raise ValueError(
                f"the checkpoint's curriculum counts {saved} training rows, this run has "
                f"{self.num_rows}: resume with the training dataset the run started with"
            )
        self.episodes_R = state["episodes_R"].clone().long()
        self.passes_R = state["passes_R"].clone().long()
        self.draws = int(state["draws"])


class Curriculum:
    """A training round's rows drawn from a `RowPool`, and its results added back.

    Args:
        rows: The training rows (map-style, indexable).
        pool: Their counts.
        pass_reward: `curriculum_pass_reward`: the weighted reward an episode passes at.
        seed: The run's seed.
    """

    def __init__(self, rows: Any, pool: RowPool, pass_reward: float, seed: int):
        self.rows, self.pool, self.pass_reward, self.seed = rows, pool, pass_reward, seed
        self._drawn: list[int] = []  # the latest round's rows, over every process

    def draw_rows(
        self, prompts_per_process: int, num_processes: int, process_index: int
    ) -> list[Mapping[str, Any]]:
        """The rows of the next round this process plays; every process draws the same ones.

        The round's `prompts_per_process * num_processes` rows are drawn at once; process p
        plays the p-th slice, as the sampler hands rows out without a curriculum.
        """
        seed = hash((self.seed, self.pool.draws)) % 2**31  # ints only: stable across runs
        self._drawn = self.pool.draw(prompts_per_process * num_processes, seed)
        start = process_index * prompts_per_process
        return [self.rows[i] for i in self._drawn[start : start + prompts_per_process]]

    def record(
        self, everyone_N_F: torch.Tensor, weights_F: Sequence[float] | torch.Tensor, size: int
    ) -> None:
        """Add the latest round's results: every process's reward columns, in process order.

        Args:
            everyone_N_F: Reward columns of the round's groups (`size` episodes each), in the
                order `draw_rows` drew their rows; NaN where a column did not score.
            weights_F: The run's reward weights.
            size: Episodes per group.
        """
        passes_Q, episodes_Q = self._passes(everyone_N_F, weights_F, size)
        if len(passes_Q) != len(self._drawn):
            raise RuntimeError(
                f"{len(passes_Q)} groups scored for {len(self._drawn)} rows drawn: the "
                "curriculum's rows must be played as drawn"
            )
        self.pool.record(self._drawn, passes_Q, episodes_Q)

    def record_group(
        self, key: int, rewards_G_F: torch.Tensor, weights_F: Sequence[float] | torch.Tensor
    ) -> None:
        """Add the results of one group of row `key` (the asynchronous producer's, as it ends)."""
        passes_Q, episodes_Q = self._passes(rewards_G_F, weights_F, len(rewards_G_F))
        self.pool.record([key], passes_Q, episodes_Q)

    def _passes(
        self, rewards_N_F: torch.Tensor, weights_F: Sequence[float] | torch.Tensor, size: int
    ) -> tuple[list[int], list[int]]:
        """Each group's passing and scored episodes."""
        sums_N = combine_rewards(rewards_N_F.cpu(), weights_F, size)  # weighted raw sum
        scored_Q_G = ~torch.isnan(sums_N).view(-1, size)
        passes_Q_G = scored_Q_G & (sums_N.view(-1, size) >= self.pass_reward)
        return passes_Q_G.sum(dim=1).tolist(), scored_Q_G.sum(dim=1).tolist()

    def metrics(self) -> dict[str, float]:
        """The pool's metrics (`RowPool.metrics`)."""
        return self.pool.metrics()

    def save(self, folder: str | Path) -> None:
        """Write the pool into a checkpoint folder."""
        torch.save(self.pool.state_dict(), Path(folder) / CURRICULUM_FILE)

    def load(self, folder: str | Path) -> bool:
        """Read the pool from a checkpoint folder; False (pool unchanged) when it has none."""
        path = Path(folder) / CURRICULUM_FILE
        if not path.is_file():
            return False
        self.pool.load_state_dict(torch.load(path, weights_only=True))
        return True
