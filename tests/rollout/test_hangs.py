"""User code never hangs a run: daemon threads, stuck-call accounting, BaseExceptions as failures.

A sync tool or environment method runs in a daemon thread (`tools.threads`): a call abandoned on
timeout is counted as stuck until it returns, too many stuck calls stop the run with an error
naming them, and a process exits promptly whatever its tools still do. `SystemExit` and
`KeyboardInterrupt` raised by user code are that code's failure, not a signal to the framework.
"""

from __future__ import annotations

import _thread
import asyncio
import gc
import json
import signal
import subprocess
import sys
import threading
import time

import anyio
import pytest

from environments import (
    Counter,
    EnvironmentCloseError,
    EnvironmentInitError,
    EnvironmentResetError,
    EnvironmentRewardError,
    EnvironmentTimeoutError,
    reset_environment,
)
from environments.lifecycle import done_runs_code
from rollout import EpisodeConfig, Finish, RolloutEngine
from tests.support.episodes import COUNTER_ROW, scripted_backend, tool_call
from tests.support.paths import SCRIPTS
from tools import StuckCallsError, ToolErrorKind, UserCodeAborted, as_tool, call_tool
from tools.threads import (
    USER_CODE,
    CallTimedOut,
    DaemonThreads,
    is_signal,
    shield_unless_interrupted,
)


async def abandon(threads: DaemonThreads, fn, label: str) -> None:
    """Start `fn` and walk away from it after a moment, as a tool's timeout does."""
    with anyio.move_on_after(0.05) as scope:
        await threads.run(fn, label)
    assert scope.cancelled_caught


async def until_none_stuck(threads: DaemonThreads) -> None:
    """Wait for released calls to return (a generous bound: the point is that they do)."""
    with anyio.fail_after(30):
        while threads.stuck:  # noqa: ASYNC110 (nothing signals that a stuck call ended)
            await anyio.sleep(0.01)


# ---------------------------------------------------------------------- daemon threads


@pytest.mark.anyio
async def test_a_call_returns_its_value_from_a_daemon_thread():
    threads = DaemonThreads()
    daemon, name = await threads.run(lambda: (threading.current_thread().daemon, "x"), "probe")
    assert (daemon, name) == (True, "x")
    assert threads.stuck == []


@pytest.mark.anyio
async def test_an_abandoned_call_is_stuck_until_it_returns():
    threads, release = DaemonThreads(), threading.Event()
    await abandon(threads, release.wait, "tool wait()")
    assert threads.stuck == ["tool wait()"]
    release.set()
    await until_none_stuck(threads)


def test_a_blocking_wait_gives_up_after_its_timeout_and_counts_the_call_stuck():
    threads, release = DaemonThreads(), threading.Event()
    assert threads.run_blocking(lambda: 7, "probe", timeout_s=30) == 7
    with pytest.raises(CallTimedOut, match=r"factory\(\) did not return within 0.2 s"):
        threads.run_blocking(release.wait, "factory()", timeout_s=0.2)
    assert threads.stuck == ["factory()"]
    release.set()
    anyio.run(until_none_stuck, threads)


def test_a_ctrl_c_that_lands_as_a_blocking_wait_starts_stops_it_while_the_call_hangs():
    """`_thread.interrupt_main` trips the SIGINT handler without waking a blocked lock wait: what
    a real SIGINT that lands just before the main thread blocks leaves behind."""
    threads, release = DaemonThreads(), threading.Event()
    timers = [threading.Timer(0.2, _thread.interrupt_main), threading.Timer(60, release.set)]

    def hang() -> None:  # the call has started: the Ctrl-C lands while the caller waits
        timers[0].start()
        release.wait()

    gc.disable()  # a gc callback would swallow the KeyboardInterrupt (test_async_resume.py)
    try:
        timers[1].start()
        with pytest.raises(KeyboardInterrupt):
            threads.run_blocking(hang, "factory()", timeout_s=None)
    finally:
        gc.enable()
        for timer in timers:
            timer.cancel()
    assert not release.is_set()  # stopped while the call still hung
    assert threads.stuck == ["factory()"]
    release.set()
    anyio.run(until_none_stuck, threads)


