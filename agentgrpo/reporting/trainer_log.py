"""What the trainer logs between two logs: metric values per mode, and the latest round's views.

`TrainerLog` queues metric values ("train" or "eval") until the Trainer's next `log`, which takes
their means, and keeps the latest round's episodes, episode records and completions table. The
distributed steps (gathers) come in as functions, so it runs on CPU without a Trainer.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace

import torch

from agentgrpo.config import GRPOConfig
from agentgrpo.learner.loss_metrics import reduce_over_processes
from agentgrpo.reporting.completions import CompletionsTable, log_to_integrations, print_table
from agentgrpo.reporting.metrics import RewardLayout
from agentgrpo.reporting.round_report import (
    GatherObjects,
    completions_table,
    episode_records,
    gathered_metrics,
    logged_metrics,
)
from agentgrpo.rounds.pipeline import Gather, Round
from agentgrpo.rounds.scoring import Scorer
from rollout import Episode, EpisodeRecord


class TrainerLog:
    """Metric values queued for the next log, and the latest round's episodes and tables.

    Args:
        gather: Gathers tensors across processes (`rounds.pipeline.Gather`).
        gather_objects: Gathers lists across processes.
        process_index: This process's index, recorded in its episode records.
        with_completions: Keep each round's completions table (`log_completions`).

    Attributes:
        metrics: Mode ("train" or "eval") to metric name to the values since the last log.
        episodes: The latest round's episodes on this process, each with its combined reward.
        records: The latest training round's episode records on this process.
        completions: The latest round's completions table, or None.
    """

    def __init__(
        self,
        gather: Gather,
        gather_objects: GatherObjects,
        process_index: int = 0,
        with_completions: bool = False,
    ) -> None:
        self.gather, self.gather_objects = gather, gather_objects
        self.process_index, self.with_completions = process_index, with_completions
        self.metrics: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.episodes: list[tuple[Episode, float]] = []
        self.records: list[EpisodeRecord] = []
        self.completions: CompletionsTable | None = None
        self.round_step = -1  # the global step the latest training round was assembled at

    def add(self, mode: str, metrics: Mapping[str, float]) -> None:
        """Queue metric values for the next log of `mode` ("train" or "eval")."""
        for name, value in metrics.items():
            self.metrics[mode][name].append(value)

    def add_reduced(self, mode: str, metrics: Mapping[str, torch.Tensor]) -> None:
        """Queue each scalar metric reduced over the processes (one gather for all of them).

        See `loss_metrics.reduce_over_processes`: `*_min` the minimum, `*_max` the maximum.
        """
        names = sorted(metrics)
        local_1_M = torch.stack([metrics[n].float().reshape(()) for n in names]).unsqueeze(0)
        values_M = reduce_over_processes(names, self.gather(local_1_M))
        self.add(mode, dict(zip(names, values_M, strict=True)))

    def take_means(self, mode: str) -> dict[str, float | None]:
        """Each queued metric's mean, NaN values left out (None when all were NaN); then clear."""
        means: dict[str, float | None] = {}
        for name, values in self.metrics[mode].items():
            valid = [v for v in values if not math.isnan(v)]
            means[name] = sum(valid) / len(valid) if valid else None
        self.metrics[mode].clear()
        return means

    def record_round(
        self,
        round_: Round,
        mode: str,
        scorer: Scorer,
        layout: RewardLayout,
        tokens_seen: int,
        step: int,
        versions: list[int] | None = None,
    ) -> int:
        """Queue the round's metrics; keep its episodes, records and completions table.

        The metrics include those reward functions logged with `log_metric` during the round.
        `tokens_seen` is the run's training tokens before the round, `step` the global step the
        round was played at, `versions` the step of the weights that started each episode when
        older weights played them (an asynchronous round; None: `step` for every episode).
        Returns the training tokens seen after it (a training round adds its tokens over every
        process; an evaluation round adds none).
        """
        gather, gather_objects = self.gather, self.gather_objects
        metrics = gathered_metrics(round_, gather, layout)
        round_tokens = int(metrics.pop("num_tokens_round"))
        if mode == "train":
            tokens_seen += round_tokens
        logs, names, size = scorer.logs, scorer.names, layout.num_generations
        self.add(mode, metrics | logged_metrics(logs.take_metrics(), gather, gather_objects))
        # As TRL: the training tokens seen so far, in eval logs too; the latest value, not a mean.
        self.metrics[mode]["num_tokens"] = [float(tokens_seen)]
        extra = logs.take_extra(len(round_.episodes) // size, size)
        if self.with_completions:
            views = [scorer.views(episode) for episode in round_.episodes]
            self.completions = completions_table(round_, views, names, extra, gather_objects, step)
        self.episodes = list(zip(round_.episodes, round_.rewards_N.tolist(), strict=True))
        if mode == "train":
            played_by = step if versions is None else versions
            self.records = episode_records(round_, names, played_by, self.process_index)
            self.round_step = step
        return tokens_seen

    def add_means(self, logs: dict[str, float]) -> str:
        """Add the means of the values queued since the last log to `logs`, under TRL's names.

        The mode is "eval" when `logs` holds an `eval_` key, else "train". Each metric is the
        mean of its values, NaN values left out (None when every value was NaN, e.g. a reward
        function that returned None throughout). Returns the mode's key prefix: "eval_" or "".
        """
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        prefix = "eval_" if mode == "eval" else ""
        for name, mean in self.take_means(mode).items():
            logs[prefix + name] = mean  # type: ignore[assignment]  # None: every value was NaN
        return prefix

    def show_completions(self, step: int, args: GRPOConfig) -> None:
        """Print the latest round's completions table and log it to `report_to`'s integrations.

        Its `step` column is set to `step`; nothing without a table (`log_completions` off).
        """
        if self.completions is None:
            return
        table = replace(self.completions, step=step)
        print_table(table, args.num_completions_to_print)
        log_to_integrations(table, args.report_to, args.log_unique_prompts)
