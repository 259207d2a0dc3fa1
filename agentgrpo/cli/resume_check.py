"""What `agentgrpo run --resume` checks: the command continues the run that saved the checkpoint.

A fresh run writes `<output_dir>/run.json`: the environment (as typed, with its `--env-args`)
and the learning rate. A resumed run compares them, and the model's architecture (its
`config.json` against the checkpoint's), with the new command, and refuses with every
difference named. A changed learning rate is refused rather than taken: transformers' Trainer
restores the optimizer and the schedule from the checkpoint, so the new value would be
silently ignored, and a schedule rebuilt halfway is a different run. A different environment
would mix two runs' episodes and metrics in one folder; a different architecture cannot load
the checkpoint's weights at all.
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


def run_settings(env: str, env_args: dict[str, Any] | None, config: GRPOConfig) -> dict[str, Any]:
    """The settings a resumed run must share with the run it continues."""
    return {"environment": env, "env_args": env_args, "learning_rate": config.learning_rate}


def write_run_settings(output_dir: str | Path, settings: dict[str, Any]) -> None:
    """Record a fresh run's settings in its output folder, for a later `--resume` to check."""
    (Path(output_dir) / RUN_FILE).write_text(json.dumps(settings, indent=2) + "\n")


def check_resume(
    checkpoint: str | Path, output_dir: str | Path, settings: dict[str, Any], model: str
) -> None:
    """Refuse to resume `checkpoint` with a command that differs from the run that saved it.

    Args:
        checkpoint: The checkpoint folder the run resumes from.
        output_dir: The run's output folder (its `run.json`; a run saved before agentgrpo
            wrote one is compared on its architecture only).
        settings: `run_settings` of the new command.
        model: The new command's model (a folder or hub id).

    Raises:
        UsageError: Naming each difference, the saved value beside the new one.
    """
    differences = _setting_differences(Path(output_dir) / RUN_FILE, settings)
    differences += _architecture_differences(Path(checkpoint), model)
    if differences:
        raise UsageError(
            f"cannot resume {checkpoint}: this command differs from the run that saved it: "
            f"{'; '.join(differences)}. A resumed run continues that run as it was (its "
            "optimizer and learning-rate schedule included): give the saved values, or start a "
            f"new run in another --output-dir (--model {checkpoint} starts from its weights)"
        )


def _setting_differences(saved_file: Path, settings: dict[str, Any]) -> list[str]:
    if not saved_file.is_file():
        return []
    saved = json.loads(saved_file.read_text())
    return [
        f"{name} {settings[name]!r} (saved run: {saved[name]!r})"
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
