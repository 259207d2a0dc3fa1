"""The asynchronous run's queue on disk: every played group is written before it is trained on.

Each group the producer finishes is written to `<output_dir>/episodes/queue/group-00000042.jsonl`
(one `rollout.record` line per episode: its tokens, per-token versions, reward columns, and the
version of its oldest token as `policy_version`; `reward` and `advantage` are NaN, as they are
computed only with the round). A group's file is removed once a checkpoint holds the weights
trained on it (or the run ends normally after training on it), or when it is dropped as stale.
So a run that was killed or Ctrl-C'd and resumes from its last checkpoint finds, in the folder,
every group played since that checkpoint that it may train on again: `AsyncGeneration` trains
the fresh ones first. A group's file is written whole and synced to disk before it is renamed
into place, so a crash leaves a temporary file (ignored) or a whole group; a file that is not a
whole group all the same (empty, or cut short by another program) is a `QueueFileError` naming
it. A write the folder refuses (a full disk) stops the run with `OutputDirUnwritable` naming
the folder, and leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from agentgrpo.run_folder import explained_write_errors
from rollout import EpisodeRecord
from rollout.record import read_records, record_line

QUEUE_DIR = Path("episodes") / "queue"
_GROUP_FILE = re.compile(r"group-(\d{8})\.jsonl")


class QueueFileError(ValueError):
    """A file in the queue folder is not a whole group: what to remove is in the message."""


@dataclass(frozen=True)
class StoredGroup:
    """A group read back from the queue folder (see `QueueFolder.read`).

    Attributes:
        path: Its file.
        records: Its episodes' records, in member order.
        rewards_G_F: Its reward columns, NaN where a function returned None.
        version: The version of its oldest token.
    """

    path: Path
    records: list[EpisodeRecord]
    rewards_G_F: torch.Tensor
    version: int


class QueueFolder:
    """Where the played groups of one run wait, one file each, numbered in the order played.

    Args:
        output_dir: The run's output folder.
        names: The reward columns, in the order of `rewards_G_F`.
    """

    def __init__(self, output_dir: str | Path, names: Sequence[str]):
        self.folder = Path(output_dir) / QUEUE_DIR
        self.names = list(names)
        self._next = 1 + max((number for number, _ in self._files()), default=0)

    def write(self, records: Sequence[EpisodeRecord]) -> Path:
        """Write a group's records at once (a temporary file, synced, renamed); its path.

        Raises:
            OutputDirUnwritable: The folder refuses the write (a full disk, say); the message
                names it, why and what to do. The temporary file is removed: nothing of the
                group is left, and the run stops (its groups since the last checkpoint are
                played again by `--resume`).
        """
        path = self.folder / f"group-{self._next:08d}.jsonl"
        self._next += 1
        temporary = path.with_name(path.name + ".tmp")
        with explained_write_errors(self.folder):
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                with temporary.open("w", encoding="ascii") as file:
                    file.write("".join(record_line(r) for r in records))
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(temporary, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    temporary.unlink()
                raise
            _sync_folder(self.folder)  # the rename itself, on disk
        return path

    def read(self) -> list[StoredGroup]:
        """Every group waiting in the folder, in the order played.

        Raises:
            QueueFileError: A group file is empty or not whole, naming it.
        """
        return [self._group(path) for _, path in sorted(self._files())]

    def clear(self) -> None:
        """Remove every group (a run that starts afresh trains nothing an earlier one left)."""
        self.remove(path for _, path in self._files())

    @staticmethod
    def remove(paths: Iterable[Path]) -> None:
        """Remove these groups' files (those already gone are skipped)."""
        for path in paths:
            path.unlink(missing_ok=True)

    def _files(self) -> list[tuple[int, Path]]:
        if not self.folder.is_dir():
            return []
        matches = ((_GROUP_FILE.fullmatch(p.name), p) for p in self.folder.iterdir())
        return [(int(m[1]), p) for m, p in matches if m]

    def _group(self, path: Path) -> StoredGroup:
        try:
            records = read_records(path)
        except ValueError as error:
            raise QueueFileError(_not_whole(path, f"it does not read back ({error})")) from None
        if not records:
            raise QueueFileError(_not_whole(path, "it is empty"))
        rewards_G_F = torch.tensor(
            [[_nan_if_none(r.rewards.get(name)) for name in self.names] for r in records],
            dtype=torch.float32,
        ).reshape(len(records), len(self.names))
        return StoredGroup(path, records, rewards_G_F, records[0].policy_version)


def _not_whole(path: Path, why: str) -> str:
    return (
        f"the queued group {path} is not a whole group: {why}. agentgrpo writes each group "
        "whole and renames it into place, so another program or a damaged disk left it; remove "
        "the file to resume without it"
    )


def _sync_folder(folder: Path) -> None:
    """Sync `folder`'s entries (a rename into it) to disk, where the platform can."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value
