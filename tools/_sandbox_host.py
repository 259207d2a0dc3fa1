"""What a sandbox call holds on the host, and its removal: the call's folder and cgroups.

As root, a call's processes are held in a pids cgroup and a memory cgroup where a hierarchy of
each is writable (`call_cgroups`); `cgroup_gaps` says, in words, which limit cannot be had here.
Folders and cgroups are named `<prefix>-<caller pid>-...`, so that the first call of a later
process removes those of a caller that died mid-call (`remove_leftovers`): killed by SIGKILL, it
could not.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
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
    found = [_cgroup_parent(c) for c in _CONTROLLERS] if os.geteuid() == 0 else []
    for parent in {p for p in found if p is not None}:
        for cgroup in parent.glob(f"{CGROUP_PREFIX}-*-*"):
            if _of_a_dead_process(cgroup.name):
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


@dataclass(frozen=True)
class CallCgroups:
    """The cgroups one call's processes join: one folder per hierarchy (one in cgroup v2).

    Attributes:
        pids: The folder whose `pids.max` bounds the call's processes, or None.
        memory: The folder whose memory limit bounds the call's memory, what the kernel holds
            for it included (pipes, files in memory, page tables), or None.

    """

    pids: Path | None = None
    memory: Path | None = None

    @property
    def folders(self) -> list[Path]:
        """Each folder once: every process of the call is in each."""
        return list(dict.fromkeys(f for f in (self.pids, self.memory) if f is not None))

    def procs(self) -> list[int]:
        """The call's processes; none once they are gone."""
        return cgroup_pids(self.folders[0]) if self.folders else []


def cgroup_pids(cgroup: Path) -> list[int]:
    """The processes in `cgroup`; none if it is gone."""
    try:
        return [int(pid) for pid in (cgroup / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def cgroup_gaps() -> list[str]:
    """What this process cannot bound with cgroups, in words; empty when it can bound both.

    Only root makes cgroups here (another user's call stays within RLIMIT_NPROC, counted per
    user namespace, and its rlimits).
    """
    if os.geteuid() != 0:
        return []
    gaps = []
    if _cgroup_parent("pids") is None:
        gaps.append(
            "max_processes is not enforced: this process runs as root, which RLIMIT_NPROC "
            "does not bind, and no pids cgroup is writable here. Run as another user, or give "
            "the container a writable cgroup (e.g. `docker run --cgroupns=private`)"
        )
    if _cgroup_parent("memory") is None:
        gaps.append(
            "memory_mb bounds each process, not the call: no memory cgroup is writable here, "
            "so a call may hold up to max_processes x memory_mb, and what the kernel holds for "
            "it is bounded by max_open_files per process only"
        )
    return gaps


@contextlib.asynccontextmanager
async def call_cgroups(max_tasks: int, memory_bytes: int) -> AsyncIterator[CallCgroups]:
    """As root, fresh cgroups for one call: at most `max_tasks` tasks, `memory_bytes` of memory.

    Each limit is set where its controller has a writable hierarchy (`cgroup_gaps` says where
    not); the folders are removed afterwards, once empty. Not root, the call gets none.
    """
    made: list[Path] = []
    try:
        pids = _limited("pids", {"pids.max": str(max_tasks)}, made)
        memory = _limited("memory", _memory_files(memory_bytes), made)
        yield CallCgroups(pids, memory)
    finally:
        for folder in reversed(made):
            await _remove_cgroup(folder)


def _limited(controller: str, limits: dict[str, str], made: list[Path]) -> Path | None:
    """The call's folder under `controller`'s hierarchy with `limits` written, or None.

    In cgroup v2 both controllers share one folder, made once (listed in `made`).
    """
    parent = _cgroup_parent(controller) if os.geteuid() == 0 else None
    if parent is None:
        return None
    folder = next((f for f in made if f.parent == parent), None)
    try:
        if folder is None:
            folder = parent / f"{CGROUP_PREFIX}-{os.getpid()}-{next(_call_numbers)}"
            folder.mkdir()
            made.append(folder)
        for name, value in limits.items():
            if (folder / name).exists():  # v1 and v2 name the memory limits differently
                (folder / name).write_text(value)
    except OSError:
        return None
    return folder


def _memory_files(memory_bytes: int) -> dict[str, str]:
    """The memory limit's files, cgroup v2's and v1's (each written where it exists), in order.

    Swap is held to the same total (v1) or refused (v2); v2 kills the whole call at the limit.
    """
    return {
        "memory.max": str(memory_bytes),
        "memory.swap.max": "0",
        "memory.oom.group": "1",
        "memory.limit_in_bytes": str(memory_bytes),
        "memory.memsw.limit_in_bytes": str(memory_bytes),
    }


_CONTROLLERS = ("pids", "memory")


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


@functools.cache
def _cgroup_parent(controller: str) -> Path | None:
    """Our own cgroup's folder in a `controller` hierarchy we can make children in, or None."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        memberships = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        separator = fields.index("-")
        mount_point, fstype, options = fields[4], fields[separator + 1], fields[separator + 3]
        if fstype == "cgroup" and controller in options.split(","):
            member = f":{controller}:"
            path = next((m.split(":", 2)[2] for m in memberships if member in m), None)
        elif fstype == "cgroup2":
            path = next((m[3:] for m in memberships if m.startswith("0::")), None)
        else:
            continue
        folder = Path(mount_point + (path or "/"))
        if path is not None and _can_limit(folder, fstype, controller):
            return folder
    return None


def _can_limit(folder: Path, fstype: str, controller: str) -> bool:
    """Whether `folder` is writable and its children get `controller`'s files."""
    if fstype == "cgroup2":
        try:
            if controller not in (folder / "cgroup.subtree_control").read_text().split():
                return False
        except OSError:
            return False
    return os.access(folder, os.W_OK)
