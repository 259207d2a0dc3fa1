"""Where a run computes, read once from accelerate: its engine, processes and sharding.

`Placement.of(accelerator)` is the one place that reads accelerate's launch state
(`accelerator.state`, `distributed_type`, `is_fsdp2`); the trainer makes it once, after
transformers' `Trainer` made the accelerator, and hands it to what decides by it: the launch
checks, the reference model, the async producer, the gathers for generation, the checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Placement:
    """One run's launch, as accelerate set it up.

    Attributes:
        engine: accelerate's `distributed_type` by name: "NO", "MULTI_CPU", "MULTI_GPU",
            "DEEPSPEED", "FSDP", ...
        num_processes: Processes training together.
        zero_stage: DeepSpeed's ZeRO stage; 0 without DeepSpeed.
        deepspeed_config: DeepSpeed's config (the accelerate plugin's), None without DeepSpeed.
        fsdp2: FSDP version 2 (`fully_shard`) shards the model.
        fsdp_saves_shards: FSDP runs and saves sharded state dicts (the Trainer then saves no
            whole model).
    """

    engine: str = "NO"
    num_processes: int = 1
    zero_stage: int = 0
    deepspeed_config: dict | None = None
    fsdp2: bool = False
    fsdp_saves_shards: bool = False

    @classmethod
    def of(cls, accelerator: Any) -> Placement:
        """The placement `accelerator` (a prepared `accelerate.Accelerator`) runs."""
        state = accelerator.state
        deepspeed = getattr(state, "deepspeed_plugin", None)
        fsdp = getattr(state, "fsdp_plugin", None)
        saves_shards = fsdp is not None and "FULL_STATE_DICT" not in str(fsdp.state_dict_type)
        return cls(
            engine=str(accelerator.distributed_type).rsplit(".", 1)[-1],
            num_processes=accelerator.num_processes,
            zero_stage=getattr(deepspeed, "zero_stage", 0) or 0,
            deepspeed_config=None if deepspeed is None else deepspeed.deepspeed_config,
            fsdp2=bool(getattr(accelerator, "is_fsdp2", False)),
            fsdp_saves_shards=saves_shards,
        )

    @property
    def shards_weights(self) -> bool:
        """FSDP2 or DeepSpeed ZeRO-3 holds the model's weights as shards.

        The learner then scores completions inside the model's forward, in one pass
        (`learner.output_head.InForwardScores`), and decoding takes no CUDA graphs.
        """
        return self.fsdp2 or self.zero_stage == 3

    @property
    def uses_deepspeed(self) -> bool:
        """DeepSpeed runs the model (any ZeRO stage)."""
        return self.deepspeed_config is not None
