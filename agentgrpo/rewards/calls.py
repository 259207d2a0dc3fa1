"""Calling user reward functions the way TRL's GRPOTrainer does, with loud user errors.

The calling convention. Each reward function is called once per batch of N completions (in
training, a group: the G completions of one task, scored the moment its last episode ends, where
TRL calls it once with the whole generation batch), with keyword arguments:

- ``prompts``, ``completions``, ``completion_ids``: one entry per completion (text or message
  lists; token ids); ``completions_ids`` is the same list as ``completion_ids``;
- every dataset column except ``prompt``, as a list with one entry per completion;
- ``trainer_state``, ``log_extra(column, values)``, ``log_metric(name, value)``;
- ``environments`` (one environment instance per completion), only when the batch has them.

A function receives only the arguments it names (verifiers style: ``def f(completions,
answer)``), or all of them when it takes ``**kwargs`` (TRL style). A parameter named
``responses`` receives the completions (the name Unsloth-style cards use), unless a dataset
column has that name. A named parameter that is not
available and has no default is a user error (`ValueError`). It returns a list (or tuple, or a
1-D numpy array or torch tensor) with one float per completion, or None where the reward does
not apply to that sample; None becomes NaN in the reward matrix. ``async def`` functions are
awaited; sync ones run in worker threads, so all the functions of a batch run concurrently.

Failures the user caused stop the run with `RewardFunctionError`, naming the function and the
row: a function that raises (to name the row, it is called again on one completion at a time,
with the loggers switched off, until one raises), returns something other than a list, returns
the wrong number of rewards, or returns a value that is not a finite number for some sample.
A reward that fails is never scored 0.0: that would train on a wrong signal.

Reward models (`reward_models`): a ``transformers`` sequence-classification model, or a path or
hub id to load one, is wrapped into a reward function.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch

from agentgrpo.rewards import reward_models

_SHOWN_CHARS = 60  # per row value, in error messages
_SHOWN_COMPLETION_CHARS = 200

#: The arguments every reward function may name, besides the dataset columns.
TRAINER_ARGUMENTS = (
    "prompts",
    "completions",
    "completion_ids",
    "completions_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
    "environments",
)

#: Dataset columns no reward function receives, as in TRL 1.16 (a ``completion`` column, as in
#: trl-lib/tldr, is the reference answer of supervised data; ``completion_ids`` is the trainer's).
UNPASSED_COLUMNS = ("prompt", "completion", "completion_ids")

#: Trainer arguments that would take a column's place; the trainer's own (TRL's) are the rest.
_COLUMN_CLASHES = ("prompts", "completions")


# Parameter names filled from another argument when nothing has their own name.
_ALIASES = {"responses": "completions"}


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something that is not one reward per completion."""


class RewardCountError(RewardFunctionError, ValueError):
    """A reward function returned more or fewer rewards than completions (TRL: a ValueError)."""


@dataclass(frozen=True)
class RewardFunction:
    """A reward function and the name its rewards are logged under (unique in a trainer).

    Attributes:
        name: The reward's column and metric name.
        fn: The function called with the batch's arguments.
        processing_class: The tokenizer of a reward model; None for plain functions.
        source: What the trainer was given: the function, or the sequence-classification
            model that `fn` wraps (None: `fn` itself).
    """

    name: str
    fn: Callable[..., Any]
    processing_class: Any = None
    source: Any = None


def _ignore(*args: Any) -> None:
    """The default `log_extra` / `log_metric`: drop what is logged."""


