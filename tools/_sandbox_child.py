"""The sandbox's first process: isolate, limit, then run the code. Standard library only.

Run by `tools.sandbox` as `python -I _sandbox_child.py`, in a new session, with the config (one
line of JSON) then the code on stdin: nothing of the host's paths in its command line, which
the code can read in `/proc/1/cmdline`. Linux only. With `"isolate": true` it builds, in this order:

1. a new user, mount, network and PID namespace (`unshare(2)`), the caller's uid and gid mapped
   to 0 inside; the network namespace has only a loopback device, left down;
2. a supervisor, PID 1 of the new PID namespace, that dies with this process
   (`PR_SET_PDEATHSIG`) and whose exit makes the kernel kill every process left in the
   namespace. It builds the new root: a size-limited tmpfs mounted on the empty folder `"root"`
   (made by the parent) holding the code (`/tmp/main.py`) and the writable folders in
   `_WRITABLE` (the working folder `/tmp/work`, `/dev/shm`),
   the paths in `"visible"` (system folders, the interpreter's prefixes) and the devices in
   `_DEVICES` bound in, and a fresh `/proc` (its `keys` and `key-users`, which list the
   caller's keys, hidden under `/dev/null`); then `pivot_root(2)` into it, the old root
   detached, and every mount made read-only (`mount_setattr(2)`, recursive) except the
   working folder. What is not bound in (the rest of `/tmp`, `/run`, home folders, sockets on
   the filesystem) is not there;
3. the code's process: rlimits set, every capability dropped for good (bounding set emptied,
   securebits locked, `no_new_privs`), `memfd_create` refused (`_refuse_memory_files`), a new
   empty session keyring (`_leave_keyrings`), stdin from `/dev/null`, then `exec` of the
   interpreter.

The supervisor ignores SIGINT, the one signal with a handler of Python's that the code could
send it (PID 1 of a namespace gets no other signal from inside), so that the code cannot make
it report a setup failure.

This process then exits the way the code's process did: the same exit status, or killed by the
same signal, so the parent reads it from its own child. A failure while isolating exits with
`SETUP_FAILED` and a message on stderr. With `"isolate": false` it runs the code file the
parent wrote into its working folder, under the rlimits, as the child of a subreaper that kills
whatever the code left running (see `_run_reaping`).
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import time

SETUP_FAILED = 125

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x2, 0x4, 0x8
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
_MNT_DETACH = 0x2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 271, "s390x": 280}
# Per architecture: the seccomp audit value, then memfd_create's number.
_MEMFD_CREATE = {
    "x86_64": (0xC000003E, 319),
    "aarch64": (0xC00000B7, 279),
    "riscv64": (0xC00000F3, 279),
    "ppc64le": (0xC0000015, 360),
    "s390x": (0x80000016, 350),
}
_X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 calls: refused with the other foreign ones
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO, _EPERM = 0x7FFF0000, 0x00050000, 1
_BPF_LD_ABS, _BPF_JEQ, _BPF_JGE, _BPF_RET = 0x20, 0x15, 0x35, 0x06
_KEYCTL_JOIN_SESSION_KEYRING = 1
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_MOUNT_ATTR_RDONLY = 0x1
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
_PR_SET_CHILD_SUBREAPER = 36
_SECUREBITS_ALL_LOCKED = 0x3F  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS, each with its lock bit
_DEVICES = ("null", "zero", "full", "random", "urandom")
_WRITABLE = ("/tmp/work", "/dev/shm")  # /dev/shm: POSIX semaphores, for multiprocessing
_HIDDEN_PROC_FILES = ("keys", "key-users")  # they list the keys of the caller's user

_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("set", "clr", "propagation", "userns")]


class _BpfInstruction(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _BpfProgram(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_BpfInstruction))]


def main() -> None:
    """Read the config and the code, then run the code isolated or only limited."""
    config = json.loads(sys.stdin.buffer.readline())
    _end_with_the_caller(config)
    code = sys.stdin.buffer.read()
    for procs in config["cgroup_procs"]:
        _write(procs, "0")  # this process and all it starts
    if not config["isolate"]:
        _relay(_run_reaping(config))
    try:
        _enter_namespaces()
    except OSError as exc:
        print(f"sandbox setup failed: {exc}", file=sys.stderr)
        sys.exit(SETUP_FAILED)
    _relay(_run_supervised(config, code))


def _end_with_the_caller(config: dict) -> None:
    """End the call when the caller dies (SIGTERM), or past a deadline of its own (SIGALRM).

    The kernel sends SIGTERM when the caller dies, however (`PR_SET_PDEATHSIG`); SIGALRM comes
    `deadline_s` after the start, should the caller be alive but stuck. Isolated, either ends
    this process, whose death takes the supervisor and the PID namespace with it; not isolated,
    `_run_reaping` kills what the code started first.
    """
    _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != config["caller_pid"]:  # it died before the line above
        sys.exit(SETUP_FAILED)
    signal.alarm(config["deadline_s"])


def _check(result: int, what: str) -> None:
    """Raise OSError naming `what` if a libc call returned -1."""
    if result == -1:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = ""):
    encode = lambda text: text.encode() if text is not None else None  # noqa: E731
    result = _libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data))
    _check(result, f"mount {target}")


def _mount_setattr(path: str, flags: int, set_: int = 0, clear: int = 0) -> None:
    attr = _MountAttr(set_, clear, 0, 0)
    result = _libc.syscall(
        ctypes.c_long(_SYS_MOUNT_SETATTR),
        ctypes.c_long(_AT_FDCWD),
        ctypes.c_char_p(path.encode()),
        ctypes.c_long(flags),
        ctypes.byref(attr),
        ctypes.c_long(ctypes.sizeof(attr)),
    )
    _check(result, f"mount_setattr {path}")


def _enter_namespaces() -> None:
    """Enter new user, mount, network and PID namespaces; mounts made from now on stay ours."""
    uid, gid = os.geteuid(), os.getegid()
    flags = _CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID
    _check(_libc.unshare(flags), "unshare")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/gid_map", f"0 {gid} 1")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)


def _build_root(root: str, code: bytes, config: dict) -> None:
    """Fill a tmpfs on `root` with the code, its writable folders, the visible paths and /proc.

    Runs as PID 1 of the new PID namespace, so the `/proc` mounted here shows only its processes
    (the kernel allows it because the old `/proc` is still visible in this mount namespace).
    """
    disk_bytes = config["disk_bytes"]
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={disk_bytes},mode=0755")
    for folder in _WRITABLE:  # each its own mount, so it alone stays writable
        os.makedirs(root + folder)
        _mount(root + folder, root + folder, None, _MS_BIND)
    with open(f"{root}/tmp/main.py", "wb") as file:
        file.write(code)
    for path in config["visible"]:
        _bind(path, root + path)
    for name in _DEVICES:
        _bind(f"/dev/{name}", f"{root}/dev/{name}")
    os.mkdir(f"{root}/proc")
    _mount("proc", f"{root}/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    for name in _HIDDEN_PROC_FILES:
        _mount("/dev/null", f"{root}/proc/{name}", None, _MS_BIND)
    _write(f"{root}/proc/sys/user/max_user_namespaces", "0")  # no nested namespace to mount in


def _bind(source: str, target: str) -> None:
    """Make `source` appear at `target`: a symlink copied as is, a folder or file bind-mounted."""
    if not os.path.lexists(source):
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "w").close()  # a mount point for a file (a device) is a file
    _mount(source, target, None, _MS_BIND | _MS_REC)


def _pivot_into(root: str) -> None:
    """Make `root` the root of this mount namespace and drop the old root from it entirely."""
    machine = os.uname().machine
    if machine not in _SYS_PIVOT_ROOT:
        raise OSError(38, f"pivot_root: no known system call number on {machine}")
    os.chdir(root)
    dot = ctypes.c_char_p(b".")
    _check(_libc.syscall(ctypes.c_long(_SYS_PIVOT_ROOT[machine]), dot, dot), "pivot_root")
    _check(_libc.umount2(dot, _MNT_DETACH), "umount the old root")
    os.chdir("/")
    _mount_setattr("/", _AT_RECURSIVE, set_=_MOUNT_ATTR_RDONLY)
    for folder in _WRITABLE:
        _mount_setattr(folder, 0, clear=_MOUNT_ATTR_RDONLY)


def _run_supervised(config: dict, code: bytes) -> int:
    """Fork PID 1 of the new PID namespace; return the code's wait status it reports."""
    read_fd, write_fd = os.pipe()
    if os.fork() == 0:
        os.close(read_fd)
        _supervise(config, code, write_fd)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        reported = pipe.read()
    _, supervisor_status = os.wait()
    return int(reported) if reported else supervisor_status


