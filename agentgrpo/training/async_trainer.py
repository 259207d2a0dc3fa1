"""TRL's names for asynchronous GRPO: `AsyncGRPOConfig` and `AsyncGRPOTrainer`.

They are `GRPOConfig` and `GRPOTrainer` with `async_grpo=True` (see
`agentgrpo.asynchronous.rounds`), so a script written for TRL's asynchronous trainer ports by
changing its import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentgrpo.config import GRPOConfig
from agentgrpo.config.grpo import _reject_unknown_keywords
from agentgrpo.training.porting import model_name
from agentgrpo.training.trainer import GRPOTrainer


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    """A `GRPOConfig` whose `async_grpo` is on by default."""

    async_grpo: bool = field(
        default=True,
        metadata={"help": "Overlap generation with training (see GRPOConfig.async_grpo)."},
    )


AsyncGRPOConfig.__init__ = _reject_unknown_keywords(AsyncGRPOConfig.__init__)  # type: ignore[method-assign]


class AsyncGRPOTrainer(GRPOTrainer):
    """A `GRPOTrainer` that always trains asynchronously; takes the same arguments.

    Raises:
        ValueError: `args` has `async_grpo=False`.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        *rest: Any,
        **kwargs: Any,
    ):
        if args is None:
            args = AsyncGRPOConfig(output_dir=f"{model_name(model)}-AsyncGRPO")
        if not args.async_grpo:
            raise ValueError(
                "AsyncGRPOTrainer trains asynchronously but args has async_grpo=False; pass an "
                "AsyncGRPOConfig (or async_grpo=True), or use GRPOTrainer."
            )
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
