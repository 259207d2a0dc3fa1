"""agentgrpo: train LLM agents with GRPO on multi-turn, tool-calling episodes.

The trainer layer. It sits on top of `rollout` (episodes), `environments` (tasks) and `tools`.
"""

__version__ = "0.1.0"
