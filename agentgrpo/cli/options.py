"""Command-line options from `GRPOConfig`'s fields, a YAML file of the same fields, and defaults.

Every `GRPOConfig` field is an option: `learning_rate` is `--learning-rate`. Values arrive as
text and are turned into the field's type when the command line is parsed (`--use-vllm` alone
means true; `none` clears an optional field; lists and dicts are JSON); a value of the wrong
type, or outside the option's range (`LIMITS`), is an error naming the option. A value's
source, strongest first: the command line, then `--config FILE.yaml`, then the command's own
defaults (`RUN_DEFAULTS`), then `GRPOConfig`'s.
A misspelt option or key is an error that names the nearest valid one.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from agentgrpo.cli.values import FieldType, InvalidValue, Limit
from agentgrpo.config import GRPOConfig

# The GRPOConfig fields `eval` takes as they are: sampling, timeouts, the context's window.
EVAL_EPISODE_FIELDS = (
    "top_p",
    "top_k",
    "tool_timeout_s",
    "environment_timeout_s",
    "max_context",
    "context_policy",
    "context_threshold",
    "context_keep_last",
    "context_summary_tokens",
)


class UsageError(ValueError):
    """A command-line or config-file mistake; the message says what to fix."""


# Defaults of `agentgrpo run` and `agentgrpo eval` where they differ from GRPOConfig's: the
# CPU recipe of ../shared/MODELS.md, which lets the 135M default model learn in minutes. Its lr
# is 1e-5, not the recipe's 5e-5: a warm start on demonstrations with one right call per turn
# (Arithmetic's, Chain's) leaves a nearly deterministic policy, and at 5e-5 the first updates
# with negative advantages knocked its format over (reward 0 from step 7); Counter learns at both.
RUN_DEFAULTS: dict[str, Any] = {
    "max_steps": 16,
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    "learning_rate": 1e-5,
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
# `--device` of run, eval and doctor (see `agentgrpo.devices`).
DEVICE_HELP = (
    "cpu, cuda or cuda:N (default: the first GPU when there is one, else the CPU); a GPU runs "
    "float32 weights under bf16 autocast where it supports bf16, as training does"
)
# Above this many completion tokens a step (batch size x max_completion_length), `agentgrpo run`
# turns gradient checkpointing on unless told otherwise: the activations the backward pass keeps
# grow with every token, enough to run a long-episode step out of memory on a CPU machine
# (docs/measurements.md, "Figures behind the code").
CHECKPOINT_ABOVE_TOKENS = 4096
# Defaults `agentgrpo run` works out for each run (commands._run_settings), as `--help` says them.
RUN_DEFAULTS_PER_RUN: dict[str, str] = {
    "project": "the environment's class name",
    "run_name": "the output folder",
    "gradient_checkpointing": (
        f"on where batch size x max_completion_length > {CHECKPOINT_ABOVE_TOKENS}"
    ),
}


def _at_least(low: float, what: str = "a whole number") -> Limit:
    return (lambda n: n >= low), f"{what} >= {low}"


# Ranges checked at parse time: values that would fail later with a traceback or a message
# that does not name the option, or (max_steps) be silently read as "train by epochs". Other
# values TRL accepts stay accepted. Eval's own options are here too (num_episodes, ...).
LIMITS: dict[str, Limit] = {
    "max_steps": (lambda n: n == -1 or n >= 1, "-1 (train by epochs) or a whole number >= 1"),
    "per_device_train_batch_size": _at_least(1),
    "per_device_eval_batch_size": _at_least(1),
    "gradient_accumulation_steps": _at_least(1),
    "steps_per_generation": _at_least(1),
    "generation_batch_size": _at_least(1),
    "num_iterations": _at_least(1),
    "max_resample_rounds": _at_least(1),
    "warmup_steps": _at_least(0, "a number"),
    "seed": (lambda n: 0 <= n < 2**32, "a whole number from 0 to 2**32 - 1"),
    "learning_rate": _at_least(0, "a number"),
    "temperature": _at_least(0, "a number"),
    "top_p": (lambda p: 0 < p <= 1, "a number in (0, 1]"),
    "max_turns": _at_least(1),
    "max_completion_length": _at_least(1),
    "num_episodes": _at_least(1),
    "generate": _at_least(1),
    "server_timeout": (lambda s: s > 0, "a number of seconds > 0"),
    "lora_r": _at_least(1),
    "lora_alpha": _at_least(1),
    "lora_dropout": (lambda p: 0 <= p < 1, "a number in [0, 1)"),
}

# Fields where the text "none" is a value TrainingArguments reads, not "unset".
_NONE_IS_TEXT = frozenset({"report_to"})
# Fields with a str member that takes only these texts (the rest of the union is typed).
_TEXT_CHOICES: dict[str, tuple[str, ...]] = {"pad_to_multiple_of": ("auto",)}


@cache
def config_fields() -> dict[str, dataclasses.Field]:
    """GRPOConfig's settable fields by name."""
    return {f.name: f for f in dataclasses.fields(GRPOConfig) if f.init}


@cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(GRPOConfig)


@cache
def field_type(name: str) -> FieldType:
    """What GRPOConfig field `name` takes: its annotation, `choices` metadata and limit."""
    return FieldType.of(
        _field_types()[name],
        _TEXT_CHOICES.get(name, config_fields()[name].metadata.get("choices")),
        none_is_text=name in _NONE_IS_TEXT,
        limit=LIMITS.get(name),
    )


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
        default = RUN_DEFAULTS_PER_RUN.get(name, repr(RUN_DEFAULTS.get(name, _default_of(field))))
        help_text = field.metadata.get("help", "").replace("%", "%%")
        groups[name in own].add_argument(
            option_name(name),
            *OPTION_ALIASES.get(name, ()),
            dest=name,
            default=argparse.SUPPRESS,
            metavar=_metavar(name),
            type=value_parser(name),
            nargs="?" if _is_bool(name) else None,
            const=True if _is_bool(name) else None,
            help=f"{help_text} (default: {default})",
        )
    add_mcp_server_option(groups[True])


def add_mcp_server_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--mcp-server`, once per server, each appended to `mcp_servers` (`run` and `eval`)."""
    parser.add_argument(
        "--mcp-server",
        dest="mcp_servers",
        action="append",
        default=argparse.SUPPRESS,
        metavar="'CMD ARGS'|URL|JSON",
        help="an MCP server whose tools every episode offers: a command serving MCP on stdio, "
        "an http(s):// URL, or a JSON object ('command', 'args', 'env' or 'url'; "
        '"per_episode": true gives each episode a server of its own); repeatable',
    )


# Shorter spellings of some options, beside `--field-name`.
OPTION_ALIASES = {"async_grpo": ("--async",)}


def option_name(field_name: str) -> str:
    """`learning_rate` -> `--learning-rate`."""
    return "--" + field_name.replace("_", "-")


def config_overrides(namespace: argparse.Namespace) -> dict[str, Any]:
    """The GRPOConfig fields the command line set (already typed by their options' `type`)."""
    given = vars(namespace)
    return {name: given[name] for name in config_fields() if name in given}


def parse_value(name: str, value: Any) -> Any:
    """Field `name`'s value from command-line text or a config file's YAML value.

    Text is read as the field's type (`none` clears an optional field; lists and dicts are
    JSON, a list also `a,b`); other values must already have the type. Either way the value
    must be one of the field's choices and inside its range (`LIMITS`).

    Raises:
        UsageError: Naming the option and what it takes.

    Examples:
        >>> parse_value("learning_rate", "1e-5"), parse_value("use_vllm", "true")
        (1e-05, True)
        >>> parse_value("max_turns", "none"), parse_value("reward_weights", "[1, 0.5]")
        (None, [1.0, 0.5])
        >>> parse_value("report_to", "none")  # a value of its own: no integrations
        ['none']
        >>> parse_value("beta", "abc")
        Traceback (most recent call last):
        ...
        agentgrpo.cli.options.UsageError: --beta takes a number, not 'abc'

    """
    try:
        return field_type(name).read(value)
    except InvalidValue as invalid:
        raise UsageError(f"{option_name(name)} {invalid}") from None


def value_parser(name: str, kind: type | None = None) -> Callable[[str], Any]:
    """An argparse `type` for option `name`: GRPOConfig field `name`, or a plain `kind`.

    A plain kind (a command's own option, e.g. eval's `num_episodes`) still gets
    `LIMITS[name]`. Errors are argparse's `ArgumentTypeError`, worded `takes X, not V`.
    """
    field = field_type(name) if kind is None else FieldType.of(kind, limit=LIMITS.get(name))

    def parse(text: str) -> Any:
        try:
            return field.read(text)
        except InvalidValue as invalid:
            raise argparse.ArgumentTypeError(str(invalid)) from None

    parse.__name__ = name  # argparse names the type in some messages
    return parse


def config_file_values(
    values: Mapping[str, Any], path: str, own_types: Mapping[str, FieldType]
) -> dict[str, Any]:
    """A config file's values, each typed and checked as `parse_value` does.

    Args:
        values: The file's mapping (keys already checked).
        path: The file, for the error message.
        own_types: The types of the command's own keys (`model`, ...); the rest are fields.

    Raises:
        UsageError: Naming the file, the key and what it takes.

    """
    typed = {}
    for name, value in values.items():
        try:
            typed[name] = (own_types.get(name) or field_type(name)).read(value)
        except InvalidValue as invalid:
            raise UsageError(f"config file {path}: {name} {invalid}") from None
    return typed


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping a YAML (or JSON) config file holds; keys are checked by the caller."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"config file not found: {file.resolve()}")
    try:
        content = yaml.safe_load(_read_text(file, "config file"))
    except yaml.YAMLError as error:
        raise UsageError(f"config file {file} is not valid YAML: {error}") from None
    if content is None:
        return {}
    if not isinstance(content, Mapping):
        raise UsageError(f"config file {file} must hold a mapping of field: value, not a list")
    return {str(key).replace("-", "_"): value for key, value in content.items()}


def _read_text(file: Path, what: str) -> str:
    """The UTF-8 text of `file`, which the user named as `what`.

    Raises:
        UsageError: The file cannot be read, or is not UTF-8 text; the message names it.
    """
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(
            f"{what} {file} is not UTF-8 text (byte {error.start}: {error.reason}); save it as "
            f"UTF-8"
        ) from None
    except OSError as error:
        raise UsageError(f"{what} {file} cannot be read: {error.strerror or error}") from None


BUILTIN_TEMPLATE = "chatml_tools"  # the default model's own template cannot show tools


def template_source(value: str) -> str:
    """`--chat-template` (or the config key) as `rollout.load_template` takes it: a file is read.

    Anything else (a built-in name, jinja source) is returned as it is.

    Raises:
        UsageError: `value` names a template file (`.jinja`, `.j2`, `.txt`) that does not exist.

    """
    if "{{" in value or "{%" in value:  # jinja source (often too long to be a file name)
        return value
    file = Path(value).expanduser()
    if file.is_file():
        return _read_text(file, "--chat-template file")
    if file.suffix in (".jinja", ".j2", ".txt"):
        raise UsageError(f"--chat-template file not found: {file.resolve()}")
    return value


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


def _is_bool(name: str) -> bool:
    return bool in field_type(name).kinds


def _metavar(name: str) -> str:
    kinds = field_type(name).kinds
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


def grpo_config(fields: dict[str, Any]) -> Any:
    """GRPOConfig(**fields); its errors, and a `report_to` tracker not installed: usage errors."""
    from agentgrpo.reporting.trackers import check_trackers

    try:
        config = GRPOConfig(**fields)
    except (TypeError, ValueError) as error:
        raise UsageError(f"invalid options: {error}") from None
    try:
        check_trackers(config.report_to)  # before the model loads
    except ImportError as error:
        raise UsageError(str(error)) from None
    return config
