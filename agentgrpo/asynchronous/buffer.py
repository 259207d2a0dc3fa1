"""What the asynchronous producer hands the learner: played groups, their buffer, the rows.

`AsyncGeneration` (`asynchronous.rounds`) plays each row that `RowStream` gives into a `PlayedGroup`
and puts it in the `GroupBuffer`; the learner's rounds take the groups fresh enough to train on
and the buffer drops (and counts) the rest.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentgrpo.rounds.curriculum import Curriculum
from agentgrpo.rounds.scoring import RewardLogs
from rollout import Episode
from tools.threads import WAKE_EVERY_S


@dataclass(frozen=True)
class PlayedGroup:
    """One played and scored group, waiting to be trained on.

    Attributes:
        episodes: The G episodes of one row.
        rewards_G_F: One reward column per scorer name.
        version: The optimizer step of the weights its oldest token was drawn with.
        path: Its file in the queue folder (`asynchronous.queue`), or None when not written.
        logs: What its reward functions logged (`log_metric`, `log_extra`), reported at the
            step that trains it; empty for a group read back from the queue folder.
    """

    episodes: list[Episode]
    rewards_G_F: torch.Tensor
    version: int
    path: Path | None = None
    logs: RewardLogs = field(default_factory=RewardLogs)


class ProducerFailed(RuntimeError):
    """The producer thread stopped without an error of its own (it was stopped)."""


class GroupBuffer:
    """A bounded FIFO of played groups between the producer thread and the learner.

    Args:
        max_episodes: The most episodes held; `put` waits while one more group would not fit.
        on_drop: Called with the groups dropped as stale (under the buffer's lock).
    """

    def __init__(
        self, max_episodes: int, on_drop: Callable[[list[PlayedGroup]], None] = lambda _: None
    ):
        self.max_episodes = max_episodes
        self.on_drop = on_drop
        self.dropped_episodes = 0  # since the run started
        self._groups: collections.deque[PlayedGroup] = collections.deque()
        self._changed = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False

    @property
    def episodes(self) -> int:
        """Episodes waiting now."""
        return sum(len(group.episodes) for group in self._groups)

    def put(self, group: PlayedGroup) -> bool:
        """Add `group` once there is room; False (and nothing added) when the buffer closed."""
        with self._changed:
            while not self._closed and self.episodes + len(group.episodes) > self.max_episodes:
                self._changed.wait()
            if self._closed:
                return False
            self._groups.append(group)
            self._changed.notify_all()
            return True

    def preload(self, groups: Sequence[PlayedGroup]) -> None:
        """Add groups ahead of any played, even past `max_episodes` (a resumed run's queue)."""
        with self._changed:
            self._groups.extendleft(reversed(groups))
            self._changed.notify_all()

    def count_dropped(self, groups: Sequence[PlayedGroup]) -> None:
        """Count groups dropped as stale before they reached the buffer."""
        with self._changed:
            self.dropped_episodes += sum(len(g.episodes) for g in groups)
            self.on_drop(list(groups))

    def take(self, count: int, oldest_version: int) -> list[PlayedGroup]:
        """The first `count` groups of version >= `oldest_version`, waiting for them to arrive.

        Older groups are dropped on the way and counted in `dropped_episodes`.

        Raises:
            Exception: The producer's own error, when it stopped on one (a reward function's
                `RewardFunctionError`, say), so the learner fails as a synchronous run would.
            ProducerFailed: The buffer was closed.
        """
        taken: list[PlayedGroup] = []
        with self._changed:
            while len(taken) < count:
                self._drop_older(oldest_version)
                while self._groups and len(taken) < count:
                    taken.append(self._groups.popleft())
                self._changed.notify_all()
                if len(taken) < count:
                    self._raise_if_failed()
                    self._changed.wait(WAKE_EVERY_S)  # a Ctrl-C is not held till a group
        return taken

    def _drop_older(self, oldest_version: int) -> None:
        stale = [g for g in self._groups if g.version < oldest_version]
        if stale:
            self.dropped_episodes += sum(len(g.episodes) for g in stale)
            self.on_drop(stale)
        self._groups = collections.deque(g for g in self._groups if g.version >= oldest_version)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ProducerFailed("the episode producer was stopped")

    def raise_error(self) -> None:
        """Raise the producer's error, if it stopped on one (nothing after `close` alone).

        A producer that failed while the learner was busy (a reward function that raised, a
        full disk) has no waiting `take` to raise in: the next round raises it here, rather
        than start a new producer past it and lose the error.
        """
        with self._changed:
            if self._error is not None:
                raise self._error

    def fail(self, error: BaseException) -> None:
        """Record the producer's error: the learner's waiting `take` raises it."""
        with self._changed:
            self._error = error
            self._closed = True
            self._changed.notify_all()

    def close(self) -> None:
        """Stop taking groups: a waiting `put` returns False, a waiting `take` raises."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()


class RowStream:
    """The training rows, epoch after epoch, shuffled per epoch by the run's seed.

    Args:
        dataset: Indexable rows.
        shuffle: Shuffle each epoch (`shuffle_dataset`); else the dataset's order.
        seed: The run's seed.
        start: How many rows to skip (a resumed run continues after the rows it consumed).
        curriculum: Draws each row by its pass rate in place of the epoch's order, or None.
    """

    def __init__(
        self,
        dataset: Any,
        shuffle: bool,
        seed: int,
        start: int = 0,
        curriculum: Curriculum | None = None,
    ):
        if len(dataset) == 0:
            raise ValueError("the training dataset is empty: there is nothing to play")
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.taken = start
        self.curriculum = curriculum

    def next(self) -> tuple[Mapping[str, Any], int, int]:
        """The next row, its group's sampling seed, and its index in the dataset."""
        seed = hash((self.seed, self.taken)) % 2**31
        if self.curriculum is not None:
            self.taken += 1
            [key] = self.curriculum.pool.draw(1, seed)
            return self.dataset[key], seed, key
        epoch, position = divmod(self.taken, len(self.dataset))
        order = list(range(len(self.dataset)))
        if self.shuffle:
            generator = torch.Generator().manual_seed(hash((self.seed, epoch)) % 2**31)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        self.taken += 1
        return self.dataset[order[position]], seed, order[position]
