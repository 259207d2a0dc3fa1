"""A run's checkpoints, a part of the trainer: atomic saves, agentgrpo's own state, resumes.

transformers' Trainer saves and loads through hooks it calls on itself (`_save_checkpoint`,
`save_model`, `_get_output_dir`, `_save_rng_state`, ...). `GRPOTrainer` overrides each in a line
that calls `Checkpoints`, handing it the Trainer's own implementation of that hook (the
trainer's `super()` method); the logic lives here.

A checkpoint save is atomic: the Trainer writes `checkpoint-<step>` inside
`checkpoints.temporary_dir`, and once every process has written its files the main process
renames it into the output folder, then rotates old checkpoints and pushes to the Hub as the
Trainer would have. A process killed mid-save leaves only a temporary folder (removed at the
next start, see `checkpoints.remove_temporary`), never a `checkpoint-<step>` folder that looks
whole but is not. A save that fails because the folder is full, read-only or not writable raises
`run_folder.OutputDirUnwritable`, which says so; a failed checkpoint's temporary folder is
removed at once, so a full disk gets back the room it took.

Besides the Trainer's files, a checkpoint holds this process's torch thread count
(`thread_count`), the adaptive entropy controller's state (`LossStep.save`), with
`sync_ref_model` the reference model (`SyncReference.save`), and with `curriculum` the pass
counts of the training rows (`Curriculum.save`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from transformers import PreTrainedConfig, ProcessorMixin, Trainer, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from agentgrpo import run_folder, thread_count
from agentgrpo.models.reference_sync import SyncReference
from agentgrpo.placement import Placement
from agentgrpo.rounds.curriculum import Curriculum
from agentgrpo.run_folder import explained_write_errors
from agentgrpo.training import checkpoints
from agentgrpo.training.loss_step import LossStep

if TYPE_CHECKING:
    from agentgrpo.training.trainer import GRPOTrainer


class Checkpoints:
    """The run's checkpoints: written whole or not at all, with agentgrpo's state; resumed checked.

    A method named after a Trainer hook (`save_model`, `save_rng_state`, ...) is that hook, and
    takes `base`, the Trainer's own implementation of it, which it runs inside.

    Args:
        args: The run's config (`output_dir`, `should_save`, `save_total_limit`, the Hub's).
        accelerator: The trainer's accelerator: barriers, and the whole state dict of shards.
        placement: The launch: whether FSDP saves sharded state dicts.
        loss_step: Its entropy controller's state is saved and loaded with the optimizer's.
        reference_sync: With `sync_ref_model`, the synced reference, saved and loaded likewise.
        processor: A vision-language policy's processor, saved beside its weights; else None.
        state: Returns the Trainer's state now (`Trainer.train` replaces it).
        model: Returns the policy as the Trainer holds it now (the Trainer may replace it).
        save_weights: Writes a state dict's weights into a folder (the Trainer's `_save`).
        push_to_hub: The Trainer's `push_to_hub`.
        push_checkpoint: Pushes a checkpoint folder (the Trainer's `_push_from_checkpoint`).
        curriculum: With `curriculum`, the rows' pass counts, saved and loaded likewise.
    """

    def __init__(
        self,
        args: TrainingArguments,
        accelerator: Accelerator,
        placement: Placement,
        loss_step: LossStep,
        reference_sync: SyncReference | None,
        processor: ProcessorMixin | None,
        *,
        state: Callable[[], TrainerState],
        model: Callable[[], torch.nn.Module | None],
        save_weights: Callable[[str, dict[str, torch.Tensor]], None],
        push_to_hub: Callable[..., object],
        push_checkpoint: Callable[[str], None],
        curriculum: Curriculum | None = None,
    ) -> None:
        self.args, self.accelerator, self.placement = args, accelerator, placement
        self.loss_step, self.reference_sync, self.processor = loss_step, reference_sync, processor
        self._state, self._model = state, model
        self._save_weights, self._push_to_hub = save_weights, push_to_hub
        self._push_checkpoint = push_checkpoint
        self.curriculum = curriculum
        self._staging: Path | None = None  # set while a checkpoint is being written

    @classmethod
    def of(
        cls,
        trainer: GRPOTrainer,
        placement: Placement,
        loss_step: LossStep,
        reference_sync: SyncReference | None,
        processor: ProcessorMixin | None,
    ) -> Checkpoints:
        """The checkpoints of `trainer`'s run, which reads its state and model when it needs them.

        `trainer`'s hooks forward to it; what else it calls of the Trainer is transformers' own.
        Its round parts' curriculum (if any) is saved with the optimizer.
        """
        return cls(
            trainer.args,
            trainer.accelerator,
            placement,
            loss_step,
            reference_sync,
            processor,
            state=lambda: trainer.state,
            model=lambda: trainer.model,
            save_weights=trainer._save,
            push_to_hub=trainer.push_to_hub,
            push_checkpoint=functools.partial(Trainer._push_from_checkpoint, trainer),
            curriculum=trainer._round_parts.curriculum,
        )

    @contextlib.contextmanager
    def staged(self, run_dir: str) -> Iterator[None]:
        """Around the Trainer's checkpoint save: write it in a temporary folder, rename when whole.

        Every process runs it. Once every process has written its files, the main process
        points the state at the final folder, renames the checkpoint into `run_dir`, rotates
        old checkpoints and, with `push_to_hub`, pushes it (the Trainer's
        `_push_from_checkpoint`). A save that fails leaves no temporary folder behind.
        """
        state = self._state()
        staging = checkpoints.temporary_dir(run_dir, state.global_step)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # left by a save killed at this step
        self.accelerator.wait_for_everyone()
        self._staging = staging
        try:
            with explained_write_errors(run_dir):
                yield
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            self._staging = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            staged = staging / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            self._publish(staged, run_dir, state)
        self.accelerator.wait_for_everyone()

    def _publish(self, staged: Path, run_dir: str, state: TrainerState) -> None:
        """Point the state at the final folder, rename the checkpoint there, rotate, push."""
        best = state.best_model_checkpoint
        if best is not None and Path(best).parent == staged.parent:
            state.best_model_checkpoint = str(Path(run_dir) / Path(best).name)
            state.save_to_json(str(staged / checkpoints.TRAINER_STATE))
        final = checkpoints.publish(staged, run_dir)
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=state.best_model_checkpoint,
            use_mtime=True,
        )
        if self.args.push_to_hub:
            self._push_checkpoint(str(final))

    def get_output_dir(self, trial: Any, base: Callable[[Any], str]) -> str:
        """`_get_output_dir`: the checkpoint's temporary folder while `staged`, else the Trainer's.

        So the Trainer writes the checkpoint inside the folder `staged` made for it.
        """
        return base(trial) if self._staging is None else str(self._staging)

    def push_from_checkpoint(self, folder: str, base: Callable[[str], None]) -> None:
        """`_push_from_checkpoint`: the Trainer's push, once the checkpoint is in its final folder.

        While a checkpoint is staged, `staged` pushes it from the final folder instead.
        """
        if self._staging is None:
            base(folder)

    def save_model(
        self, output_dir: str | None, internal: bool, base: Callable[[str | None, bool], None]
    ) -> None:
        """`save_model`: the Trainer's; a folder that refuses writes is one clear error.

        A vision-language policy's processor is saved beside it, so the folder loads as a VLM.
        Under FSDP with sharded state dicts (`examples/accelerate/fsdp2.yaml`), where the
        Trainer saves no model at all, the whole weights are gathered and saved: the folder
        loads with `from_pretrained` whatever the engine. Checkpoints (`internal`, the Trainer's
        `_internal_call`) stay sharded, as the Trainer writes them.
        """
        folder = output_dir or str(self.args.output_dir)
        with explained_write_errors(folder):
            if self.placement.fsdp_saves_shards and not internal:
                self._save_gathered(folder, push=self.args.push_to_hub)
            else:
                base(output_dir, internal)
            if self.processor is not None and self.args.should_save:
                self.processor.save_pretrained(folder)

    def _save_gathered(self, folder: str, push: bool) -> None:
        """Save the whole weights, gathered from every process's shards; push them if asked."""
        state_dict = self.accelerator.get_state_dict(self._model())  # a collective
        if self.args.should_save:
            self._save_weights(folder, state_dict)
        if push:
            self._push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    @contextlib.contextmanager
    def output_dir_held(self) -> Iterator[None]:
        """While training: the output folder locked, the temporary folders of killed saves gone.

        On the main process only (`should_save`): a second run into the folder fails at once
        with `run_folder.OutputDirBusy` (`run_folder.hold`).
        """
        if not self.args.should_save:
            yield
            return
        output_dir = str(self.args.output_dir)  # TrainingArguments always sets one
        with run_folder.hold(output_dir):
            checkpoints.remove_temporary(output_dir)
            yield

    def resume_point(
        self,
        resume_from_checkpoint: str | os.PathLike | bool | None,
        model_config: PreTrainedConfig,
    ) -> str | None:
        """The checkpoint to resume from, checked, or None to start afresh.

        `resume_from_checkpoint` is a checkpoint folder, or True for the latest intact one in
        `output_dir` (incomplete ones are skipped with a warning); anything else that is not a
        checkpoint, or a checkpoint of another architecture than `model_config`'s, is a
        ValueError before training starts. A resumed run takes the torch thread count the
        checkpoint recorded (with a warning if that changes it; see `thread_count`).
        """
        checkpoint = checkpoints.resume_point(resume_from_checkpoint, str(self.args.output_dir))
        if checkpoint is not None:
            checkpoints.check_architecture(checkpoint, model_config.to_dict())
            thread_count.restore(checkpoint, self.args.process_index, self.args.world_size)
        return checkpoint

    def save_rng_state(self, output_dir: str, base: Callable[[str], None]) -> None:
        """`_save_rng_state`: the Trainer's RNG states, and this process's torch thread count."""
        base(output_dir)
        thread_count.save(output_dir, self.args.process_index, self.args.world_size)

    def save_optimizer(self, output_dir: str, base: Callable[[str], None]) -> None:
        """`_save_optimizer_and_scheduler`: the Trainer's, and agentgrpo's state beside it.

        The entropy controller, the synced reference and the curriculum's pass counts.
        """
        base(output_dir)
        if self.args.should_save:
            self.loss_step.save(output_dir)
            if self.curriculum is not None:  # the same on every process: the main one writes it
                self.curriculum.save(output_dir)
        if self.reference_sync is not None:
            self.reference_sync.save(output_dir, writes=self.args.should_save)

    def load_optimizer(self, checkpoint: str | None, base: Callable[[str | None], None]) -> None:
        """`_load_optimizer_and_scheduler`: the Trainer's, and agentgrpo's state beside it.

        A checkpoint of a run without `curriculum` has no pass counts: the curriculum then
        starts from none, with a warning.
        """
        base(checkpoint)
        if checkpoint is not None:
            self.loss_step.load(checkpoint)
            if self.curriculum is not None and not self.curriculum.load(checkpoint):
                warnings.warn(
                    f"{checkpoint} holds no curriculum pass counts (its run had curriculum off): "
                    "the curriculum starts from none",
                    stacklevel=2,
                )
            if self.reference_sync is not None:
                self.reference_sync.load(checkpoint)
