"""Where the task rows come from, and turning a custom `rollout_func`'s output into episodes."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from rollout import Episode, EpisodeRow, EpisodeStats, Finish, RolloutEngine
from rollout.engine import ENVIRONMENT_COLUMN

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig

logger = logging.getLogger(__name__)


def training_rows(
    dataset: Any, environment_factory: Any, rows_needed: int | None, shuffle_seed: int | None
) -> torch.utils.data.Dataset | Sequence[Mapping[str, Any]]:
    """The rows to train on, as a map-style dataset.

    - A `datasets.Dataset` (or any sized dataset of dicts) is used as is.
    - An iterable dataset is read up to `rows_needed` rows (what `max_steps` consumes). With a
      `shuffle_seed` (`shuffle_dataset`), one with a `shuffle` method (`datasets.
      IterableDataset`) is read through its buffered shuffle of that seed, as TRL reads it,
      rather than from the head of the stream in order.
    - No dataset: the environment's `dataset()` if it defines one; else the environment owns
      the tasks (its `reset` states them, TRL's environment-owned data) and each round plays
      prompt-less rows, `rows_needed` of them.

    Raises:
        ValueError: Nothing to train on, an unsized dataset without `max_steps`, or several
            environments without a dataset to route rows to them.
    """
    if dataset is None and isinstance(environment_factory, Mapping):
        raise ValueError(
            "A `dict` `environment_factory` (multiple environments) requires a `train_dataset` "
            "with an `environment` column to route each example to its environment. Provide a "
            "dataset, or pass a single environment factory."
        )
    if dataset is not None:
        if hasattr(dataset, "__len__"):
            return dataset
        if rows_needed is None:
            raise ValueError("an IterableDataset needs max_steps > 0 to know how far to read it")
        if shuffle_seed is not None and hasattr(dataset, "shuffle"):
            dataset = dataset.shuffle(seed=shuffle_seed)
        return list(itertools.islice(dataset, rows_needed))
    env_class = environment_factory if isinstance(environment_factory, type) else None
    if env_class is not None and hasattr(env_class, "dataset"):
        return env_class.dataset()
    if environment_factory is not None:
        if rows_needed is None:
            raise ValueError(
                "When training without a `train_dataset` (the environment owns the data and "
                "returns the prompt from `reset()`), `max_steps` must be set to a positive value "
                "to define the training length. Set it via `GRPOConfig(max_steps=...)`."
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


def adapt_to_iterable_datasets(args: GRPOConfig, train_dataset: Any, eval_dataset: Any) -> None:
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
    # TrainingArguments made it an AcceleratorConfig (transformers annotates the input's types)
    if args.accelerator_config.dispatch_batches:  # type: ignore[union-attr]
        raise ValueError(
            "Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
            "`accelerator_config`. Please set it to `False` (or leave it unset): each process "
            "then reads its own rows."
        )
    args.accelerator_config.dispatch_batches = False  # type: ignore[union-attr]
    if is_iterable_dataset(train_dataset) and args.dataloader_num_workers != 0:
        logger.warning(
            "Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; "
            "overriding the provided value (%d).",
            args.dataloader_num_workers,
        )
        args.dataloader_num_workers = 0


def check_environment_column(rows: Any, engine: RolloutEngine) -> None:
    """With several environments, fail unless every row names a known one in `environment`.

    Raises:
        ValueError: A row names no environment or one the engine lacks (TRL's message, which
            `RolloutEngine.context_for` raises).
    """
    if not engine.multi_environment:
        return
    columns = getattr(rows, "column_names", None)
    if columns is not None:  # a datasets.Dataset: read the one column
        if ENVIRONMENT_COLUMN not in columns:
            engine.context_for({name: None for name in columns})
            return
        names = list(rows[ENVIRONMENT_COLUMN])
    else:
        names = [row.get(ENVIRONMENT_COLUMN) for row in rows]
    for name in dict.fromkeys(names):
        engine.context_for({ENVIRONMENT_COLUMN: name})


def without_unused_columns(dataset: Any, remove: bool) -> Any:
    """`dataset` with only `prompt`, `image` and `images` when `remove` (`remove_unused_columns`).

    TRL's GRPOTrainer keeps those columns when the option is True, so reward functions and
    environments see no other. A set without column names (a list of rows, a stream of unknown
    features) comes back as it is.
    """
    columns = getattr(dataset, "column_names", None)
    if not remove or not columns:
        return dataset
    return dataset.select_columns([c for c in columns if c in ("prompt", "image", "images")])


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
    """Episodes from a TRL-style `rollout_func` result.

    `output` answers `rollout_func(prompts, trainer)`, whose `prompts` held each of `rows`'
    prompts `num_generations` times in a row (as TRL 1.16 passes them). It has `prompt_ids`,
    `completion_ids` and `logprobs` lists with one entry per training row, optionally
    `env_mask` (1 where the policy sampled the token, 0 where the environment added it).
    Without `episode_ids`, each entry is one episode (TRL's format): entry i is completion
    i % num_generations of prompt i // num_generations. With `episode_ids` (one
    hashable id per entry), entries with equal ids are the rows of one episode, in entry order,
    sharing its reward and advantage (for an agent whose history rewrite forced a new row);
    episodes are numbered by their first entry and there must be num_generations per prompt.
    Every other key is a per-entry value handed to the reward functions as a column; an episode
    gets its first entry's value.

    Raises:
        ValueError: A required key is missing, or the count of episodes is not
            num_generations per prompt.
    """
    required = {"prompt_ids", "completion_ids", "logprobs"}
    if missing := sorted(required - output.keys()):
        raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
    entries = len(output["completion_ids"])
    groups = _entries_by_episode(output.get("episode_ids"), entries)
    expected = len(rows) * num_generations
    if len(groups) != expected:
        raise ValueError(
            f"rollout_func returned {len(groups)} episodes for {len(rows)} prompts; it must "
            f"return num_generations={num_generations} per prompt ({expected})"
        )
    skip = {*required, "env_mask", "episode_ids"}
    extras = {k: v for k, v in output.items() if k not in skip}
    masks = output.get("env_mask") or [[1] * len(ids) for ids in output["completion_ids"]]
    episodes = []
    for i, group in enumerate(groups):
        row = {**rows[i // num_generations], **{k: v[group[0]] for k, v in extras.items()}}
        episode_rows = tuple(_row(output, masks[e], e) for e in group)
        episodes.append(_episode(episode_rows, row, i, num_generations, eos_token_ids, decode))
    return episodes


def _entries_by_episode(episode_ids: Sequence[Any] | None, entries: int) -> list[list[int]]:
    """The entries of each episode, episodes in the order of their first entry."""
    if episode_ids is None:
        return [[i] for i in range(entries)]
    if len(episode_ids) != entries:
        raise ValueError(
            f"rollout_func returned {len(episode_ids)} episode_ids for {entries} completions; "
            "give one per completion"
        )
    groups: dict[Any, list[int]] = {}
    for i, episode in enumerate(episode_ids):
        groups.setdefault(episode, []).append(i)
    return list(groups.values())


def _row(output: Mapping[str, Any], mask: Sequence[int], i: int) -> EpisodeRow:
    logprobs = [lp if m else 0.0 for lp, m in zip(output["logprobs"][i], mask, strict=True)]
    return EpisodeRow(
        list(output["prompt_ids"][i]), list(output["completion_ids"][i]), list(mask), logprobs
    )


def _episode(rows, row, i, num_generations, eos_token_ids, decode) -> Episode:
    prompt = row.get("prompt")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    messages += [{"role": "assistant", "content": decode(r.completion_ids)} for r in rows]
    last = rows[-1].completion_ids
    stopped = bool(last) and last[-1] in eos_token_ids
    return Episode(
        rows=rows,
        messages=messages,
        finish=Finish.STOP if stopped else Finish.LENGTH,
        stats=EpisodeStats(turns=len(rows), tool_calls=0, tool_errors={}),
        row=row,
        group=i // num_generations,
        index=i,
    )