@pytest.mark.anyio
async def test_too_many_stuck_calls_refuse_the_next_with_an_error_naming_them():
    threads, release = DaemonThreads(max_stuck=2), threading.Event()
    ran = []
    try:
        await abandon(threads, release.wait, "tool wait()")
        await abandon(threads, release.wait, "tool wait()")
        with pytest.raises(
            StuckCallsError, match=r"2 calls of user code are stuck.*\(tool wait\(\) x2\)"
        ):
            await threads.run(lambda: ran.append(1), "tool other()")
        assert ran == []  # a refused call never starts
    finally:
        release.set()
    await until_none_stuck(threads)
    await threads.run(lambda: ran.append(1), "tool other()")
    assert ran == [1]


@pytest.mark.anyio
async def test_an_exception_comes_back_as_it_is():
    def fail() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await DaemonThreads().run(fail, "fail")


@pytest.mark.anyio
@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt()])
async def test_system_exit_and_keyboard_interrupt_come_back_as_the_codes_failure(raised):
    def fail() -> None:
        raise raised

    with pytest.raises(UserCodeAborted) as caught:
        await DaemonThreads().run(fail, "fail")
    assert caught.value.raised is raised and caught.value.__cause__ is raised


async def signal_seen_while_cancelled() -> bool:
    """What `is_signal` says of the cancellation a cancelled scope delivers to this task."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        try:
            await anyio.sleep(10)
        except anyio.get_cancelled_exc_class() as cancelled:
            seen = is_signal(cancelled)
            raise
    assert scope.cancelled_caught
    return seen


@pytest.mark.anyio
async def test_cancellation_and_a_ctrl_c_on_the_main_thread_are_signals_nothing_else_is():
    assert await signal_seen_while_cancelled()
    assert is_signal(KeyboardInterrupt())
    assert not is_signal(SystemExit(0))
    assert not is_signal(ValueError())
    in_a_worker = await DaemonThreads().run(lambda: is_signal(KeyboardInterrupt()), "probe")
    assert in_a_worker is False


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_cancel_scopes_cancellation_is_a_signal_on_every_backend(anyio_backend):
    assert await signal_seen_while_cancelled()


@pytest.mark.anyio
async def test_a_cancelled_error_of_another_task_is_not_a_signal():
    inner = asyncio.create_task(asyncio.sleep(10))
    asyncio.get_running_loop().call_later(0.01, inner.cancel)
    with pytest.raises(asyncio.CancelledError) as caught:
        await inner
    assert not is_signal(caught.value)
    assert not is_signal(asyncio.CancelledError())  # raised by hand: nothing is being cancelled


# ---------------------------------------------------------------------- tools


def quit_now() -> str:
    """Exit the interpreter."""
    sys.exit(3)


def interrupt() -> str:
    """Interrupt the program."""
    raise KeyboardInterrupt


async def async_quit() -> str:
    """Exit the interpreter, asynchronously."""
    raise SystemExit("bye")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("tool", "content"),
    [
        (quit_now, "Error: quit_now() raised SystemExit: 3"),
        (interrupt, "Error: interrupt() raised KeyboardInterrupt"),
        (async_quit, "Error: async_quit() raised SystemExit: bye"),
    ],
)
async def test_a_tool_raising_system_exit_or_keyboard_interrupt_is_an_error_for_the_model(
    tool, content
):
    t = as_tool(tool)
    result = await call_tool({t.name: t}, t.name, {}, timeout_s=5.0)
    assert (result.error, result.content) == (ToolErrorKind.EXCEPTION, content)


@pytest.mark.anyio
async def test_too_many_stuck_tools_stop_the_run_with_an_error_naming_the_tool(monkeypatch):
    release = threading.Event()

    def lookup() -> str:
        """Wait for a server that does not answer."""
        release.wait()
        return "late"

    tools = {"lookup": as_tool(lookup)}
    await until_none_stuck(USER_CODE)  # calls other tests abandoned
    monkeypatch.setattr(USER_CODE, "max_stuck", 1)
    try:
        timed_out = await call_tool(tools, "lookup", {}, timeout_s=0.05)
        assert timed_out.error is ToolErrorKind.TIMEOUT
        with pytest.raises(StuckCallsError, match=r"tool lookup\(\) x1"):
            await call_tool(tools, "lookup", {}, timeout_s=0.05)
    finally:
        release.set()
    await until_none_stuck(USER_CODE)


# ---------------------------------------------------------------------- environment code


def engine(tokenizer, factory, turns=("Done.",), environment_timeout_s=None) -> RolloutEngine:
    config = EpisodeConfig(
        max_completion_length=256,
        max_turns=3,
        tool_timeout_s=0.5,
        environment_timeout_s=environment_timeout_s,
    )
    return RolloutEngine(
        scripted_backend(tokenizer, list(turns)),
        tokenizer,
        environment_factory=factory,
        chat_template="chatml_tools",
        config=config,
    )


class ExitingReset(Counter):
    def reset(self, target: int) -> str:
        sys.exit("gave up")


class InterruptedReset(Counter):
    def reset(self, target: int) -> str:
        raise KeyboardInterrupt


class ExitingInit(Counter):
    def __init__(self):
        raise KeyboardInterrupt("no")


class ExitingReward(Counter):
    def reward(self) -> float:
        sys.exit(1)


class ExitingClose(Counter):
    def close(self) -> None:
        raise SystemExit


ROW = {"prompt": "Reach 1.", "target": 1}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("factory", "error", "message"),
    [
        (ExitingReset, EnvironmentResetError, "ExitingReset.reset() raised SystemExit: gave up"),
        (InterruptedReset, EnvironmentResetError, "InterruptedReset.reset() raised KeyboardInt"),
        (ExitingInit, EnvironmentInitError, "ExitingInit.__init__() raised KeyboardInterrupt: no"),
        (ExitingReward, EnvironmentRewardError, "ExitingReward.reward() raised SystemExit: 1"),
        (ExitingClose, EnvironmentCloseError, "ExitingClose.close() raised SystemExit"),
    ],
)  # fmt: skip
async def test_system_exit_or_keyboard_interrupt_in_environment_code_is_that_methods_error(
    tokenizer, factory, error, message
):
    with pytest.raises(error) as caught:
        await engine(tokenizer, factory).run([ROW])
    assert str(caught.value).startswith(message)


def test_a_real_ctrl_c_in_reset_called_on_the_main_thread_still_propagates():
    with pytest.raises(KeyboardInterrupt):
        reset_environment(InterruptedReset(), ROW, seed=0)


# ---------------------------------------------------------------------- environment timeouts

RELEASE = threading.Event()  # what a hung method waits for; set once its test is over


class HungInit(Counter):
    def __init__(self):
        RELEASE.wait()
        super().__init__()


class HungReset(Counter):
    def reset(self, target: int) -> str:
        RELEASE.wait()
        return super().reset(target)


class HungReward(Counter):
    def reward(self) -> float:
        RELEASE.wait()
        return 1.0


class AsyncHungReward(Counter):
    async def reward(self) -> float:
        await anyio.sleep_forever()
        return 1.0


class HungClose(Counter):
    def close(self) -> None:
        RELEASE.wait()


class BrokenResetHungClose(HungClose):
    def reset(self, target: int) -> str:
        raise ValueError("bad target")


class HungDone(Counter):
    @property
    def done(self) -> bool:
        RELEASE.wait(30)  # bounded, so the event loop it blocked before the fix comes back
        return False


def hung_factory() -> Counter:
    RELEASE.wait(30)  # as above: the engine's set-up called it synchronously, without a limit
    return Counter()


@pytest.fixture
def release_hung_calls():
    """Let the methods a test abandoned return, and wait until they have."""
    RELEASE.clear()
    yield
    RELEASE.set()
    anyio.run(until_none_stuck, USER_CODE)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("factory", "where"),
    [
        (HungInit, "HungInit.__init__()"),
        (HungReset, "HungReset.reset()"),
        (HungReward, "HungReward.reward()"),
        (AsyncHungReward, "AsyncHungReward.reward()"),
        (HungClose, "HungClose.close()"),
    ],
)
async def test_environment_code_that_never_returns_stops_the_run_naming_class_and_method(
    tokenizer, release_hung_calls, factory, where
):
    with anyio.fail_after(60), pytest.raises(EnvironmentTimeoutError) as caught:  # before: hung
        await engine(tokenizer, factory, environment_timeout_s=0.5).run([ROW])
    assert str(caught.value).startswith(
        f"{where} did not return within 0.5 s (environment_timeout_s); it was abandoned"
    )


@pytest.mark.anyio
async def test_a_done_property_that_never_returns_stops_the_run_naming_it(
    tokenizer, release_hung_calls
):
    calls = (tool_call("increment", step=1), "Done.")
    with anyio.fail_after(60), pytest.raises(EnvironmentTimeoutError) as caught:
        await engine(tokenizer, HungDone, calls, environment_timeout_s=0.5).run([ROW])
    assert str(caught.value).startswith("HungDone.done (a property) did not return within 0.5 s")


def test_a_factory_that_never_returns_stops_the_engine_set_up_naming_it(
    tokenizer, release_hung_calls
):
    with pytest.raises(EnvironmentTimeoutError) as caught:  # before: waited, then set up
        engine(tokenizer, hung_factory, environment_timeout_s=0.5)
    assert str(caught.value).startswith(
        "the environment factory hung_factory() did not return within 0.5 s"
    )


@pytest.mark.anyio
async def test_a_done_property_is_read_in_a_daemon_thread_and_a_plain_attribute_in_place(
    tokenizer,
):
    readers = []

    class DoneProperty(Counter):
        @property
        def done(self) -> bool:
            readers.append(threading.current_thread())
            return True

    calls = (tool_call("increment", step=1), "Done.")
    [episode] = await engine(tokenizer, DoneProperty, calls, environment_timeout_s=30).run([ROW])
    assert episode.finish is Finish.ENV_DONE
    assert [reader.daemon for reader in readers] == [True]
    assert (done_runs_code(DoneProperty()), done_runs_code(Counter())) == (True, False)


@pytest.mark.anyio
@pytest.mark.parametrize("method", ["reset", "reward"])
async def test_close_is_not_called_while_a_method_that_timed_out_still_runs(
    tokenizer, release_hung_calls, method
):
    closed = []

    class HungMethodCountsClose(HungReset if method == "reset" else HungReward):
        def close(self) -> None:
            closed.append(RELEASE.is_set())

    with anyio.fail_after(60), pytest.raises(EnvironmentTimeoutError) as caught:
        await engine(tokenizer, HungMethodCountsClose, environment_timeout_s=0.5).run([ROW])
    assert closed == []  # before: close ran at once, beside the hung method
    [note] = caught.value.__notes__
    assert note.endswith(
        "HungMethodCountsClose.close() was not called: the method that timed out may still run."
    )


@pytest.mark.anyio
async def test_close_is_called_after_an_async_reward_timed_out_since_it_was_cancelled(
    tokenizer, release_hung_calls
):
    closed = []

    class AsyncHungRewardCountsClose(AsyncHungReward):
        def close(self) -> None:
            closed.append(True)

    with anyio.fail_after(60), pytest.raises(EnvironmentTimeoutError) as caught:
        await engine(tokenizer, AsyncHungRewardCountsClose, environment_timeout_s=0.5).run([ROW])
    assert closed == [True] and not getattr(caught.value, "__notes__", [])


@pytest.mark.anyio
async def test_a_close_that_hangs_after_reset_failed_is_a_note_on_resets_error(
    tokenizer, release_hung_calls
):
    with anyio.fail_after(60), pytest.raises(EnvironmentResetError) as caught:
        await engine(tokenizer, BrokenResetHungClose, environment_timeout_s=0.5).run([ROW])
    assert str(caught.value).startswith("BrokenResetHungClose.reset() raised ValueError")
    [note] = caught.value.__notes__
    assert note.startswith("Closing the environment then failed too: BrokenResetHungClose.close()")


@pytest.mark.anyio
async def test_a_close_that_hangs_after_the_episode_failed_is_a_note_on_its_error(
    tokenizer, release_hung_calls
):
    class RaisingRewardHungClose(HungClose):
        def reward(self) -> float:
            raise ValueError("no score")

    with anyio.fail_after(60), pytest.raises(EnvironmentRewardError) as caught:
        await engine(tokenizer, RaisingRewardHungClose, environment_timeout_s=0.5).run([ROW])
    [note] = caught.value.__notes__
    assert "RaisingRewardHungClose.close() did not return within 0.5 s" in note


# ---------------------------------------------------------------------- the process exits


@pytest.mark.process
def test_the_interpreter_exits_promptly_after_a_tool_that_blocks_for_ever(tiny_model_dir):
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "stuck_calls.py"), str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=120,  # the point is that it exits at all: before, it never did
    )
    assert done.returncode == 0, done.stderr
    tool_replies, reset, last = done.stdout.splitlines()[-3:]
    assert json.loads(tool_replies) == [
        "Error: wait() timed out after 0.5 s",
        "Error: quit() raised SystemExit: 3",
        "Error: interrupt() raised KeyboardInterrupt",
    ]
    assert reset.startswith("reset failed: InterruptedReset.reset() raised KeyboardInterrupt: ")
    assert last == "returned"
    assert time.monotonic() - started < 120


STUCK_COUNTER = """
import threading

