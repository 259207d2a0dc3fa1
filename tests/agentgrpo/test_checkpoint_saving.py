"""The trainer's checkpoints are a part it holds: atomic saves that run without a Trainer."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import Trainer, TrainerState

from agentgrpo.placement import Placement
from agentgrpo.training.checkpoint_saving import Checkpoints
from agentgrpo.training.trainer import GRPOTrainer
from agentgrpo.training.trl_attributes import TRLAttributes


def checkpoints_of(output_dir: Path, state: TrainerState, pushed: list[str]) -> Checkpoints:
    """A main process's `Checkpoints` over fakes: one process, pushes recorded, no Trainer."""
    args = SimpleNamespace(
        output_dir=str(output_dir), should_save=True, save_total_limit=None, push_to_hub=True
    )
    return Checkpoints(
        args,  # the fields it reads
        SimpleNamespace(wait_for_everyone=lambda: None),  # one process
        Placement(),
        SimpleNamespace(),  # the loss step: no state is saved here
        None,
        None,
        state=lambda: state,
        model=lambda: None,
        save_weights=lambda folder, state_dict: None,
        push_to_hub=lambda **kwargs: None,
        push_checkpoint=pushed.append,
    )


def trainer_save(checkpoints: Checkpoints, run_dir: Path, step: int) -> Path:
    """What transformers' `_save_checkpoint` does: write into `_get_output_dir`'s folder."""
    folder = (
        Path(checkpoints.get_output_dir(None, lambda trial: str(run_dir))) / f"checkpoint-{step}"
    )
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    checkpoints.push_from_checkpoint(str(folder), lambda folder: pytest.fail("pushed while staged"))
    return folder


def test_a_checkpoint_is_written_aside_and_renamed_into_the_run_folder_once_whole(tmp_path):
    state, pushed = TrainerState(global_step=3), []
    checkpoints = checkpoints_of(tmp_path, state, pushed)
    with checkpoints.staged(str(tmp_path)):
        written = trainer_save(checkpoints, tmp_path, 3)
        assert written.parent != tmp_path and not (tmp_path / "checkpoint-3").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]
    assert (tmp_path / "checkpoint-3" / "model.safetensors").read_bytes() == b"weights"
    assert pushed == [str(tmp_path / "checkpoint-3")]  # pushed from the final folder only
    assert checkpoints.get_output_dir(None, lambda trial: "the Trainer's") == "the Trainer's"


def test_a_checkpoint_save_that_fails_leaves_no_folder_behind(tmp_path):
    checkpoints = checkpoints_of(tmp_path, TrainerState(global_step=2), pushed := [])
    with pytest.raises(RuntimeError, match="killed"), checkpoints.staged(str(tmp_path)):
        trainer_save(checkpoints, tmp_path, 2)
        raise RuntimeError("killed mid-save")
    assert list(tmp_path.iterdir()) == [] and pushed == []


def test_the_trainer_holds_its_checkpoints_and_inherits_only_the_trainer_and_trl_attributes():
    assert GRPOTrainer.__mro__[1:3] == (TRLAttributes, Trainer)
    assert not any("Checkpoint" in cls.__name__ for cls in GRPOTrainer.__mro__)
