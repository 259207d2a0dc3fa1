"""The public attributes and helpers of TRL 1.16's `GRPOTrainer`, with TRL's meanings.

TRL's trainer copies many `GRPOConfig` fields onto itself (`trainer.beta`, `trainer.loss_type`,
`trainer.num_generations`, ...) and keeps its run's state in public attributes
(`reward_weights`, `entropy_coef`, `environments`, ...); scripts and callbacks written for TRL
read them. `TRLAttributes` gives `GRPOTrainer` each one, read from where agentgrpo keeps the
value. A copied config field is read from `args` and cannot be set on the trainer (the run was
built from the config); `reward_weights` can be changed, in place or by assignment, and the
next round uses it, as in TRL. So is the `log` hook: TRL's, adding the GRPO metrics the
trainer's `TrainerLog` queued. agentgrpo's own public attributes hold the latest round
(`last_records`, `last_episodes`, `last_completions`, `last_round_step`).

Not provided: `vllm_generation` (TRL's vLLM client object; agentgrpo's vLLM backends differ),
`commit_scheduler` and the `async_loop*` attributes (TRL's plumbing for Hub uploads and async
reward functions, which agentgrpo runs on its own event loop).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, Trainer

from agentgrpo.config import GRPOConfig
from agentgrpo.learner.entropy_control import AdaptiveEntropy
from agentgrpo.learner.objectives import VespoShape, vespo_weights
from agentgrpo.learner.token_weights import high_entropy_mask, trl_off_policy_mask
from agentgrpo.reporting.completions import CompletionsTable
from agentgrpo.reporting.trainer_log import TrainerLog
from agentgrpo.rewards.calls import RewardFunction
from agentgrpo.rounds.pipeline import RoundParts
from agentgrpo.rounds.scoring import Scorer, environment_reward
from agentgrpo.run_folder import explained_write_errors
from agentgrpo.training.loss_step import LossStep
from rollout import Episode, EpisodeRecord, RolloutEngine, load_template
from rollout.agents import Agent


class _ConfigField:
    """A trainer attribute that reads `args.<field>` (through `derive` when given), read-only.

    Args:
        field: The config field; None: the attribute's own name.
        derive: `(value, args) -> attribute` for a value TRL derives from the field.
    """

    def __init__(self, field: str | None = None, derive: Callable[[Any, Any], Any] | None = None):
        self.field = field
        self.derive = derive

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.field = self.field or name

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        value = getattr(trainer.args, self.field)  # type: ignore[arg-type]
        return value if self.derive is None else self.derive(value, trainer.args)

    def __set__(self, trainer: Any, value: Any) -> None:
        raise AttributeError(
            f"GRPOTrainer.{self.name} is args.{self.field}, which the run was built from; set "
            f"GRPOConfig({self.field}=...) before creating the trainer"
        )


class TRLAttributes(Trainer):
    """TRL's public `GRPOTrainer` attributes and helpers on agentgrpo's trainer.

    The trainer sets the parts these read (declared here).
    """

    _tag_names = ("trl", "grpo", "agentgrpo")  # the model card's, added to its tags
    args: GRPOConfig
    processing_class: Any
    scorer: Scorer
    engine: RolloutEngine
    loss_step: LossStep
    agent: Agent | None
    _reward_functions: list[RewardFunction]
    _round_parts: RoundParts
    _trainer_log: TrainerLog

    # --- GRPOConfig fields TRL copies onto the trainer -----------------------------------------
    max_completion_length = _ConfigField()
    num_generations = _ConfigField()
    num_generations_eval = _ConfigField(derive=lambda value, args: value or args.num_generations)
    max_tool_calling_iterations = _ConfigField(
        derive=lambda value, args: sys.maxsize if value is None else value
    )
    chat_template_kwargs = _ConfigField(derive=lambda value, args: value or {})
    temperature = _ConfigField()
    top_p = _ConfigField()
    top_k = _ConfigField()
    min_p = _ConfigField()
    repetition_penalty = _ConfigField()
    use_transformers_continuous_batching = _ConfigField()
    pad_to_multiple_of = _ConfigField()
    use_vllm = _ConfigField()
    vllm_mode = _ConfigField()
    vllm_gpu_memory_utilization = _ConfigField()
    vllm_tensor_parallel_size = _ConfigField()
    vllm_importance_sampling_correction = _ConfigField()
    vllm_importance_sampling_mode = _ConfigField()
    vllm_importance_sampling_clip_max = _ConfigField()
    vllm_importance_sampling_clip_min = _ConfigField()
    loss_type = _ConfigField()
    multi_objective_aggregation = _ConfigField()
    scale_rewards = _ConfigField()
    importance_sampling_level = _ConfigField()
    off_policy_mask_threshold = _ConfigField()
    mask_truncated_completions = _ConfigField()
    top_entropy_quantile = _ConfigField()
    use_adaptive_entropy = _ConfigField()
    shuffle_dataset = _ConfigField()
    num_iterations = _ConfigField()
    epsilon_low = _ConfigField("epsilon")
    epsilon_high = _ConfigField()
    beta = _ConfigField()
    log_completions = _ConfigField()
    log_multimodal = _ConfigField()
    log_unique_prompts = _ConfigField()
    num_completions_to_print = _ConfigField()

    # --- the latest round, as the trainer's log keeps it ---------------------------------------
    @property
    def last_records(self) -> list[EpisodeRecord]:
        """The latest training round's episodes on this process, as the episode record holds them.

        Each has its per-function rewards (None where a function returned None), the combined
        reward, the advantage the loss used, and `policy_version`: the global step the round
        was generated at (it is first trained at the next step); with `async_grpo`, the step of
        the weights that started the episode's group. Empty before the first round; replaced,
        never mutated, by the next training round (eval rounds leave it alone).
        """
        return self._trainer_log.records

    @property
    def last_round_step(self) -> int:
        """The global step at which the latest training round was assembled (-1 before one)."""
        return self._trainer_log.round_step

    @property
    def last_completions(self) -> CompletionsTable | None:
        """The latest round's completions table (every process's rows), with `log_completions`.

        None before the first round or without `log_completions`; replaced by the next round.
        Its `step` is the global step the round was played at; the logged table's is the log's.
        """
        return self._trainer_log.completions

    @property
    def last_episodes(self) -> list[tuple[Episode, float]]:
        """The latest round's episodes on this process (train or eval), each with its reward.

        Rewards are the combined (weighted) totals. Empty before the first round. Read-only:
        the list is replaced, never mutated, by the next round.
        """
        return self._trainer_log.episodes

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the GRPO metrics queued since the last log, under TRL's names; show completions.

        Each is the mean of its values since the last log (`TrainerLog.add_means`). With
        `log_completions`, a log holding round metrics prints the latest round's completions
        table (its `step` column set to the global step) and logs it to the `report_to`
        integrations that take tables.
        """
        prefix = self._trainer_log.add_means(logs)
        super().log(logs, start_time)
        with_round = prefix + "reward" in logs  # not, e.g., the end-of-training summary
        if with_round and self.accelerator.is_main_process:
            self._trainer_log.show_completions(self.state.global_step, self.args)

    @property
    def continuous_batching_config(self) -> None:
        """None: agentgrpo's transformers backend batches continuously without transformers'."""
        return None

    # --- Rewards --------------------------------------------------------------------------------

    @property
    def reward_func_names(self) -> list[str]:
        """The name of each reward column, as logged: the functions', then each environment's."""
        return self.scorer.names

    @functools.cached_property
    def reward_funcs(self) -> list[Any]:
        """One reward source per `reward_func_names`, in TRL's layout.

        Each function as given, a reward model as the loaded `PreTrainedModel`, then for each
        environment class that scores itself a function `get_reward(environments, **kwargs)`
        giving each completion its environment's reward (None for another class's), and for
        an agent's reward columns the agent function.
        """
        given = [f.source if f.source is not None else f.fn for f in self._reward_functions]
        environments = [environment_reward(c) for c in self.scorer.env_reward_classes]
        agent = [self.agent.function] * len(self.scorer.agent_columns) if self.agent else []
        return given + environments + agent

    @property
    def reward_processing_classes(self) -> list[Any]:
        """One entry per `reward_func_names`: a reward model's tokenizer, else None."""
        own = [func.processing_class for func in self._reward_functions]
        return own + [None] * (len(self.scorer.names) - len(own))

    @property
    def reward_weights(self) -> torch.Tensor:
        """float32 (F,): each reward column's weight (`reward_func_names`' order), on the CPU.

        The tensor the rounds combine rewards with: changing it in place, or assigning a new
        one (one weight per column), changes the next round's rewards, as in TRL.
        """
        weights_F = self._round_parts.shaping.weights_F
        assert isinstance(weights_F, torch.Tensor)  # the trainer keeps a tensor
        return weights_F

    @reward_weights.setter
    def reward_weights(self, weights: Any) -> None:
        weights_F = torch.as_tensor(weights, dtype=torch.float32).cpu()
        names = self.reward_func_names
        if weights_F.shape != (len(names),):
            raise ValueError(
                f"reward_weights needs one weight per reward function {names}, "
                f"got shape {tuple(weights_F.shape)}"
            )
        shaping = replace(self._round_parts.shaping, weights_F=weights_F)
        self._round_parts = replace(self._round_parts, shaping=shaping)

    # --- Loss -----------------------------------------------------------------------------------

    @property
    def entropy_control(self) -> AdaptiveEntropy | None:
        """The adaptive entropy controller (`use_adaptive_entropy`), else None."""
        return self.loss_step.entropy_control

    @property
    def router_aux_loss_coef(self) -> float:
        """The weight of a mixture-of-experts model's load-balancing loss (0.0: none)."""
        return self.loss_step.router_aux_loss_coef

    @property
    def aux_loss_enabled(self) -> bool:
        """Whether the loss adds a mixture-of-experts model's load-balancing loss."""
        return self.loss_step.router_aux_loss_coef != 0.0

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now: the controller's with `use_adaptive_entropy`.

        As in TRL, the adaptive coefficient is the one the controller last set, even while the
        bonus is off because entropy is above `entropy_target`.
        """
        control = self.entropy_control
        return self.args.entropy_coef if control is None else control.coef

    def get_high_entropy_mask(
        self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float
    ) -> torch.Tensor:
        """TRL's mask of the tokens whose entropy is at or above a quantile over all processes.

        Args:
            entropies: Per-token entropies, (B, T).
            mask: 1 where the token counts, (B, T).
            threshold: The quantile in [0, 1] of the active tokens' entropies (over every
                process) that a token must reach; `1 - top_entropy_quantile` in training.

        Returns:
            Bool (B, T): True where the token is active and reaches the threshold.
        """
        local = entropies[mask.bool()].float()
        padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=-1.0)
        everyone = self.accelerator.gather(padded)
        everyone = everyone[everyone >= 0]  # entropies are >= 0: the padding drops out
        return high_entropy_mask(entropies, mask, threshold, everyone.to(entropies.device))

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """TRL's off-policy sequence mask (DeepSeek-V3.2): (B, 1), 1.0 keep, 0.0 drop.

        A sequence is dropped when its advantage is negative and the mean over its active
        tokens of `sampling_per_token_logps - per_token_logps` exceeds `off_policy_threshold`
        (see `token_weights.off_policy_sequence_mask`). Tokens the sampler could not score
        (NaN) count as no drift.

        Args:
            advantages: One per sequence, (B,) or (B, 1).
            per_token_logps: The current policy's logprobs, (B, T).
            sampling_per_token_logps: The sampler's logprobs, (B, T).
            mask: 1 where the token counts, (B, T).
            off_policy_threshold: The largest mean drift kept for a negative advantage.
        """
        return trl_off_policy_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        )

    @staticmethod
    @torch.no_grad()
    def get_gamma_weights(
        advantages: torch.Tensor,
        log_ratio_per_token: torch.Tensor,
        mask: torch.Tensor,
        importance_sampling_ratio: torch.Tensor | None,
        k_pos: float = 2.0,
        lambda_pos: float = 3.0,
        k_neg: float = 3.0,
        lambda_neg: float = 2.0,
    ) -> torch.Tensor:
        """TRL's VESPO weights: `phi(w) = w**k exp(lambda (1 - w))` per sequence, (B, 1).

        `log w` sums the active tokens' log ratios (each clamped to [-20, 20]) and, when
        `importance_sampling_ratio` is given, their log sampler corrections (each clamped to
        [log 1e-8, 20]); `(k, lambda)` are the `_pos` pair where the advantage is >= 0, else
        the `_neg` pair (see `objectives.vespo_weights`).

        Args:
            advantages: (B, 1).
            log_ratio_per_token: log(pi_theta / pi_old), (B, T).
            mask: 1 where the token counts, (B, T).
            importance_sampling_ratio: pi_old / pi_sampler per token, (B, T), or None.
            k_pos: `k` for advantages >= 0.
            lambda_pos: `lambda` for advantages >= 0.
            k_neg: `k` for negative advantages.
            lambda_neg: `lambda` for negative advantages.
        """
        log_ratio_B_T = log_ratio_per_token.clamp(-20.0, 20.0)
        if importance_sampling_ratio is not None:
            log_ratio_B_T = log_ratio_B_T + importance_sampling_ratio.log().clamp(
                math.log(1e-8), 20.0
            )
        return vespo_weights(
            log_ratio_B_T,
            advantages.reshape(-1, 1),
            mask,
            VespoShape(k_pos, lambda_pos),
            VespoShape(k_neg, lambda_neg),
        )

    # --- Generation -----------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a completion: the tokenizer's eos first, then the model's others."""
        eos = self.processing_class.eos_token_id
        stop = self.engine.context.backend.stop_token_ids
        return [eos, *sorted(set(stop) - {eos})] if eos in stop else sorted(stop)

    @property
    def generation_kwargs(self) -> dict[str, Any]:
        """TRL's arguments for transformers' generation (the transformers backend only).

        The config's sampling fields, then `args.generation_kwargs`, which win.

        Raises:
            AttributeError: With `use_vllm=True`, as TRL has no such attribute then.
        """
        args = self.args
        if args.use_vllm:
            raise AttributeError(
                "generation_kwargs and generation_config describe the transformers backend; "
                "with use_vllm=True the vLLM backend generates (see args.generation_kwargs)"
            )
        tokenizer = self.processing_class
        return {
            "max_new_tokens": args.max_completion_length,
            "do_sample": True,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": self.eos_token_ids,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty,
            "cache_implementation": args.cache_implementation,
        } | dict(args.generation_kwargs or {})  # type: ignore[arg-type]  # a dict once checked

    @property
    def generation_config(self) -> GenerationConfig:
        """`generation_kwargs` as a `GenerationConfig` (a new object at each read)."""
        return GenerationConfig(**self.generation_kwargs)

    # --- Environments, tools and the template ---------------------------------------------------

    @property
    def environment_factories(self) -> dict[str | None, Callable[[], Any]] | None:
        """None without environments; else `{name: factory}` (`{None: factory}` for one)."""
        contexts = self.engine.contexts
        factories = {name: c.environment_factory for name, c in contexts.items()}
        if all(factory is None for factory in factories.values()):
            return None
        return factories  # type: ignore[return-value]  # none is None past the check

    @property
    def tools(self) -> list[Callable[..., Any]]:
        """The plain tools, then each environment's tool methods (functions of its class)."""
        contexts = list(self.engine.contexts.values())
        plain = [tool.fn for tool in contexts[0].tools.values()]
        methods = {
            name: getattr(tool.fn, "__func__", tool.fn)
            for context in contexts
            for name, tool in context.environment_tools.items()
        }
        return plain + list(methods.values())

    @property
    def environments(self) -> list[Any] | None:
        """The latest round's environment instances on this process, one per completion.

        None without environments or before the first round (TRL's value before a batch).
        """
        if self.environment_factories is None or not self._trainer_log.episodes:
            return None
        return [episode.environment for episode, _ in self._trainer_log.episodes]

    @property
    def chat_template(self) -> str | None:
        """The template episodes are rendered with when it is not the tokenizer's, else None.

        TRL's attribute holds the training template it swaps in for the tokenizer's; agentgrpo
        renders with the tokenizer's own unless `chat_template` (a built-in name or jinja
        source) is set in the config.
        """
        name = self.args.chat_template
        return None if name is None else load_template(self.processing_class, name)

    # --- The model card -------------------------------------------------------------------------

    def create_model_card(  # type: ignore[override]  # TRL's arguments, not transformers'
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
    ) -> None:
        """Write a model card draft, `README.md` in `output_dir`, with TRL's arguments.

        transformers' card, with `dataset_name` as its dataset and the trainer's tags (`trl`,
        `grpo`, `agentgrpo`) added to `tags`; `push_to_hub(dataset_name=...)` passes it here.
        """
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags += [tag for tag in self._tag_names if tag not in tags]
        super().create_model_card(model_name=model_name, dataset=dataset_name, tags=tags)

    def _write_model_card(self) -> None:
        """Write the model card into `output_dir`, as TRL does before each checkpoint.

        The card is named after `hub_model_id`'s last part, else the output folder's name. A
        folder that refuses the card's write is the same clear error as for the checkpoint.
        """
        hub_id = self.args.hub_model_id
        folder = Path(str(self.args.output_dir))
        with explained_write_errors(folder):
            self.create_model_card(model_name=hub_id.split("/")[-1] if hub_id else folder.name)
