"""The trainer's asynchronous mode (`async_grpo`): where its training rounds come from.

With `async_grpo` the trainer holds an `AsyncRounds`: a producer (`asynchronous.rounds.
AsyncGeneration`) that plays groups into a bounded queue while the learner trains, the callback
that pushes new weights to it every `weight_sync_steps` (`WeightPushes`),
and the round parts that take its training rounds from that queue. The loss's old logprobs are
then the sampler's: the weights that drew each token. The producer generates with a copy of the
policy, or with the run's vLLM server (`generation.generator.choose_generators`); evaluation
then plays on the server through the producer (`AsyncGeneration.generating`). Without
`async_grpo` the trainer holds none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from agentgrpo.asynchronous.rounds import AsyncGeneration
from agentgrpo.generation.generator import ConcurrentGenerator
from agentgrpo.learner.batch import TrainingBatch
from agentgrpo.rounds.dynamic_sampling import GroupFilter
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
        group_filter = GroupFilter.of(args, parts.shaping.combine, plan.prompts_per_process)
        generation = AsyncGeneration.build(
            args,
            plan,
            policy,
            producer,
            make_engine,
            scorer,
            dataset,
            group_filter,
            parts.curriculum,
            parts.shaping.weights_or_ones,
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


class WeightPushes(TrainerCallback):
    """Push the policy to the generator after every `weight_sync_steps` optimizer steps.

    Args:
        generation: The producer to push to.
        every: `weight_sync_steps`.
        record: Receives `perf/weight_sync_s`, the learner's time spent on each push.
    """

    def __init__(
        self, generation: AsyncGeneration, every: int, record: Callable[[dict[str, float]], None]
    ):
        self.generation, self.every, self.record = generation, every, record

    def on_save(self, args, state, control, **kwargs):
        """The checkpoint holds the rounds trained so far: their queued files can go."""
        self.generation.forget_trained(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        """Training ended normally: nothing trained will be trained again."""
        self.generation.forget_trained(2**62)

    def on_step_end(self, args, state, control, **kwargs):
        """Push when the step count reaches a multiple of `every`."""
        if state.global_step % self.every == 0:
            seconds = self.generation.push(state.global_step)
            self.record({"perf/weight_sync_s": seconds})


def asynchronous_round_parts(
    generation: AsyncGeneration, parts: RoundParts, step: Callable[[], int]
) -> RoundParts:
    """`parts` whose rounds take `generation`'s played groups at the learner's `step()`.

    The loss's old logprobs are the sampler's: the weights that drew each token, which the
    importance-sampling correction needs once the learner has moved on.
    """
    collate = parts.collate
    return dataclasses.replace(
        parts,
        play=lambda rows, n, seed: generation.take_round(rows, n, seed, step=step()),
        dynamic=None,  # the producer drops uninformative groups itself (`GroupFilter`)
        curriculum=None,  # the producer draws its rows itself (`RowStream`)
        collate=lambda episodes, advantages_N: _sampler_as_old(collate(episodes, advantages_N)),
        old_logprobs=lambda batch: batch.sampler_logprobs_B_C,
    )


def _sampler_as_old(batch: TrainingBatch) -> TrainingBatch:
    """`batch` with the sampler's logprobs as the old ones."""
    return dataclasses.replace(batch, old_logprobs_B_C=batch.sampler_logprobs_B_C)
