"""What a command line names, made real: the environment, the model, the rows, the rewards.

Each function turns one user-typed string into an object or raises `UsageError` (or the
environment layer's `EnvironmentSpecError`) with a message that says what to fix.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agentgrpo.cli.options import UsageError
from environments import check_environment, resolve_environment
from environments.contract import episode_limits
from environments.loading import load_attribute
from tools.threads import describe_error

_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
DEFAULT_MODEL = "the embedded SmolLM2-135M-Instruct"
_MODEL_FILES = ("config.json", "adapter_config.json")  # a model, or a PEFT adapter on one


AGENT_PREFIX = "agent:"
VERIFIERS_PREFIX = "vf:"


def environment_class(spec: str) -> type:
    """The environment class `spec` names, checked against the contract."""
    cls = resolve_environment(spec)
    check_environment(cls)
    return cls


def task_source(spec: str, env_args: dict[str, Any] | None = None) -> Any:
    """What `run` and `eval` play: an `Agent` for `agent:...` and `vf:...`, else a class.

    Raises:
        UsageError: `env_args` (`--env-args`) for a source other than `vf:`.
    """
    if env_args is not None and not spec.startswith(VERIFIERS_PREFIX):
        raise UsageError(
            f"--env-args configures a verifiers environment (vf:ENV_ID), not {spec}; leave it "
            f"out (a gymnasium id takes its arguments as gym:ENV_ID,key=value)"
        )
    if spec.startswith(AGENT_PREFIX):
        return agent(spec.removeprefix(AGENT_PREFIX))
    if spec.startswith(VERIFIERS_PREFIX):
        return verifiers_environment(spec.removeprefix(VERIFIERS_PREFIX), env_args)
    return environment_class(spec)


def verifiers_environment(env_id: str, env_args: dict[str, Any] | None) -> Any:
    """The `Agent` playing installed verifiers environment `env_id` (`agents.verifiers_env`).

    Raises:
        UsageError: No id after `vf:`.
        VerifiersEnvError: verifiers is missing, or the environment cannot be loaded as asked.
    """
    from rollout.agents.verifiers_env import verifiers_agent

    if not env_id:
        raise UsageError("vf: needs the environment's id: vf:ENV_ID (its taskset's id)")
    return verifiers_agent(env_id, env_args)


def env_args(value: Any) -> dict[str, Any] | None:
    """`--env-args` (JSON text, or a config file's mapping) as a dict; None stays None.

    Raises:
        UsageError: Text that is not JSON, or JSON that is not an object.
    """
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as error:
        raise UsageError(
            f"--env-args takes a JSON object (verifiers' env config), not {value!r}: {error}"
        ) from None
    if not isinstance(parsed, dict):
        raise UsageError(
            f"--env-args takes a JSON object such as '{{\"taskset\": {{...}}}}', not a "
            f"{type(parsed).__name__} ({value!r})"
        )
    return parsed


def agent(spec: str) -> Any:
    """The agent function `path/to/file.py:function` or `package.module:function` names.

    A `dataset(split)` function beside it in its module gives the agent's task rows, as an
    environment's `dataset` does (`--dataset` still takes precedence), and a module-level
    `episode_limits` dict what its episodes need, as an environment's does.

    Raises:
        UsageError: The spec names no function, one that cannot take `(client, row)`, or the
            `openai` package is missing.
    """
    from rollout.agents import INSTALL, Agent

    function = load_attribute(spec)
    if not callable(function) or inspect.isclass(function):
        raise UsageError(
            f"agent:{spec} names a {type(function).__name__}; an agent is a function "
            f"`async def solve(client, row) -> float | None`"
        )
    try:
        inspect.signature(function).bind(None, {})
    except TypeError as error:
        raise UsageError(
            f"agent:{spec} cannot be called as function(client, row) ({error}); an "
            f"agent takes an OpenAI client and the task row"
        ) from None
    except ValueError:  # no signature to read (a builtin): let the call tell
        pass
    try:
        import openai  # noqa: F401
    except ImportError:
        raise UsageError(f"agent:{spec} needs the openai package: {INSTALL}") from None
    module = inspect.getmodule(function)
    rows_of = getattr(module, "dataset", None)
    limits = episode_limits(module) if module is not None else {}
    return Agent(function, dataset=rows_of if callable(rows_of) else None, episode_limits=limits)


def source_name(source: Any) -> str:
    """The name a run is filed under: the environment class's, or the agent's."""
    return getattr(source, "__name__", None) or source.name


def model_path(model: str | None) -> str:
    """`--model` checked: a local model folder, or a hub id the hub (or its cache) provides.

    Without `--model`, the embedded default (converted and cached on first use). A hub id is
    checked by fetching its `config.json`, so a typo or an unreachable hub fails in seconds.

    Raises:
        UsageError: The folder does not exist or holds no model, or the name is not a folder
            and the hub cannot provide it; the message says which.

    """
    if model is None:
        from agentgrpo.models.default_model import default_model_path

        return str(default_model_path())
    path = Path(model).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in _MODEL_FILES):
            raise UsageError(
                f"--model folder {path.resolve()} holds no config.json; pass a folder saved "
                f"with save_pretrained (config.json and the weights)"
            )
        return str(path)
    if path.exists():
        raise UsageError(f"--model {model} is a file; pass the model's folder (with config.json)")
    if _looks_like_path(model):
        raise UsageError(f"--model folder not found: {path.resolve()}")
    _check_hub_model(model, path)
    return model


def check_output_dir(output_dir: str) -> None:
    """Raise `UsageError` if `output_dir`, or a folder above it, is an existing file."""
    path = Path(output_dir).expanduser()
    for folder in (path, *path.parents):
        if folder.exists() and not folder.is_dir():
            where = "is a file" if folder == path else f"is inside {folder}, a file"
            raise UsageError(
                f"--output-dir {output_dir} {where}; name a folder (it is created if missing)"
            )


def rows(env_class: Any, dataset: str | None, split: str, size: int | None = None) -> Any:
    """The task rows: `--dataset` if given, else the environment's (or agent's) `dataset(split)`.

    `size` (`--dataset-size`) is passed to a `dataset()` that takes `size` (the rows are then
    generated, as for `rg:TASK`); other rows are cut to their first `size`. The rows come back
    as a `datasets.Dataset`, a `datasets.IterableDataset` or a list of dicts (a tuple of dicts
    becomes a list), each as it was given, never converted to another: a list stays as the
    environment wrote it (`datasets.Dataset.from_list` would fill missing keys with None and
    drop keys the first row lacks). `first` cuts any of them.

    Raises:
        UsageError: There is neither, the source cannot be read, `dataset()` raises or returns
            no rows or something else than rows, or `size` is below 1.

    """
    if size is not None and size < 1:
        raise UsageError(f"--dataset-size must be at least 1, got {size}")
    if dataset is not None:
        loaded = _load_dataset(dataset, split)
        if not _has_rows(loaded):
            raise UsageError(f"--dataset {dataset!r} has no rows; pass a file with task rows")
        return first(loaded, size)
    method = getattr(env_class, "dataset", None)
    if method is None and not isinstance(env_class, type):
        raise UsageError(
            f"agent {source_name(env_class)} has no task rows of its own; pass --dataset "
            f"FILE.jsonl (or a datasets-loadable name), or define dataset(split) in its "
            f"module: each row is passed to the agent"
        )
    if method is None:
        raise UsageError(
            f"{env_class.__name__} has no dataset() classmethod, so there are no task rows; "
            f"pass --dataset FILE.jsonl (or a datasets-loadable name), or give the class "
            f"`@classmethod def dataset(cls, split='train')`"
        )
    return first(_dataset_rows(method, split, size), size)


def split_read(source: Any, dataset: str | None, split: str) -> str | None:
    """The split `rows(source, dataset, split)` reads, or None where its source has no splits.

    None for a `dataset()` without a `split` parameter (it returns the same rows whatever the
    split) and for a `--dataset` file or saved folder (one set of rows); `split` otherwise.
    """
    if dataset is not None:
        path = Path(dataset).expanduser()
        return None if path.suffix in _FILE_FORMATS or _is_saved_dataset(path) else split
    method = getattr(source, "dataset", None)
    return split if method is not None and "split" in _parameters(method) else None


def _dataset_rows(method: Callable[..., Any], split: str, size: int | None) -> Any:
    """What `method` (a `dataset()`) returns for `split` (and `size`, if it takes one), checked.

    Raises:
        UsageError: The call raised, or returned something else than rows, or no rows; the
            message names the call as made, e.g. `Class.dataset(split='eval')`.
    """
    parameters = _parameters(method)
    arguments: dict[str, Any] = {"split": split} if "split" in parameters else {}
    if size is not None and "size" in parameters:
        arguments["size"] = size
    shown = ", ".join(f"{name}={value!r}" for name, value in arguments.items())
    call = f"{getattr(method, '__qualname__', 'dataset')}({shown})"
    try:
        returned = method(**arguments)
    except Exception as error:
        raise UsageError(
            f"{call} raised {describe_error(error)}; make it return that split's rows (a "
            f"datasets.Dataset or a list of dicts), or pass --dataset FILE.jsonl"
        ) from None
    checked = _checked_rows(returned, method)
    if not _has_rows(checked):
        raise UsageError(
            f"{call} returned no rows; return at least one task row, or pass --dataset FILE.jsonl"
        )
    return checked


def _parameters(method: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    """`method`'s parameters by name; none where it has no signature to read (a builtin)."""
    try:
        return inspect.signature(method).parameters
    except (TypeError, ValueError):
        return {}


