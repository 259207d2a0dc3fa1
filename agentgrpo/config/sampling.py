"""`GRPOConfig` fields of dynamic sampling and their check (`agentgrpo.rounds.dynamic_sampling`)."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentgrpo.config.errors import require

if TYPE_CHECKING:
    from agentgrpo.config.grpo import GRPOConfig


@dataclass
class SamplingFields:
    """Which groups a training round keeps."""

    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "Replace each training round's groups whose episodes all got the same reward "
            "(advantage 0: they teach nothing) with groups of fresh rows, drawn at random from "
            "the training rows and played, as DAPO does; with async_grpo the producer plays "
            "another row in place of such a group. False: every group is trained on, as in TRL."
        },
    )
    max_resample_rounds: int = field(
        default=3,
        metadata={
            "help": "With dynamic_sampling: the most plays of fresh rows a round may add (with "
            "async_grpo: the most groups dropped in a row per group kept, times the groups of "
            "a round); groups still uninformative then stay in the round."
        },
    )


def check_sampling(config: "GRPOConfig") -> None:
    """Check the dynamic sampling fields."""
    require(
        config.max_resample_rounds >= 1,
        f"max_resample_rounds={config.max_resample_rounds} must be at least 1.",
    )
