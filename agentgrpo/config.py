"""`GRPOConfig`: every knob of a GRPO run, checked once when the config is built.

The fields, their types and their defaults are those of TRL 1.x's `GRPOConfig`, so a TRL script
ports by changing its import; agentgrpo's own additions are grouped at the end. Every value
left open (`bf16`, `epsilon_high`, the batch sizes, `pad_to_multiple_of`) is resolved here,
so what `to_dict()` saves is what the run used.

Decisions that differ from TRL, each for a reason given where it is made:

- `bf16=None` means bf16 only on a CUDA GPU that supports it; on CPU, float32.
- `sync_ref_model=True` with `beta=0.0` is rejected here rather than by the trainer.
- Features agentgrpo lacks (transformers continuous batching, vLLM colocated
  over several processes or tensor-parallel) are refused, never silently ignored.
- An unknown keyword is a `TypeError` that names the nearest valid field.
"""

import difflib
import functools
import math
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from transformers import TrainingArguments

from agentgrpo.precision import corrects_sampler_mismatch
from rollout.backends.vllm_colocate import check_sampling_overrides
from rollout.parsers import get_parser
from rollout.template import load_template

# Every loss TRL 1.16 names. Which of them agentgrpo implements is decided in one place, the loss
# module's dispatch table, which refuses the others when the trainer is built; listing them all
# here keeps TRL configs loadable and avoids a second list that could drift from the first.
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")

# Fields whose value must be one of a fixed set (checked after `scale_rewards` is normalized).
_CHOICES: dict[str, tuple[str, ...]] = {
    "scale_rewards": ("group", "batch", "none"),
    "loss_type": LOSS_TYPES,
    "importance_sampling_level": ("token", "sequence"),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
    "vllm_mode": ("colocate", "server"),
    "vllm_model_impl": ("vllm", "transformers"),
    "vllm_importance_sampling_mode": (
        "token_truncate",
        "token_mask",
        "sequence_truncate",
        "sequence_mask",
    ),
}

# TRL features agentgrpo does not implement: a True value is refused with this advice.
_OTHER_GENERATOR = "generate with the transformers backend (the default) or use_vllm=True"
_UNSUPPORTED: dict[str, str] = {
    "use_transformers_continuous_batching": _OTHER_GENERATOR,
    "use_transformers_paged": _OTHER_GENERATOR,
}


