"""Where the task rows come from, and turning a custom `rollout_func`'s output into episodes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rollout import Episode, EpisodeStats, Finish


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
        ValueError: Nothing to train on, or an unsized dataset without `max_steps`.
    """
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
        "GRPOTrainer needs a train_dataset (or an environment_factory whose environment has "
        "a dataset() classmethod or states its own tasks in reset())"
    )


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