@dataclass(frozen=True)
class RewardBatch:
    """The N completions one `score` call rates, and everything a reward function may ask for.

    Attributes:
        prompts: One prompt per completion (text, or a list of messages).
        completions: One completion per completion slot (text, or a list of messages).
        completion_ids: The completion's token ids, one list per completion.
        rows: The dataset row each completion answers (shown in error messages).
        columns: Column name to one value per completion, passed as keyword arguments. None
            (the default) takes every column of `rows` but `UNPASSED_COLUMNS`; a row lacking a
            column gives None there. A column named like one of the trainer's own arguments
            (``trainer_state``, ``log_extra``, ``log_metric``, ``environments``) gives way to
            it, as in TRL.
        environments: One environment instance per completion, or None when there are none
            (then ``environments`` is not an argument functions may name).
        trainer_state: The trainer's state (``transformers.TrainerState``), passed as is.
        log_extra: ``log_extra(column, values)``: log a column of N values beside the samples.
        log_metric: ``log_metric(name, value)``: log a scalar metric for this step.

    Raises:
        ValueError: The lengths disagree, or a column is named ``prompts`` or ``completions``.

    """

    prompts: Sequence[Any]
    completions: Sequence[Any]
    completion_ids: Sequence[Sequence[int]]
    rows: Sequence[Mapping[str, Any]]
    columns: Mapping[str, Sequence[Any]] | None = None
    environments: Sequence[Any] | None = None
    trainer_state: Any = None
    log_extra: Callable[[str, list[Any]], None] = _ignore
    log_metric: Callable[[str, float], None] = _ignore

    def __post_init__(self) -> None:
        if self.columns is None:
            keys = (key for row in self.rows for key in row if key not in UNPASSED_COLUMNS)
            names = dict.fromkeys(keys)
            columns = {name: [row.get(name) for row in self.rows] for name in names}
            object.__setattr__(self, "columns", columns)
        n = len(self.completions)
        lengths = {"prompts": len(self.prompts), "completion_ids": len(self.completion_ids)}
        lengths["rows"] = len(self.rows)
        lengths |= {f"column {name!r}": len(v) for name, v in self._columns.items()}
        if self.environments is not None:
            lengths["environments"] = len(self.environments)
        wrong = {what: length for what, length in lengths.items() if length != n}
        if wrong:
            raise ValueError(f"RewardBatch has {n} completions but lengths {wrong}")
        clashes = sorted(set(self._columns) & set(_COLUMN_CLASHES))
        if clashes:
            raise ValueError(
                f"dataset columns {clashes} have the names of reward function arguments the "
                "trainer passes; rename the columns"
            )

    @property
    def _columns(self) -> Mapping[str, Sequence[Any]]:
        assert self.columns is not None  # set in __post_init__
        return self.columns

    def __len__(self) -> int:
        return len(self.completions)

    def keyword_arguments(self) -> dict[str, Any]:
        """Every argument a reward function may name, each list a fresh copy."""
        completion_ids = list(self.completion_ids)
        arguments = {
            "prompts": list(self.prompts),
            "completions": list(self.completions),
            "completion_ids": completion_ids,
            # An alias: TRL's documentation names the argument `completions_ids` (its custom
            # reward function Example 1) while its trainer passes `completion_ids`; offering
            # both lets the documented code run unchanged.
            "completions_ids": completion_ids,
            **{name: list(values) for name, values in self._columns.items()},
            "trainer_state": self.trainer_state,
            "log_extra": self.log_extra,
            "log_metric": self.log_metric,
        }
        if self.environments is not None:
            arguments["environments"] = list(self.environments)
        return arguments

    def select(self, indices: Sequence[int]) -> RewardBatch:
        """The sub-batch of the completions at `indices`."""

        def pick(values: Sequence[Any]) -> list[Any]:
            return [values[i] for i in indices]

        return dataclasses.replace(
            self,
            prompts=pick(self.prompts),
            completions=pick(self.completions),
            completion_ids=pick(self.completion_ids),
            rows=pick(self.rows),
            columns={name: pick(values) for name, values in self._columns.items()},
            environments=None if self.environments is None else pick(self.environments),
        )


async def score(funcs: Sequence[RewardFunction], batch: RewardBatch) -> torch.Tensor:
    """Run every reward function on the batch, concurrently, and collect their rewards.

    Args:
        funcs: The reward functions, from `reward_functions`.
        batch: The completions to score and the arguments the functions may name.

    Returns:
        ``rewards_N_F``: float32, one row per completion and one column per function, in the
        order of `funcs`; NaN where a function returned None (not applicable).

    Raises:
        ValueError: A function names a parameter that is not available (before any runs).
        RewardFunctionError: A function raised or returned something other than one finite
            number (or None) per completion; the first such function in `funcs` order is
            reported, with the offending row.

    """
    calls = [(func, _arguments_for(func, batch.keyword_arguments())) for func in funcs]
    outcomes: list[Any] = [None] * len(calls)

    async def run(k: int) -> None:
        func, kwargs = calls[k]
        try:
            outcomes[k] = await _call(func.fn, kwargs)
        except Exception as error:
            outcomes[k] = _Raised(error)

    async with anyio.create_task_group() as group:
        for k in range(len(calls)):
            group.start_soon(run, k)

    rewards_F_N = []
    for func, outcome in zip(funcs, outcomes, strict=True):
        if isinstance(outcome, _Raised):
            raise await _raised_error(func, batch, outcome.error) from outcome.error
        rewards_F_N.append(_checked_rewards(func, outcome, batch))
    if not rewards_F_N:
        return torch.empty(len(batch), 0)
    return torch.tensor(rewards_F_N, dtype=torch.float32).T.contiguous()


def check_arguments(funcs: Sequence[RewardFunction], available: Collection[str]) -> None:
    """Fail early if a function names a parameter that will not be available.

    Args:
        funcs: The reward functions.
        available: The argument names the trainer will pass: `TRAINER_ARGUMENTS` (without
            ``environments`` when there are none) and the dataset columns but `UNPASSED_COLUMNS`.

    Raises:
        ValueError: Naming the function, the parameter and the available names.

    """
    placeholder = dict.fromkeys(available)
    for func in funcs:
        _arguments_for(func, placeholder)


