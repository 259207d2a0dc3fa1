"""`agentgrpo run --use-peft`: train a LoRA adapter of the model instead of all its weights.

The options are TRL's `ModelConfig` ones in the command line's spelling (`--use_peft` is
`--use-peft`, `--lora_r` is `--lora-r`), with its defaults: rank 16, alpha 32, dropout 0.05, and
PEFT's target modules for the model's architecture unless `--lora-target-modules` names them
(`all-linear`: every linear layer but the output one). The run hands the adapter to
`GRPOTrainer` as its `peft_config`, which wraps the model with it; the saved model folder is
then the adapter (adapter_config.json, adapter_model.safetensors) and the tokenizer, which
`agentgrpo eval --model FOLDER` loads on its base model (`models.loading.adapter_base`).
A `--config` file takes the same keys (`use_peft: true`, `lora_r: 8`, ...).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from agentgrpo.cli.options import LIMITS, UsageError, option_name, value_parser
from agentgrpo.cli.values import FieldType

if TYPE_CHECKING:
    from peft import LoraConfig

# TRL ModelConfig's defaults for the options that shape the adapter (None: PEFT's choice).
LORA_DEFAULTS: dict[str, Any] = {
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.05,
    "lora_target_modules": None,
}
LORA_KEYS = ("use_peft", *LORA_DEFAULTS)
"""The `run` options (and config-file keys) this module reads."""
LORA_KEY_TYPES = {
    "use_peft": FieldType.of(bool | None),
    "lora_r": FieldType.of(int | None, limit=LIMITS["lora_r"]),
    "lora_alpha": FieldType.of(int | None, limit=LIMITS["lora_alpha"]),
    "lora_dropout": FieldType.of(float | None, limit=LIMITS["lora_dropout"]),
    "lora_target_modules": FieldType.of(list[str] | str | None),
}
"""What each key takes in a `--config` file."""
ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output layer


def add_lora_options(parser: argparse.ArgumentParser) -> None:
    """Add `--use-peft` and the `--lora-*` options (absent from the namespace unless given)."""
    group = parser.add_argument_group(
        "LoRA options (TRL's ModelConfig: --use_peft, --lora_r, ... in kebab-case)"
    )
    group.add_argument(
        "--use-peft",
        nargs="?",
        const=True,
        type=value_parser("use_peft", bool),
        default=argparse.SUPPRESS,
        metavar="BOOL",
        help="train a LoRA adapter of the model (saved as the model folder) instead of all of "
        "its weights (default: False)",
    )
    shapes = (
        ("lora_r", int, "R", "the adapter's rank"),
        ("lora_alpha", int, "A", "LoRA alpha: the update is scaled by alpha / r"),
        ("lora_dropout", float, "D", "dropout on the adapter's input"),
    )
    for name, kind, metavar, text in shapes:
        group.add_argument(
            option_name(name),
            type=value_parser(name, kind),
            default=argparse.SUPPRESS,
            metavar=metavar,
            help=f"{text}; needs --use-peft (default: {LORA_DEFAULTS[name]})",
        )
    group.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=argparse.SUPPRESS,
        metavar="M",
        help="names of the layers to adapt (e.g. q_proj v_proj), or all-linear; needs "
        "--use-peft (default: PEFT's for the model's architecture, q_proj v_proj for Llama)",
    )


def lora_config(settings: Mapping[str, Any]) -> LoraConfig | None:
    """The `LoraConfig` the run's `use_peft` and `lora_*` settings ask for; None without one.

    Args:
        settings: The run's merged settings (command line over config file): `LORA_KEYS`,
            each None where neither gave it.

    Raises:
        UsageError: A `--lora-*` option without `--use-peft`, naming it.
    """
    given = [key for key in LORA_DEFAULTS if settings.get(key) is not None]
    if not settings.get("use_peft"):
        if given:
            raise UsageError(
                f"{option_name(given[0])} shapes the LoRA adapter of --use-peft: add --use-peft "
                f"to train one, or leave {option_name(given[0])} out to train every weight"
            )
        return None
    from peft import LoraConfig

    chosen = {key: settings[key] for key in given}
    values = LORA_DEFAULTS | chosen
    targets = values["lora_target_modules"]
    if isinstance(targets, str):  # a config file's one name
        targets = [targets]
    if targets == [ALL_LINEAR]:
        targets = ALL_LINEAR  # PEFT reads the name only as a string
    return LoraConfig(
        r=values["lora_r"],
        lora_alpha=values["lora_alpha"],
        lora_dropout=values["lora_dropout"],
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


@contextlib.contextmanager
def naming_target_modules(config: LoraConfig | None) -> Iterator[None]:
    """Around wrapping the model with `config`: PEFT's error for layers it lacks names the option.

    Raises:
        UsageError: In place of PEFT's ValueError for target modules the model does not have.
    """
    try:
        yield
    except ValueError as error:
        if config is None or "target modules" not in str(error).lower():
            raise
        raise UsageError(
            f"--lora-target-modules: {error} Name layers of the model (q_proj v_proj for "
            "Llama-like models), or all-linear for every linear layer"
        ) from None


def adapter_settings(config: LoraConfig | None) -> dict[str, Any] | None:
    """What a resumed run compares of the adapter (`cli.resume_check`): JSON values; None: none.

    Examples:
        >>> from peft import LoraConfig
        >>> adapter_settings(LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"]))
        {'r': 4, 'lora_alpha': 8, 'lora_dropout': 0.0, 'target_modules': ['q_proj', 'v_proj']}
    """
    if config is None:
        return None
    targets = config.target_modules
    return {
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": targets
        if targets is None or isinstance(targets, str)
        else sorted(targets),
    }


def describe(config: LoraConfig) -> str:
    """`LoRA r 16, alpha 32, dropout 0.05 on q_proj, v_proj`, for the run's start-up lines."""
    targets = config.target_modules
    if targets is None:
        where = "PEFT's default layers"
    else:
        where = targets if isinstance(targets, str) else ", ".join(sorted(targets))
    return (
        f"LoRA r {config.r}, alpha {config.lora_alpha:g}, dropout {config.lora_dropout:g} on "
        f"{where}"
    )
