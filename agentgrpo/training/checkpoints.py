"""Checkpoints that are whole or absent, and the one a run resumes from.

A checkpoint is the folder `<output_dir>/checkpoint-<step>/` that transformers' Trainer writes
(weights, optimizer, scheduler, RNG states, `trainer_state.json`). `GRPOTrainer` writes it into
`temporary_dir(output_dir, step)` first and renames it into place once every file is written
(`publish`), so a run killed mid-save leaves a temporary folder, never a half-written
checkpoint. Temporary folders start with `_`, which keeps them out of `checkpoint-*` globs and
out of the Trainer's Hub uploads; `remove_temporary` deletes the ones a killed save left.

A checkpoint written before saves were atomic (or copied by hand) may still be incomplete:
`latest_checkpoint` skips those and names them, and `checked_checkpoint` refuses them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

TRAINER_STATE = "trainer_state.json"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
# The config.json fields that decide a model's tensors: any difference and weights cannot load.
ARCHITECTURE = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
_TEMPORARY_PREFIX = "_tmp-"
_STEP = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def temporary_dir(output_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` is written before `publish` renames it into place.

    The checkpoint itself is the subfolder `checkpoint-<step>` of the returned folder, so the
    Trainer's own save writes it there unchanged.
    """
    return Path(output_dir) / f"{_TEMPORARY_PREFIX}{PREFIX_CHECKPOINT_DIR}-{step}"


def publish(staged: Path, output_dir: str | Path) -> Path:
    """Rename the fully written checkpoint folder `staged` into `output_dir`; returns its path.

    A checkpoint of the same step already there (left by a later run the user resumed before)
    is replaced. The temporary folder around `staged` is removed.
    """
    final = Path(output_dir) / staged.name
    if final.exists():
        old = staged.parent / "replaced"
        final.rename(old)
    staged.rename(final)
    shutil.rmtree(staged.parent, ignore_errors=True)
    return final


def remove_temporary(output_dir: str | Path) -> None:
    """Delete the temporary checkpoint folders a killed save left in `output_dir`."""
    folder = Path(output_dir)
    if folder.is_dir():
        for path in folder.glob(f"{_TEMPORARY_PREFIX}{PREFIX_CHECKPOINT_DIR}-*"):
            shutil.rmtree(path, ignore_errors=True)


def incomplete_reason(path: str | os.PathLike) -> str | None:
    """Why `path` is not a checkpoint a run can resume from, or None if it is one.

    A checkpoint is a folder holding a readable `trainer_state.json` and the model's weights
    (a weights file, or the subfolders DeepSpeed and FSDP save them in).
    """
    folder = Path(path)
    if not folder.exists():
        return "no such folder"
    if not folder.is_dir():
        return "it is a file, not a checkpoint folder"
    state = folder / TRAINER_STATE
    if not state.is_file():
        return f"it has no {TRAINER_STATE}"
    try:
        json.loads(state.read_text())
    except (ValueError, OSError):
        return f"its {TRAINER_STATE} is unreadable (cut short by a crash?)"
    has_weights = any((folder / name).is_file() for name in WEIGHT_FILES)
    if not has_weights and not any(child.is_dir() for child in folder.iterdir()):
        return "it has no model weights"
    return None


def checkpoint_step(path: str | Path) -> int:
    """The global step a checkpoint was saved at (from its `trainer_state.json`)."""
    return int(json.loads((Path(path) / TRAINER_STATE).read_text())["global_step"])


def checked_checkpoint(path: str | os.PathLike) -> str:
    """`path` as text if it is a checkpoint to resume from; else a ValueError saying what to fix."""
    reason = incomplete_reason(path)
    if reason is not None:
        raise ValueError(
            f"cannot resume from {path}: {reason}; give a {PREFIX_CHECKPOINT_DIR}-N folder that "
            f"an earlier run saved (or --resume for the latest intact one in --output-dir)"
        )
    return str(path)


def latest_checkpoint(output_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The intact checkpoint of `output_dir` with the highest step, and the newer ones skipped.

    Returns:
        The checkpoint folder (None when there is no intact one) and, for each incomplete
        checkpoint newer than it, a line `checkpoint-N (why)` for the caller to warn with.
    """
    folder = Path(output_dir)
    steps = {}
    if folder.is_dir():
        for child in folder.iterdir():
            match = _STEP.match(child.name)
            if match and child.is_dir():
                steps[int(match.group(1))] = child
    skipped: list[str] = []
    for step in sorted(steps, reverse=True):
        reason = incomplete_reason(steps[step])
        if reason is None:
            return steps[step], skipped
        skipped.append(f"{steps[step].name} ({reason})")
    return None, skipped


def resume_point(resume: str | os.PathLike | bool | None, output_dir: str | Path) -> str | None:
    """The checkpoint `Trainer.train(resume_from_checkpoint=resume)` resumes from, checked.

    Args:
        resume: None or False for a fresh start; True for the latest intact checkpoint of
            `output_dir` (incomplete newer ones are skipped with a warning); or a path.
        output_dir: The run's output folder.

    Raises:
        ValueError: The path is not a checkpoint, or True found no intact checkpoint.
    """
    if resume is None or resume is False:
        return None
    if resume is not True:
        return checked_checkpoint(resume)
    latest, skipped = latest_checkpoint(output_dir)
    for line in skipped:
        warnings.warn(f"skipping incomplete checkpoint {line}", stacklevel=3)
    if latest is None:
        raise ValueError(
            f"no intact checkpoint in {output_dir} to resume from; train without "
            f"resume_from_checkpoint to start a new run"
        )
    return str(latest)


def architecture_differences(checkpoint: str | Path, model_config: dict[str, Any]) -> list[str]:
    """`model NAME NEW (saved run: OLD)` for each `ARCHITECTURE` field that differs.

    Args:
        checkpoint: A checkpoint folder; one without `config.json` (a PEFT adapter's, whose
            base model is not saved) has nothing to compare.
        model_config: The model's `config.to_dict()`.
    """
    saved_file = Path(checkpoint) / "config.json"
    if not saved_file.is_file():
        return []
    saved = json.loads(saved_file.read_text())
    return [
        f"model {name} {model_config.get(name)!r} (saved run: {saved.get(name)!r})"
        for name in ARCHITECTURE
        if model_config.get(name) != saved.get(name)
    ]


def check_architecture(checkpoint: str | Path, model_config: dict[str, Any]) -> None:
    """Raise a ValueError naming every architecture field the model and checkpoint differ in."""
    differences = architecture_differences(checkpoint, model_config)
    if differences:
        raise ValueError(
            f"cannot resume {checkpoint} with this model: {'; '.join(differences)}; its weights "
            "do not fit. Resume with the model the run started from"
        )
