"""The output folder of a run: one run at a time in it, and writes that fail saying why.

Two runs writing one folder at once would interleave their metrics and episodes and leave a
model mixed from both. `hold(output_dir)` takes an exclusive `flock` on
`<output_dir>/.agentgrpo.lock` (which records the holder's pid) or fails at once, naming the
folder and the other run's pid. The kernel drops the lock when the holder exits, however it
exits, so a killed run never leaves the folder locked. The lock file itself stays (deleting it
would let two runs lock two different files of one name).

Within one process the lock is re-entrant: `agentgrpo run` holds it for the whole command and
`GRPOTrainer.train` takes it again inside.

A save that fails because of the folder (full disk, read-only file system, no permission)
surfaces from torch or safetensors as an error that rarely says so. `explained_write_errors`
turns it into one `OutputDirUnwritable` naming the folder and the reason.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = ".agentgrpo.lock"

_held: dict[Path, int] = {}  # folder -> how many `hold`s of this process are open on it


class OutputDirBusy(RuntimeError):
    """Another process is running in the output folder (the message names it and its pid)."""


class OutputDirUnwritable(RuntimeError):
    """The output folder cannot be created or written (the message names it and why)."""


@contextlib.contextmanager
def hold(output_dir: str | os.PathLike) -> Iterator[None]:
    """Hold the output folder's lock while the block runs; the folder is created if missing.

    Raises:
        OutputDirBusy: Another process holds the lock.
        OutputDirUnwritable: The folder cannot be created or its lock file written
            (read-only file system, no permission, full disk).
    """
    folder = Path(output_dir).resolve()
    if folder in _held:
        _held[folder] += 1
        try:
            yield
        finally:
            _held[folder] -= 1
        return
    descriptor = _lock(folder, output_dir)
    _held[folder] = 1
    try:
        yield
    finally:
        del _held[folder]
        os.close(descriptor)  # releases the lock


def _lock(folder: Path, given: str | os.PathLike) -> int:
    """Open and lock the lock file; write this process's pid in it. Returns the descriptor."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise OutputDirUnwritable(unwritable_message(given, error)) from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(descriptor, 32).decode(errors="replace").strip() or "unknown"
        os.close(descriptor)
        raise OutputDirBusy(
            f"output folder {given} is in use by another agentgrpo run (pid {holder}); wait "
            "for it to end, or give this run another output folder"
        ) from None
    try:
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
    except OSError as error:
        os.close(descriptor)
        raise OutputDirUnwritable(unwritable_message(given, error)) from None
    return descriptor


# What to do about each way a folder refuses writes.
_ADVICE = {
    errno.ENOSPC: "free some space on its disk (or lower save_total_limit)",
    errno.EDQUOT: "free some of your disk quota (or lower save_total_limit)",
    errno.EROFS: "it is on a read-only file system; give an output folder on a writable one",
    errno.EACCES: "you may not write there; fix its permissions or give another output folder",
    errno.EPERM: "you may not write there; fix its permissions or give another output folder",
}


def unwritable_message(folder: str | os.PathLike, error: OSError) -> str:
    """`cannot write to output folder F: <the system's reason> (<path>); <what to do>`."""
    reason = os.strerror(error.errno) if error.errno else str(error)
    where = f" ({error.filename})" if error.filename else ""
    advice = _ADVICE.get(error.errno or 0, "check that the folder is writable")
    return f"cannot write to output folder {folder}: {reason}{where}; {advice}"


@contextlib.contextmanager
def explained_write_errors(folder: str | os.PathLike) -> Iterator[None]:
    """Run a save into `folder`; if it fails because the folder refuses writes, say so.

    The failure is the save's own `OSError` where it names a cause (`ENOSPC`, `EROFS`,
    `EACCES`, ...); otherwise (torch reports a full disk as a `RuntimeError`, safetensors as
    a `SafetensorError`) the folder is probed with a small write. A failure the folder did not
    cause propagates unchanged.

    Raises:
        OutputDirUnwritable: The folder is full, read-only or not writable; chained to the
            save's own error.
    """
    try:
        yield
    except Exception as error:
        cause = error if isinstance(error, OSError) and _names_cause(error) else None
        cause = cause or _probe(Path(folder))
        if cause is None:
            raise
        raise OutputDirUnwritable(unwritable_message(folder, cause)) from error


_PROBE_BYTES = 1 << 20  # a save needs at least this much room: far less is a full disk


def _names_cause(error: OSError) -> bool:
    return error.errno in _ADVICE


def _probe(folder: Path) -> OSError | None:
    """Why a write of `_PROBE_BYTES` into `folder` (or its nearest existing parent) fails."""
    existing = next((p for p in (folder, *folder.parents) if p.is_dir()), None)
    if existing is None:
        return None
    try:
        with tempfile.TemporaryFile(dir=existing) as probe:
            probe.write(bytes(_PROBE_BYTES))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        return error if error.errno in _ADVICE else None
    return None
