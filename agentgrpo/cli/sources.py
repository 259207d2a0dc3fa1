"""What a command line names, made real: the environment, the model, the rows, the rewards.

Each function turns one user-typed string into an object or raises `UsageError` (or the
environment layer's `EnvironmentSpecError`) with a message that says what to fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentgrpo.cli.options import UsageError
from environments import check_environment, resolve_environment
from environments.resolve import load_attribute

_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
DEFAULT_MODEL = "the embedded SmolLM2-135M-Instruct"


def environment_class(spec: str) -> type:
    """The environment class `spec` names, checked against the contract."""
    cls = resolve_environment(spec)
    check_environment(cls)
    return cls


def model_path(model: str | None) -> str:
    """`--model` as given, or the embedded default (converted and cached on first use)."""
    if model is not None:
        return model
    from agentgrpo.default_model import default_model_path

    return str(default_model_path())


def rows(env_class: type, dataset: str | None, split: str) -> Any:
    """The task rows: `--dataset` if given, else the environment's own `dataset(split)`.

    Raises:
        UsageError: There is neither, or the source cannot be read.

    """
    if dataset is not None:
        return _load_dataset(dataset, split)
    method = getattr(env_class, "dataset", None)
    if method is None:
        raise UsageError(
            f"{env_class.__name__} has no dataset() classmethod, so there are no task rows; "
            f"pass --dataset FILE.jsonl (or a datasets-loadable name), or give the class "
            f"`@classmethod def dataset(cls, split='train')`"
        )
    if "split" in inspect.signature(method).parameters:
        return method(split=split)
    return method()


def reward_functions(specs: list[str]) -> list[Callable[..., Any]]:
    """Each `module:function` or `file.py:function` spec, loaded and checked to be callable."""
    functions = []
    for spec in specs:
        function = load_attribute(spec)
        if not callable(function):
            raise UsageError(f"--reward {spec} names a {type(function).__name__}, not a function")
        functions.append(function)
    return functions


def _load_dataset(source: str, split: str) -> Any:
    import datasets

    path = Path(source).expanduser()
    try:
        if path.suffix in _FILE_FORMATS:
            if not path.is_file():
                raise UsageError(f"--dataset file not found: {path.resolve()}")
            return datasets.load_dataset(_FILE_FORMATS[path.suffix], data_files=str(path))["train"]
        if path.is_dir() and (path / "dataset_info.json").is_file():
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
