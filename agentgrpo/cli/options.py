"""Command-line options from `GRPOConfig`'s fields, a YAML file of the same fields, and defaults.

Every `GRPOConfig` field is an option: `learning_rate` is `--learning-rate`. Values arrive as
text and are turned into the field's type here (`--use-vllm` alone means true; `none` clears an
optional field; lists and dicts are JSON). A value's source, strongest first: the command line,
then `--config FILE.yaml`, then the command's own defaults (`RUN_DEFAULTS`), then `GRPOConfig`'s.
A misspelt option or key is an error that names the nearest valid one.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from agentgrpo.config import GRPOConfig


class UsageError(ValueError):
    """A command-line or config-file mistake; the message says what to fix."""


# Defaults of `agentgrpo run` and `agentgrpo eval` where they differ from GRPOConfig's: the
# CPU recipe of ../shared/MODELS.md, which lets the 135M default model learn in minutes.
RUN_DEFAULTS: dict[str, Any] = {
    "max_steps": 16,
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    "learning_rate": 5e-5,
    "lr_scheduler_type": "constant",
    "max_completion_length": 64,
    "max_turns": 2,
    "beta": 0.0,
    "loss_type": "dapo",
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "save_steps": 8,
    "save_total_limit": 1,
    "report_to": "none",
    "seed": 0,
}


# Fields where the text "none" is a value TrainingArguments reads, not "unset".
_NONE_IS_TEXT = frozenset({"report_to"})


@cache
def config_fields() -> dict[str, dataclasses.Field]:
    """GRPOConfig's settable fields by name."""
    return {f.name: f for f in dataclasses.fields(GRPOConfig) if f.init}


@cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(GRPOConfig)


def own_field_names() -> set[str]:
    """Fields GRPOConfig adds to transformers' TrainingArguments (the GRPO and agentgrpo ones)."""
    from transformers import TrainingArguments

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    return set(config_fields()) - inherited


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """Add a `--field-name` option for every GRPOConfig field, in two help groups.

    Options default to "not given" (absent from the parsed namespace), so `config_overrides`
    can tell a value the user typed from a default.
    """
    own = own_field_names()
    groups = {
        True: parser.add_argument_group("GRPO options (GRPOConfig)"),
        False: parser.add_argument_group("Trainer options (transformers TrainingArguments)"),
    }
    for name, field in config_fields().items():
        default = RUN_DEFAULTS.get(name, _default_of(field))
        help_text = field.metadata.get("help", "").replace("%", "%%")
        groups[name in own].add_argument(
            option_name(name),
            dest=name,
            default=argparse.SUPPRESS,
            metavar=_metavar(name),
            nargs="?" if _is_bool(name) else None,
            const="true" if _is_bool(name) else None,
            help=f"{help_text} (default: {default!r})",
        )


def option_name(field_name: str) -> str:
    """`learning_rate` -> `--learning-rate`."""
    return "--" + field_name.replace("_", "-")


def config_overrides(namespace: argparse.Namespace) -> dict[str, Any]:
    """The GRPOConfig fields the command line set, converted to their types."""
    given = vars(namespace)
    return {name: parse_value(name, given[name]) for name in config_fields() if name in given}


def parse_value(name: str, text: Any) -> Any:
    """Turn a command-line string into the type of field `name`; other values pass through.

    Example:
        >>> parse_value("learning_rate", "1e-5"), parse_value("use_vllm", "true")
        (1e-05, True)
        >>> parse_value("max_turns", "none"), parse_value("reward_weights", "[1, 0.5]")
        (None, [1, 0.5])
        >>> parse_value("report_to", "none")  # a value of its own: no integrations
        ['none']

    """
    if not isinstance(text, str):
        return text
    kinds = _kinds(_field_types()[name])
    if text.lower() in ("none", "null") and type(None) in kinds and name not in _NONE_IS_TEXT:
        return None
    if bool in kinds:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        if str not in kinds:
            raise UsageError(f"{option_name(name)} takes true or false, not {text!r}")
    for kind in (int, float):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                if str not in kinds and float not in kinds:
                    raise UsageError(f"{option_name(name)} takes a number, not {text!r}") from None
    if kinds & {list, dict}:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            if list in kinds:
                return [part.strip() for part in text.split(",") if part.strip()]
    return text


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping a YAML (or JSON) config file holds; keys are checked by the caller."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"config file not found: {file.resolve()}")
    try:
        content = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        raise UsageError(f"config file {file} is not valid YAML: {error}") from None
    if content is None:
        return {}
    if not isinstance(content, Mapping):
        raise UsageError(f"config file {file} must hold a mapping of field: value, not a list")
    return {str(key).replace("-", "_"): value for key, value in content.items()}


def check_keys(keys: Iterable[str], valid: Iterable[str], where: str) -> None:
    """Raise `UsageError` for the first key not in `valid`, suggesting the nearest one."""
    valid = sorted(valid)
    for key in keys:
        if key not in valid:
            raise UsageError(f"{where}: unknown key {key!r}{suggestion(key, valid)}")


def check_unknown_options(unknown: list[str], parser: argparse.ArgumentParser) -> None:
    """Raise `UsageError` for the first unrecognised command-line token, with a suggestion."""
    if not unknown:
        return
    token = unknown[0]
    if not token.startswith("-"):
        raise UsageError(f"unexpected argument {token!r}; see `{parser.prog} --help`")
    known = [o for action in parser._actions for o in action.option_strings]
    option = token.split("=", 1)[0]
    raise UsageError(
        f"unknown option {option}{suggestion(option, known)}; see `{parser.prog} --help`"
    )


def suggestion(name: str, candidates: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest candidate, or ''."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _kinds(annotation: Any) -> set[type]:
    """The plain types an annotation allows: `int | None` -> {int, NoneType}."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = typing.get_args(annotation)
    else:
        members = (annotation,)
    kinds = set()
    for member in members:
        origin = typing.get_origin(member) or member
        if origin is typing.Literal:
            kinds |= {type(value) for value in typing.get_args(member)}
        elif isinstance(origin, type):
            kinds.add(str if issubclass(origin, str) else origin)
        else:
            kinds.add(str)
    return kinds


def _is_bool(name: str) -> bool:
    return bool in _kinds(_field_types()[name])


def _metavar(name: str) -> str:
    kinds = _kinds(_field_types()[name])
    for kind, label in ((bool, "BOOL"), (int, "INT"), (float, "FLOAT"), (list, "LIST")):
        if kind in kinds:
            return label
    return "TEXT"


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None