def _checked_rows(rows: Any, method: Any) -> Any:
    """What `dataset()` returned when it is a `datasets.Dataset` or a list (or tuple) of dicts.

    A tuple comes back as a list, so that every later step sees one of the three kinds of
    rows that `first` cuts.

    Raises:
        UsageError: Anything else, naming the method and what to return.
    """
    import datasets

    owner = getattr(method, "__qualname__", "dataset")
    if isinstance(rows, datasets.DatasetDict | datasets.IterableDatasetDict):
        raise UsageError(
            f"{owner}() returned a {type(rows).__name__} of the splits {list(rows)}; return one "
            "split (a datasets.Dataset, e.g. `splits[split]`) or a list of dicts"
        )
    if isinstance(rows, list | tuple) and all(isinstance(row, dict) for row in rows):
        return list(rows)
    if isinstance(rows, datasets.Dataset | datasets.IterableDataset):
        return rows
    raise UsageError(
        f"{owner}() returned {type(rows).__name__}; return a datasets.Dataset or a list of "
        "dicts, one per task row"
    )


def _has_rows(rows: Any) -> bool:
    """Whether `rows` holds at least one row (a stream is read up to its first)."""
    if hasattr(rows, "__len__"):
        return len(rows) > 0
    return next(iter(rows), None) is not None


