"""The trainer's asynchronous mode (`async_grpo`): where its training rounds come from.

With `async_grpo` the trainer holds an `AsyncRounds`: a producer (`asynchronous.rounds.
AsyncGeneration`) that plays groups into a bounded queue while the learner trains, the callback
that pushes new weights to it every `weight_sync_steps` (`asynchronous.rounds.WeightPushes`),
and the round parts that take its training rounds from that queue. The loss's old logprobs are
then the sampler's: the weights that drew each token. The producer generates with a copy of the
policy, or with the run's vLLM server (`generation.generator.choose_generators`); evaluation
then plays on the server through the producer (`AsyncGeneration.generating`). Without
`async_grpo` the trainer holds none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from agentgrpo.asynchronous.rounds import AsyncGeneration, WeightPushes, asynchronous_round_parts
from agentgrpo.generation.generator import ConcurrentGenerator
from agentgrpo.rounds.pipeline import RoundParts, RoundPlan
from agentgrpo.rounds.scoring import Scorer
from rollout import GenerationBackend, RolloutEngine

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig


@dataclass
class AsyncRounds:
    """The producer, its weight pushes, and the parts of the training rounds it feeds.

    Attributes:
        generation: The producer.
        pushes: The trainer's callback that pushes the policy to it.
        parts: Round parts whose `play` takes the producer's played groups.
        record: Receives the producer's metrics (the trainer's train metrics).
    """

    generation: AsyncGeneration
    pushes: WeightPushes
    parts: RoundParts
    record: Callable[[dict[str, float]], None]

    @classmethod
    def build(
        cls,
        args: GRPOConfig,
        plan: RoundPlan,
        producer: ConcurrentGenerator,
        policy: Callable[[], torch.nn.Module],
        make_engine: Callable[[GenerationBackend], RolloutEngine],
        scorer: Scorer,
        dataset: Any,
        parts: RoundParts,
        step: Callable[[], int],
        record: Callable[[dict[str, float]], None],
    ) -> AsyncRounds:
        """The asynchronous mode of a run of `args`.

        Args:
            args: The run's config.
            plan: The training round's sizes.
            producer: The producer's generator.
            policy: Returns the learner's policy (unwrapped).
            make_engine: Builds the engine (as the trainer builds its own) over a backend.
            scorer: The trainer's scorer.
            dataset: The training rows.
            parts: The synchronous rounds' parts, which the queue's replace `play` of.
            step: Returns the learner's optimizer step.
            record: Receives the train metrics: the producer's, and the learner's seconds
                spent on each push.
        """
        generation = AsyncGeneration.build(
            args, plan, policy, producer, make_engine, scorer, dataset
        )
        return cls(
            generation,
            WeightPushes(generation, args.weight_sync_steps, record),
            asynchronous_round_parts(generation, parts, step),
            record,
        )

    def parts_for(self, plan: RoundPlan, parts: RoundParts) -> RoundParts:
        """The parts a round of `plan` plays with: the queue's for training rounds."""
        return self.parts if plan.train else parts

    def versions(self, plan: RoundPlan) -> list[int] | None:
        """The policy version of each episode of a training round just taken, else None.

        None: the current weights played the round (evaluation). The producer's metrics since
        the last training round are recorded too.
        """
        if not plan.train:
            return None
        self.record(self.generation.take_metrics())
        return self.generation.last_versions_N

    def stop(self) -> None:
        """Stop the producer (the end of `train`, however it ends)."""
        self.generation.stop()


def check_async_players(rollout_func: Any, agent: Any) -> None:
    """Refuse `async_grpo` when a `rollout_func` or an agent plays the episodes.

    Raises:
        ValueError: Either is set.
    """
    if rollout_func is not None or agent is not None:
        raise ValueError(
            "async_grpo plays episodes with the engine's own loop; a rollout_func or an "
            "agent cannot run asynchronously yet: set async_grpo=False."
        )
