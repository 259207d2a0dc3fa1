"""The torch thread count of a run, kept in its checkpoints so that a resumed run computes alike.

On a CPU torch splits a long sum (a matrix product, a norm, a reduction) into one part per
thread and adds the parts, so the same sum with another thread count rounds differently: a run
resumed with another count ends away from the uninterrupted run (docs/cli.md has the figure).
Each checkpoint records the count of each process (`save`, beside the
Trainer's `rng_state.pth`), and a resumed process takes it back (`restore`), which makes the
resume bit for bit on the same machine and software; another CPU model or another torch build
can still round differently.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

_KEY = "torch_threads"


def file_name(process_index: int, num_processes: int) -> str:
    """The file of one process's thread count, named like the Trainer's RNG state files.

    Examples:
        >>> file_name(0, 1), file_name(1, 2)
        ('torch_threads.json', 'torch_threads_1.json')

    """
    return f"{_KEY}.json" if num_processes <= 1 else f"{_KEY}_{process_index}.json"


def save(folder: str | Path, process_index: int, num_processes: int) -> None:
    """Record this process's `torch.get_num_threads()` in the checkpoint folder `folder`."""
    path = Path(folder) / file_name(process_index, num_processes)
    path.write_text(json.dumps({_KEY: torch.get_num_threads()}) + "\n")


def restore(checkpoint: str | Path, process_index: int, num_processes: int) -> None:
    """Set this process's torch thread count to the one `checkpoint` recorded, warning if it moves.

    A checkpoint without the file (saved before counts were recorded) leaves the count alone.

    Raises:
        ValueError: The file is there but holds no positive whole count (edited or damaged);
            the message names it.
    """
    path = Path(checkpoint) / file_name(process_index, num_processes)
    if not path.is_file():
        return
    saved = _read(path)
    current = torch.get_num_threads()
    if saved != current:
        warnings.warn(
            f"{Path(checkpoint).name} was trained with {saved} torch threads; this process had "
            f"{current}, and now uses {saved} too, so that its float sums round as the "
            f"uninterrupted run's did (delete {path} to keep {current})",
            stacklevel=3,
        )
        torch.set_num_threads(saved)


def _read(path: Path) -> int:
    try:
        saved = json.loads(path.read_text())[_KEY]
    except (ValueError, OSError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is unreadable ({error!r}); delete it to resume") from error
    if not isinstance(saved, int) or isinstance(saved, bool) or saved < 1:
        raise ValueError(f"{path} holds {saved!r}, not a thread count; delete it to resume")
    return saved