def first(rows: Any, count: int | None) -> Any:
    """The first `count` of `rows` (all of them for None), of the kind they came as.

    `rows` is what `rows()` returns: a list of dicts (sliced), a `datasets.Dataset`
    (`select`) or a `datasets.IterableDataset` (`take`, read as it is played).

    >>> first([{"n": 1}, {"n": 2}, {"n": 3}], 2)
    [{'n': 1}, {'n': 2}]
    """
    if count is None:
        return rows
    if isinstance(rows, list):
        return rows[:count]
    if hasattr(rows, "__len__"):
        return rows.select(range(min(count, len(rows))))
    return rows.take(count)


def reward_functions(specs: list[str]) -> list[Callable[..., Any]]:
    """Each `module:function` or `file.py:function` spec, loaded and checked to be callable."""
    functions: list[Callable[..., Any]] = []
    for spec in specs:
        function = load_attribute(spec)
        if not callable(function):
            raise UsageError(f"--reward {spec} names a {type(function).__name__}, not a function")
        functions.append(function)
    return functions


def _looks_like_path(name: str) -> bool:
    """Whether `name` can only be a folder: a hub id is `name` or `owner/name`, nothing more."""
    parts = name.split("/")
    return (
        name.startswith((".", "~", "/"))
        or "\\" in name
        or len(parts) > 2
        or "" in parts
        or (len(parts) == 2 and Path(parts[0]).exists())
    )


def _check_hub_model(name: str, path: Path) -> None:
    """Raise `UsageError` unless the hub, or its local cache, has model `name`'s config.json."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    problem = f"--model {name!r} is not a local folder (there is no {path.resolve()})"
    try:
        hf_hub_download(name, "config.json", local_files_only=not _hub_resolves())
    except HFValidationError:
        raise UsageError(f"{problem} nor a valid hub model id; pass a model folder") from None
    except LocalEntryNotFoundError:
        raise UsageError(
            f"{problem}, and the Hugging Face hub cannot be reached from here to fetch it "
            f"(offline, and not in the hub cache); pass a local model folder"
        ) from None
    except RepositoryNotFoundError:
        raise UsageError(
            f"{problem} nor a model on the Hugging Face hub (or it is private or gated: log "
            f"in with `hf auth login`); pass a model folder or a hub id such as owner/name"
        ) from None
    except EntryNotFoundError:
        raise UsageError(f"{problem}, and hub repo {name} has no config.json") from None
    except HfHubHTTPError as error:
        raise UsageError(f"{problem}, and the hub did not provide it: {error}") from None


def _hub_resolves() -> bool:
    """False when the hub's host name does not resolve and no proxy would resolve it for us.

    Then only the hub cache is read: the hub client would otherwise retry for about 20 s,
    logging each retry, before reporting what is already known.
    """
    import socket
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    if urllib.request.getproxies():
        return True
    try:
        socket.getaddrinfo(urllib.parse.urlparse(constants.ENDPOINT).hostname, 443)
    except OSError:
        return False
    return True


def _load_dataset(source: str, split: str) -> Any:
    import datasets

    path = Path(source).expanduser()
    try:
        if path.suffix in _FILE_FORMATS:
            if not path.is_file():
                raise UsageError(f"--dataset file not found: {path.resolve()}")
            return datasets.load_dataset(_FILE_FORMATS[path.suffix], data_files=str(path))["train"]
        if _is_saved_dataset(path):
            return datasets.load_from_disk(str(path))
        return datasets.load_dataset(source, split=split)
    except UsageError:
        raise
    except Exception as error:
        raise UsageError(
            f"--dataset {source!r} could not be loaded ({type(error).__name__}: {error}); pass a "
            f".json/.jsonl/.csv/.parquet file, a folder saved with save_to_disk, or a name "
            f"datasets.load_dataset can read"
        ) from None


def _is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder `datasets.Dataset.save_to_disk` wrote (one set of rows)."""
    return path.is_dir() and (path / "dataset_info.json").is_file()


def played_by(source: Any) -> dict[str, Any]:
    """The trainer's argument for what plays the episodes: an environment class or an agent."""
    return {"environment_factory": source} if isinstance(source, type) else {"agent": source}


def source_limits(source: Any) -> dict[str, int]:
    """What an episode needs, as the environment class or the agent's module says."""
    return episode_limits(source) if isinstance(source, type) else dict(source.episode_limits)
