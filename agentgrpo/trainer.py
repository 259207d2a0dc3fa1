"""GRPOTrainer: TRL's GRPOTrainer interface on transformers' Trainer, with agentgrpo's engine.

The training step reads as its stages. Every `steps_per_generation` micro-batches a generation
round plays the rows through the rollout engine (`rounds.play_round`: episodes run concurrently,
each group scored as it ends), turns rewards into group-relative advantages
(`advantages.group_advantages`), lays the episodes out as tensors (`batch.collate_episodes`) and
splits them into micro-batches. Each micro-batch's loss is `losses.policy_loss` over mask-1
tokens only. transformers' Trainer does the rest: optimizer, schedule, accumulation, checkpoints,
callbacks, logging, `save_model` and `push_to_hub`.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from agentgrpo import checkpoints
from agentgrpo.advantages import combine_rewards, group_advantages
from agentgrpo.batch import TrainingBatch, collate_episodes
from agentgrpo.config import GRPOConfig
from agentgrpo.data import episodes_from_rollout_func, rows_collator, training_rows
from agentgrpo.logprobs import batched_logprobs, completion_logprobs
from agentgrpo.losses import LossConfig, normalises_by_num_items, policy_loss
from agentgrpo.metrics import episode_stats, round_metrics
from agentgrpo.models import SyncReference, load_policy, load_tokenizer, reference_model
from agentgrpo.reward_calls import TRAINER_ARGUMENTS, check_arguments, reward_functions
from agentgrpo.rounds import Scorer, environment_reward_name, play_round
from agentgrpo.run_log import EpisodeLog
from agentgrpo.sampler import RoundSampler
from agentgrpo.token_weights import (
    entropy_from_logits,
    off_policy_sequence_mask,
    sampler_correction,
    top_entropy_mask,
)
from agentgrpo.warm_start import environment_demonstrations, warm_start
from agentgrpo.weight_sync import build_generator
from rollout import Episode, EpisodeConfig, EpisodeRecord, RolloutEngine


class GRPOTrainer(Trainer):
    """Train a causal LM with GRPO on single-turn prompts or multi-turn tool-calling episodes.

    Accepts the arguments of TRL's `GRPOTrainer` with the same meanings, so a TRL script ports
    by changing its import.

    Args:
        model: A hub id or local path, a `PreTrainedModel`, or a `PeftModel`.
        reward_funcs: A reward function, a sequence-classification model (or its id/path), or a
            list of those. Optional when the environment scores itself (`reward`/`get_reward`).
        args: A `GRPOConfig`; defaults to one writing to `<model name>-GRPO`.
        train_dataset: Rows with a `prompt` (text, or a list of messages) and any other columns,
            which reward functions and the environment's `reset` receive by name.
        eval_dataset: Like `train_dataset`, or a dict of them.
        processing_class: The tokenizer; loaded from the model when None.
        reward_processing_classes: Tokenizers of reward models, by position.
        callbacks: transformers `TrainerCallback`s.
        optimizers: `(optimizer, lr_scheduler)`, as for `Trainer`.
        peft_config: A PEFT config; the model is trained through that adapter.
        tools: Plain tool functions (typed, Google-style docstrings), offered in every episode.
        rollout_func: `rollout_func(prompts, trainer) -> dict` replacing the engine (see
            `data.episodes_from_rollout_func` for the dict).
        environment_factory: An environment class (or zero-argument factory): each episode plays
            against a fresh instance whose public methods are tools.
    """

    _tag_names = ("trl", "grpo", "agentgrpo")

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        rollout_func: Callable[[list[Any], GRPOTrainer], Mapping[str, Any]] | None = None,
        environment_factory: Callable[[], Any] | None = None,
    ):
        args = args or GRPOConfig(output_dir=f"{_model_name(model)}-GRPO")
        if isinstance(environment_factory, Mapping):
            raise ValueError(
                "a dict of environment factories is not supported; pass one environment class"
            )
        model = load_policy(model, args, peft_config)
        tokenizer = load_tokenizer(model, processing_class)
        self.reward_funcs = reward_functions(reward_funcs or [], reward_processing_classes)
        self.rollout_func = rollout_func
        super().__init__(
            model=model,
            args=args,
            data_collator=rows_collator,
            train_dataset=training_rows(train_dataset, environment_factory, _rows_needed(args)),
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.model_accepts_loss_kwargs = False  # compute_loss normalises; Trainer divides by GA
        self._metrics: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.ref_model = reference_model(self.model, args)
        if args.sync_ref_model:
            self._sync_reference()
        self._environment_factory = environment_factory
        self.engine = self._build_engine(tools or [], environment_factory)
        self.scorer = self._build_scorer(environment_factory)
        self._check_reward_weights()
        self._check_reward_arguments(environment_factory is not None)
        self.loss_config = _loss_config(args)
        self._buffer: list[TrainingBatch] = []
        self._micro_index: int | None = None
        self._step_seconds = 0.0
        self._last_episodes: list[tuple[Episode, float]] = []
        self._last_records: list[EpisodeRecord] = []
        if self.args.log_episodes:
            self.add_callback(EpisodeLog(self))
        self._staging_dir: Path | None = None  # set while a checkpoint is being written

    # ------------------------------------------------------------------ set-up

    def _sync_reference(self) -> None:
        if self.ref_model is None:
            raise ValueError(
                "sync_ref_model mixes the policy into a separate reference model, but with PEFT "
                "the reference is the base model under the adapter; turn sync_ref_model off"
            )
        unwrapped = self.accelerator.unwrap_model(self.model)
        self.add_callback(
            SyncReference(
                self.ref_model,
                unwrapped,
                self.args.ref_model_mixup_alpha,
                self.args.ref_model_sync_steps,
            )
        )

    def _build_engine(self, tools: Sequence[Callable[..., Any]], factory: Any) -> RolloutEngine:
        args = self.args
        backend, self.weight_sync = build_generator(
            self.model, self.processing_class, args, self.accelerator
        )
        return RolloutEngine(
            backend,
            self.processing_class,
            environment_factory=factory,
            tools=tools,
            chat_template=args.chat_template,
            tool_call_parser=args.tool_call_parser,
            chat_template_kwargs=args.chat_template_kwargs,
            config=EpisodeConfig(
                max_completion_length=args.max_completion_length,
                max_turns=args.episode_max_turns,
                tool_timeout_s=args.tool_timeout_s,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k or 0,
            ),
            max_concurrent_episodes=args.max_concurrent_episodes,
        )

    def _build_scorer(self, factory: Any) -> Scorer:
        env_reward_name = environment_reward_name(factory)
        if not self.reward_funcs and env_reward_name is None:
            raise ValueError(
                "no reward: pass reward_funcs, or an environment with a reward()/get_reward() "
                "method"
            )
        pending = self._metrics
        return Scorer(
            funcs=self.reward_funcs,
            env_reward_name=env_reward_name,
            with_environments=factory is not None,
            text_completions=not self.engine.context.has_tools,
            decode=lambda ids: self.processing_class.decode(ids, skip_special_tokens=True),
            trainer_state=lambda: self.state,
            log_extra=lambda column, values: None,
            log_metric=lambda name, value: pending[self._mode][name].append(float(value)),
        )

    def _check_reward_weights(self) -> None:
        weights = self.args.reward_weights
        if weights is not None and len(weights) != len(self.scorer.names):
            raise ValueError(
                f"reward_weights has {len(weights)} values but there are "
                f"{len(self.scorer.names)} rewards ({', '.join(self.scorer.names)})"
            )

    def _check_reward_arguments(self, with_environments: bool) -> None:
        """Fail before the first rollout if a reward function names an argument never passed."""
        if self.rollout_func is not None:
            return  # its extra fields are known only once it runs
        available = [a for a in TRAINER_ARGUMENTS if with_environments or a != "environments"]
        check_arguments(self.reward_funcs, available + _columns(self.train_dataset))

    @property
    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    # ------------------------------------------------------------------ train, resume, save

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`, after the warm start when `warm_start_steps` > 0.

        `resume_from_checkpoint` is a checkpoint folder, or True for the latest intact one in
        `output_dir` (incomplete ones are skipped with a warning); anything else that is not a
        checkpoint is a ValueError before training starts. A resumed run skips the warm start:
        its checkpoint already holds warm-started weights. Temporary folders that a killed
        checkpoint save left are removed first. A Ctrl-C stops training at once (the
        KeyboardInterrupt propagates); the checkpoints already saved stay intact.
        """
        checkpoint = checkpoints.resume_point(resume_from_checkpoint, self.args.output_dir)
        if self.args.should_save:
            checkpoints.remove_temporary(self.args.output_dir)
        if self.args.warm_start_steps and checkpoint is None:
            self._warm_start()
        return super().train(checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Trainer's checkpoint save, made atomic: write a temporary folder, then rename it.

        The Trainer writes `checkpoint-<step>` inside `checkpoints.temporary_dir` (through
        `_get_output_dir`); once every process has written its files, the main process renames
        it into the output folder, then rotates old checkpoints and pushes to the Hub as the
        Trainer would have.
        """
        run_dir = super()._get_output_dir(trial)
        staging = checkpoints.temporary_dir(run_dir, self.state.global_step)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # left by a save killed at this step
        self.accelerator.wait_for_everyone()
        self._staging_dir = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_dir = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            self._publish_checkpoint(
                staging / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}", run_dir
            )
        self.accelerator.wait_for_everyone()

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

    # ------------------------------------------------------------------ warm start

    def _warm_start(self) -> None:
        steps = self.args.warm_start_steps
        conversations = environment_demonstrations(
            self._environment_factory, steps, seed=self.args.seed
        )
        show = self.is_world_process_zero()

        def log(step: int, loss: float) -> None:
            if show:
                print(f"warm start {step + 1}/{steps}: loss {loss:.3f}", flush=True)

        self.model.to(self.args.device)
        warm_start(
            self.model,
            self.engine.context.renderer,
            conversations,
            self.args.warm_start_learning_rate,
            stop_text=self.processing_class.eos_token,
            log=log,
        )

    # ------------------------------------------------------------------ data

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """Rows round by round (see `RoundSampler`); each process gets whole groups."""
        args = self.args
        per_process = _prompts_per_process(
            args.generation_batch_size, args.num_generations, args.world_size
        )
        sampler = RoundSampler(
            len(self.train_dataset),
            per_process,
            args.world_size,
            repeats=args.steps_per_generation * args.num_iterations,
            shuffle=args.shuffle_dataset,
            seed=args.seed,
        )
        return self._rows_loader(self.train_dataset, per_process, sampler)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        """Eval rows, `per_device_eval_batch_size / num_generations_eval` prompts a process."""
        args = self.args
        if isinstance(eval_dataset, str):
            dataset = self.eval_dataset[eval_dataset]
        else:
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        per_process = _prompts_per_process(
            args.per_device_eval_batch_size * args.world_size,
            self._eval_generations,
            args.world_size,
        )
        sampler = RoundSampler(len(dataset), per_process, args.world_size, 1, shuffle=False)
        return self._rows_loader(dataset, per_process, sampler)

    def _rows_loader(self, dataset, batch_size, sampler) -> torch.utils.data.DataLoader:
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=rows_collator,
            num_workers=self.args.dataloader_num_workers,
        )
        return self.accelerator.prepare(loader)

    @property
    def _eval_generations(self) -> int:
        return self.args.num_generations_eval or self.args.num_generations

    # ------------------------------------------------------------------ generation

    def _prepare_inputs(self, rows: list[Mapping[str, Any]]) -> TrainingBatch:
        """The micro-batch to train on: a fresh round every `steps_per_generation` calls."""
        if not self.model.training:
            return self._generate_round(rows, self._eval_generations)[0]
        repeats = self.args.steps_per_generation * self.args.num_iterations
        if self._micro_index is None:  # (re)started: continue where the checkpoint left off
            self._micro_index = self.state.global_step * self.args.gradient_accumulation_steps
        position = self._micro_index % repeats
        if position == 0 or not self._buffer:
            self._buffer = self._generate_round(rows, self.args.num_generations)
        self._micro_index += 1
        return self._buffer[position % self.args.steps_per_generation]

    def _generate_round(self, rows: list[Mapping[str, Any]], num_generations: int) -> list:
        """Play, score and batch one round; returns its micro-batches (one in eval)."""
        mode = self._mode
        # Only ints: Python salts the hash of strings per interpreter, which would break
        # reproducibility across runs (and checkpoint resumes).
        seed = hash(
            (
                self.args.seed,
                mode == "train",
                self.state.global_step,
                self.accelerator.process_index,
            )
        )
        with (
            self._generation_weights() as model,
            self.weight_sync.generating(model, self.state.global_step),
        ):
            episodes, rewards_N_F = self._play(rows, num_generations, seed % 2**31)
        rewards_N = self._combined_rewards(rewards_N_F, num_generations)
        advantages_N = self._local_advantages(rewards_N, num_generations)
        self._record_round(episodes, rewards_N_F, rewards_N, advantages_N, num_generations)
        batch = collate_episodes(
            episodes,
            advantages_N,
            self.processing_class.pad_token_id,
            self.args.mask_truncated_completions,
        )
        batch = self._with_reference_logprobs(batch)
        if mode == "eval":
            return [replace(batch, num_items=self._global_tokens(batch))]
        return self._micro_batches(batch)

    def _play(
        self, rows: list[Mapping[str, Any]], num_generations: int, seed: int
    ) -> tuple[list[Episode], torch.Tensor]:
        if self.rollout_func is None:
            return anyio.run(play_round, self.engine, rows, num_generations, seed, self.scorer)
        output = self.rollout_func([row.get("prompt") for row in rows], self)
        backend = self.engine.context.backend
        episodes = episodes_from_rollout_func(
            output,
            rows,
            num_generations,
            set(backend.stop_token_ids),
            lambda ids: self.processing_class.decode(ids, skip_special_tokens=True),
        )
        groups = [
            episodes[g : g + num_generations] for g in range(0, len(episodes), num_generations)
        ]

        async def score_all() -> list[torch.Tensor]:
            return [await self.scorer.score_group(group) for group in groups]

        return episodes, torch.cat(anyio.run(score_all))

    @contextlib.contextmanager
    def _generation_weights(self):
        """Generate in eval mode (no dropout, KV cache on), with ZeRO-3 weights gathered.

        Yields the unwrapped policy.
        """
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        gather = contextlib.nullcontext()
        if self.is_deepspeed_enabled and self.args.ds3_gather_for_generation:
            import deepspeed

            if getattr(self.accelerator.state.deepspeed_plugin, "zero_stage", 0) == 3:
                gather = deepspeed.zero.GatheredParameters(list(model.parameters()))
        try:
            with gather:
                yield model
        finally:
            model.train(was_training)

    # ------------------------------------------------------------------ rewards

    def _combined_rewards(self, rewards_N_F: torch.Tensor, num_generations: int) -> torch.Tensor:
        weights = self.args.reward_weights or [1.0] * rewards_N_F.shape[1]
        rewards_N = combine_rewards(
            rewards_N_F,
            torch.tensor(weights, dtype=torch.float32),
            num_generations,
            self.args.multi_objective_aggregation,
        )
        if rewards_N.isnan().any():
            warnings.warn(
                "every reward function returned None for some completions; they get reward 0",
                stacklevel=2,
            )
            rewards_N = rewards_N.nan_to_num(0.0)
        return rewards_N

    def _local_advantages(self, rewards_N: torch.Tensor, num_generations: int) -> torch.Tensor:
        """Advantages over all processes' rewards (needed for batch std), this process's share."""
        everyone_N = self.accelerator.gather(rewards_N.to(self.accelerator.device)).cpu()
        scale = self.args.scale_rewards
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            scale = "batch"  # each reward was normalised per group already (GDPO)
        advantages_N = group_advantages(everyone_N, num_generations, scale)
        start = self.accelerator.process_index * len(rewards_N)
        return advantages_N[start : start + len(rewards_N)]

    # ------------------------------------------------------------------ batches

    def _with_reference_logprobs(self, batch: TrainingBatch) -> TrainingBatch:
        """Add old logprobs (several updates per round) and reference logprobs (beta > 0)."""
        args, rows = self.args, self.args.per_device_train_batch_size
        updates_per_round = args.steps_per_generation // args.gradient_accumulation_steps
        if self.model.training and (args.num_iterations > 1 or updates_per_round > 1):
            batch = replace(
                batch, old_logprobs_B_C=batched_logprobs(self.model, batch, args.temperature, rows)
            )
        if args.beta != 0.0:
            batch = replace(batch, ref_logprobs_B_C=self._reference_logprobs(batch))
        return batch

    def _reference_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        rows = self.args.per_device_train_batch_size
        if self.ref_model is not None:
            return batched_logprobs(self.ref_model, batch, self.args.temperature, rows)
        with self.accelerator.unwrap_model(self.model).disable_adapter():  # PEFT: base model
            return batched_logprobs(self.model, batch, self.args.temperature, rows)

    def _micro_batches(self, batch: TrainingBatch) -> list[TrainingBatch]:
        """Shuffle the round and cut it into `steps_per_generation` micro-batches."""
        order = torch.randperm(len(batch)).tolist()
        size = self.args.per_device_train_batch_size
        # The token losses divide by an optimizer step's active tokens over all processes: a
        # round holds steps_per_generation / gradient_accumulation_steps steps' worth.
        steps_in_round = self.args.steps_per_generation / self.args.gradient_accumulation_steps
        num_items = self._global_tokens(batch) / steps_in_round
        return [
            replace(batch.select(order[i : i + size]), num_items=num_items)
            for i in range(0, len(batch), size)
        ]

    def _global_tokens(self, batch: TrainingBatch) -> float:
        local = batch.loss_mask_B_C.sum().to(self.accelerator.device)
        return float(self.accelerator.gather(local.reshape(1)).sum())

    # ------------------------------------------------------------------ loss

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: TrainingBatch,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The GRPO loss of one micro-batch, over its mask-1 tokens only."""
        batch, args = inputs, self.args
        logprobs_B_C, logits_B_C_V = completion_logprobs(model, batch, args.temperature, True)
        entropy_B_C = entropy_from_logits(logits_B_C_V.detach())
        del logits_B_C_V
        old_B_C = batch.old_logprobs_B_C
        if old_B_C is None:  # one update per round: the generating policy is the current one
            old_B_C = logprobs_B_C.detach()
        output = policy_loss(
            logprobs_B_C,
            old_B_C,
            batch.advantages_B,
            batch.loss_mask_B_C,
            self.loss_config,
            ref_logprobs_B_T=batch.ref_logprobs_B_C,
            sampler_weights_B_T=self._token_weights(
                batch, logprobs_B_C.detach(), old_B_C, entropy_B_C
            ),
            num_items=batch.num_items,
            entropy_B_T=entropy_B_C,
        )
        self._record_loss_metrics(output.metrics)
        return output.loss * self._loss_scale()

    def _record_loss_metrics(self, metrics: Mapping[str, torch.Tensor]) -> None:
        """Average each loss metric over the processes (one gather for all of them)."""
        names = sorted(metrics)
        local_1_M = torch.stack([metrics[n].float().reshape(()) for n in names]).unsqueeze(0)
        everyone_P_M = self.accelerator.gather(local_1_M.to(self.accelerator.device)).cpu()
        for name, value in zip(names, everyone_P_M.nanmean(0).tolist(), strict=True):
            self._metrics[self._mode][name].append(value)

    def _token_weights(
        self,
        batch: TrainingBatch,
        logprobs_B_C: torch.Tensor,
        old_B_C: torch.Tensor,
        entropy_B_C: torch.Tensor,
    ) -> torch.Tensor | None:
        """Per-token weights on the policy term: entropy filter, off-policy mask, IS correction."""
        args, mask_B_C = self.args, batch.loss_mask_B_C
        weights_B_C = torch.ones_like(mask_B_C)
        if args.top_entropy_quantile < 1.0:
            weights_B_C = weights_B_C * top_entropy_mask(
                entropy_B_C, mask_B_C, args.top_entropy_quantile
            )
        if args.off_policy_mask_threshold is not None:
            keep_B = off_policy_sequence_mask(
                logprobs_B_C,
                batch.sampler_logprobs_B_C,
                batch.advantages_B,
                mask_B_C,
                args.off_policy_mask_threshold,
            )
            weights_B_C = weights_B_C * keep_B.unsqueeze(-1)
        if args.use_vllm and args.vllm_importance_sampling_correction:
            weights_B_C = weights_B_C * sampler_correction(
                old_B_C,
                batch.sampler_logprobs_B_C,
                mask_B_C,
                args.vllm_importance_sampling_mode,
                args.vllm_importance_sampling_clip_max,
                args.vllm_importance_sampling_clip_min,
            )
        return weights_B_C

    def _loss_scale(self) -> float:
        """Undo the Trainer's division by accumulation steps and DDP's mean for token losses."""
        if not self.model.training or not normalises_by_num_items(self.args.loss_type):
            return 1.0
        return self.current_gradient_accumulation_steps * self.accelerator.num_processes

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Trainer's step, timed: `step_time` covers generation and the update."""
        started = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_seconds += time.perf_counter() - started
        if self.accelerator.sync_gradients:
            self._metrics["train"]["step_time"].append(self._step_seconds)
            self._step_seconds = 0.0
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation: generate with `num_generations_eval`, score, and report the loss."""
        with torch.no_grad():
            batch = self._prepare_inputs(inputs)
            loss = self.compute_loss(model, batch)
        return loss.detach(), None, None

    # ------------------------------------------------------------------ logging

    def _record_round(
        self, episodes, rewards_N_F, rewards_N, advantages_N, num_generations
    ) -> None:
        device = self.accelerator.device
        gather = lambda t: self.accelerator.gather(t.to(device)).cpu()  # noqa: E731
        metrics = round_metrics(
            gather(episode_stats(episodes)),
            gather(rewards_N_F),
            gather(rewards_N),
            self.scorer.names,
            num_generations,
            self.args.scale_rewards == "batch",
        )
        mode = self._mode
        if mode == "train":
            self.state.num_input_tokens_seen += int(metrics.pop("num_tokens_round"))
            metrics["num_tokens"] = self.state.num_input_tokens_seen
        else:
            metrics.pop("num_tokens_round")
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)
        self._last_episodes = list(zip(episodes, rewards_N.tolist(), strict=True))
        if mode == "train":
            self._last_records = self._episode_records(
                episodes, rewards_N_F, rewards_N, advantages_N
            )

    def _episode_records(
        self, episodes, rewards_N_F, rewards_N, advantages_N
    ) -> list[EpisodeRecord]:
        """The round's episodes with their scores, generated by this global step's weights."""
        names = self.scorer.names
        scores = zip(rewards_N_F.tolist(), rewards_N.tolist(), advantages_N.tolist(), strict=True)
        return [
            EpisodeRecord(
                episode,
                {n: None if math.isnan(r) else r for n, r in zip(names, rewards_F, strict=True)},
                reward,
                advantage,
                policy_version=self.state.global_step,
                process=self.accelerator.process_index,
            )
            for episode, (rewards_F, reward, advantage) in zip(episodes, scores, strict=True)
        ]

    @property
    def last_records(self) -> list[EpisodeRecord]:
        """The latest training round's episodes on this process, as the episode record holds them.

        Each has its per-function rewards (None where a function returned None), the combined
        reward, the advantage the loss used, and `policy_version`: the global step the round
        was generated at (it is first trained at the next step). Empty before the first round;
        replaced, never mutated, by the next training round (eval rounds leave it alone).
        """
        return self._last_records

    @property
    def last_episodes(self) -> list[tuple[Episode, float]]:
        """The latest round's episodes on this process (train or eval), each with its reward.

        Rewards are the combined (weighted) totals. Empty before the first round. Read-only:
        the list is replaced, never mutated, by the next round.
        """
        return self._last_episodes

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the averaged GRPO metrics gathered since the last log, under TRL's names."""
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        prefix = "eval_" if mode == "eval" else ""
        for name, values in self._metrics[mode].items():
            logs[prefix + name] = sum(values) / len(values)
        self._metrics[mode].clear()
        if self.args.log_completions and self.accelerator.is_main_process:
            self._print_completions()
        super().log(logs, start_time)

    def _print_completions(self) -> None:
        shown = self._last_episodes[
            : self.args.num_completions_to_print or len(self._last_episodes)
        ]
        decode = self.processing_class.decode
        print(f"--- completions at step {self.state.global_step}")
        for episode, reward in shown:
            text = "".join(
                decode([token]) if mask else f"\x1b[2m{decode([token])}\x1b[0m"
                for token, mask in zip(episode.completion_ids, episode.loss_mask, strict=True)
            )
            print(f"[reward {reward:+.3f} | {episode.finish}] {text}")


# ---------------------------------------------------------------------- helpers


def _model_name(model: Any) -> str:
    name = model if isinstance(model, str) else model.config._name_or_path
    return str(name).rstrip("/").split("/")[-1] or "model"


def _columns(dataset: Any) -> list[str]:
    """The dataset's columns other than `prompt` (they become reward function arguments)."""
    names = getattr(dataset, "column_names", None)
    if names is None:
        names = list(dataset[0]) if len(dataset) else []
    return [name for name in names if name != "prompt"]


def _prompts_per_process(completions: int, num_generations: int, processes: int) -> int:
    """Prompts each process plays per round; groups are never split across processes."""
    if completions % (num_generations * processes):
        raise ValueError(
            f"a round of {completions} completions over {processes} process(es) cannot give "
            f"each process whole groups of num_generations={num_generations}; choose batch "
            f"sizes so that the round is a multiple of num_generations x processes"
        )
    return completions // (num_generations * processes)


def _rows_needed(args: GRPOConfig) -> int | None:
    """Rows `max_steps` consumes (None without max_steps)."""
    if args.max_steps <= 0:
        return None
    rounds_per_step = args.gradient_accumulation_steps / args.steps_per_generation
    rounds = max(1, int(args.max_steps * rounds_per_step + 0.999))
    return rounds * args.generation_batch_size // args.num_generations


def _loss_config(args: GRPOConfig) -> LossConfig:
    return LossConfig(
        loss_type=args.loss_type,
        epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high,
        delta=args.delta,
        importance_sampling_level=args.importance_sampling_level,
        beta=args.beta,
        use_bias_correction_kl=args.use_bias_correction_kl,
        sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg,
        max_completion_length=args.max_completion_length,
        entropy_coef=args.entropy_coef,
    )
