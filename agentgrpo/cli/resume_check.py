"""What `agentgrpo run --resume` checks: the command continues the run that saved the checkpoint.

A fresh run writes `<output_dir>/run.json`: the environment (as typed, with its `--env-args`),
the learning rate, and the reward functions (`--reward`, as typed) with their weights. A
resumed run compares them, and the model's architecture (its `config.json` against the
checkpoint's), with the new command, and refuses with every difference named. A changed
learning rate is refused rather than taken: transformers' Trainer restores the optimizer and
the schedule from the checkpoint, so the new value would be silently ignored, and a schedule
rebuilt halfway is a different run. A different environment would mix two runs' episodes and
metrics in one folder; a different architecture cannot load the checkpoint's weights at all.

Other reward functions or weights are taken, as TRL takes them (a reward fixed halfway is a
common, deliberate change, and nothing of it is ignored), with a warning naming the change:
the curves and the summary of the folder then measure one reward before and another after.
The resumed run records its own rewards in `run.json`, so resuming it again is quiet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentgrpo.cli.options import UsageError
from agentgrpo.training import checkpoints

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig

RUN_FILE = "run.json"
MAY_CHANGE = frozenset({"reward", "reward_weights"})
"""The settings a resumed run may change, with a warning (the others it must share)."""


def run_settings(
    env: str,
    env_args: dict[str, Any] | None,
    config: GRPOConfig,
    rewards: list[str],
    adapter: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings a resumed run is compared on.

    Args:
        env: The environment as typed.
        env_args: Its `--env-args`.
        config: The run's config (its learning rate and reward weights).
        rewards: The `--reward` specs as typed.
        adapter: The LoRA adapter `--use-peft` trains (`lora.adapter_settings`), None without
            one: a checkpoint holds the adapter's weights alone, which fit no other.
    """
    return {
        "environment": env,
        "env_args": env_args,
        "learning_rate": config.learning_rate,
        "reward": list(rewards),
        "reward_weights": config.reward_weights,
        "lora": adapter,
    }


def write_run_settings(output_dir: str | Path, settings: dict[str, Any]) -> None:
    """Record a fresh run's settings in its output folder, for a later `--resume` to check."""
    (Path(output_dir) / RUN_FILE).write_text(json.dumps(settings, indent=2) + "\n")


def check_resume(
    checkpoint: str | Path, output_dir: str | Path, settings: dict[str, Any], model: str
) -> list[str]:
    """Refuse to resume `checkpoint` with a command that differs from the run that saved it.

    Args:
        checkpoint: The checkpoint folder the run resumes from.
        output_dir: The run's output folder (its `run.json`; a run saved before agentgrpo
            wrote one is compared on its architecture only, one saved before it recorded its
            rewards is not compared on them).
        settings: `run_settings` of the new command.
        model: The new command's model (a folder or hub id).

    Returns:
        One warning for the settings of `MAY_CHANGE` that differ (empty when none does),
        naming the saved values beside the new ones; print it.

    Raises:
        UsageError: Naming each difference in the other settings, the saved value beside the
            new one.
    """
    differences = _setting_differences(Path(output_dir) / RUN_FILE, settings)
    refused = [line for name, line in differences if name not in MAY_CHANGE]
    refused += _architecture_differences(Path(checkpoint), model)
    if refused:
        raise UsageError(
            f"cannot resume {checkpoint}: this command differs from the run that saved it: "
            f"{'; '.join(refused)}. A resumed run continues that run as it was (its "
            "optimizer and learning-rate schedule included): give the saved values, or start a "
            f"new run in another --output-dir (--model {checkpoint} starts from its weights)"
        )
    changed = [line for name, line in differences if name in MAY_CHANGE]
    if not changed:
        return []
    return [
        f"resuming {checkpoint} with other rewards than the run that saved it: "
        f"{'; '.join(changed)}. Training goes on with the new ones; the folder's curves and "
        "summary measure the saved rewards before this step and the new ones after (to keep "
        f"them apart, start a new run in another --output-dir with --model {checkpoint})"
    ]


def _setting_differences(saved_file: Path, settings: dict[str, Any]) -> list[tuple[str, str]]:
    """Each setting whose saved value differs: its name, and `name NEW (saved run: OLD)`."""
    if not saved_file.is_file():
        return []
    saved = json.loads(saved_file.read_text())
    return [
        (name, f"{name} {settings[name]!r} (saved run: {saved[name]!r})")
        for name in settings
        if name in saved and saved[name] != settings[name]
    ]


def _architecture_differences(checkpoint: Path, model: str) -> list[str]:
    from transformers import AutoConfig

    try:
        new = AutoConfig.from_pretrained(model).to_dict()
    except (OSError, ValueError):  # custom code, say: loading the model will tell
        return []
    return checkpoints.architecture_differences(checkpoint, new)