from environments import Counter


class StuckCounter(Counter):
    def reset(self, target: int) -> str:
        watcher = threading.Thread(
            target=threading.Event().wait, name="leftover watcher", daemon=False
        )
        watcher.start()  # never stopped: Python would wait for it at exit for ever
        return super().reset(target)

    def increment(self, step: int) -> int:
        threading.Event().wait()  # never returns
        return 0

    increment.__doc__ = Counter.increment.__doc__  # the schema the model was taught on
"""


@pytest.mark.process
def test_agentgrpo_run_exits_after_a_tool_that_blocks_for_ever_and_a_thread_left_running(
    tmp_path, tokenizer, tool_calling_tiny_model
):
    """The tiny model taught to call `increment` plays a Counter whose `increment` never returns
    and whose `reset` starts a thread nobody stops."""
    model_dir = tmp_path / "model"
    tool_calling_tiny_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    (tmp_path / "stuck.py").write_text(STUCK_COUNTER)
    (tmp_path / "rows.jsonl").write_text(json.dumps(COUNTER_ROW) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "agentgrpo", "run", "stuck.py:StuckCounter",
         "--model", str(model_dir), "--dataset", "rows.jsonl", "--chat-template", "chatml_tools",
         "--max-steps", "1", "--per-device-train-batch-size", "2", "--num-generations", "2",
         "--max-completion-length", "48", "--tool-timeout-s", "1", "--output-dir", "out",
         "--temperature", "0"],  # greedy: the taught call, whatever the sampler draws
        capture_output=True, text=True, cwd=tmp_path, timeout=300,  # before: never exited
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trained in" in done.stdout
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    [step] = [entry for entry in logged if "reward" in entry]
    assert step["tools/failure_frequency/timeout"] > 0  # the model called the tool, which got stuck
    assert "warning: exiting although threads still run" in done.stderr
    assert "leftover watcher" in done.stderr


@pytest.mark.process
def test_the_exit_watchdog_keeps_the_status_and_flushes_the_output():
    script = (
        "import threading\n"
        "from agentgrpo.cli.exiting import exit_within\n"
        "threading.Thread(target=threading.Event().wait, name='forever').start()\n"
        "print('last line', end='')\n"
        "exit_within(0.5, 3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (3, "last line")
    assert "forever" in done.stderr


LAUNCHED = """
import sys, time
from agentgrpo.cli.exiting import end_with_launcher
end_with_launcher({"TORCHELASTIC_RUN_ID": "test"})
print("ready", flush=True)
try:
    time.sleep(600)
