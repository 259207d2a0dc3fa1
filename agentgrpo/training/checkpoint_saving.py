"""Atomic checkpoint saves for transformers' Trainer: write a temporary folder, then rename it.

A process killed mid-save leaves only a temporary folder (removed at the next start, see
`checkpoints.remove_temporary`), never a `checkpoint-<step>` folder that looks whole but is not.
A save that fails because the folder is full, read-only or not writable raises
`run_folder.OutputDirUnwritable`, which says so; a failed checkpoint's temporary folder is
removed at once, so a full disk gets back the room it took.

Besides the Trainer's files, a checkpoint holds this process's torch thread count
(`thread_count`), the adaptive entropy controller's state (`LossStep.save`) and, with
`sync_ref_model`, the reference model (`SyncReference.save`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from agentgrpo import thread_count
from agentgrpo.models.reference_sync import SyncReference
from agentgrpo.placement import Placement
from agentgrpo.run_folder import explained_write_errors
from agentgrpo.training import checkpoints
from agentgrpo.training.loss_step import LossStep


class AtomicCheckpoints(Trainer):
    """transformers' `Trainer` whose checkpoint saves are atomic.

    The Trainer writes `checkpoint-<step>` inside `checkpoints.temporary_dir` (through
    `_get_output_dir`); once every process has written its files, the main process renames it
    into the output folder, then rotates old checkpoints and pushes to the Hub as the Trainer
    would have. A checkpoint also keeps the thread count, the loss step's state and the synced
    reference model.
    """

    _staging_dir: Path | None = None  # set while a checkpoint is being written
    loss_step: LossStep  # set by the trainer
    placement: Placement  # set by the trainer
    reference_sync: SyncReference | None = None  # set by the trainer with sync_ref_model
    model: Any  # a causal LM, possibly PEFT-wrapped

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Trainer's checkpoint save, written to a temporary folder and renamed when whole."""
        run_dir = super()._get_output_dir(trial)
        staging = checkpoints.temporary_dir(run_dir, self.state.global_step)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # left by a save killed at this step
        self.accelerator.wait_for_everyone()
        self._staging_dir = staging
        try:
            with explained_write_errors(run_dir):
                super()._save_checkpoint(model, trial)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            self._staging_dir = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            self._publish_checkpoint(
                staging / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}", run_dir
            )
        self.accelerator.wait_for_everyone()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's `save_model`; a folder that refuses writes is one clear error.

        A vision-language policy's processor is saved beside it, so the folder loads as a VLM.
        Under FSDP with sharded state dicts (`examples/accelerate/fsdp2.yaml`), where the
        Trainer saves no model at all, the whole weights are gathered and saved: the folder
        loads with `from_pretrained` whatever the engine. Checkpoints (`_internal_call`) stay
        sharded, as the Trainer writes them.
        """
        folder = output_dir or str(self.args.output_dir)
        with explained_write_errors(folder):
            if self.placement.fsdp_saves_shards and not _internal_call:
                self._save_gathered(folder, push=self.args.push_to_hub)
            else:
                super().save_model(output_dir, _internal_call)
            processor = getattr(self, "processor", None)
            if processor is not None and self.args.should_save:
                processor.save_pretrained(folder)

    def _save_gathered(self, folder: str, push: bool) -> None:
        """Save the whole weights, gathered from every process's shards; push them if asked."""
        state_dict = self.accelerator.get_state_dict(self.model)  # a collective
        if self.args.should_save:
            self._save(folder, state_dict=state_dict)
        if push:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _get_output_dir(self, trial: Any) -> str:
        """The temporary folder while a checkpoint is being written, else the Trainer's."""
        if self._staging_dir is not None:
            return str(self._staging_dir)
        return super()._get_output_dir(trial)

    def _publish_checkpoint(self, staged: Path, run_dir: str) -> None:
        """Point the state at the final folder, rename the checkpoint there, rotate, push."""
        best = self.state.best_model_checkpoint
        if best is not None and Path(best).parent == staged.parent:
            self.state.best_model_checkpoint = str(Path(run_dir) / Path(best).name)
            self.state.save_to_json(str(staged / checkpoints.TRAINER_STATE))
        final = checkpoints.publish(staged, run_dir)
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )
        if self.args.push_to_hub:
            super()._push_from_checkpoint(str(final))

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Push once the checkpoint is in its final folder (see `_publish_checkpoint`)."""
        if self._staging_dir is None:
            super()._push_from_checkpoint(checkpoint_folder)

    def _resume_point(self, resume_from_checkpoint: Any) -> str | None:
        """The checkpoint to resume from, checked, or None to start afresh.

        `resume_from_checkpoint` is a checkpoint folder, or True for the latest intact one in
        `output_dir` (incomplete ones are skipped with a warning); anything else that is not a
        checkpoint, or a checkpoint of another architecture, is a ValueError before training
        starts. A resumed run takes the torch thread count the checkpoint recorded (with a
        warning if that changes it; see `thread_count`).
        """
        checkpoint = checkpoints.resume_point(resume_from_checkpoint, str(self.args.output_dir))
        if checkpoint is not None:
            checkpoints.check_architecture(checkpoint, self.model.config.to_dict())
            thread_count.restore(checkpoint, self.args.process_index, self.args.world_size)
        return checkpoint

    def _save_rng_state(self, output_dir: str) -> None:
        """The Trainer's RNG states, and this process's torch thread count (`thread_count`)."""
        super()._save_rng_state(output_dir)
        thread_count.save(output_dir, self.args.process_index, self.args.world_size)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Trainer's save, plus the entropy controller's state and the synced reference."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            self.loss_step.save(output_dir)
        if self.reference_sync is not None:
            self.reference_sync.save(output_dir, writes=self.args.should_save)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Trainer's load, plus the entropy controller's state and the synced reference."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.loss_step.load(checkpoint)
            if self.reference_sync is not None:
                self.reference_sync.load(checkpoint)
