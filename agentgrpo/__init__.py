"""agentgrpo: train LLM agents with GRPO on multi-turn, tool-calling episodes.

`GRPOTrainer` and `GRPOConfig` accept what TRL's do, so a TRL script ports by changing its
import. They are loaded on first use: importing transformers' training stack takes seconds, and
`import agentgrpo` should not.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig
    from agentgrpo.training.async_trainer import AsyncGRPOConfig, AsyncGRPOTrainer
    from agentgrpo.training.trainer import GRPOTrainer
    from tools import InfrastructureError

__version__ = "0.1.0"
__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "InfrastructureError",
]

_LAZY = {
    "GRPOConfig": "agentgrpo.config",
    "GRPOTrainer": "agentgrpo.training.trainer",
    "AsyncGRPOConfig": "agentgrpo.training.async_trainer",
    "AsyncGRPOTrainer": "agentgrpo.training.async_trainer",
    "InfrastructureError": "tools",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentgrpo' has no attribute {name!r}")