except KeyboardInterrupt:
    open(sys.argv[1], "w").write("stopped as on Ctrl-C")
"""
# Stands in for torchrun's agent: starts the process, says its pid, and waits to be killed.
LAUNCHER = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {LAUNCHED!r}, sys.argv[1]], stdout=subprocess.PIPE)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.process
def test_a_launched_process_stops_as_on_ctrl_c_once_its_launcher_is_killed(tmp_path):
    stopped = tmp_path / "stopped"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(stopped)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    launched = int(launcher.stdout.readline())
    launcher.kill()  # SIGKILL: no chance to stop what it started
    launcher.wait()
    deadline = time.monotonic() + 30
    while not stopped.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stopped.read_text() == "stopped as on Ctrl-C"
    said = launcher.stderr.read()  # the launched process's, until it exits
    assert f"the launcher (pid {launcher.pid}) that started this process is gone" in said
    assert launched != launcher.pid


# ---------------------------------------------------------------------- Ctrl-C


@pytest.mark.anyio
async def test_a_shield_that_ctrl_c_ends_stands_in_front_of_the_sigint_handler_only_while_open():
    before = signal.getsignal(signal.SIGINT)
    with shield_unless_interrupted() as scope:
        assert scope.shield and signal.getsignal(signal.SIGINT) is not before
        with shield_unless_interrupted():
            pass
        assert signal.getsignal(signal.SIGINT) is not before  # the outer one is still open
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.process
def test_a_first_ctrl_c_stops_a_run_whose_close_never_returns(smollm2_path):
    run = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "stuck_close.py"), str(smollm2_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in run.stdout:  # until the close has started (and hangs)
            if line.strip() == "closing":
                break
        run.send_signal(signal.SIGINT)
        output, _ = run.communicate(timeout=60)  # before: the first Ctrl-C was ignored for ever
    finally:
        run.kill()
    assert run.returncode == 0, output
    assert output.splitlines()[-1] == "interrupted; still running: ['StuckClose.close()']"
