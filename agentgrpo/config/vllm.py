"""`GRPOConfig` fields of the vLLM backend (colocated or a server), checked when vLLM generates."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentgrpo.config.errors import require
from rollout.types import check_sampling_overrides

if TYPE_CHECKING:
    from agentgrpo.config.grpo import GRPOConfig

# `vllm_lora_push`'s values (`agentgrpo.generation.adapters`).
LORA_PUSHES = ("auto", "adapter", "merged")


@dataclass
class VLLMFields:
    """Where vLLM runs, how much memory it takes, and how weights reach it."""

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
    vllm_lora_push: str = field(
        default="auto",
        metadata={
            "help": "How a PEFT LoRA policy reaches vLLM after each step. 'adapter': only the "
            "adapter (lora_A/lora_B and its config) is loaded, as a vLLM LoRA; 'merged': the "
            "merged weights are reloaded; 'auto': the adapter where vLLM can serve it, else "
            "merged with a warning naming why (DoRA, modules_to_save, a rank over the "
            "server's --max-lora-rank, ...). 'adapter' without PEFT is refused."
        },
    )


def check_vllm(config: "GRPOConfig") -> None:
    """Check the vLLM fields when vLLM generates (they are inert otherwise)."""
    colocated = config.vllm_mode == "colocate"
    require(
        not colocated or config.vllm_tensor_parallel_size == 1,
        f"vllm_tensor_parallel_size={config.vllm_tensor_parallel_size} in colocate mode is not "
        "supported: run `agentgrpo vllm-serve --tensor-parallel-size N` and set "
        "vllm_mode='server'.",
    )
    require(
        not colocated or config.world_size == 1,
        f"vllm_mode='colocate' runs one vLLM inside one training process; this run has "
        f"{config.world_size} processes: set vllm_mode='server' (one `agentgrpo vllm-serve` "
        "for all of them).",
    )
    require(
        colocated or not config.vllm_enable_sleep_mode,
        "vllm_enable_sleep_mode applies to colocate mode; a server manages its own memory "
        "(start it with --enable-sleep-mode): unset vllm_enable_sleep_mode.",
    )
    require(
        config.ds3_gather_for_generation,
        "ds3_gather_for_generation=False cannot be used with vLLM, which needs the full "
        "weights to load: set it to True.",
    )
    require(
        0.0 < config.vllm_gpu_memory_utilization <= 1.0,
        f"vllm_gpu_memory_utilization={config.vllm_gpu_memory_utilization} must be in (0, 1].",
    )
    require(
        config.vllm_server_timeout > 0,
        f"vllm_server_timeout={config.vllm_server_timeout} must be positive (seconds).",
    )
    require(
        config.vllm_lora_push in LORA_PUSHES,
        f"vllm_lora_push={config.vllm_lora_push!r} must be one of {', '.join(LORA_PUSHES)}.",
    )
    generation_kwargs = config.generation_kwargs or {}
    if not isinstance(generation_kwargs, dict):  # TrainingArguments parses only "{...}"
        raise ValueError(
            f"generation_kwargs={generation_kwargs!r} must be a dict or a JSON object string "
            """such as '{"min_p": 0.1}'."""
        )
    check_sampling_overrides(generation_kwargs)
