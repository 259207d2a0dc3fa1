"""The trainer's asynchronous mode (`async_grpo`): where its rounds come from, and its stop.

`GRPOTrainer` inherits `AsyncMode`. With `async_grpo` it builds a producer
(`asynchronous.rounds.AsyncGeneration`) that plays groups into a bounded queue while the learner
trains, pushes new weights to it every `weight_sync_steps` (`asynchronous.rounds.WeightPushes`), and
plays its training rounds from that queue. The loss's old logprobs are then the sampler's:
the weights that drew each token. The producer generates with a copy of the policy, or with
the run's vLLM server (`asynchronous.generators`); evaluation then shares the server, and brings it
to the learner's weights first. Without `async_grpo` nothing here runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from agentgrpo.asynchronous.generators import PushedForEvaluation, generator_weights
from agentgrpo.asynchronous.rounds import AsyncGeneration, WeightPushes, asynchronous_round_parts
from agentgrpo.rounds.pipeline import RoundParts, RoundPlan


class AsyncMode:
    """The asynchronous-rounds part of `GRPOTrainer` (it sets everything this class reads)."""

    _async: AsyncGeneration | None = None
    _async_parts: RoundParts

    def _wire_async(self, tools: Sequence[Callable[..., Any]], factory: Any) -> None:
        """The producer, its weight pushes, and the round parts that read from its queue.

        Raises:
            ValueError: A `rollout_func` or an agent plays the episodes (not asynchronous yet),
                or the policy's weights are sharded (`check_async_weights`).
        """
        trainer: Any = self
        check_async_weights(trainer.placement.zero_stage, trainer.placement.engine)
        if trainer.rollout_func is not None or trainer.agent is not None:
            raise ValueError(
                "async_grpo plays episodes with the engine's own loop; a rollout_func or an "
                "agent cannot run asynchronously yet: set async_grpo=False."
            )

        def policy() -> Any:
            return trainer.accelerator.unwrap_model(trainer.model)

        weights = generator_weights(
            trainer.args,
            policy(),
            trainer.processing_class,
            trainer.engine.context.backend,
            trainer.weight_sync,
        )
        self._async = generation = AsyncGeneration.build(
            trainer.args,
            trainer.plan,
            policy,
            weights,
            lambda backend: trainer._build_parts(backend, tools, factory, None).engine,
            trainer.scorer,
            trainer.train_dataset,
        )
        if trainer.args.use_vllm:  # evaluation shares the server: push through the producer
            trainer.weight_sync = PushedForEvaluation(generation.push, lambda: weights.version)
        add_metrics = functools.partial(trainer._trainer_log.add, "train")
        trainer.add_callback(WeightPushes(generation, trainer.args.weight_sync_steps, add_metrics))
        self._async_parts = asynchronous_round_parts(
            generation, trainer._round_parts, lambda: trainer.state.global_step
        )

    def _parts_for(self, plan: RoundPlan, parts: RoundParts) -> RoundParts:
        """The parts a round of `plan` plays with: the queue's for training rounds when async."""
        return self._async_parts if self._async is not None and plan.train else parts

    def _async_versions(self, plan: RoundPlan) -> list[int] | None:
        """The policy version of each episode of an asynchronous training round, else None.

        None: the current weights played the round. The producer's metrics are queued too.
        """
        if self._async is None or not plan.train:
            return None
        trainer: Any = self
        trainer._trainer_log.add("train", self._async.take_metrics())
        return self._async.last_versions_N

    def _stop_async(self) -> None:
        """Stop the producer, if there is one (the end of `train`, however it ends)."""
        if self._async is not None:
            self._async.stop()


def check_async_weights(zero_stage: int, engine: str) -> None:
    """Refuse async_grpo over sharded weights (DeepSpeed ZeRO-3, FSDP).

    The producer copies the policy's tensors and pushes them from its own thread, while the
    learner runs; sharded weights are empty until every process gathers them together.

    Args:
        zero_stage: DeepSpeed's ZeRO stage (0 without DeepSpeed).
        engine: accelerate's `distributed_type` by name (`Placement.engine`).

    Raises:
        ValueError: ZeRO-3 or FSDP.

    Example:
        >>> check_async_weights(zero_stage=2, engine="DEEPSPEED")
    """
    sharding = "FSDP" if engine == "FSDP" else None
    sharding = "DeepSpeed ZeRO-3" if zero_stage == 3 else sharding
    if sharding is not None:
        raise ValueError(
            f"async_grpo cannot generate from {sharding}'s sharded weights: its producer copies "
            "and pushes the policy's whole weights from its own thread while the learner "
            "trains. Launch its one process without sharded weights (DeepSpeed ZeRO-2, "
            "examples/accelerate/deepspeed_zero2.yaml, works), or set async_grpo=False."
        )
