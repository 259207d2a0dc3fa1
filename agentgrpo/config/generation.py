"""`GRPOConfig` fields that say how completions are sampled, and TRL's engines agentgrpo lacks."""

from dataclasses import dataclass, field


@dataclass
class GenerationFields:
    """Sampling settings shared by every generation backend."""

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


@dataclass
class OtherGeneratorFields:
    """TRL's transformers generation engines: accepted so TRL configs train unchanged.

    agentgrpo's transformers backend batches continuously whatever these say; on, they are
    logged as such (`porting.warn_about_generation_settings`).
    """

    use_transformers_continuous_batching: bool = field(
        default=False,
        metadata={
            "help": "TRL: generate with transformers' continuous batching. agentgrpo's "
            "transformers backend batches continuously already; True logs that it is used."
        },
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None,
        metadata={"help": "TRL: arguments for transformers' `ContinuousBatchingConfig`. Not read."},
    )
    use_transformers_paged: bool = field(
        default=False,
        metadata={
            "help": "Deprecated: sets use_transformers_continuous_batching (a FutureWarning)."
        },
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None,
        metadata={"help": "Deprecated: sets vllm_importance_sampling_clip_max."},
    )
