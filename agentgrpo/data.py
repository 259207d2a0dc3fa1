"""Where the task rows come from, and turning a custom `rollout_func`'s output into episodes."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rollout import Episode, EpisodeStats, Finish, RolloutEngine
from rollout.engine import ENVIRONMENT_COLUMN

logger = logging.getLogger(__name__)


def training_rows(
    dataset: Any, environment_factory: Any, rows_needed: int | None
) -> torch.utils.data.Dataset | Sequence[Mapping[str, Any]]:
    """The rows to train on, as a map-style dataset.

    - A `datasets.Dataset` (or any sized dataset of dicts) is used as is.
    - An iterable dataset is read up to `rows_needed` rows (what `max_steps` consumes).
    - No dataset: the environment's `dataset()` if it defines one; else the environment owns
      the tasks (its `reset` states them, TRL's environment-owned data) and each round plays
      prompt-less rows, `rows_needed` of them.

    Raises:
        ValueError: Nothing to train on, an unsized dataset without `max_steps`, or several
            environments without a dataset to route rows to them.
    """
    if dataset is None and isinstance(environment_factory, Mapping):
        raise ValueError(
            "A dict `environment_factory` (several environments) requires a `train_dataset` "
            f"with an {ENVIRONMENT_COLUMN!r} column naming each row's environment; pass such a "
            "dataset, or a single environment factory"
        )
    if dataset is not None:
        if hasattr(dataset, "__len__"):
            return dataset
        if rows_needed is None:
            raise ValueError("an IterableDataset needs max_steps > 0 to know how far to read it")
        return list(itertools.islice(dataset, rows_needed))
    env_class = environment_factory if isinstance(environment_factory, type) else None
    if env_class is not None and hasattr(env_class, "dataset"):
        return env_class.dataset()
    if environment_factory is not None:
        if rows_needed is None:
            raise ValueError(
                "without a train_dataset the environment states the tasks itself, so training "
                "length must come from max_steps: set max_steps > 0"
            )
        return [{} for _ in range(rows_needed)]
    raise ValueError(
        "`train_dataset` is required unless an `environment_factory` is provided (an "
        "environment class with a dataset() classmethod, or one that states its own tasks in "
        "reset() with max_steps > 0)"
    )


def is_iterable_dataset(dataset: Any) -> bool:
    """Whether `dataset` is read as a stream (e.g. `datasets.IterableDataset`): no `len()`."""
    return dataset is not None and not hasattr(dataset, "__len__") and hasattr(dataset, "__iter__")


def adapt_to_iterable_datasets(args: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """Set `args` for iterable datasets as TRL does, in place, before the Trainer reads them.

    With any iterable dataset (train, eval, or one of a dict of eval sets), each process reads
    its own rows: `accelerator_config.dispatch_batches` becomes False. With an iterable train
    set, `dataloader_num_workers` becomes 0 (with a warning), so one reader keeps the stream's
    order.

    Raises:
        ValueError: `dispatch_batches=True` was asked for.
    """
    evals = eval_dataset.values() if isinstance(eval_dataset, Mapping) else [eval_dataset]
    if not any(is_iterable_dataset(d) for d in (train_dataset, *evals)):
        return
    if args.accelerator_config.dispatch_batches:
        raise ValueError(
            "Iterable datasets require `dispatch_batches=False`, and accelerator_config sets it "
            "to True: set it to False (or leave it unset); each process then reads its own rows"
        )
    args.accelerator_config.dispatch_batches = False
    if is_iterable_dataset(train_dataset) and args.dataloader_num_workers != 0:
        logger.warning(
            "Iterable datasets require dataloader_num_workers=0 to keep the stream's order; "
            "overriding dataloader_num_workers=%d",
            args.dataloader_num_workers,
        )
        args.dataloader_num_workers = 0


def check_environment_column(rows: Any, engine: RolloutEngine) -> None:
    """With several environments, fail unless every row names a known one in `environment`.

    Raises:
        ValueError: The column is missing, or names an environment the engine lacks.
    """
    if not engine.multi_environment:
        return
    columns = getattr(rows, "column_names", None)
    if columns is None:
        columns = list(rows[0]) if len(rows) else []
    if ENVIRONMENT_COLUMN not in columns:
        raise ValueError(
            f"A dict `environment_factory` (several environments) requires a `train_dataset` "
            f"with an {ENVIRONMENT_COLUMN!r} column naming each row's environment (one of "
            f"{list(engine.contexts)}); its columns are {columns}"
        )
    if hasattr(rows, "column_names"):
        names = list(rows[ENVIRONMENT_COLUMN])
    else:
        names = [row.get(ENVIRONMENT_COLUMN) for row in rows]
    for name in dict.fromkeys(names):
        engine.context_for({ENVIRONMENT_COLUMN: name})


def rows_collator(rows: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The DataLoader hands the trainer the rows themselves: they are played, not tensorised."""
    return rows


def episodes_from_rollout_func(
    output: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    num_generations: int,
    eos_token_ids: set[int],
    decode: Callable[[list[int]], str],
) -> list[Episode]:
    """Episodes from a TRL-style `rollout_func` result (one entry per completion).

    `output` has `prompt_ids`, `completion_ids` and `logprobs` lists, optionally `env_mask`
    (1 where the policy sampled the token, 0 where the environment added it); every other key
    is a per-completion value handed to the reward functions as a column.
    """
    required = {"prompt_ids", "completion_ids", "logprobs"}
    if missing := sorted(required - output.keys()):
        raise ValueError(f"rollout_func must return the keys {missing} in its dict")
    expected = len(rows) * num_generations
    count = len(output["completion_ids"])
    if count != expected:
        raise ValueError(
            f"rollout_func returned {count} completions for {len(rows)} prompts; it must "
            f"return num_generations={num_generations} per prompt ({expected})"
        )
    extras = {k: v for k, v in output.items() if k not in required and k != "env_mask"}
    masks = output.get("env_mask") or [[1] * len(ids) for ids in output["completion_ids"]]
    episodes = []
    for i in range(count):
        row = {**rows[i // num_generations], **{k: v[i] for k, v in extras.items()}}
        episodes.append(_episode(output, masks[i], row, i, num_generations, eos_token_ids, decode))
    return episodes


def _episode(output, mask, row, i, num_generations, eos_token_ids, decode) -> Episode:
    ids = list(output["completion_ids"][i])
    logprobs = [lp if m else 0.0 for lp, m in zip(output["logprobs"][i], mask, strict=True)]
    prompt = row.get("prompt")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    messages.append({"role": "assistant", "content": decode(ids)})
    stopped = bool(ids) and ids[-1] in eos_token_ids
    return Episode(
        prompt_ids=list(output["prompt_ids"][i]),
        completion_ids=ids,
        loss_mask=list(mask),
        sampler_logprobs=logprobs,
        messages=messages,
        finish=Finish.STOP if stopped else Finish.LENGTH,
        stats=EpisodeStats(turns=1, tool_calls=0, tool_errors={}),
        row=row,
        group=i // num_generations,
        index=i,
    )
