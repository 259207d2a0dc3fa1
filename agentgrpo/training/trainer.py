"""GRPOTrainer: TRL's GRPOTrainer interface on transformers' Trainer, with agentgrpo's engine.

The trainer is glue between transformers' hooks and the round. Its parts come from
`wiring.build_parts`; `_prepare_inputs` plays a round (`rounds.pipeline.play_and_batch`: play and
score, advantages, batch, logprobs, micro-batches) every `RoundPlan.repeats` micro-batches and
serves its micro-batches; `compute_loss` is `losses.policy_loss` over mask-1 tokens. transformers'
Trainer does the rest: optimizer, schedule, accumulation, checkpoints (made atomic by the trainer's
`checkpoint_saving.Checkpoints`), callbacks, logging, `save_model` and `push_to_hub`.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio
import torch

from agentgrpo.asynchronous.mode import AsyncRounds, check_async_players
from agentgrpo.config import GRPOConfig
from agentgrpo.devices import check_launch
from agentgrpo.generation.generator import Generator, Generators
from agentgrpo.learner.batch import TrainingBatch, collate_episodes
from agentgrpo.learner.losses import normalises_by_num_items
from agentgrpo.models.loading import (
    load_policy_and_processing,
    reference_model,
    reward_model_kwargs,
    router_aux_loss_coef,
)
from agentgrpo.models.reference_sync import SyncReference, reference_sync
from agentgrpo.models.sharded import generation_weights
from agentgrpo.models.warm_start import warm_start_from_environment
from agentgrpo.placement import Placement
from agentgrpo.reporting.metrics import RewardLayout
from agentgrpo.reporting.run_log import EpisodeLog
from agentgrpo.reporting.trackers import check_trackers
from agentgrpo.reporting.trainer_log import TrainerLog
from agentgrpo.rewards.calls import check_trainer_arguments, reward_functions
from agentgrpo.rounds.data import (
    adapt_to_iterable_datasets,
    check_environment_column,
    episodes_from_rollout_func,
    is_iterable_dataset,
    rows_collator,
    training_rows,
)
from agentgrpo.rounds.dynamic_sampling import dynamic_sampling_of
from agentgrpo.rounds.pipeline import (
    RewardShaping,
    Round,
    RoundParts,
    RoundPlan,
    play_and_batch,
    round_seed,
)
from agentgrpo.rounds.sampler import curriculum_of, evaluation_loader, training_loader
from agentgrpo.rounds.scoring import Scorer, play_round, score_played
from agentgrpo.rounds.wiring import build_parts
from agentgrpo.training import porting, seat_snapshots
from agentgrpo.training.checkpoint_saving import Checkpoints
from agentgrpo.training.loss_step import LossStep
from agentgrpo.training.processes import Processes
from agentgrpo.training.trl_attributes import TRLAttributes
from rollout import Episode
from rollout.agents import Agent

WARM_START_DIR = "warm_start"  # where `save_warm_start` puts the model, in the output folder


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
            `data.episodes_from_rollout_func` for the dict). As TRL 1.16 calls it: `prompts`
            holds each row's prompt `num_generations` times in a row, and the dict one entry
            per completion, in that order; an optional `episode_ids` list (one id per entry)
            makes entries with equal ids the rows of one episode, sharing reward and advantage.
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

    # What this trainer holds, narrower than transformers' declarations: a GRPOConfig, a causal
    # LM (possibly PEFT-wrapped), a tokenizer, and row datasets that are played, not tensorised.
    args: GRPOConfig
    model: Any
    processing_class: Any
    train_dataset: Any
    eval_dataset: Any
    reference_sync: SyncReference | None = None  # with sync_ref_model

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
        args = args if args is not None else porting.default_config(model, num_generations)
        porting.check_arguments(args, num_generations)
        check_trackers(args.report_to)
        adapt_to_iterable_datasets(args, train_dataset, eval_dataset)
        processing_class = porting.processing_class_of(processing_class, tokenizer)
        sources = porting.reward_sources(reward_funcs, reward_model, reward_fn)
        model, tokenizer, self.processor = load_policy_and_processing(
            model, processing_class, args, peft_config, quantization_config
        )
        self._reward_functions = reward_functions(
            sources, reward_processing_classes, reward_model_kwargs(args), args.device
        )
        self.rollout_func = rollout_func
        self.plan = RoundPlan.from_config(args, args.world_size, environment_factory)
        rows, shuffle_seed = self.plan.rows_needed, args.seed if args.shuffle_dataset else None
        super().__init__(
            model=model,
            args=args,
            data_collator=rows_collator,  # type: ignore[arg-type]  # rows are played, not tensorised
            train_dataset=training_rows(train_dataset, environment_factory, rows, shuffle_seed),
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self._set_up(tools or [], environment_factory, agent)

    # ------------------------------------------------------------------ set-up

    def _set_up(
        self, tools: Sequence[Callable[..., Any]], factory: Any, agent: Agent | Callable | None
    ) -> None:
        """Check the launch; build the reference model, the round's parts and the loss step."""
        args, accelerator = self.args, self.accelerator
        self.placement = placement = Placement.of(accelerator)
        check_launch(os.environ, placement)
        self.model_accepts_loss_kwargs = False  # compute_loss normalises; Trainer divides by GA
        router_coef = router_aux_loss_coef(self.model, args.router_aux_loss_coef)
        self._processes = processes = Processes(accelerator)
        self._trainer_log = TrainerLog(
            processes.gather, processes.gather_objects, processes.index, args.log_completions
        )
        self._metrics = self._trainer_log.metrics  # TRL's name for the queued metric values
        self.ref_model = reference_model(self.model, args, placement, accelerator)
        if args.sync_ref_model:
            unwrap = accelerator.unwrap_model
            self.reference_sync = reference_sync(self.ref_model, self.model, args, unwrap)
            self.add_callback(self.reference_sync)
        self._environment_factory = factory
        self.agent = agent if agent is None or isinstance(agent, Agent) else Agent(agent)
        self._wire(tools, factory, router_coef)
        self.checkpoints = Checkpoints.of(
            self, placement, self.loss_step, self.reference_sync, self.processor
        )
        if self.rollout_func is None:  # its extra fields are known only once it runs
            check_trainer_arguments(self._reward_functions, self.train_dataset, bool(factory))
        self._round: Round | None = None  # the round being trained on
        self._micro_index: int | None = None  # micro-batches served since the run started
        self._step_seconds = 0.0
        if args.log_episodes:
            self.add_callback(EpisodeLog(self))

    def _wire(self, tools: Sequence[Callable[..., Any]], factory: Any, router_coef: float) -> None:
        """Build the engine, scorer and loss step (`wiring.build_parts`) and the round's parts."""
        args, tokenizer = self.args, self.processing_class
        generators, self.snapshots, self.policies = seat_snapshots.choose_with_snapshots(
            args, self.placement, self.model, tokenizer, self.accelerator, self.processor, factory
        )
        self.generator: Generator = generators.rounds
        parts = self._build_parts(generators.rounds.backend, tools, factory, self.agent)
        self.engine, self.scorer = parts.engine, parts.scorer
        sharded = self.placement.shards_weights
        self.loss_step = LossStep.from_config(args, parts.loss_config, router_coef, sharded)
        shaping = RewardShaping.from_config(args)
        self._round_parts = RoundParts(
            play=self._play,
            shaping=replace(shaping, weights_F=torch.tensor(parts.reward_weights)),
            collate=lambda episodes, advantages_N: collate_episodes(
                episodes, advantages_N, tokenizer.pad_token_id, args.mask_truncated_completions
            ).to(args.device),
            old_logprobs=lambda batch: self.policies.logprobs(self.model, batch),
            ref_logprobs=self._reference_logprobs if args.beta != 0.0 else None,
            gather=self._processes.gather,
            process_index=self.accelerator.process_index,
            dynamic=dynamic_sampling_of(args, self.train_dataset, self._play, self.scorer),
            curriculum=curriculum_of(args, self.train_dataset),
        )
        self._round_parts = self.policies.route(self._round_parts, self.loss_step, self._metrics)
        self._async: AsyncRounds | None = None
        if generators.producer is not None:  # training rounds take groups played meanwhile
            self._wire_async(generators, tools, factory)

    def _wire_async(self, generators: Generators, tools: Sequence[Callable], factory: Any) -> None:
        """The producer and its rounds (model seats: its own backends); a server: evaluation too."""
        check_async_players(self.rollout_func, self.agent)
        args, tokenizer = self.args, self.processing_class
        producer, seats = self.snapshots.producer(generators.producer, tokenizer, args)
        self._async = AsyncRounds.build(
            self.args,
            self.plan,
            producer,
            lambda: self.accelerator.unwrap_model(self.model),
            lambda backend: self._build_parts(backend, tools, factory, None, seats).engine,
            self.scorer,
            self.train_dataset,
            self._round_parts,
            lambda: self.state.global_step,
            functools.partial(self._trainer_log.add, "train"),
        )
        self.add_callback(self._async.pushes)
        if generators.producer is generators.rounds:  # one server: evaluation plays through it
            self.generator = self._async.generation

    def _build_parts(
        self, backend: Any, tools: Sequence[Callable], factory: Any, agent: Any, seats=None
    ):
        """`wiring.build_parts` over `backend` (frozen `seats`, else the rounds'); VLMs: images."""
        renderer = self.processing_class if self.processor is None else self.processor
        seats = self.snapshots.backends if seats is None else seats
        parts = (self._reward_functions, lambda: self.state, agent, seats)
        return build_parts(self.args, backend, renderer, factory, tools, *parts)

    @property
    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    # ------------------------------------------------------------------ train

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`, after the warm start when `warm_start_steps` > 0.

        With `save_warm_start`, the warm-started model is saved to `output_dir/warm_start` first.
        `resume_from_checkpoint` is a checkpoint folder, or True for the latest intact one in
        `output_dir` (`Checkpoints.resume_point`); a resumed run skips the warm start (its
        checkpoint holds warm-started weights). Folders a killed checkpoint save left are removed
        first. The output folder is locked while training: a second run into it fails at once
        with `run_folder.OutputDirBusy`. A Ctrl-C stops training at once; saved checkpoints stay
        intact. With several environments, a row naming none or an unknown one is an error
        here, before any work (TRL's message; TRL raises it at the first batch).
        """
        check_environment_column(self.train_dataset, self.engine)
        checkpoint = self.checkpoints.resume_point(resume_from_checkpoint, self.model.config)
        with self.checkpoints.output_dir_held():
            if self.args.warm_start_steps and checkpoint is None:
                self._warm_start()
                if self.args.save_warm_start:
                    self.save_model(os.path.join(str(self.args.output_dir), WARM_START_DIR))
            try:
                return super().train(checkpoint, *args, **kwargs)
            finally:
                if self._async is not None:
                    self._async.stop()

    def _warm_start(self) -> None:
        """Fine-tune on the environment's demonstrations (`warm_start_from_environment`)."""
        warm_start_from_environment(
            self.model,
            self.engine.context.renderer,
            self._environment_factory,
            self.args,
            stop_text=self.processing_class.eos_token,
            show=self.is_world_process_zero(),
        )

    # ------------------------------------------------------------------ data

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        """Rows round by round (see `RoundSampler`); each process gets whole groups."""
        return self.accelerator.prepare(training_loader(self.train_dataset, self.plan, self.args))

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        """Eval rows, `per_device_eval_batch_size / num_generations_eval` prompts a process.

        Every row is evaluated, a short last batch (or a set smaller than one batch) included.
        An iterable set is streamed in order; each process reads its own rows (no dispatch).
        """
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        loader = evaluation_loader(dataset, self._eval_plan, self.args)
        if is_iterable_dataset(dataset):  # each process reads its own rows of the stream
            self.accelerator.dataloader_config.dispatch_batches = False
        return self.accelerator.prepare(loader)

    @property
    def _eval_plan(self) -> RoundPlan:
        return RoundPlan.for_eval(self.args, self.args.world_size, self.plan.seats)

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
        """Play, score and batch one round (`rounds.pipeline.play_and_batch`), and record it."""
        step, process = self.state.global_step, self.accelerator.process_index
        seed = round_seed(self.args.seed, plan.train, step, process)
        parts = self._async.parts_for(plan, self._round_parts) if self._async else self._round_parts
        round_ = play_and_batch(parts, plan, rows, seed)
        versions = None if self._async is None else self._async.versions(plan)
        # an agent offers tools with its requests: its calls, turns and forks count too
        with_tools = self.engine.context.has_tools or self.engine.player is not None
        shaping, tokens_seen = self._round_parts.shaping, self.state.num_input_tokens_seen
        layout = RewardLayout.of(self.scorer.names, shaping, plan.num_generations, with_tools)
        self.state.num_input_tokens_seen = self._trainer_log.record_round(
            round_, self._mode, self.scorer, layout, tokens_seen, step, versions
        )
        return round_

    def _play(
        self, rows: Sequence[Mapping[str, Any]], G: int, seed: int, scorer: Scorer | None = None
    ) -> tuple[list[Episode], torch.Tensor]:
        """Play the rows (the engine, or `rollout_func`); score them (None: the run's scorer)."""
        with (
            generation_weights(
                self.accelerator,
                self.model_wrapped,
                self.args.ds3_gather_for_generation and self.placement.zero_stage == 3,
                policy_generates=not self.args.use_vllm,
            ) as model,
            self.generator.generating(model, self.state.global_step),
        ):
            if self.rollout_func is None:
                return anyio.run(play_round, self.engine, rows, G, seed, scorer or self.scorer)
            prompts = [row.get("prompt") for row in rows for _ in range(G)]
            episodes = episodes_from_rollout_func(
                self.rollout_func(prompts, self),
                rows,
                G,
                set(self.engine.context.backend.stop_token_ids),
                lambda ids: self.processing_class.decode(ids, skip_special_tokens=True),
            )
            return episodes, anyio.run(score_played, scorer or self.scorer, episodes, G)

    def _reference_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        if self.ref_model is not None:
            return self.policies.logprobs(self.ref_model, batch)
        with self.accelerator.unwrap_model(self.model).disable_adapter():  # PEFT: base model
            return self.policies.logprobs(self.model, batch)

    # ------------------------------------------------------------------ loss

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: TrainingBatch,  # type: ignore[override]  # what _prepare_inputs returns
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The GRPO loss of one micro-batch, over its mask-1 tokens only (`LossStep.loss`).

        Records the loss metrics; as TRL, a fixed entropy bonus's `entropy_coef` is logged at
        each optimizer step (the adaptive controller logs its own in `training_step`).
        """
        step, training = self.loss_step, self.model.training
        # `output_head` runs outside the forward accelerate autocasts: autocast it as the rest.
        with self.accelerator.autocast():
            loss, metrics = step.loss(model, inputs, training, self._loss_scale())
        fixed = step.entropy_bonus and step.entropy_control is None
        if fixed and training and self.accelerator.sync_gradients:
            self._metrics["train"]["entropy_coef"].append(step.loss_config.entropy_coef)
        self._trainer_log.add_reduced(self._mode, metrics)
        return loss

    def _loss_scale(self) -> float:
        """Undo the Trainer's division by accumulation steps and DDP's mean for token losses."""
        if not self.model.training or not normalises_by_num_items(self.args.loss_type):
            return 1.0
        return self.current_gradient_accumulation_steps * self.accelerator.num_processes

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Trainer's step, timed: `step_time` covers generation and the update.

        At each optimizer step the adaptive entropy coefficient is updated from every
        process's window, and the step's sampler-mismatch metrics are queued (`LossStep.end_step`).
        """
        started = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_seconds += time.perf_counter() - started
        if self.accelerator.sync_gradients:
            self._metrics["train"]["step_time"].append(self._step_seconds)
            self._step_seconds = 0.0
            ends = self.loss_step.end_step(self._processes.reduce_sum, self._processes.gather)
            self._trainer_log.add("train", ends)
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation: generate with `num_generations_eval`, score, and report the loss."""
        with torch.no_grad():
            batch = self._prepare_inputs(inputs)
            loss = self.compute_loss(model, batch)
        self._trainer_log.add("eval", self.loss_step.sampling.close(self._processes.gather))
        return loss.detach(), None, None

    # ------------------------------------------------------------------ checkpoints
    # Hooks the Trainer calls on itself: `Checkpoints` runs each around the Trainer's own.

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        self._write_model_card()  # as TRL does
        with self.checkpoints.staged(super()._get_output_dir(trial)):
            super()._save_checkpoint(model, trial)

    def _get_output_dir(self, trial: Any) -> str:
        return self.checkpoints.get_output_dir(trial, super()._get_output_dir)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        self.checkpoints.push_from_checkpoint(checkpoint_folder, super()._push_from_checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model`, with a VLM's processor and, under sharded FSDP, whole weights."""
        self.checkpoints.save_model(output_dir, _internal_call, super().save_model)

    def _save_rng_state(self, output_dir: str) -> None:
        self.checkpoints.save_rng_state(output_dir, super()._save_rng_state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.checkpoints.save_optimizer(output_dir, super()._save_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        self.checkpoints.load_optimizer(checkpoint, super()._load_optimizer_and_scheduler)

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """`Trainer.create_optimizer`, a param group per adapter seats train (`SeatPolicies`)."""
        return self.policies.grouped(functools.partial(super().create_optimizer, model))