@dataclass
class GRPOConfig(TrainingArguments):
    """Configuration of a GRPO run: TRL 1.x's `GRPOConfig` fields plus agentgrpo's own.

    Every field is documented where it is defined (its `help` metadata, also shown by
    `HfArgumentParser`). After construction the derived values are filled in:
    `steps_per_generation`, `generation_batch_size`, `epsilon_high`, `bf16`,
    `pad_to_multiple_of`, and `scale_rewards` as a string.

    Raises:
        TypeError: For an unknown keyword argument (the message names the nearest field).
        ValueError: For a value or a combination of values that cannot work; the message says
            what to change.

    Examples:
        >>> config = GRPOConfig(
        ...     output_dir="runs/doctest", report_to="none",
        ...     per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        ... )
        >>> config.steps_per_generation, config.generation_batch_size
        (2, 8)
        >>> config.epsilon_high == config.epsilon, config.episode_max_turns
        (True, 512)

    """

    # Dict fields that also accept a JSON string from the command line (parsed by
    # `TrainingArguments.__post_init__`).
    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
        "transformers_continuous_batching_config",
    ]

    # --- TrainingArguments defaults that GRPO changes -------------------------------------------
    learning_rate: float = field(
        default=1e-6, metadata={"help": "Initial learning rate of the AdamW optimizer."}
    )
    logging_steps: float = field(
        default=10,
        metadata={
            "help": "Log every this many optimizer steps; a value below 1 is a fraction of the "
            "total number of steps."
        },
    )
    gradient_checkpointing: bool = field(
        default=True,
        metadata={
            "help": "Recompute activations in the backward pass to save memory. Non-reentrant "
            "unless gradient_checkpointing_kwargs says use_reentrant=True, which also turns off "
            "the learner's shared-prompt forward (one pass over whole rows instead)."
        },
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={
            "help": "Drop dataset columns other than 'prompt'. Keep False when reward functions "
            "or environments read other columns."
        },
    )
    # None until __post_init__ resolves it, a bool from then on, as TrainingArguments expects.
    bf16: bool | None = field(  # type: ignore[assignment]
        default=None,
        metadata={
            "help": "Train in bf16 mixed precision. None: True on a CUDA GPU that supports bf16 "
            "(and fp16 is off), else False; on CPU agentgrpo trains in float32, which is exact "
            "and, on the machines it is tested on, faster."
        },
    )

    # --- Model -----------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `AutoModelForCausalLM.from_pretrained` when the model "
            "is given by name; its `revision` also applies to the tokenizer. A JSON string is "
            "accepted."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Allow models and tokenizers (reward models included) to run custom code "
            "from their repository."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the mixture-of-experts load-balancing loss. None: the model "
            "config's value; 0.0 disables it. An error for a model without experts."
        },
    )
    disable_dropout: bool = field(
        default=False,
        metadata={"help": "Turn off dropout so that repeated forward passes give equal logprobs."},
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "Compute the language-model head of the policy and reference in float32. "
            "Needs an lm_head not tied to the input embeddings."
        },
    )

    # --- Data and batching -----------------------------------------------------------------------
    num_generations: int = field(
        default=8,
        metadata={
            "help": "Completions (episodes) sampled per prompt: the group size G. At least 2; "
            "the generation batch must be a multiple of it."
        },
    )
    num_generations_eval: int | None = field(
        default=None,
        metadata={"help": "Group size during evaluation. None: num_generations."},
    )
    max_completion_length: int | None = field(
        default=512,
        metadata={
            "help": "Token budget of one completion; for an episode, model and tool turns together."
        },
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "Under DeepSpeed ZeRO-3, gather the full weights to generate: faster, but "
            "the model must fit on one GPU. False is incompatible with vLLM, and with more "
            "than one process (every forward pass would wait for every process)."
        },
    )
    shuffle_dataset: bool | None = field(
        default=True, metadata={"help": "Shuffle the training dataset."}
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={
            "help": "Pad prompt and completion ids to a multiple of this. 'auto': 128 on AWS "
            "Neuron (which compiles once per shape), no padding elsewhere."
        },
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions generated at once, across all processes. None: "
            "per_device_train_batch_size * world_size * steps_per_generation. Exclusive with "
            "steps_per_generation."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-steps trained on each generation batch. None: "
            "gradient_accumulation_steps (or derived from generation_batch_size)."
        },
    )

    # --- Generation ------------------------------------------------------------------------------
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_p: float = field(
        default=1.0,
        metadata={
            "help": "Nucleus sampling: smallest token set of this total probability, in (0, 1]."
        },
    )
    top_k: int = field(
        default=0, metadata={"help": "Sample among the k most likely tokens; 0 disables it."}
    )
    min_p: float | None = field(
        default=None,
        metadata={
            "help": "Drop tokens less likely than min_p times the most likely token's "
            "probability (0 to 1). None disables it."
        },
    )
    generation_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra arguments for `GenerationConfig` or vLLM's `SamplingParams`; they "
            "override the sampling fields above. A JSON string is accepted."
        },
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra arguments for rendering the chat template (e.g. enable_thinking). "
            "A JSON string is accepted."
        },
    )
    repetition_penalty: float = field(
        default=1.0,
        metadata={
            "help": "Above 1.0, discourages tokens already in the prompt or completion; below "
            "1.0, encourages them."
        },
    )
    cache_implementation: str | None = field(
        default=None,
        metadata={
            "help": "Accepted for TRL scripts; agentgrpo's transformers backend always keeps its "
            "own dynamic cache (reused across an episode's turns and a group's prompt)."
        },
    )

    # --- vLLM ------------------------------------------------------------------------------------
    use_vllm: bool = field(
        default=False, metadata={"help": "Generate with vLLM instead of transformers."}
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={
            "help": "'colocate': vLLM runs in the training process on the same GPUs. 'server': "
            "requests go to a separately started vLLM server."
        },
    )
    vllm_model_impl: str = field(
        default="vllm",
        metadata={"help": "Model implementation vLLM uses: 'vllm' (native) or 'transformers'."},
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={
            "help": "Offload vLLM's weights and KV cache during the optimizer step: less GPU "
            "memory, slower wake-up."
        },
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None,
        metadata={"help": "Constrain each turn vLLM generates to this regex. None: unconstrained."},
    )
    vllm_guided_decoding_regex: str | None = field(
        default=None,
        metadata={"help": "Earlier TRL name of vllm_structured_outputs_regex; sets it."},
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={
            "help": "Base URL of the vLLM server (e.g. 'http://localhost:8000'); when set, host "
            "and port are ignored."
        },
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "Host of the vLLM server."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Port of the vLLM server."})
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={
            "help": "Seconds to wait for the vLLM server to come up before a ConnectionError."
        },
    )
    vllm_group_port: int = field(
        default=51216,
        metadata={"help": "Port of the group that pushes new weights to the vLLM server."},
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={
            "help": "Fraction of GPU memory vLLM may take, in colocate mode (a server gets its "
            "own flag)."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={
            "help": "vLLM's context length; at least the longest prompt plus "
            "max_completion_length. None: from the model config."
        },
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Tensor-parallel size of vLLM in colocate mode (a server gets its own flag)."
        },
    )

    # --- Algorithm: loss and advantages ----------------------------------------------------------
    beta: float = field(
        default=0.0,
        metadata={
            "help": "Weight of the KL penalty to the reference model. 0.0: no reference model "
            "is loaded."
        },
    )
    num_iterations: int = field(
        default=1,
        metadata={"help": "Optimization passes over each generation batch (mu in the paper)."},
    )
    epsilon: float = field(
        default=0.2, metadata={"help": "Lower clipping bound of the ratio: 1 - epsilon."}
    )
    delta: float | None = field(
        default=None,
        metadata={
            "help": "Upper bound on the ratio for two-sided clipping (INTELLECT-2); should "
            "exceed 1 + epsilon. None: one-sided clipping."
        },
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper clipping bound: 1 + epsilon_high. None: epsilon. DAPO suggests 0.28; "
            "for 'cispo' it is the cap on the weight itself (ScaleRL suggests 5.0)."
        },
    )
    sapo_temperature_neg: float = field(
        default=1.05,
        metadata={"help": "'sapo' gate temperature for tokens with advantage <= 0."},
    )
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "'sapo' gate temperature for tokens with advantage > 0."}
    )
    vespo_k_pos: float = field(
        default=2.0,
        metadata={"help": "'vespo' power exponent for positive advantages (ratio below 1)."},
    )
    vespo_lambda_pos: float = field(
        default=3.0,
        metadata={"help": "'vespo' decay for positive advantages (ratio above 1)."},
    )
    vespo_k_neg: float = field(
        default=3.0,
        metadata={"help": "'vespo' power exponent for negative advantages (ratio below 1)."},
    )
    vespo_lambda_neg: float = field(
        default=2.0,
        metadata={"help": "'vespo' decay for negative advantages (ratio above 1)."},
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": "'token': one policy ratio per token. 'sequence': one per completion, from "
            "the mean token log-ratio (GSPO)."
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "One weight per reward function (the trainer checks the count). None: all 1.0."
        },
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "'sum_then_normalize': weight and sum the rewards, then scale. "
            "'normalize_then_sum': scale each reward within its group, then weight and sum "
            "(GDPO)."
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Divide advantages by the reward std of the 'group' (or True), of the "
            "'batch', or not at all: 'none' (or False), as Dr. GRPO advises."
        },
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "Policy loss: 'dapo' (tokens averaged over the global batch), 'grpo' (per "
            "sequence, then per batch), 'dr_grpo' (divided by a constant), 'bnpo' (tokens "
            "averaged over the local batch), 'cispo', 'sapo', 'luspo' or 'vespo' (a smooth "
            "Gamma-kernel weight of the sequence importance ratio, vespo_k_* and vespo_lambda_*)."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "Leave completions cut off by a limit out of the loss (DAPO)."},
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "Move the reference model toward the policy every ref_model_sync_steps "
            "(TR-DPO). Needs beta > 0."
        },
    )
    ref_model_mixup_alpha: float = field(
        default=0.6,
        metadata={"help": "Mix of a reference sync: ref = alpha * policy + (1 - alpha) * ref."},
    )
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "Optimizer steps between reference syncs."}
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "Fraction of tokens, by entropy, kept in the policy loss, in [0, 1]. 1.0 "
            "keeps all; 0.0 only the highest-entropy token."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={"help": "Weight of a mean per-token entropy bonus in the loss; 0.0 disables it."},
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Adaptive entropy control (Skywork-OR1): after each optimizer step, raise "
            "entropy_coef by entropy_coef_delta when the step's mean token entropy is at or "
            "below entropy_target, else lower it, within [entropy_coef_min, entropy_coef_max]; "
            "the bonus applies only while entropy is at or below the target."
        },
    )
    entropy_coef_min: float = field(
        default=0.0, metadata={"help": "Adaptive entropy control: lowest entropy_coef."}
    )
    entropy_coef_max: float = field(
        default=1.0, metadata={"help": "Adaptive entropy control: highest entropy_coef."}
    )
    entropy_coef_delta: float = field(
        default=0.005, metadata={"help": "Adaptive entropy control: step of entropy_coef."}
    )
    entropy_target: float = field(
        default=0.2,
        metadata={"help": "Adaptive entropy control: target mean token entropy, in nats."},
    )

    # --- Algorithm: off-policy corrections -------------------------------------------------------
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Reweight the loss by training/sampler probability ratios to correct for the "
            "sampler's numerics: vLLM's, or generation under bf16/fp16 mixed precision."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "How the correction treats ratios outside [clip_min, clip_max]: "
            "'*_truncate' clamps, '*_mask' zeroes; 'token_*' per token, 'sequence_*' per "
            "sequence."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0,
        metadata={"help": "Upper bound of the correction ratio. None: no upper bound."},
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None,
        metadata={"help": "Lower bound of the correction ratio. None: no lower bound."},
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Drop sequences with negative advantage whose KL to the sampler exceeds "
            "this (DeepSeek-V3.2, e.g. 0.5). None disables it."
        },
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Multiply the KL term by the policy ratio so its gradient is the unbiased "
            "reverse-KL gradient (DeepSeek-V3.2)."
        },
    )

    # --- Tools and agents ------------------------------------------------------------------------
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "Most tool-calling turns per episode. None: no limit but the token budget. "
            "See max_turns."
        },
    )

    # --- Logging ---------------------------------------------------------------------------------
    log_completions: bool = field(
        default=False,
        metadata={"help": "Log a sample of prompts and completions every logging_steps."},
    )
    log_multimodal: bool = field(
        default=True, metadata={"help": "Include images and videos in logged completions."}
    )
    num_completions_to_print: int | None = field(
        default=None,
        metadata={"help": "Completions printed to the console. None: all logged ones."},
    )
    log_unique_prompts: bool = field(
        default=False, metadata={"help": "Log each distinct prompt once."}
    )
    log_completions_hub_repo: str | None = field(
        default=None,
        metadata={
            "help": "Hub repository ('user/name' or 'name') to upload logged completions to; "
            "public unless hub_private_repo. Needs log_completions."
        },
    )

    # --- TRL generation engines agentgrpo does not provide -----------------------------------
    use_transformers_continuous_batching: bool = field(
        default=False,
        metadata={
            "help": "Generate with transformers' continuous batching. Not supported by agentgrpo."
        },
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None,
        metadata={"help": "Arguments for transformers' `ContinuousBatchingConfig`."},
    )
    use_transformers_paged: bool = field(
        default=False,
        metadata={
            "help": "Deprecated alias of use_transformers_continuous_batching. Not supported by "
            "agentgrpo."
        },
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None,
        metadata={"help": "Deprecated: sets vllm_importance_sampling_clip_max."},
    )

    # --- agentgrpo: episodes ---------------------------------------------------------------------
    max_turns: int | None = field(
        default=None,
        metadata={
            "help": "Most model turns per episode. None: max_tool_calling_iterations + 1 when "
            "that is set, else only the token budget limits turns."
        },
    )
    tool_timeout_s: float | None = field(
        default=30.0,
        metadata={
            "help": "Seconds one tool call may run before it fails (as a message to the model). "
            "None: no timeout."
        },
    )
    environment_timeout_s: float | None = field(
        default=120.0,
        metadata={
            "help": "Seconds each of an environment's __init__, reset, done (a property), "
            "reward and close may take before the run stops with an error naming the method. "
            "None: no timeout."
        },
    )
    max_concurrent_episodes: int = field(
        default=256, metadata={"help": "Most episodes in flight at once."}
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "Template that renders conversations and tools. None: the tokenizer's; "
            "'chatml_tools': built-in ChatML with Hermes tool calls; or jinja source."
        },
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata={
            "help": "How tool calls are read from model text (a rollout.PARSERS name: 'hermes', "
            "'llama3_json', 'qwen3_xml', 'glm4', 'harmony', 'atem', 'mistral', 'deepseek_v3', "
            "'gemma4', 'lfm2'). None: detected from the chat template."
        },
    )
    log_episodes: bool = field(
        default=True,
        metadata={
            "help": "Write every training episode (token ids, loss mask, sampler logprobs, "
            "messages, tool calls and results, rewards, advantage, policy version) to "
            "<output_dir>/episodes/step-N.jsonl as each step ends."
        },
    )

    # --- agentgrpo: warm start ------------------------------------------------------------------
    warm_start_steps: int = field(
        default=0,
        metadata={
            "help": "Supervised steps on the environment's demonstrations() before GRPO, one "
            "conversation per step (loss on the assistant turns only). Teaches a model that "
            "never calls tools the call format. 0: no warm start."
        },
    )
    warm_start_learning_rate: float = field(
        default=5e-5, metadata={"help": "AdamW learning rate of the warm start."}
    )
    save_warm_start: bool = field(
        default=False,
        metadata={
            "help": "Save the warm-started model (and its tokenizer) to <output_dir>/warm_start "
            "before GRPO starts, so the warm start alone can be evaluated beside the trained "
            "model. Needs warm_start_steps > 0."
        },
    )

    # --- agentgrpo: asynchronous GRPO (TRL's AsyncGRPOConfig names) ------------------------------
    async_grpo: bool = field(
        default=False,
        metadata={
            "help": "Overlap generation with training: a producer thread plays groups with the "
            "generator's weights into a bounded queue while the learner trains on the fresh "
            "ones (agentgrpo.async_rounds). False: rounds run in lock-step (the default)."
        },
    )
    max_staleness: int = field(
        default=4,
        metadata={
            "help": "With async_grpo: the most optimizer steps the weights that started a group "
            "may lag behind the step that trains it; older groups are dropped and counted."
        },
    )
    queue_maxsize: int = field(
        default=1024,
        metadata={"help": "With async_grpo: the most played episodes waiting to be trained on."},
    )
    weight_sync_steps: int = field(
        default=1,
        metadata={"help": "With async_grpo: optimizer steps between pushes to the generator."},
    )

    def __post_init__(self) -> None:
        # bf16 must be a bool before TrainingArguments sees it: it rejects bf16 without a GPU.
        if self.bf16 is None:
            self.bf16 = default_bf16(self.fp16, self.use_cpu)
        self._check_numbers()  # before TrainingArguments computes anything from them
        super().__post_init__()
        self._normalize()
        self._check_values()
        self._check_combinations()
        self._resolve_batches()
        self._check_eval_batch()
        self._check_async()

    @property
    def episode_max_turns(self) -> int:
        """The most model turns an episode may take.

        `max_turns` when set, else `max_tool_calling_iterations + 1` (the tool-calling turns
        plus the answer), else a bound no episode reaches: every turn samples at least one
        token, so `max_completion_length` turns exhaust the token budget.
        """
        if self.max_turns is not None:
            return self.max_turns
        if self.max_tool_calling_iterations is not None:
            return self.max_tool_calling_iterations + 1
        return self.max_completion_length or 2**31 - 1

    def _normalize(self) -> None:
        """Turn accepted spellings into the single value the rest of agentgrpo reads."""
        self.scale_rewards = _SCALE_REWARDS_ALIASES.get(
            str(self.scale_rewards).lower(), self.scale_rewards
        )
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.gradient_checkpointing:  # as TRL and transformers 5 default to
            kwargs = dict(self.gradient_checkpointing_kwargs or {})  # type: ignore[arg-type]
            self.gradient_checkpointing_kwargs = {"use_reentrant": False, **kwargs}
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":
            # The command line delivers every value as text.
            text = self.pad_to_multiple_of.lower()
            self.pad_to_multiple_of = None if text in ("none", "null") else int(text)
        if self.pad_to_multiple_of == "auto":
            self.pad_to_multiple_of = 128 if self.device.type == "neuron" else None
        if self.vllm_guided_decoding_regex is not None:
            _require(
                self.vllm_structured_outputs_regex in (None, self.vllm_guided_decoding_regex),
                "vllm_guided_decoding_regex and vllm_structured_outputs_regex are two names for "
                "one setting and differ here; set only vllm_structured_outputs_regex.",
            )
            self.vllm_structured_outputs_regex = self.vllm_guided_decoding_regex
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                "vllm_importance_sampling_cap is deprecated; use "
                "vllm_importance_sampling_clip_max instead (it now takes the cap's value).",
                FutureWarning,
                stacklevel=5,  # the caller of GRPOConfig(...)
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap

    def _check_numbers(self) -> None:
        """Refuse NaN, infinity, negative rates and a group too large to hold in memory.

        Every number field is checked, and every number in a list field. Neither NaN nor
        infinity is a setting: `learning_rate=inf` or `beta=nan` would train every weight to
        NaN and still exit cleanly. A limit is lifted with None, never inf.
        """
        for item in fields(self):
            value = getattr(self, item.name, None)
            numbers = value if isinstance(value, list | tuple) else [value]
            for number in numbers:
                if isinstance(number, float) and not math.isfinite(number):
                    raise ValueError(_not_finite(item, number, alone=number is value))
        for name in _NOT_NEGATIVE:
            _require(
                getattr(self, name) >= 0,
                f"{name}={getattr(self, name)} is negative; it must be >= 0.",
            )
        _require(
            self.num_generations is None or self.num_generations <= MAX_BATCH,
            f"num_generations={self.num_generations} is above {MAX_BATCH}, the most episodes "
            "agentgrpo holds in memory for one step; lower it.",
        )

    def _check_values(self) -> None:
        """Check each field on its own: choices, ranges and unsupported features."""
        for name, valid in _CHOICES.items():
            if getattr(self, name) not in valid:
                choices = ", ".join(repr(v) for v in valid)
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {choices}.")
        for name, advice in _UNSUPPORTED.items():
            if getattr(self, name):
                raise ValueError(f"{name}=True is not supported by agentgrpo yet; {advice}.")
        _require(
            self.num_generations is not None and self.num_generations >= 2,
            "GRPO requires at least 2 generations per prompt to calculate the advantages. You "
            f"provided {self.num_generations}, which is less than the minimum required: set "
            "num_generations >= 2.",
        )
        _require(
            self.num_generations_eval is None or self.num_generations_eval >= 1,
            f"num_generations_eval={self.num_generations_eval} must be at least 1 (or None).",
        )
        _require(
            self.max_completion_length is None or self.max_completion_length >= 1,
            f"max_completion_length={self.max_completion_length} must be at least 1 (or None).",
        )
        _require(
            self.entropy_coef_min <= self.entropy_coef_max and self.entropy_coef_delta >= 0,
            f"adaptive entropy control needs entropy_coef_min ({self.entropy_coef_min}) <= "
            f"entropy_coef_max ({self.entropy_coef_max}) and entropy_coef_delta "
            f"({self.entropy_coef_delta}) >= 0.",
        )
        _require(
            0.0 <= self.top_entropy_quantile <= 1.0,
            f"top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1].",
        )
        _require(
            self.max_tool_calling_iterations is None or self.max_tool_calling_iterations >= 0,
            f"max_tool_calling_iterations={self.max_tool_calling_iterations} must be >= 0.",
        )
        self._check_episode_values()

    def _check_episode_values(self) -> None:
        """Check agentgrpo's own episode fields; names go through rollout's own lookups."""
        _require(
            self.max_turns is None or self.max_turns >= 1,
            f"max_turns={self.max_turns} must be at least 1 (or None for no turn limit).",
        )
        _require(
            self.tool_timeout_s is None or self.tool_timeout_s > 0,
            f"tool_timeout_s={self.tool_timeout_s} must be positive (or None for no timeout).",
        )
        _require(
            self.environment_timeout_s is None or self.environment_timeout_s > 0,
            f"environment_timeout_s={self.environment_timeout_s} must be positive (or None for "
            "no timeout).",
        )
        _require(
            self.max_concurrent_episodes >= 1,
            f"max_concurrent_episodes={self.max_concurrent_episodes} must be at least 1.",
        )
        _require(
            self.warm_start_steps >= 0 and self.warm_start_learning_rate > 0,
            f"warm_start_steps={self.warm_start_steps} must be >= 0 and "
            f"warm_start_learning_rate={self.warm_start_learning_rate} positive.",
        )
        _require(
            self.warm_start_steps > 0 or not self.save_warm_start,
            "save_warm_start=True saves the warm-started model, but warm_start_steps=0 runs no "
            "warm start; set warm_start_steps > 0 or save_warm_start=False.",
        )
        if self.tool_call_parser is not None:
            get_parser(self.tool_call_parser)
        if self.chat_template is not None:
            load_template(None, self.chat_template)  # the tokenizer is only read for None

    def _check_async(self) -> None:
        """Check the async_grpo fields: a queue that holds a group, and groups that can be fresh.

        The generator's weights lag the learner's by up to `weight_sync_steps - 1` steps, and a
        round is trained over `round_steps` optimizer steps: below that staleness no group could
        ever be trained on, so the run would wait forever.
        """
        if not self.async_grpo:
            return
        _require(
            self.max_staleness >= 0 and self.weight_sync_steps >= 1,
            f"max_staleness={self.max_staleness} must be >= 0 and "
            f"weight_sync_steps={self.weight_sync_steps} at least 1.",
        )
        _require(
            self.queue_maxsize >= self.num_generations,
            f"queue_maxsize={self.queue_maxsize} cannot hold one group of "
            f"num_generations={self.num_generations}; raise it.",
        )
        _require(
            not self.use_vllm and self.world_size == 1,
            "async_grpo runs on one process with the transformers backend for now; set "
            "use_vllm=False and launch one process, or async_grpo=False.",
        )
        assert self.steps_per_generation is not None  # `_resolve_batches` set it
        round_steps = math.ceil(
            self.steps_per_generation * self.num_iterations / self.gradient_accumulation_steps
        )
        least = self.weight_sync_steps - 1 + round_steps - 1
        _require(
            self.max_staleness >= least,
            f"max_staleness={self.max_staleness} is below {least}, the staleness of the freshest "
            f"group (weights pushed every weight_sync_steps={self.weight_sync_steps} steps, a "
            f"round trained over {round_steps} steps), so no group could be trained on; raise "
            "max_staleness or lower weight_sync_steps.",
        )

    def _check_combinations(self) -> None:
        """Check fields that only fail together."""
        # TRL raises this in its trainer; it is a config mistake, so it is caught here.
        _require(
            not (self.sync_ref_model and self.beta == 0.0),
            "You passed `sync_ref_model=True` while `beta=0.0`, which means the reference model "
            "is not used during training: set beta > 0 or sync_ref_model=False.",
        )
        _require(
            self.log_completions_hub_repo is None or self.log_completions,
            "log_completions_hub_repo is set, but log_completions is False. Enable "
            "log_completions to upload completions to the Hub, or unset log_completions_hub_repo.",
        )
        _require(
            not self.auto_find_batch_size,
            "auto_find_batch_size is not supported by GRPO, because the generation batch must "
            "contain full prompt groups of num_generations completions; lower "
            "per_device_train_batch_size instead.",
        )
        parallel = self.parallelism_config
        _require(
            parallel is None or not (parallel.cp_enabled or parallel.sp_enabled),
            "GRPOTrainer does not support sequence-dim parallelism (`parallelism_config.cp_size "
            "> 1` or `parallelism_config.sp_size > 1`) yet. Set both `cp_size=1` and `sp_size=1`.",
        )
        self._check_importance_sampling_bounds()
        self._check_loss_combinations()
        if self.use_vllm:
            self._check_vllm()

    def _check_loss_combinations(self) -> None:
        """Refuse what cannot work; the trainer logs TRL's warnings (`porting`)."""
        _require(
            not (
                self.loss_type == "vespo"
                and corrects_sampler_mismatch(self)
                and not self.vllm_importance_sampling_mode.startswith("token_")
            ),
            "VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or "
            f"'token_mask'. Got: {self.vllm_importance_sampling_mode}. (Its sequence weight takes "
            "per-token corrections; or set vllm_importance_sampling_correction=False.)",
        )

    def _check_vllm(self) -> None:
        """Check the vLLM fields when vLLM generates (they are inert otherwise)."""
        colocated = self.vllm_mode == "colocate"
        _require(
            not colocated or self.vllm_tensor_parallel_size == 1,
            f"vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} in colocate mode is not "
            "supported: run `agentgrpo vllm-serve --tensor-parallel-size N` and set "
            "vllm_mode='server'.",
        )
        _require(
            not colocated or self.world_size == 1,
            f"vllm_mode='colocate' runs one vLLM inside one training process; this run has "
            f"{self.world_size} processes: set vllm_mode='server' (one `agentgrpo vllm-serve` "
            "for all of them).",
        )
        _require(
            colocated or not self.vllm_enable_sleep_mode,
            "vllm_enable_sleep_mode applies to colocate mode; a server manages its own memory "
            "(start it with --enable-sleep-mode): unset vllm_enable_sleep_mode.",
        )
        _require(
            self.ds3_gather_for_generation,
            "ds3_gather_for_generation=False cannot be used with vLLM, which needs the full "
            "weights to load: set it to True.",
        )
        _require(
            0.0 < self.vllm_gpu_memory_utilization <= 1.0,
            f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} must be in (0, 1].",
        )
        _require(
            self.vllm_server_timeout > 0,
            f"vllm_server_timeout={self.vllm_server_timeout} must be positive (seconds).",
        )
        generation_kwargs = self.generation_kwargs or {}
        if not isinstance(generation_kwargs, dict):  # TrainingArguments parses only "{...}"
            raise ValueError(
                f"generation_kwargs={generation_kwargs!r} must be a dict or a JSON object string "
                """such as '{"min_p": 0.1}'."""
            )
        check_sampling_overrides(generation_kwargs)

    def _check_importance_sampling_bounds(self) -> None:
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        _require(
            low is None or high is None or low < high,
            f"vllm_importance_sampling_clip_min ({low}) must be less than "
            f"vllm_importance_sampling_clip_max ({high}).",
        )
        truncates = self.vllm_importance_sampling_mode.endswith("_truncate")
        _require(
            not (self.vllm_importance_sampling_correction and truncates)
            or low is not None
            or high is not None,
            "At least one of `vllm_importance_sampling_clip_min` or `vllm_importance_sampling_"
            "clip_max` must be set when `vllm_importance_sampling_mode` is a `*_truncate` mode.",
        )

    def _resolve_batches(self) -> None:
        """Derive `steps_per_generation` and `generation_batch_size` from each other."""
        global_batch = self.per_device_train_batch_size * self.world_size
        _require(
            self.generation_batch_size is None or self.steps_per_generation is None,
            "'generation_batch_size' and 'steps_per_generation' can not be both configured at "
            "the same time: each determines the other; set only one of them.",
        )
        if self.generation_batch_size is not None:
            _require(
                self.generation_batch_size % global_batch == 0,
                f"generation_batch_size ({self.generation_batch_size}) must be divisible by the "
                f"global batch size ({global_batch}), per_device_train_batch_size * world_size.",
            )
            self.steps_per_generation = self.generation_batch_size // global_batch
        else:
            if self.steps_per_generation is None:
                self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = global_batch * self.steps_per_generation
        _require(
            self.generation_batch_size <= MAX_BATCH,
            f"the generation batch of {self.generation_batch_size} episodes "
            f"(per_device_train_batch_size={self.per_device_train_batch_size} x world_size="
            f"{self.world_size} x steps_per_generation={self.steps_per_generation}) is above "
            f"{MAX_BATCH}, the most agentgrpo holds in memory for one step; lower them.",
        )
        _require(
            self.generation_batch_size % self.num_generations == 0,
            f"generation_batch_size ({self.generation_batch_size}) must be divisible by "
            f"num_generations ({self.num_generations}). It is per_device_train_batch_size="
            f"{self.per_device_train_batch_size} x world_size={self.world_size} x "
            f"steps_per_generation={self.steps_per_generation}: choose "
            "per_device_train_batch_size, gradient_accumulation_steps (or steps_per_generation, "
            "or generation_batch_size) so that it holds whole groups.",
        )

    def _check_eval_batch(self) -> None:
        if not self.do_eval or self.eval_strategy == "no":
            return
        group = self.num_generations_eval or self.num_generations
        batch = self.per_device_eval_batch_size * self.world_size
        _require(
            batch % group == 0,
            f"The global eval batch size ({self.per_device_eval_batch_size} * {self.world_size}) "
            f"must be divisible by the number of generations used for evaluation ({group}): "
            "choose per_device_eval_batch_size or num_generations_eval so that it holds whole "
            "groups.",
        )