def reward_functions(
    funcs: Any,
    processing_classes: Any = None,
    model_kwargs: dict[str, Any] | None = None,
    device: Any = None,
) -> list[RewardFunction]:
    """Turn what a user passes as ``reward_funcs`` into named reward functions.

    Args:
        funcs: One, or a list, of: callables (named by ``__name__``, or the class name of a
            callable object); `RewardFunction`s (kept as they are); sequence-classification
            reward models, as a ``transformers.PreTrainedModel`` or a path/hub id (loaded with
            ``AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)``), named
            by the last component of ``config._name_or_path`` (the class name if empty).
        processing_classes: None, or one tokenizer per entry of `funcs` (by position; None
            entries allowed, and entries for callables are ignored). A reward model without one
            loads ``AutoTokenizer.from_pretrained(config._name_or_path)``.
        model_kwargs: ``from_pretrained`` arguments for reward models given by path (the
            trainer passes ``model_init_kwargs`` and ``trust_remote_code``); their tokenizers
            get its ``trust_remote_code`` and ``revision``.
        device: Where reward models go (the trainer passes the run's device, as TRL places
            them); None leaves them where they are. One spread over devices stays spread.

    Returns:
        One `RewardFunction` per entry; a repeated name gets a suffix (``f``, ``f_2``, ...).

    Raises:
        TypeError: An entry is neither callable, a model, nor a str.
        ValueError: `processing_classes` does not match `funcs` in length, or a reward model's
            tokenizer cannot be found.

    Examples:
        >>> def correct(completions, answer):
        ...     return [float(c == a) for c, a in zip(completions, answer)]
        >>> [f.name for f in reward_functions([correct, correct, len])]
        ['correct', 'correct_2', 'len']

    """
    funcs = list(funcs) if isinstance(funcs, list | tuple) else [funcs]
    if processing_classes is None:
        processing_classes = [None] * len(funcs)
    elif not isinstance(processing_classes, list | tuple):
        processing_classes = [processing_classes]
    if len(processing_classes) != len(funcs):
        raise ValueError(
            f"The number of reward processing classes ({len(processing_classes)}) must match "
            f"the number of reward functions ({len(funcs)}). Give one per reward function, by "
            "position (None for plain functions)."
        )
    kwargs = model_kwargs or {}
    named = [_named(f, pc, kwargs) for f, pc in zip(funcs, processing_classes, strict=True)]
    for func in named:
        if device is not None and isinstance(func.fn, reward_models.SequenceClassifierReward):
            func.fn.to(device)
    seen: set[str] = set()
    unique = []
    for func in named:
        name, k = func.name, 1
        while name in seen:
            k += 1
            name = f"{func.name}_{k}"
        seen.add(name)
        unique.append(dataclasses.replace(func, name=name))
    return unique


# --- calling ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Raised:
    error: Exception


