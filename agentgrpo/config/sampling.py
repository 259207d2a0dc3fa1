"""`GRPOConfig` fields of the rows a round plays and keeps, and their check.

Dynamic sampling (`agentgrpo.rounds.dynamic_sampling`) and the curriculum
(`agentgrpo.rounds.curriculum`).
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentgrpo.config.errors import require

if TYPE_CHECKING:
    from agentgrpo.config.grpo import GRPOConfig


@dataclass
class SamplingFields:
    """Which rows a training round plays, and which of its groups it keeps."""

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
    curriculum: bool = field(
        default=False,
        metadata={
            "help": "Draw each training round's rows by how much they can still teach: a row "
            "whose episodes pass about half the time most, one always or never passed least "
            "(weight max(curriculum_floor, p(1-p)), p the row's pass rate so far, 0.5 unseen). "
            "Pass rates are kept across the run and in checkpoints; eval rows are untouched. "
            "False: every row once an epoch, in the sampler's order, as in TRL."
        },
    )
    curriculum_floor: float = field(
        default=0.05,
        metadata={
            "help": "With curriculum: the least draw weight of a row, in (0, 0.25], so no row "
            "starves (a row passed half the time weighs 0.25)."
        },
    )
    curriculum_pass_reward: float = field(
        default=1.0,
        metadata={
            "help": "With curriculum: an episode passes when the weighted sum of its raw "
            "rewards (reward_weights) is at least this."
        },
    )


def check_sampling(config: "GRPOConfig") -> None:
    """Check the dynamic sampling and curriculum fields."""
    require(
        config.max_resample_rounds >= 1,
        f"max_resample_rounds={config.max_resample_rounds} must be at least 1.",
    )
    require(
        0.0 < config.curriculum_floor <= 0.25,
        f"curriculum_floor={config.curriculum_floor} must be in (0, 0.25]: above 0 so no row "
        "starves, at most 0.25 (the weight of a row passed half the time).",
    )