_SCALE_REWARDS_ALIASES = {"true": "group", "false": "none"}
# Fields a negative value makes meaningless (a negative learning rate climbs the loss).
_NOT_NEGATIVE = ("learning_rate", "beta", "temperature", "warm_start_learning_rate")
MAX_BATCH = 2**16
"""The most episodes one generation batch (one step's rounds) may hold.

Every episode of the batch (its tokens, logprobs and messages) is in memory at once, and the
sampler lists every row index of it; far larger batches than any published GRPO run uses
(thousands of episodes per step) exhaust memory instead of failing.
"""


def _not_finite(item: Any, number: float, alone: bool) -> str:
    """Why `number`, the value of field `item` (or an element of it), is refused."""
    if math.isnan(number):
        what = "not a number"
    else:
        what = "infinite (a number too large for a float, such as 1e400, reads as inf)"
    lifted = alone and "None" in str(item.type)
    return f"{item.name}={number} is {what}; give a finite value" + (
        ", or None for no limit." if lifted else "."
    )


def default_bf16(fp16: bool, use_cpu: bool) -> bool:
    """What `bf16=None` means: on when a CUDA GPU that supports it trains, off on CPU.

    On CPU training stays float32, which on these machines is both faster and exact.
    """
    return not fp16 and not use_cpu and _cuda_bf16_available()


def _cuda_bf16_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _reject_unknown_keywords(init):
    """Wrap a dataclass `__init__` so that a mistyped keyword names the nearest field."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        known = {f.name for f in fields(self) if f.init}
        for key in sorted(kwargs.keys() - known):
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise TypeError(f"{type(self).__name__} got an unknown argument {key!r}{hint}")
        init(self, *args, **kwargs)

    return __init__


# Replacing a method is what this means to do: wrap the __init__ the dataclass made.
GRPOConfig.__init__ = _reject_unknown_keywords(GRPOConfig.__init__)  # type: ignore[method-assign]