def _supervise(config: dict, code: bytes, status_fd: int) -> None:
    """As PID 1: build the new root, start the code, reap until it ends, report its status."""
    try:
        _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the code's SIGINT, not a setup failure
        _build_root(config["root"], code, config)
        _pivot_into(config["root"])
        code_pid = os.fork()
        if code_pid == 0:
            os.close(status_fd)
            _drop_capabilities()
            _exec_code(config, "/tmp/main.py", "/tmp/work")
    except BaseException as exc:  # a forked child must never return into the caller
        os.write(2, f"sandbox setup failed: {exc}\n".encode())
        os._exit(SETUP_FAILED)
    while True:
        pid, status = os.wait()
        if pid == code_pid:
            os.write(status_fd, str(status).encode())
            os._exit(0)


def _run_reaping(config: dict) -> int:
    """Without isolation: run the code as a child, then kill all it left; return its status.

    As a child subreaper this process inherits the orphans the code leaves, those that left its
    session included, so it can find and kill them; on SIGTERM (the parent's deadline) it does
    the same, then dies by SIGKILL.
    """
    _check(_libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the code's SIGINT is not this process's
    signal.signal(signal.SIGTERM, _on_deadline)
    signal.signal(signal.SIGALRM, _on_deadline)
    code_pid = os.fork()
    if code_pid == 0:
        try:
            _exec_code(config, config["script"], config["workdir"])
        except BaseException as exc:  # a forked child must never return into the caller
            os.write(2, f"sandbox setup failed: {exc}\n".encode())
            os._exit(SETUP_FAILED)
    _, status = os.waitpid(code_pid, 0)
    _kill_descendants()
    return status


def _on_deadline(*_: object) -> None:
    _kill_descendants()
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_descendants() -> None:
    """SIGKILL and reap this process's children until none is left; their orphans come here."""
    while True:
        for pid in _children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            reaped, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if reaped == 0:
            time.sleep(0.01)


def _children() -> list[int]:
    """Pids of this process's children, read from /proc."""
    children = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as file:
                parent = int(file.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # not a process, or gone
            continue
        if parent == os.getpid():
            children.append(int(name))
    return children


def _drop_capabilities() -> None:
    """Give up every capability, now and across exec, with no way back."""
    with open("/proc/sys/kernel/cap_last_cap") as file:
        last_cap = int(file.read())
    for cap in range(last_cap + 1):
        _check(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), "prctl(PR_CAPBSET_DROP)")
    _check(_libc.prctl(_PR_SET_SECUREBITS, _SECUREBITS_ALL_LOCKED, 0, 0, 0), "securebits")
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def _exec_code(config: dict, script: str, workdir: str) -> None:
    """Set the rlimits, then replace this process with the interpreter running `script`."""
    cpu_s = config["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (config["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (config["disk_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (config["max_open_files"],) * 2)
    if config["isolate"]:  # counted per user namespace, so only this sandbox's processes
        resource.setrlimit(resource.RLIMIT_NPROC, (config["max_processes"],) * 2)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python's own handler, as exec will set it
    _refuse_memory_files()
    _leave_keyrings()
    os.chdir(workdir)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    env = dict(config["env"], HOME=workdir, TMPDIR=workdir)
    os.execve(config["python"], [config["python"], "-u", script], env)


def _refuse_memory_files() -> None:
    """Install a seccomp filter under which `memfd_create` fails with EPERM.

    So do the system calls of another architecture (x86_64's 32-bit and x32 calls), which would
    reach it by another number. A memory file holds memory that no mapping counts against
    RLIMIT_AS; each is bounded by RLIMIT_FSIZE, but not their number. Sets `no_new_privs`, which
    the filter needs.
    """
    machine = os.uname().machine
    if machine not in _MEMFD_CREATE:
        raise OSError(38, f"seccomp: no known memfd_create number on {machine}")
    arch, memfd_create = _MEMFD_CREATE[machine]
    refuse = _SECCOMP_RET_ERRNO | _EPERM
    program = [  # (code, jump if true, jump if false, value); jumps skip that many lines
        (_BPF_LD_ABS, 0, 0, 4),  # the call's architecture
        (_BPF_JEQ, 0, 4, arch),
        (_BPF_LD_ABS, 0, 0, 0),  # the call's number
        (_BPF_JGE, 2, 0, _X32_SYSCALL_BIT),
        (_BPF_JEQ, 1, 0, memfd_create),
        (_BPF_RET, 0, 0, _SECCOMP_RET_ALLOW),
        (_BPF_RET, 0, 0, refuse),
    ]
    instructions = (_BpfInstruction * len(program))(*(_BpfInstruction(*i) for i in program))
    filter_ = _BpfProgram(len(program), instructions)
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    result = _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(filter_), 0, 0)
    _check(result, "prctl(PR_SET_SECCOMP)")


def _leave_keyrings() -> None:
    """Join a new, empty session keyring: the caller's session keys are out of reach.

    The keys in the caller's session keyring are its possessions, which a process reads only
    while it holds that keyring (`KEYCTL_SEARCH @s`, then `KEYCTL_READ`). Where keyctl is refused
    (a seccomp profile, as Docker's), the code cannot call it either.
    """
    number = _SYS_KEYCTL.get(os.uname().machine)
    if number is None:
        raise OSError(f"no keyctl syscall number known for {os.uname().machine}")
    if _libc.syscall(number, _KEYCTL_JOIN_SESSION_KEYRING, None) == -1:
        errno = ctypes.get_errno()
        if errno not in (1, 38):  # EPERM, ENOSYS: keyrings are closed to the code as well
            raise OSError(errno, f"keyctl(KEYCTL_JOIN_SESSION_KEYRING): {os.strerror(errno)}")


def _relay(status: int) -> None:
    """Exit the way a process with wait status `status` ended."""
    if os.WIFSIGNALED(status):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU and others would dump core
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    sys.exit(os.waitstatus_to_exitcode(status))  # also for a signal that does not kill


if __name__ == "__main__":
    main()
