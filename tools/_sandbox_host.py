"""What a sandbox call holds on the host, and its removal: the call's folder and pids cgroup.

Both are named `<prefix>-<caller pid>-...`, so that the first call of a later process removes
those of a caller that died mid-call (`remove_leftovers`): killed by SIGKILL, it could not.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio

CGROUP_PREFIX = "agentgrpo-sandbox"
CALL_FOLDER_PREFIX = "agentgrpo-python"
_call_numbers = itertools.count()


@contextlib.contextmanager
def call_folder(isolated: bool, code: str) -> Iterator[str]:
    """A temporary folder for one call, removed afterwards.

    Isolated, it stays empty here: the child mounts its new root on it, in its own mount
    namespace. Not isolated, it holds the code (`main.py`) and the working folder (`work`).
    """
    prefix = f"{CALL_FOLDER_PREFIX}-{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        if not isolated:
            os.mkdir(os.path.join(folder, "work"))
            Path(folder, "main.py").write_text(code)
        yield folder


@functools.cache
def remove_leftovers() -> None:
    """Once a process: remove the call folders and cgroups of callers that died mid-call."""
    folders = Path(tempfile.gettempdir()).glob(f"{CALL_FOLDER_PREFIX}-*-*")
    for folder in (f for f in folders if _of_a_dead_process(f.name)):
        shutil.rmtree(folder, ignore_errors=True)
    parent = _pids_cgroup_parent() if os.geteuid() == 0 else None
    cgroups = parent.glob(f"{CGROUP_PREFIX}-*-*") if parent is not None else ()
    for cgroup in (c for c in cgroups if _of_a_dead_process(c.name)):
        _removed(cgroup)  # empty: its processes died with their caller


def _of_a_dead_process(name: str) -> bool:
    """Whether a `<prefix>-<pid>-<rest>` name's process is gone."""
    pid = name.split("-")[2]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def cgroup_pids(cgroup: Path) -> list[int]:
    """The processes in `cgroup`; none if it is gone."""
    try:
        return [int(pid) for pid in (cgroup / "cgroup.procs").read_text().split()]
    except OSError:
        return []


@contextlib.asynccontextmanager
async def pids_cgroup(max_tasks: int) -> AsyncIterator[Path | None]:
    """As root, a fresh pids cgroup allowing `max_tasks` tasks; yields its folder.

    Root is exempt from RLIMIT_NPROC, so this is what limits a fork bomb run by root. Yields
    None when not root or when no writable pids hierarchy exists.
    """
    parent = _pids_cgroup_parent() if os.geteuid() == 0 else None
    if parent is None:
        yield None
        return
    folder = parent / f"{CGROUP_PREFIX}-{os.getpid()}-{next(_call_numbers)}"
    try:
        folder.mkdir()
        (folder / "pids.max").write_text(str(max_tasks))
    except OSError:
        yield None
        return
    try:
        yield folder
    finally:
        await _remove_cgroup(folder)


async def _remove_cgroup(folder: Path) -> None:
    """Remove an emptied cgroup; its last tasks may take a moment to be reaped."""
    with anyio.CancelScope(shield=True):
        for _ in range(100):
            if _removed(folder):
                return
            await anyio.sleep(0.02)


def _removed(folder: Path) -> bool:
    """Try to remove an empty folder (a cgroup folder is never slow to remove)."""
    try:
        folder.rmdir()
    except OSError:
        return False
    return True


def _pids_cgroup_parent() -> Path | None:
    """Find our own cgroup's folder in a pids hierarchy we can make children in, or None."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        memberships = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        separator = fields.index("-")
        mount_point, fstype, options = fields[4], fields[separator + 1], fields[separator + 3]
        if fstype == "cgroup" and "pids" in options.split(","):
            path = next((m.split(":", 2)[2] for m in memberships if ":pids:" in m), None)
        elif fstype == "cgroup2":
            path = next((m[3:] for m in memberships if m.startswith("0::")), None)
        else:
            continue
        folder = Path(mount_point + (path or "/"))
        if path is not None and _can_limit_pids(folder, fstype):
            return folder
    return None


def _can_limit_pids(folder: Path, fstype: str) -> bool:
    """Whether children of `folder` get a `pids.max` and `folder` is writable."""
    if fstype == "cgroup2":
        try:
            if "pids" not in (folder / "cgroup.subtree_control").read_text().split():
                return False
        except OSError:
            return False
    return os.access(folder, os.W_OK)
