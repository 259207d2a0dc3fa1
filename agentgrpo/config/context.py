"""`GRPOConfig` fields of long episodes: the window, compaction, and the credit of each turn.

The policies themselves are `rollout.compaction`'s; `context_policy_of` builds the one a config
names (`agentgrpo.rounds.wiring.episode_config_of`); the credit per turn is
`agentgrpo.rounds.turn_credit`'s.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentgrpo.config.errors import require
from agentgrpo.learner.turn_credit import TURN_ADVANTAGES
from rollout.compaction import POLICY_NAMES, ContextPolicy, ContextPolicyError, context_policy_of

if TYPE_CHECKING:
    from agentgrpo.config.grpo import GRPOConfig


@dataclass
class ContextFields:
    """How long an episode's context may grow, and how it is compacted."""

    max_context: int | None = field(
        default=None,
        metadata={
            "help": "Most tokens one training row of an episode may hold, prompt included. None: "
            "the model's context limit (and max_completion_length past the prompt)."
        },
    )
    context_policy: str | None = field(
        default=None,
        metadata={
            "help": "What an episode does when its context passes context_threshold of the "
            "window: 'truncate' (old tool results replaced by a marker), 'summarize' (the "
            "model summarizes its progress; the summary is trained), or 'module:function' "
            "(messages, tokenizer) -> messages. The episode goes on in a new row that shares its "
            "reward. 'none': no compaction, whatever the environment names. None: the "
            "environment's context_policy, else none (the episode ends at the limit, finish "
            "'length')."
        },
    )
    context_threshold: float = field(
        default=0.75,
        metadata={"help": "Share of the window (0 to 1) past which context_policy applies."},
    )
    context_keep_last: int = field(
        default=2,
        metadata={"help": "With context_policy 'truncate': the latest tool results kept whole."},
    )
    context_summary_prompt: str | None = field(
        default=None,
        metadata={
            "help": "With context_policy 'summarize': the user turn asking for the summary. "
            "None: rollout.compaction.SUMMARY_INSTRUCTION."
        },
    )
    context_summary_tokens: int = field(
        default=256,
        metadata={"help": "With context_policy 'summarize': the most tokens of the summary."},
    )
    turn_advantage: str = field(
        default="episode",
        metadata={
            "help": "Credit per turn: 'episode' (every token gets its episode's advantage, as "
            "TRL), 'return' (each turn's discounted return-to-go, turn rewards and the "
            "episode's reward, normalised against the group's turns at the same index), or "
            "'same_state' (GiGPO: the episode's advantage plus a step advantage against the "
            "group's turns that start from the same state)."
        },
    )
    turn_discount: float = field(
        default=1.0,
        metadata={"help": "The discount gamma of a turn's return-to-go, in (0, 1]."},
    )


def check_context(config: "GRPOConfig") -> None:
    """Check the context fields (the policy is built, so a bad one fails here)."""
    require(
        config.max_context is None or config.max_context >= 2,
        f"max_context={config.max_context} must be at least 2 tokens (None: the model's limit).",
    )
    context_of(config)
    require(
        config.turn_advantage in TURN_ADVANTAGES,
        f"turn_advantage={config.turn_advantage!r} is not one of {list(TURN_ADVANTAGES)}.",
    )
    require(
        config.turn_advantage == "episode" or config.loss_type != "vespo",
        f"turn_advantage={config.turn_advantage!r} gives each turn its own advantage, and "
        "loss_type='vespo' weighs whole sequences by one: use another loss_type, or "
        "turn_advantage='episode'.",
    )
    require(
        0 < config.turn_discount <= 1,
        f"turn_discount={config.turn_discount} must be in (0, 1] (1: no discount).",
    )


def context_of(config: "GRPOConfig") -> ContextPolicy | None:
    """The context policy `config` names (None: none), its function imported.

    Raises:
        ContextPolicyError: An unknown policy, a function that cannot be imported, or settings
            out of range, naming the option.
    """
    return context_policy_of(
        _policy_value(config.context_policy),
        threshold=config.context_threshold,
        keep_last=config.context_keep_last,
        instruction=config.context_summary_prompt,
        summary_tokens=config.context_summary_tokens,
    )


def _policy_value(value: Any) -> str | Callable[..., Any] | None:
    """A policy name or a function as given, or the function a 'module:function' names."""
    if not isinstance(value, str) or value in POLICY_NAMES or ":" not in value:
        return value
    module_name, _, name = value.rpartition(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ContextPolicyError(
            f"context_policy={value!r}: cannot import {name!r} from {module_name!r} ({error}); "
            f"give 'module:function' of an importable module, or one of {list(POLICY_NAMES)}"
        ) from None
    if not callable(function):
        raise ContextPolicyError(f"context_policy={value!r} names a {type(function).__name__}")
    return function
