"""Asynchronous GRPO: a producer plays groups into a bounded queue while the learner trains.

The producer is a thread of its own running an event loop. Its workers each take the next row,
play its group of `num_generations` episodes with the generator's weights, score it, and put it
in a `GroupBuffer` (`asynchronous.buffer`), tagged with the version (the optimizer step) of the
weights the group started with. The learner's round takes `prompts_per_process` groups from the
buffer in place of playing them (`AsyncGeneration.take_round` is a `round.Play`); every other
stage of the round is the synchronous one. A group whose version lags the steps that will
train on it by more than `max_staleness` is dropped, whole, and counted; the producer starts no
group that could not be fresh by then, it waits for newer weights (`AsyncGeneration._hold`).
After every `weight_sync_steps` optimizer steps the learner pushes its weights to the
generator, between two of its steps.

The generator is a copy of the policy on the producer's thread, or a vLLM server in its own
process (`generation.generator.choose_generators`); either takes new weights between two of
its steps. With a server, the learner's own rounds (evaluation) play on the producer's
generator too (`AsyncGeneration.generating`).

Every sampled token records the version of the weights that drew it (`EpisodeRow.
policy_versions`; an episode that spans a push holds two or more). An episode's version is its
oldest token's, and a group's its oldest episode's, so the staleness checked is the bound for
each of its tokens. The loss's old logprobs are the sampler's own
(`TrainingBatch.sampler_logprobs_B_C`), token by token: the weights that drew each token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import torch

from agentgrpo.asynchronous.buffer import GroupBuffer, PlayedGroup, RowStream
from agentgrpo.asynchronous.queue import QueueFolder
from agentgrpo.generation.generator import ConcurrentGenerator
from agentgrpo.rounds.curriculum import Curriculum
from agentgrpo.rounds.dynamic_sampling import GroupFilter
from agentgrpo.rounds.pipeline import RoundPlan
from agentgrpo.rounds.scoring import RewardLogs, Scorer, play_round
from rollout import Episode, EpisodeRecord, GenerationBackend, RolloutEngine

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig

logger = logging.getLogger(__name__)

# Column count -> one weight per reward column (`RewardShaping.weights_or_ones`).
RewardWeights = Callable[[int], Sequence[float] | torch.Tensor]

# How long `AsyncGeneration.stop` waits for the producer thread to end, in seconds.
STOP_TIMEOUT_S = 60.0


@dataclass
class Waits:
    """Seconds spent waiting, and episodes trained, since the metrics were last taken."""

    learner_s: float = 0.0
    held_s: float = 0.0  # the producer's, for newer weights (`AsyncGeneration._hold`)
    staleness: list[int] = dataclasses.field(default_factory=list)


class AsyncGeneration:
    """The producer thread, its buffer and its weights; `take_round` feeds the learner's rounds.

    Args:
        engine: Plays episodes with the generator's backend (`weights.backend`).
        scorer: Rates each group as it ends.
        weights: The generator's weights.
        rows: Where the producer takes its rows.
        num_generations: Episodes per group.
        workers: Groups played at once.
        max_staleness: See `GRPOConfig.max_staleness`.
        round_steps: Optimizer steps one round is trained over (its last micro-batch is trained
            `round_steps - 1` steps after its first).
        max_episodes: `GRPOConfig.queue_maxsize`.
        policy: Returns the learner's policy (unwrapped), read at start and at each push.
        rows_per_step: Rows the learner consumes per optimizer step (where a resumed run's
            producer starts in `rows`).
        queue: Where each played group is written before it is trained on (`asynchronous.queue`),
            or None to keep them in memory only.
        group_filter: Drops the groups that teach nothing as they end (`dynamic_sampling`), or
            None to keep every group.
        reward_weights: Column count -> the run's reward weights: with a curriculum (`rows.
            curriculum`), what a group's results are added to it with.
        seats: Groups one row gives: the policy's seats in a game (`rollout.match`), else 1.
            A played row is then a `PlayedGroup` of `seats` groups of `num_generations`
            episodes, one per seat, taken and dropped together.

    Raises:
        ValueError: `max_episodes` cannot hold one played row.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        scorer: Scorer,
        weights: ConcurrentGenerator,
        rows: RowStream,
        num_generations: int,
        workers: int,
        max_staleness: int,
        round_steps: int,
        max_episodes: int,
        policy: Callable[[], torch.nn.Module],
        rows_per_step: float,
        queue: QueueFolder | None = None,
        group_filter: GroupFilter | None = None,
        reward_weights: RewardWeights = lambda columns: [1.0] * columns,
        seats: int = 1,
    ):
        if max_episodes < num_generations * seats:  # a played row would never fit: a hang
            raise ValueError(
                f"queue_maxsize={max_episodes} cannot hold one row's games: num_generations="
                f"{num_generations} x {seats} seats trained = {num_generations * seats} "
                "episodes; raise it"
            )
        self.policy, self.rows_per_step, self.queue = policy, rows_per_step, queue
        self.seats = seats
        self.reward_weights = reward_weights
        self.group_filter = group_filter
        self._rows_dropped = 0  # rows whose groups `group_filter` dropped since the start
        self._filtered_reported = 0  # groups it dropped, as of the last `take_metrics`
        self.consumed: list[tuple[int, Path]] = []  # (step a round took it at, its file)
        self.resumed_groups = 0  # groups a resumed run found in the queue and kept
        self.resumed_dropped = 0  # episodes it found there too stale to train on
        self.engine, self.scorer, self.weights, self.rows = engine, scorer, weights, rows
        self.num_generations, self.workers = num_generations, workers
        self.max_staleness, self.round_steps = max_staleness, round_steps
        self.buffer = GroupBuffer(max_episodes, self._forget)
        self.last_versions_N: list[int] = []  # the latest round's, one per episode
        self._waits = Waits()
        self._dropped_reported = 0
        self._thread: threading.Thread | None = None
        self._token: Any = None
        self._scope: anyio.CancelScope | None = None
        self._pushed: anyio.Condition | None = None  # notified after each push (its loop's)
        self._ready = threading.Event()

    @classmethod
    def build(
        cls,
        args: GRPOConfig,
        plan: RoundPlan,
        policy: Callable[[], torch.nn.Module],
        weights: ConcurrentGenerator,
        make_engine: Callable[[GenerationBackend], RolloutEngine],
        scorer: Scorer,
        dataset: Any,
        group_filter: GroupFilter | None = None,
        curriculum: Curriculum | None = None,
        reward_weights: RewardWeights = lambda columns: [1.0] * columns,
    ) -> AsyncGeneration:
        """The producer of a `GRPOConfig` with `async_grpo`.

        Args:
            args: The run's config.
            plan: The training round's sizes.
            policy: Returns the learner's policy (unwrapped).
            weights: The producer's generator (`generation.generator.choose_generators`).
            make_engine: Builds the engine (as the trainer builds its own) over a backend.
            scorer: The trainer's scorer (its reward logs are the run's).
            dataset: The training rows.
            group_filter: See the class's arguments.
            curriculum: Draws the producer's rows (`curriculum`), or None for the epochs' order.
            reward_weights: See the class's arguments.
        """
        return cls(
            make_engine(weights.backend),
            scorer,
            weights,
            RowStream(dataset, bool(args.shuffle_dataset), args.seed, curriculum=curriculum),
            plan.num_generations,
            workers=plan.prompts_per_process,
            max_staleness=args.max_staleness,
            round_steps=math.ceil(plan.repeats / plan.accumulation_steps),
            max_episodes=args.queue_maxsize,
            policy=policy,
            rows_per_step=plan.prompts_per_process * plan.accumulation_steps / plan.repeats,
            queue=QueueFolder(str(args.output_dir), scorer.names),  # TrainingArguments sets it
            group_filter=group_filter,
            reward_weights=reward_weights,
            seats=plan.seats,
        )

    # ------------------------------------------------------------------ producer

    def start(self, step: int) -> None:
        """Start the producer thread with the policy of step `step`; returns when it runs.

        It starts lazily, at the first round: a resumed run has loaded its checkpoint by then.
        Nothing happens while it runs; after `stop` (a second `train()`), a new one starts with
        an empty buffer and the queue folder's groups; one that stopped on an error is not
        restarted: its error is raised (`GroupBuffer.raise_error`).
        """
        if self._thread is not None:
            if self._thread.is_alive():
                return
            self.buffer.raise_error()
            dropped = self.buffer.dropped_episodes
            self.buffer = GroupBuffer(self.buffer.max_episodes, self._forget)
            self.buffer.dropped_episodes = self._dropped_reported = dropped
            self._ready = threading.Event()
        self.rows.taken, self._rows_dropped = int(step * self.rows_per_step), 0
        self._load(step)
        self._resume_queue(step)
        self._thread = threading.Thread(target=self._main, name="agentgrpo-producer", daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        try:
            anyio.run(self._produce)
        except BaseException as error:  # the learner raises it
            self.buffer.fail(_first_error(error))
        finally:
            self._ready.set()

    async def _produce(self) -> None:
        self._token = anyio.lowlevel.current_token()
        self._pushed = anyio.Condition()
        async with anyio.create_task_group() as workers:
            self._scope = workers.cancel_scope
            self._ready.set()
            for _ in range(self.workers):
                workers.start_soon(self._play_groups)

    async def _play_groups(self) -> None:
        """Play group after group until the buffer closes."""
        while True:
            await self._hold()
            row, seed, key = self.rows.next()
            started = self.weights.version
            scorer = dataclasses.replace(self.scorer, logs=RewardLogs())  # this group's logs
            episodes, rewards_G_F = await play_round(
                self.engine, [row], self.num_generations, seed, scorer
            )
            if self.rows.curriculum is not None:
                weights_F = self.reward_weights(rewards_G_F.shape[1])
                self.rows.curriculum.record_group(key, rewards_G_F, weights_F)
            if self.group_filter is not None and self.group_filter.drops(rewards_G_F):
                self._rows_dropped += 1  # another row takes its place
                continue
            version = min(episode_version(e, started) for e in episodes)
            group = PlayedGroup(episodes, rewards_G_F, version, logs=scorer.logs)
            if not await anyio.to_thread.run_sync(self._store_and_put, group):
                return

    async def _hold(self) -> None:
        """Wait while a group started now could not be fresh when the learner reaches it.

        The learner takes `rows_per_step` rows a step; with weights of version `v`, the rows
        before `(v + max_staleness + 1) * rows_per_step` are trained on within `max_staleness`
        steps of `v` (the config's check makes that at least the rows of the learner's round).
        Past them the producer waits for a push: generation is held to `max_staleness`, not
        spent on groups that would be dropped. Rows whose groups dynamic sampling dropped do
        not count: the learner never takes them.
        """
        started, pushed = time.perf_counter(), self._pushed
        assert pushed is not None  # made by `_produce`, which runs this
        async with pushed:
            while self.rows.taken - self._rows_dropped >= self._fresh_rows():
                await pushed.wait()
        self._waits.held_s += time.perf_counter() - started

    def _fresh_rows(self) -> float:
        return (self.weights.version + self.max_staleness + 1) * self.rows_per_step

    async def _push_and_release(self, step: int) -> None:
        """Push the policy of step `step`, then let held workers go on."""
        await self.weights.push(self.policy(), step)
        pushed = self._pushed
        assert pushed is not None  # made by `_produce`, whose loop runs this
        async with pushed:
            pushed.notify_all()

    def _store_and_put(self, group: PlayedGroup) -> bool:
        """Write the group to the queue folder, then put it in the buffer (False: closed)."""
        if self.queue is not None:
            records = [
                EpisodeRecord(e, _rewards(self.scorer.names, r), math.nan, math.nan, group.version)
                for e, r in zip(group.episodes, group.rewards_G_F.tolist(), strict=True)
            ]
            group = dataclasses.replace(group, path=self.queue.write(records))
        return self.buffer.put(group)

    def _resume_queue(self, step: int) -> None:
        """Put the groups a run left in the queue folder first; drop the stale ones.

        A run that starts at step 0 clears the folder instead. A group is kept when it would
        be fresh now and was not played with weights newer than the checkpoint's (they were
        lost with the run that played it).
        """
        if self.queue is None:
            return
        if step == 0:
            self.queue.clear()
            return
        oldest = step + self.round_steps - 1 - self.max_staleness
        stored = [
            PlayedGroup([r.episode for r in g.records], g.rewards_G_F, g.version, g.path)
            for g in self.queue.read()
        ]
        size = self.num_generations * self.seats
        if sizes := sorted({len(g.episodes) for g in stored} - {size}):
            seats = f" x {self.seats} seats" if self.seats > 1 else ""
            raise ValueError(
                f"the queue folder {self.queue.folder} holds groups of "
                f"{', '.join(map(str, sizes))} episodes, played with another num_generations "
                f"(or seats) than this run's {self.num_generations}{seats}: resume with the "
                "settings that played them, or remove the folder to start the queue afresh"
            )
        kept = [g for g in stored if oldest <= g.version <= step]
        dropped = [g for g in stored if not oldest <= g.version <= step]
        self.buffer.preload(kept)
        self.buffer.count_dropped(dropped)
        self.resumed_groups = len(kept)
        self.resumed_dropped = sum(len(g.episodes) for g in dropped)
        if stored:
            logger.warning(
                "resuming at step %d with %d queued group(s) left by the earlier run: %d to train "
                "first, %d episode(s) dropped as stale",
                step,
                len(stored),
                len(kept),
                self.resumed_dropped,
            )

    def _forget(self, groups: list[PlayedGroup]) -> None:
        """Remove the files of groups that will never be trained on again."""
        if self.queue is not None:
            self.queue.remove(g.path for g in groups if g.path is not None)

    def forget_trained(self, step: int) -> None:
        """Remove the files of the rounds whose every step is before `step` (a checkpoint's)."""
        done = [(s, p) for s, p in self.consumed if s + self.round_steps <= step]
        self.consumed = [item for item in self.consumed if item not in done]
        if self.queue is not None:
            self.queue.remove(path for _, path in done)

    def stop(self) -> None:
        """Close the buffer, cancel the episodes in flight and wait for the thread to end."""
        self.buffer.close()
        thread, scope = self._thread, self._scope
        if thread is None or not thread.is_alive():
            return
        if scope is not None:
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                anyio.from_thread.run_sync(scope.cancel, token=self._token)
        thread.join(STOP_TIMEOUT_S)
        if thread.is_alive():
            raise RuntimeError(f"the episode producer did not stop within {STOP_TIMEOUT_S:.0f} s")

    # ------------------------------------------------------------------ learner

    def take_round(
        self, rows: Sequence[Mapping[str, Any]], num_generations: int, seed: int, *, step: int
    ) -> tuple[list[Episode], torch.Tensor]:
        """A `round.Play` for the learner at optimizer step `step`: `len(rows)` fresh played rows.

        `rows` give only the count (the producer plays its own rows), `seed` is unused. A
        played row is one group, or one per seat in a game (`seats`). It is fresh when the
        round's last optimizer step is at most `max_staleness` steps after its version.
        Episodes are renumbered into this round's groups, and what the reward functions
        logged for each group joins the scorer's logs as that group's.
        """
        self.start(step)
        oldest = step + self.round_steps - 1 - self.max_staleness
        started = time.perf_counter()
        groups = self.buffer.take(len(rows), oldest)
        self._waits.learner_s += time.perf_counter() - started
        size = num_generations * self.seats  # a played row's episodes
        episodes = [
            dataclasses.replace(e, group=g * self.seats + e.group, index=g * size + e.index)
            for g, group in enumerate(groups)
            for e in group.episodes
        ]
        self.last_versions_N = [
            episode_version(e, group.version) for group in groups for e in group.episodes
        ]
        for g, group in enumerate(groups):
            self.scorer.logs.add_group(g * self.seats, group.logs)
        self.consumed += [(step, g.path) for g in groups if g.path is not None]
        self._waits.staleness += [step - version for version in self.last_versions_N]
        return episodes, torch.cat([group.rewards_G_F for group in groups])

    def push(self, step: int) -> float:
        """Push the policy's weights (at optimizer step `step`) to the generator; seconds taken."""
        started = time.perf_counter()
        if self._thread is None or not self._thread.is_alive():
            self._load(step)  # nothing generates
        else:
            anyio.from_thread.run(self._push_and_release, step, token=self._token)
        return time.perf_counter() - started

    def _load(self, step: int) -> None:
        self.weights.load(self.policy(), step)

    @property
    def version(self) -> int:
        """The optimizer step of the generator's weights."""
        return self.weights.version

    @property
    def backend(self) -> GenerationBackend:
        """The generator's backend."""
        return self.weights.backend

    @contextlib.contextmanager
    def generating(self, policy: torch.nn.Module, step: int) -> Iterator[None]:
        """A learner's own round (evaluation) on the producer's generator, at step `step`.

        The generator is brought to `step` first, through the producer, between its requests
        (`push`), so that evaluation is of the current policy: the learner's `policy`, which
        `self.policy()` returns.
        """
        if self.weights.version != step:
            self.push(step)
        yield

    def take_metrics(self) -> dict[str, float]:
        """The metrics since the last call, under TRL's AsyncGRPO names where it logs the same.

        `sample/staleness_mean` and `_max`: optimizer steps between the weights that started
        each trained episode and the step that first trains it. `sample/dropped_stale_total`:
        episodes dropped as stale since the last call. `rollout/queue_size`: episodes waiting.
        `perf/rollout_wait_s`: the learner's wait for episodes. `perf/weight_sync_pause_s`:
        generation paused for weight pushes. `perf/generation_held_s`: the producer's workers
        waited for newer weights, summed over workers (`_hold`). With dynamic sampling,
        `dynamic_sampling/groups_replaced`: uninformative groups dropped since the last call.
        With a curriculum, its pool's `curriculum/*` metrics.
        """
        staleness, self._waits.staleness = self._waits.staleness, []
        dropped = self.buffer.dropped_episodes - self._dropped_reported
        self._dropped_reported = self.buffer.dropped_episodes
        metrics = {
            "sample/dropped_stale_total": float(dropped),
            "rollout/queue_size": float(self.buffer.episodes),
            "perf/rollout_wait_s": self._waits.learner_s,
            "perf/weight_sync_pause_s": self.weights.take_paused_s(),
            "perf/generation_held_s": self._waits.held_s,
        }
        self._waits.learner_s = self._waits.held_s = 0.0
        if self.group_filter is not None:
            dropped = self.group_filter.dropped
            metrics["dynamic_sampling/groups_replaced"] = float(dropped - self._filtered_reported)
            self._filtered_reported = dropped
        if self.rows.curriculum is not None:
            metrics |= self.rows.curriculum.metrics()
        if staleness:
            metrics["sample/staleness_mean"] = sum(staleness) / len(staleness)
            metrics["sample/staleness_max"] = float(max(staleness))
        return metrics


def _first_error(error: BaseException) -> BaseException:
    """The first error a task group's exception group holds (itself for a plain error)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def _rewards(names: Sequence[str], rewards_F: Sequence[float]) -> dict[str, float | None]:
    """A group member's reward columns by name, None where NaN (as the episode record holds)."""
    return {n: None if math.isnan(r) else r for n, r in zip(names, rewards_F, strict=True)}


def episode_version(episode: Episode, default: int) -> int:
    """The version of the oldest weights that drew a token of `episode`.

    `default` (the version when it started) when its rows recorded no versions.
    """
    versions = [
        version
        for row in episode.rows
        if row.policy_versions is not None
        for version in row.policy_versions
        if version >= 0
    ]
    return min(versions, default=default)