async def _call(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Await an async function; run a sync one in a worker thread."""
    # The second test catches callable objects whose class defines `async def __call__`.
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        return await fn(**kwargs)
    value = await anyio.to_thread.run_sync(functools.partial(fn, **kwargs))
    if inspect.isawaitable(value):  # e.g. a lambda or partial around an async function
        value = await value
    return value


def _arguments_for(func: RewardFunction, available: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments `func` asks for: the ones it names, or all with ``**kwargs``."""
    try:
        parameters = list(inspect.signature(func.fn).parameters.values())
    except (TypeError, ValueError):  # no introspectable signature: pass everything
        return dict(available)
    chosen = {}
    for p in parameters:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        by_keyword = p.kind is not inspect.Parameter.POSITIONAL_ONLY
        alias = _ALIASES.get(p.name, p.name)
        if by_keyword and p.name in available:
            chosen[p.name] = available[p.name]
        elif by_keyword and alias in available:
            chosen[p.name] = available[alias]
        elif p.default is p.empty:
            how = "is not available" if by_keyword else "is positional-only"
            raise ValueError(
                f"reward function {func.name!r} has a parameter {p.name!r} that {how}: reward "
                f"arguments are passed by keyword, and the available ones are "
                f"{', '.join(available)}. Rename the parameter, give it a default, or add the "
                "dataset column."
            )
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return {**available, **chosen}  # TRL style: everything, and the aliases it names
    return chosen


# --- checking what came back --------------------------------------------------------------


def _checked_rewards(func: RewardFunction, value: Any, batch: RewardBatch) -> list[float]:
    """The function's rewards as floats (NaN for None), or a loud error saying what is wrong."""
    n = len(batch)
    first_row = _show_row(batch.rows[0]) if n else "{}"
    if not isinstance(value, list | tuple) and hasattr(value, "tolist"):
        value = value.tolist()  # a 1-D numpy array or torch tensor, as TRL takes them
    if not isinstance(value, list | tuple):
        raise RewardFunctionError(
            f"reward function {func.name!r} returned {type(value).__name__}; it must return a "
            f"list (or a 1-D array) with one float (or None) per completion. First row: "
            f"{first_row}"
        )
    if len(value) != n:
        raise RewardCountError(
            f"The reward function {func.name!r} returned {len(value)} rewards, but {n} were "
            "expected (one per prompt-completion pair). Make sure the reward function returns "
            f"exactly one reward per completion (None where it does not apply). First row: "
            f"{first_row}"
        )
    return [_checked_reward(func, value[i], batch, i) for i in range(n)]


def _checked_reward(func: RewardFunction, value: Any, batch: RewardBatch, i: int) -> float:
    """One reward as a float: None is NaN, bool is 0/1; a string, NaN or inf is an error."""
    if value is None:
        return math.nan
    number = None
    if not isinstance(value, str | bytes) and hasattr(value, "__float__"):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
    if number is not None and math.isfinite(number):
        return number
    what = "not a number" if number is None else "not finite"
    raise RewardFunctionError(
        f"reward function {func.name!r} returned {_short(value, _SHOWN_CHARS)} "
        f"({type(value).__name__}, {what}) for completion {i} of {len(batch)}; a reward must be "
        "a finite float, or None where it does not apply. "
        f"Row: {_show_row(batch.rows[i])}. "
        f"Completion: {_short(batch.completions[i], _SHOWN_COMPLETION_CHARS)}"
    )


async def _raised_error(
    func: RewardFunction, batch: RewardBatch, error: Exception
) -> RewardFunctionError:
    """Describe the exception, with the first row that raises on its own if there is one."""
    what = f"reward function {func.name!r} raised {type(error).__name__}: {error}"
    i = await _first_failing_row(func, batch)
    if i is None:
        return RewardFunctionError(
            f"{what} (on the batch of {len(batch)} completions; no single completion raises "
            f"alone). First row: {_show_row(batch.rows[0]) if len(batch) else '{}'}"
        )
    return RewardFunctionError(
        f"{what} (completion {i} of {len(batch)} raises alone). Row: {_show_row(batch.rows[i])}. "
        f"Completion: {_short(batch.completions[i], _SHOWN_COMPLETION_CHARS)}"
    )


async def _first_failing_row(func: RewardFunction, batch: RewardBatch) -> int | None:
    """Call `func` on one completion at a time, loggers off; the first index that raises."""
    quiet = dataclasses.replace(batch, log_extra=_ignore, log_metric=_ignore)
    for i in range(len(batch)):
        kwargs = _arguments_for(func, quiet.select([i]).keyword_arguments())
        try:
            await _call(func.fn, kwargs)
        except Exception:
            return i
    return None


def _short(value: Any, limit: int) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show_row(row: Mapping[str, Any]) -> str:
    """The row as ``{column: repr}``, each value cut to a readable length."""
    return "{" + ", ".join(f"{k!r}: {_short(v, _SHOWN_CHARS)}" for k, v in row.items()) + "}"


# --- naming -----------------------------------------------------------------------------


def _named(func: Any, processing_class: Any, model_kwargs: dict[str, Any]) -> RewardFunction:
    if isinstance(func, RewardFunction):
        return func
    if isinstance(func, str) or reward_models.is_reward_model(func):
        scorer = reward_models.SequenceClassifierReward.of(func, processing_class, model_kwargs)
        return RewardFunction(scorer.name, scorer, scorer.tokenizer, source=scorer.model)
    if not callable(func):
        raise TypeError(
            f"a reward function must be a callable, a sequence-classification model or a model "
            f"path, not {type(func).__name__}"
        )
    inner = func.func if isinstance(func, functools.partial) else func
    name = getattr(inner, "__name__", None) or type(inner).__name__
    return RewardFunction(name, func)


def check_trainer_arguments(
    funcs: Sequence[RewardFunction], dataset: Any, with_environments: bool
) -> None:
    """`check_arguments` against what the trainer passes: its arguments and `dataset`'s columns.

    Args:
        funcs: The reward functions.
        dataset: The training rows; every column but `UNPASSED_COLUMNS` becomes an argument.
        with_environments: Episodes have environments, so ``environments`` is passed.
    """
    names = getattr(dataset, "column_names", None)
    if names is None:
        names = list(dataset[0]) if len(dataset) else []
    available = [a for a in TRAINER_ARGUMENTS if with_environments or a != "environments"]
    check_arguments(funcs, available + [name for name in names if name not in UNPASSED_COLUMNS])
