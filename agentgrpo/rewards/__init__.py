"""Rewards: calling the user's reward functions (`calls`) and the built-in ones (`builtin`).

`from agentgrpo.rewards import accuracy_reward` keeps working: the built-ins (and
`tool_call_match`) are re-exported here, as TRL exposes its own under `trl.rewards`.
"""

from agentgrpo.rewards.builtin import (
    accuracy_reward,
    answers_match,
    completion_text,
    extract_answer,
    get_soft_overlong_punishment,
    normalize_answer,
    think_format_reward,
)
from agentgrpo.rewards.tool_call_match import tool_call_match

__all__ = [
    "accuracy_reward",
    "answers_match",
    "completion_text",
    "extract_answer",
    "get_soft_overlong_punishment",
    "normalize_answer",
    "think_format_reward",
    "tool_call_match",
]
