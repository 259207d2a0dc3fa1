"""`GRPOConfig` fields of the warm start: supervised steps on demonstrations before GRPO."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentgrpo.config.errors import require

if TYPE_CHECKING:
    from agentgrpo.config.grpo import GRPOConfig


@dataclass
class WarmStartFields:
    """Supervised steps on the environment's demonstrations, and saving their result."""

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


def check_warm_start(config: "GRPOConfig") -> None:
    """Check the warm-start fields: a count, a positive rate, and something to save."""
    require(
        config.warm_start_steps >= 0 and config.warm_start_learning_rate > 0,
        f"warm_start_steps={config.warm_start_steps} must be >= 0 and "
        f"warm_start_learning_rate={config.warm_start_learning_rate} positive.",
    )
    require(
        config.warm_start_steps > 0 or not config.save_warm_start,
        "save_warm_start=True saves the warm-started model, but warm_start_steps=0 runs no "
        "warm start; set warm_start_steps > 0 or save_warm_start=False.",
    )
