"""`GRPOConfig` fields of asynchronous GRPO (TRL's `AsyncGRPOConfig` names), and their check."""

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentgrpo.config.errors import require

if TYPE_CHECKING:
    from agentgrpo.config.grpo import GRPOConfig


@dataclass
class AsyncFields:
    """Generation overlapped with training, within a staleness bound.

    See `agentgrpo.asynchronous.rounds`.
    """

    async_grpo: bool = field(
        default=False,
        metadata={
            "help": "Overlap generation with training: a producer thread plays groups with the "
            "generator's weights (a copy of the policy, or the vLLM server with "
            "vllm_mode='server') into a bounded queue while the learner trains on the fresh "
            "ones (agentgrpo.asynchronous.rounds). False: rounds run in lock-step (the default)."
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


def check_async(config: "GRPOConfig") -> None:
    """Check the async_grpo fields: a queue that holds a group, and groups that can be fresh.

    The generator's weights lag the learner's by up to `weight_sync_steps - 1` steps, and a
    round is trained over `round_steps` optimizer steps: below that staleness no group could
    ever be trained on, so the run would wait forever. Needs the resolved batch sizes.
    """
    if not config.async_grpo:
        return
    require(
        config.max_staleness >= 0 and config.weight_sync_steps >= 1,
        f"max_staleness={config.max_staleness} must be >= 0 and "
        f"weight_sync_steps={config.weight_sync_steps} at least 1.",
    )
    require(
        config.queue_maxsize >= config.num_generations,
        f"queue_maxsize={config.queue_maxsize} cannot hold one group of "
        f"num_generations={config.num_generations}; raise it.",
    )
    require(
        config.world_size == 1,
        "async_grpo runs on one process for now; launch one process, or set async_grpo=False.",
    )
    require(
        not config.use_vllm or config.vllm_mode == "server",
        "async_grpo generates with transformers or a vLLM server, not a colocated vLLM (it "
        "would share the learner's device and stop for every push); set vllm_mode='server' "
        "and start one with `agentgrpo vllm-serve`, or use_vllm=False.",
    )
    assert config.steps_per_generation is not None  # `resolve_batches` set it
    round_steps = math.ceil(
        config.steps_per_generation * config.num_iterations / config.gradient_accumulation_steps
    )
    least = config.weight_sync_steps - 1 + round_steps - 1
    require(
        config.max_staleness >= least,
        f"max_staleness={config.max_staleness} is below {least}, the staleness of the freshest "
        f"group (weights pushed every weight_sync_steps={config.weight_sync_steps} steps, a "
        f"round trained over {round_steps} steps), so no group could be trained on; raise "
        "max_staleness or lower weight_sync_steps.",
    )
