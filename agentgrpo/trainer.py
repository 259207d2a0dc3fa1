"""GRPOTrainer: TRL's GRPOTrainer interface on transformers' Trainer, with agentgrpo's engine.

The trainer is glue between transformers' hooks and the round. Its parts come from
`wiring.build_parts`; `_prepare_inputs` plays a round (`round.play_and_batch`: play and score,
advantages, batch, logprobs, micro-batches) every `RoundPlan.repeats` micro-batches and serves
its micro-batches; `compute_loss` is `losses.policy_loss` over mask-1 tokens. transformers'
Trainer does the rest: optimizer, schedule, accumulation, checkpoints (made atomic by
`checkpoint_saving`), callbacks, logging, `save_model` and `push_to_hub`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio
import torch
from accelerate.utils import gather_object

from agentgrpo import checkpoints, porting, run_folder, thread_count
from agentgrpo.config import GRPOConfig
from agentgrpo.data import (
    adapt_to_iterable_datasets,
    check_environment_column,
    episodes_from_rollout_func,
    is_iterable_dataset,
    rows_collator,
    training_rows,
)
from agentgrpo.devices import check_sharded_launch
from agentgrpo.learner.batch import TrainingBatch, collate_episodes
from agentgrpo.learner.entropy_control import AdaptiveEntropy
from agentgrpo.learner.logprobs import batched_logprobs, completion_logprobs
from agentgrpo.learner.loss_metrics import reduce_over_processes
from agentgrpo.learner.losses import normalises_by_num_items, policy_loss
from agentgrpo.learner.token_weights import TokenWeighting
from agentgrpo.models import (
    check_liger_kernel,
    load_policy,
    reference_model,
    reference_sync,
    reward_model_kwargs,
    router_aux_loss_coef,
    tokenizer_kwargs,
)
from agentgrpo.precision import corrects_sampler_mismatch
from agentgrpo.reporting.completions import CompletionsTable, log_to_integrations, print_table
from agentgrpo.reporting.metrics import RewardLayout
from agentgrpo.reporting.round_report import (
    completions_table,
    episode_records,
    gathered_metrics,
    logged_metrics,
)
from agentgrpo.reporting.run_log import EpisodeLog
from agentgrpo.reporting.sampling import SamplingWindow
from agentgrpo.reporting.trackers import check_trackers
from agentgrpo.rewards.calls import check_trainer_arguments, reward_functions
from agentgrpo.round import (
    RewardShaping,
    Round,
    RoundParts,
    RoundPlan,
    play_and_batch,
    round_seed,
)
from agentgrpo.rounds import play_round, score_played
from agentgrpo.sampler import RoundSampler, eval_rows_loader, rows_loader, stream_loader
from agentgrpo.trl_attributes import TRLAttributes
from agentgrpo.vision import tokenizer_and_processor
from agentgrpo.warm_start import environment_demonstrations, warm_start
from agentgrpo.weight_sync import build_generator, check_zero3_generation, generation_weights
from agentgrpo.wiring import build_parts
from rollout import Episode, EpisodeRecord
from rollout.agents import Agent

# Where `save_warm_start` puts the warm-started model, in the output folder.
WARM_START_DIR = "warm_start"
# Where a checkpoint keeps the adaptive entropy controller (the name TRL 1.16 uses).
ENTROPY_STATE_FILE = "entropy_ctrl_state.json"


class GRPOTrainer(TRLAttributes):
    """Train a causal LM with GRPO on single-turn prompts or multi-turn tool-calling episodes.

    Accepts the arguments of TRL's `GRPOTrainer` with the same meanings, so a TRL script ports
    by changing its import; the keyword-only arguments are older spellings (see `porting`).

    Args:
        model: A hub id or local path, a `PreTrainedModel`, or a `PeftModel`.
        reward_funcs: A reward function, a sequence-classification model (or its id/path), or a
            list of those. Optional when the environment scores itself (`reward`/`get_reward`).
        args: A `GRPOConfig`; defaults to one writing to `<model name>-GRPO`.
        train_dataset: Rows with a `prompt` (text, or a list of messages) and any other columns,
            which reward functions and the environment's `reset` receive by name.
        eval_dataset: Like `train_dataset` (an `IterableDataset` is streamed), or a dict of them.
        processing_class: The tokenizer, or a vision-language model's processor; loaded from
            the model when None.
        reward_processing_classes: Tokenizers of reward models, by position.
        callbacks: transformers `TrainerCallback`s.
        optimizers: `(optimizer, lr_scheduler)`, as for `Trainer`.
        quantization_config: E.g. a `BitsAndBytesConfig`, passed to `from_pretrained` when
            `model` is a name or path (an error if `model_init_kwargs` sets one too).
        peft_config: A PEFT config; the model is trained through that adapter.
        tools: Plain tool functions (typed, Google-style docstrings), offered in every episode.
        rollout_func: `rollout_func(prompts, trainer) -> dict` replacing the engine (see
            `data.episodes_from_rollout_func` for the dict). One entry per completion, as in
            TRL; an optional `episode_ids` list (one id per entry) makes entries with equal ids
            the rows of one episode, sharing its reward and advantage.
        environment_factory: An environment class (or zero-argument factory): each episode plays
            against a fresh instance whose public methods are tools. Or a dict of them by name:
            each row's `environment` column picks its environment, whose tools alone (with
            `tools`) its episodes are offered.
        tokenizer: The older name of `processing_class` (give one of them).
        reward_model: A reward model (or its path), added to `reward_funcs`.
        reward_fn: A reward function, added to `reward_funcs`.
        num_generations: The group size, when given here as well: it must equal the config's
            (which it sets when `args` is None).
        agent: An agent function, `(client: openai.AsyncOpenAI, row) -> reward` (or sync with
            an `openai.OpenAI`), or a `rollout.agents.Agent`: it plays each episode itself
            against an OpenAI-compatible endpoint served on 127.0.0.1 by this policy, and
            every request is recorded token-exactly (`rollout.agents`). Not with `tools` or
            `environment_factory`; needs `train_dataset` (`pip install 'agentgrpo[agents]'`).

    Raises:
        ValueError: A user mistake (no reward, mismatched arguments, a bad dataset...).
        ImportError: `args.optim` needs bitsandbytes and it is missing or fails; or a tracker
            in `args.report_to` (trackio, wandb, tensorboard) is not installed.
    """

    _tag_names = ("trl", "grpo", "agentgrpo")
    # What this trainer holds, narrower than transformers' declarations: a GRPOConfig, a causal
    # LM (possibly PEFT-wrapped), a tokenizer, and row datasets that are played, not tensorised.
    args: GRPOConfig
    model: Any
    processing_class: Any
    train_dataset: Any
    eval_dataset: Any

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
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        rollout_func: Callable[[list[Any], GRPOTrainer], Mapping[str, Any]] | None = None,
        environment_factory: Callable[[], Any] | Mapping[str, Callable[[], Any]] | None = None,
        *,
        tokenizer: Any = None,
        reward_model: Any = None,
        reward_fn: Callable[..., Any] | None = None,
        num_generations: int | None = None,
        agent: Agent | Callable[..., Any] | None = None,
    ):
        if args is None:
            group: dict[str, Any] = {}
            if num_generations is not None:
                group["num_generations"] = num_generations
            args = GRPOConfig(output_dir=f"{_model_name(model)}-GRPO", **group)
        porting.check_num_generations(args.num_generations, num_generations)
        porting.warn_about_loss_settings(args)
        porting.check_optimizer(args.optim, args.device)
        check_trackers(args.report_to)
        adapt_to_iterable_datasets(args, train_dataset, eval_dataset)
        processing_class = porting.processing_class_of(processing_class, tokenizer)
        sources = porting.reward_sources(reward_funcs, reward_model, reward_fn)
        tokenizer_source = tokenizer_kwargs(args, model)
        model = load_policy(model, args, peft_config, quantization_config)
        check_liger_kernel(args, model)
        tokenizer, self.processor = tokenizer_and_processor(
            model, processing_class, tokenizer_source
        )
        self._reward_functions = reward_functions(
            sources, reward_processing_classes, reward_model_kwargs(args)
        )
        self.rollout_func = rollout_func
        self.plan = RoundPlan.from_config(args, args.world_size)
        super().__init__(
            model=model,
            args=args,
            data_collator=rows_collator,  # type: ignore[arg-type]  # rows are played, not tensorised
            train_dataset=training_rows(train_dataset, environment_factory, self.plan.rows_needed),
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        check_sharded_launch(os.environ, str(self.accelerator.distributed_type))
        check_zero3_generation(
            getattr(self.accelerator.state.deepspeed_plugin, "zero_stage", 0),
            self.accelerator.num_processes,
            args.ds3_gather_for_generation,
        )
        self.model_accepts_loss_kwargs = False  # compute_loss normalises; Trainer divides by GA
        self.router_aux_loss_coef = router_aux_loss_coef(self.model, args.router_aux_loss_coef)
        self.aux_loss_enabled = self.router_aux_loss_coef != 0.0
        self._metrics: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self._sampling = SamplingWindow()  # the sampler mismatch of this step's micro-batches
        self.ref_model = reference_model(self.model, args)
        if args.sync_ref_model:
            policy = self.accelerator.unwrap_model(self.model)
            self.add_callback(reference_sync(self.ref_model, policy, args))
        self._environment_factory = environment_factory
        self.agent = agent if agent is None or isinstance(agent, Agent) else Agent(agent)
        self._wire(tools or [], environment_factory)
        if rollout_func is None:  # its extra fields are known only once it runs
            check_trainer_arguments(
                self._reward_functions, self.train_dataset, bool(environment_factory)
            )
        self._round: Round | None = None  # the round being trained on
        self._micro_index: int | None = None  # micro-batches served since the run started
        self._step_seconds = 0.0
        self._last_episodes: list[tuple[Episode, float]] = []
        self._last_records: list[EpisodeRecord] = []
        self._completions: CompletionsTable | None = None  # the latest round's, to log
        if self.args.log_episodes:
            self.add_callback(EpisodeLog(self))

    # ------------------------------------------------------------------ set-up

    def _wire(self, tools: Sequence[Callable[..., Any]], factory: Any) -> None:
        """Build the engine, scorer and loss settings (`wiring.build_parts`) and the round."""
        args, tokenizer = self.args, self.processing_class
        backend, self.weight_sync = build_generator(
            self.model, tokenizer, args, self.accelerator, self.processor
        )
        parts = build_parts(
            args,
            backend,
            # a VLM's processor renders its images
            tokenizer if self.processor is None else self.processor,
            factory,
            tools,
            self._reward_functions,
            trainer_state=lambda: self.state,
            agent=self.agent,
        )
        self.engine, self.scorer, self.loss_config = parts.engine, parts.scorer, parts.loss_config
        self.token_weighting = TokenWeighting.from_config(args, corrects_sampler_mismatch(args))
        self.entropy_control = AdaptiveEntropy.from_config(args)
        shaping = RewardShaping.from_config(args)
        self._round_parts = RoundParts(
            play=self._play,
            shaping=dataclasses.replace(shaping, weights_F=torch.tensor(parts.reward_weights)),
            collate=lambda episodes, advantages_N: collate_episodes(
                episodes, advantages_N, tokenizer.pad_token_id, args.mask_truncated_completions
            ).to(args.device),
            old_logprobs=lambda batch: self._logprobs(self.model, batch),
            ref_logprobs=self._reference_logprobs if args.beta != 0.0 else None,
            gather=self._gather,
            process_index=self.accelerator.process_index,
        )

    @property
    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's rows of `tensor`, in process order, on the CPU."""
        return self.accelerator.gather(tensor.to(self.accelerator.device)).cpu()

    def _gather_objects(self, values: list[Any]) -> list[Any]:
        """Every process's `values`, concatenated in process order."""
        return gather_object(values) if self.accelerator.num_processes > 1 else list(values)

    # ------------------------------------------------------------------ train

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`, after the warm start when `warm_start_steps` > 0.

        With `save_warm_start`, the warm-started model is saved to `output_dir/warm_start`
        before GRPO's first step. `resume_from_checkpoint` is a checkpoint folder, or True for
        the latest intact one in `output_dir` (incomplete ones are skipped with a warning);
        anything else that is not a checkpoint, or a checkpoint of another architecture, is a
        ValueError before training starts. A resumed run skips the warm start: its checkpoint
        already holds warm-started weights, and takes the torch thread count the checkpoint
        recorded (with a warning if that changes it; see `thread_count`). Temporary folders
        that a killed checkpoint save left are removed first. The output folder is locked
        while training (`run_folder.hold`): a second run into it fails at once with
        `run_folder.OutputDirBusy`. A Ctrl-C stops training at once (the KeyboardInterrupt
        propagates); the checkpoints already saved stay intact. With several environments, a
        row naming none or an unknown one is an error here, before any work (TRL's message;
        TRL raises it at the first batch).
        """
        check_environment_column(self.train_dataset, self.engine)
        output_dir = str(self.args.output_dir)  # TrainingArguments always sets one
        checkpoint = checkpoints.resume_point(resume_from_checkpoint, output_dir)
        if checkpoint is not None:
            checkpoints.check_architecture(checkpoint, self.model.config.to_dict())
            thread_count.restore(checkpoint, self.args.process_index, self.args.world_size)
        with run_folder.hold(output_dir) if self.args.should_save else contextlib.nullcontext():
            if self.args.should_save:
                checkpoints.remove_temporary(output_dir)
            if self.args.warm_start_steps and checkpoint is None:
                self._warm_start()
                if self.args.save_warm_start:
                    self.save_model(os.path.join(output_dir, WARM_START_DIR))
            return super().train(checkpoint, *args, **kwargs)

    def _save_rng_state(self, output_dir: str) -> None:
        """The Trainer's RNG states, and this process's torch thread count (`thread_count`)."""
        super()._save_rng_state(output_dir)
        thread_count.save(output_dir, self.args.process_index, self.args.world_size)

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
        plan, args = self.plan, self.args
        sampler = RoundSampler(
            len(self.train_dataset),
            plan.prompts_per_process,
            plan.num_processes,
            plan.repeats,
            bool(args.shuffle_dataset),
            args.seed,
        )
        loader = rows_loader(self.train_dataset, sampler, args.dataloader_num_workers)
        return self.accelerator.prepare(loader)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        """Eval rows, `per_device_eval_batch_size / num_generations_eval` prompts a process.

        Every row is evaluated, a short last batch (or a set smaller than one batch) included.
        An iterable set is streamed in order; each process reads its own rows (no dispatch).
        """
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        plan = self._eval_plan
        if is_iterable_dataset(dataset):  # streamed: no len(), read in order by one worker
            # A stream first seen here (`evaluate(eval_dataset=...)`) is set up as at init.
            adapt_to_iterable_datasets(self.args, None, dataset)
            self.accelerator.dataloader_config.dispatch_batches = False
            return self.accelerator.prepare(stream_loader(dataset, plan.prompts_per_process))
        loader = eval_rows_loader(
            dataset, plan.prompts_per_process, self.args.dataloader_num_workers
        )
        return self.accelerator.prepare(loader)

    @property
    def _eval_plan(self) -> RoundPlan:
        return RoundPlan.for_eval(self.args, self.args.world_size)

    # ------------------------------------------------------------------ rounds

    # The Trainer's hooks carry whatever the collator yields: here rows in, a TrainingBatch out.
    def _prepare_inputs(self, rows: list[Mapping[str, Any]]) -> TrainingBatch:  # type: ignore[override]
        """The micro-batch to train on: a fresh round every `plan.repeats` micro-batches."""
        if not self.model.training:
            return self._new_round(rows, self._eval_plan).micro_batches[0]
        plan = self.plan
        if self._micro_index is None:  # (re)started: continue where the checkpoint left off
            self._micro_index = plan.first_micro_batch(self.state.global_step)
        if plan.starts_round(self._micro_index) or self._round is None:
            self._round = self._new_round(rows, plan)
        batch = self._round.micro_batches[plan.position(self._micro_index)]
        self._micro_index += 1
        return batch

    def _new_round(self, rows: list[Mapping[str, Any]], plan: RoundPlan) -> Round:
        """Play, score and batch one round (`round.play_and_batch`), and record it."""
        step, process = self.state.global_step, self.accelerator.process_index
        seed = round_seed(self.args.seed, plan.train, step, process)
        round_ = play_and_batch(self._round_parts, plan, rows, seed)
        self._record_round(round_, plan)
        return round_

    def _play(
        self, rows: Sequence[Mapping[str, Any]], num_generations: int, seed: int
    ) -> tuple[list[Episode], torch.Tensor]:
        """Play the rows (the engine, or `rollout_func`) and score them: the `round.Play` stage."""
        with (
            generation_weights(
                self.accelerator, self.model_wrapped, self.args.ds3_gather_for_generation
            ) as model,
            self.weight_sync.generating(model, self.state.global_step),
        ):
            if self.rollout_func is None:
                return anyio.run(play_round, self.engine, rows, num_generations, seed, self.scorer)
            episodes = episodes_from_rollout_func(
                self.rollout_func([row.get("prompt") for row in rows], self),
                rows,
                num_generations,
                set(self.engine.context.backend.stop_token_ids),
                lambda ids: self.processing_class.decode(ids, skip_special_tokens=True),
            )
            return episodes, anyio.run(score_played, self.scorer, episodes, num_generations)

    def _logprobs(self, model: torch.nn.Module, batch: TrainingBatch) -> torch.Tensor:
        """`model`'s logprobs of the batch, no grad, under autocast, a micro-batch at a time."""
        with self.accelerator.autocast():  # the run's mixed precision, as in the loss forward
            rows = self.args.per_device_train_batch_size
            return batched_logprobs(model, batch, self.args.temperature, rows)

    def _reference_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, batch)
        with self.accelerator.unwrap_model(self.model).disable_adapter():  # PEFT: base model
            return self._logprobs(self.model, batch)

    # ------------------------------------------------------------------ loss

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: TrainingBatch,  # type: ignore[override]  # what _prepare_inputs returns
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The GRPO loss of one micro-batch, over its mask-1 tokens only."""
        batch, args = inputs, self.args
        # The entropy bonus needs the entropy's gradient; everything else reads it detached.
        logprobs_B_C, entropy_B_C, aux_loss = completion_logprobs(
            model,
            batch,
            args.temperature,
            entropy="differentiable" if self._entropy_bonus else "detached",
            with_aux_loss=self.aux_loss_enabled,
        )
        assert entropy_B_C is not None  # asked for
        old_B_C = batch.old_logprobs_B_C
        if old_B_C is None:  # one update per round: the generating policy is the current one
            old_B_C = logprobs_B_C.detach()
        ratios_U = self.token_weighting.sampler_ratios(batch, old_B_C)
        self._sampling.add(old_B_C, batch.sampler_logprobs_B_C, batch.loss_mask_B_C, ratios_U)
        output = policy_loss(
            logprobs_B_C,
            old_B_C,
            batch.advantages_B,
            batch.loss_mask_B_C,
            self.loss_config,
            ref_logprobs_B_T=batch.ref_logprobs_B_C,
            sampler_weights_B_T=self.token_weighting.weights(
                batch, logprobs_B_C.detach(), old_B_C, entropy_B_C.detach()
            ),
            num_items=batch.num_items,
            entropy_B_T=entropy_B_C,
            entropy_coef=self._entropy_coef(entropy_B_C.detach(), batch.loss_mask_B_C),
            episode_B=batch.episode_B,
        )
        return self._total_loss(output.loss, output.metrics, aux_loss)

    @property
    def _entropy_bonus(self) -> bool:
        """Whether the loss has an entropy bonus (a coefficient, fixed or adapted)."""
        return self.args.entropy_coef != 0.0 or self.args.use_adaptive_entropy

    def _total_loss(
        self,
        loss: torch.Tensor,
        metrics: Mapping[str, torch.Tensor],
        aux_loss: torch.Tensor | None,
    ) -> torch.Tensor:
        """The loss to back-propagate; records the loss metrics.

        The policy loss scaled by `_loss_scale`, plus a mixture-of-experts model's load-balancing
        loss times `router_aux_loss_coef` (the Trainer then divides both by the accumulation).

        As TRL: `policy_loss` (the loss before the entropy bonus) and `entropy_coef` (at each
        optimizer step) are logged when there is an entropy bonus, `aux_loss` (unweighted)
        when the model is mixture-of-experts.
        """
        scale = self._loss_scale()
        loss = loss * scale
        recorded = {name: value for name, value in metrics.items() if name != "policy_loss"}
        if self._entropy_bonus:
            recorded["policy_loss"] = metrics["policy_loss"] * scale
            fixed = self.entropy_control is None  # the controller logs its own, once a step
            if fixed and self.model.training and self.accelerator.sync_gradients:
                self._metrics["train"]["entropy_coef"].append(self.loss_config.entropy_coef)
        if aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss
            recorded["aux_loss"] = aux_loss.detach()
        self._record_loss_metrics(recorded)
        return loss

    def _entropy_coef(self, entropy_B_C: torch.Tensor, mask_B_C: torch.Tensor) -> float | None:
        """The adaptive coefficient for this micro-batch (None: the config's fixed one).

        A training micro-batch also adds its entropy to the controller's window, which
        `training_step` closes at each optimizer step; evaluation never changes the controller.
        """
        control = self.entropy_control
        if control is None:
            return None
        if self.model.training:
            mask_B_C = mask_B_C.to(entropy_B_C.dtype)
            control.observe(float((entropy_B_C * mask_B_C).sum()), float(mask_B_C.sum()))
        return control.applied_coef

    def _record_loss_metrics(self, metrics: Mapping[str, torch.Tensor]) -> None:
        """Reduce each loss metric over the processes (one gather for all of them).

        See `loss_metrics.reduce_over_processes`: `*_min` the minimum, `*_max` the maximum.
        """
        names = sorted(metrics)
        local_1_M = torch.stack([metrics[n].float().reshape(()) for n in names]).unsqueeze(0)
        values_M = reduce_over_processes(names, self._gather(local_1_M))
        self._add_metrics(self._mode, dict(zip(names, values_M, strict=True)))

    def _add_metrics(self, mode: str, metrics: Mapping[str, float]) -> None:
        """Queue metric values for the next log of `mode` ("train" or "eval")."""
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)

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
            self._end_entropy_window()
            self._add_metrics("train", self._sampling.close(self._gather))
        return loss

    def _end_entropy_window(self) -> None:
        """At an optimizer step: update the adaptive coefficient from every process's window."""
        control = self.entropy_control
        if control is None:
            return
        local_2 = torch.tensor([control.window_sum, control.window_tokens], dtype=torch.float64)
        total_2 = self.accelerator.reduce(local_2.to(self.accelerator.device), reduction="sum")
        control.end_step(float(total_2[0]), float(total_2[1]))
        self._metrics["train"]["entropy_coef"].append(control.coef)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Trainer's save, plus the adaptive entropy controller's state (TRL's file name)."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self.entropy_control is not None and self.args.should_save:
            path = os.path.join(output_dir, ENTROPY_STATE_FILE)
            with open(path, "w") as file:
                json.dump(self.entropy_control.state(), file)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Trainer's load, plus the adaptive entropy controller's state when saved."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.entropy_control is None or checkpoint is None:
            return
        path = os.path.join(checkpoint, ENTROPY_STATE_FILE)
        if os.path.exists(path):
            with open(path) as file:
                self.entropy_control.load(json.load(file))

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation: generate with `num_generations_eval`, score, and report the loss."""
        with torch.no_grad():
            batch = self._prepare_inputs(inputs)
            loss = self.compute_loss(model, batch)
        self._add_metrics("eval", self._sampling.close(self._gather))
        return loss.detach(), None, None

    # ------------------------------------------------------------------ logging

    def _record_round(self, round_: Round, plan: RoundPlan) -> None:
        """Queue the round's metrics for the next log; keep its episodes and completions table.

        The metrics include those reward functions logged with `log_metric` during the round.
        """
        names, mode = self.scorer.names, self._mode
        metrics = gathered_metrics(round_, self._gather, self._reward_layout(plan))
        round_tokens = int(metrics.pop("num_tokens_round"))
        if mode == "train":
            self.state.num_input_tokens_seen += round_tokens
        logs = self.scorer.logs
        metrics |= logged_metrics(logs.take_metrics(), self._gather, self._gather_objects)
        self._add_metrics(mode, metrics)
        # As TRL: the training tokens seen so far, in eval logs too; the latest value, not a mean.
        self._metrics[mode]["num_tokens"] = [float(self.state.num_input_tokens_seen)]
        extra = logs.take_extra(len(round_.episodes) // plan.num_generations, plan.num_generations)
        if self.args.log_completions:
            views = [self.scorer.views(episode) for episode in round_.episodes]
            self._completions = completions_table(
                round_, views, names, extra, self._gather_objects, self.state.global_step
            )
        self._last_episodes = list(zip(round_.episodes, round_.rewards_N.tolist(), strict=True))
        if mode == "train":
            step, process = self.state.global_step, self.accelerator.process_index
            self._last_records = episode_records(round_, names, step, process)

    def _reward_layout(self, plan: RoundPlan) -> RewardLayout:
        """How this run's reward columns are named, weighted and scaled, for the metrics."""
        # an agent offers tools with its requests: its calls, turns and forks count too
        with_tools = self.engine.context.has_tools or self.engine.player is not None
        shaping, names = self._round_parts.shaping, self.scorer.names
        return RewardLayout.of(names, shaping, plan.num_generations, with_tools)

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
    def last_completions(self) -> CompletionsTable | None:
        """The latest round's completions table (every process's rows), with `log_completions`.

        None before the first round or without `log_completions`; replaced by the next round.
        Its `step` is the global step the round was played at; the logged table's is the log's.
        """
        return self._completions

    @property
    def last_episodes(self) -> list[tuple[Episode, float]]:
        """The latest round's episodes on this process (train or eval), each with its reward.

        Rewards are the combined (weighted) totals. Empty before the first round. Read-only:
        the list is replaced, never mutated, by the next round.
        """
        return self._last_episodes

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the GRPO metrics gathered since the last log, under TRL's names; show completions.

        With `log_completions`, a log holding round metrics prints the latest round's
        completions table (its `step` column set to the global step) and logs it to the
        `report_to` integrations that take tables.

        Each metric is the mean of its values since the last log, NaN values left out (None
        when every value was NaN, e.g. a reward function that returned None throughout).
        """
        mode = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        prefix = "eval_" if mode == "eval" else ""
        for name, values in self._metrics[mode].items():
            valid = [v for v in values if not math.isnan(v)]
            logs[prefix + name] = sum(valid) / len(valid) if valid else None  # type: ignore[assignment]
        self._metrics[mode].clear()
        super().log(logs, start_time)
        table = self._completions
        with_round = prefix + "reward" in logs  # not, e.g., the end-of-training summary
        if with_round and self.accelerator.is_main_process and table is not None:
            table = replace(table, step=self.state.global_step)
            print_table(table, self.args.num_completions_to_print)
            log_to_integrations(table, self.args.report_to, self.args.log_unique_prompts)


# ---------------------------------------------------------------------- helpers


def _model_name(model: Any) -> str:
    name = model if isinstance(model, str) else model.config._name_or_path
    return str(name).rstrip("/").split("/")[-1] or "model"
