"""Which dataset rows each process plays in each generation round.

A generation round plays `prompts_per_process` rows per process (each `num_generations` times,
so a group never spans processes) and feeds `repeats` micro-batches (`steps_per_generation` x
`num_iterations`). The Trainer pulls one DataLoader batch per micro-batch, so the sampler yields
each process's rows once per micro-batch; the trainer generates on the first and serves the rest
from what it generated.

Order, for a round with processes p0, p1 and two repeats: [p0 rows, p1 rows, p0 rows, p1 rows].
accelerate hands batch k to process k % num_processes, so each process sees its own rows.

With `curriculum`, a training round plays the rows its `Curriculum` draws when it starts
(`curriculum_of`; `agentgrpo.rounds.curriculum`) in place of the sampler's, which then only
count the rounds of an epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from agentgrpo.rounds.curriculum import Curriculum, RowPool
from agentgrpo.rounds.data import (
    adapt_to_iterable_datasets,
    is_iterable_dataset,
    rows_collator,
    without_unused_columns,
)
from agentgrpo.rounds.pipeline import RoundPlan

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig


class RoundSampler(torch.utils.data.Sampler[int]):
    """Yields row indices round by round, as described in the module docstring.

    Args:
        num_rows: Rows in the dataset.
        prompts_per_process: Rows each process plays per round (the DataLoader batch size).
        num_processes: Processes taking part.
        repeats: Micro-batches each round feeds.
        shuffle: Shuffle the rows each epoch (seeded with `seed` and the epoch).
        seed: Seed of the shuffle.
    """

    def __init__(
        self,
        num_rows: int,
        prompts_per_process: int,
        num_processes: int,
        repeats: int,
        shuffle: bool = True,
        seed: int = 0,
    ):
        self.rows_per_round = prompts_per_process * num_processes
        if num_rows < self.rows_per_round:
            raise ValueError(
                f"the dataset has {num_rows} rows but one generation round needs "
                f"{self.rows_per_round} prompts; add rows or lower the generation batch size"
            )
        self.num_rows = num_rows
        self.prompts_per_process = prompts_per_process
        self.num_processes = num_processes
        self.repeats = repeats
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by the Trainer at each epoch, so every epoch has its own order."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.num_rows))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=generator).tolist()
        rounds = self.num_rows // self.rows_per_round  # an incomplete last round is dropped
        for r in range(rounds):
            chunk = order[r * self.rows_per_round : (r + 1) * self.rows_per_round]
            for _ in range(self.repeats):
                yield from chunk

    def __len__(self) -> int:
        return (self.num_rows // self.rows_per_round) * self.rows_per_round * self.repeats


def round_rows_loader(
    dataset: Any, plan: RoundPlan, shuffle: bool, seed: int, num_workers: int = 0
) -> torch.utils.data.DataLoader:
    """Training rows round by round, as `plan` sizes them (a `RoundSampler` under `rows_loader`)."""
    sampler = RoundSampler(
        len(dataset),
        plan.prompts_per_process,
        plan.num_processes,
        plan.repeats,
        shuffle,
        seed,
    )
    return rows_loader(dataset, sampler, num_workers)


def rows_loader(
    dataset: Any, sampler: RoundSampler, num_workers: int = 0
) -> torch.utils.data.DataLoader:
    """A DataLoader handing over each process's rows of a round as a list (not tensorised)."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=sampler.prompts_per_process,
        sampler=sampler,
        collate_fn=rows_collator,
        num_workers=num_workers,
    )


def eval_rows_loader(
    dataset: Any, prompts_per_process: int, num_workers: int = 0
) -> torch.utils.data.DataLoader:
    """Every eval row once, in order, `prompts_per_process` rows a batch; the last may be short.

    As in TRL, an eval set smaller than one eval round, or whose size is not a multiple of it,
    is evaluated whole: the short batch is played like any other (each row still gets its
    `num_generations_eval` episodes, so groups stay whole). With several processes accelerate
    hands batch k to process k % num_processes.
    """
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=prompts_per_process,
        shuffle=False,
        collate_fn=rows_collator,
        num_workers=num_workers,
    )


def stream_loader(dataset: Any, rows_per_batch: int) -> torch.utils.data.DataLoader:
    """A DataLoader reading an iterable dataset in order, `rows_per_batch` rows at a time.

    One worker, so the stream keeps its order; the last batch may be shorter.
    """
    return torch.utils.data.DataLoader(
        dataset, batch_size=rows_per_batch, collate_fn=rows_collator, num_workers=0
    )


def eval_loader(
    dataset: Any, prompts_per_process: int, num_workers: int = 0
) -> torch.utils.data.DataLoader:
    """Every eval row once, in order: `stream_loader` for a stream, else `eval_rows_loader`."""
    if is_iterable_dataset(dataset):  # streamed: no len(), read in order by one worker
        return stream_loader(dataset, prompts_per_process)
    return eval_rows_loader(dataset, prompts_per_process, num_workers)


def training_loader(dataset: Any, plan: RoundPlan, args: GRPOConfig) -> torch.utils.data.DataLoader:
    """A run's training rows round by round (`round_rows_loader`), as `args` reads them.

    Shuffled with `seed` when `shuffle_dataset`; with `remove_unused_columns`, only the columns
    TRL keeps (`without_unused_columns`); `dataloader_num_workers` workers.
    """
    shuffle, workers = bool(args.shuffle_dataset), args.dataloader_num_workers
    rows = without_unused_columns(dataset, args.remove_unused_columns)
    return round_rows_loader(rows, plan, shuffle, args.seed, workers)


def evaluation_loader(
    dataset: Any, plan: RoundPlan, args: GRPOConfig
) -> torch.utils.data.DataLoader:
    """A run's eval rows, every one once (`eval_loader`), `plan.prompts_per_process` a batch.

    A stream first seen here (`evaluate(eval_dataset=...)`) sets `args` up as at init
    (`adapt_to_iterable_datasets`); with `remove_unused_columns`, only the columns TRL keeps.
    """
    if is_iterable_dataset(dataset):
        adapt_to_iterable_datasets(args, None, dataset)
    rows = without_unused_columns(dataset, args.remove_unused_columns)
    return eval_loader(rows, plan.prompts_per_process, args.dataloader_num_workers)


def curriculum_of(args: GRPOConfig, dataset: Any) -> Curriculum | None:
    """The curriculum a run of `args` draws its training rounds' rows with (None without one).

    Args:
        args: The run's config (`curriculum`, `curriculum_floor`, `curriculum_pass_reward`,
            `seed`, `remove_unused_columns`).
        dataset: The training rows as the trainer holds them (map-style).

    Raises:
        ValueError: The rows carry no columns (the environment states its own tasks in
            `reset`): every row is the same, so a row's pass rate says nothing of a task.
    """
    if not args.curriculum:
        return None
    if len(dataset) and not dataset[0]:
        raise ValueError(
            "curriculum=True draws rows by their pass rates, but the training rows have no "
            "columns (the environment states its own tasks in reset()): give a train_dataset "
            "(or an environment dataset()) whose rows name their tasks, or set curriculum=False"
        )
    rows = without_unused_columns(dataset, args.remove_unused_columns)
    pool = RowPool(len(rows), args.curriculum_floor)
    return Curriculum(rows, pool, args.curriculum_pass_reward, args.seed)
