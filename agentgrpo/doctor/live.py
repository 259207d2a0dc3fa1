"""The checks that run user code or the model: the environment (check 5), sampled episodes (6)."""

from __future__ import annotations

import functools
from collections import Counter as Tally
from collections.abc import Callable, Mapping, Sequence
from itertools import cycle, islice
from typing import Any

import anyio

from agentgrpo.doctor.checks import CheckResult, Setup, Status, what_happened
from environments import (
    EnvironmentSpecError,
    check_environment,
    class_tools,
    close_environment,
    create_environment,
    reset_environment,
)
from environments.seats import is_seated, seat_observation, seat_to_move
from rollout import ChatRenderer, RolloutEngine, prompt_messages
from tools import run_in_daemon_thread
from tools.threads import describe_error

RESET_TIMEOUT_S = 60.0
"""How long the environment's constructor, `reset` and `close` may take before the check fails."""


def check_environment_runs(
    env_class: type, rows: Callable[[], Sequence[Mapping[str, Any]]] | None, setup: Setup | None
) -> CheckResult:
    """Check 5: the class meets the contract, resets on its first row, and its tools render.

    Args:
        env_class: The environment class.
        rows: Returns the task rows (`dataset()` or `--dataset`); None when there are none.
        setup: The template the tools render in (its own `tools` are not used); None when the
            template check failed, so the tools are not rendered (rendering a template that
            failed once would fail again, or wait out the render time limit again).

    """
    name = env_class.__qualname__
    try:
        check_environment(env_class)
        tools = class_tools(env_class)
        if rows is None:
            return CheckResult(
                "environment",
                Status.WARNING,
                f"{name} meets the contract but has no dataset(), so reset was not tried",
                "give it `@classmethod def dataset(cls, split='train')`, or pass --dataset "
                "to `agentgrpo run`",
            )
        first = next(iter(rows()), None)
        if first is None:
            return CheckResult(
                "environment",
                Status.FAIL,
                f"{name}: its task rows are empty, so reset was not tried",
                "return at least one row from dataset(), or pass --dataset to `agentgrpo run`",
            )
        row = dict(first)
        observation, seats = anyio.run(_reset_and_close, env_class, row)
        if setup is not None:
            _check_tools_render(setup, [t.schema for t in tools.values()], row, observation)
    except _DidNotReturn as error:
        fix = "make it return promptly: does it wait on a server, a lock or input?"
        return CheckResult("environment", Status.FAIL, f"{name}: {error}", fix)
    except Exception as error:
        message = f"{name}: {what_happened(error)}"
        return CheckResult("environment", Status.FAIL, message, _ENVIRONMENT_FIX)
    shown = ", ".join(tools) or "no tools"
    rendered = "render" if setup is not None else "were not rendered (the template failed)"
    return CheckResult(
        "environment",
        Status.OK,
        f"{name} meets the contract, resets on its first row, and its tools ({shown}) "
        f"{rendered}{seats}",
    )


_ENVIRONMENT_FIX = "see docs/environments.md for the contract; the message names what broke"


class _DidNotReturn(TimeoutError):
    """The environment's constructor, `reset` or `close` outlasted `RESET_TIMEOUT_S`."""


async def _reset_and_close(
    env_class: type, row: Mapping[str, Any]
) -> tuple[str | list[Any] | None, str]:
    """Build and reset an instance on `row` (seed 0), then close it; return what reset did.

    The second value describes a game's seats (`environments.seats`): which seat moves first
    and that it is told something; "" for an environment without seats.

    Raises:
        _DidNotReturn: The calls together took over `RESET_TIMEOUT_S`; the message names
            the one that had not returned.
        EnvironmentSpecError: ``to_move`` names no seat, or ``observe`` returns no text.
    """
    running = f"{env_class.__qualname__}()"

    def run() -> tuple[str | list[Any] | None, str]:
        nonlocal running
        env = create_environment(env_class)
        running = "reset()"
        try:
            observation = reset_environment(env, row, 0)
            running = "to_move() and observe()"
            return observation, _seats_line(env) if is_seated(env_class) else ""
        finally:
            running = "close()"
            close_environment(env)

    try:
        with anyio.fail_after(RESET_TIMEOUT_S):
            label = f"{env_class.__qualname__}() and reset()"
            return await run_in_daemon_thread(run, label=label)
    except TimeoutError:
        raise _DidNotReturn(
            f"{running} had not returned after {RESET_TIMEOUT_S:g} s (doctor's limit for the "
            f"constructor, reset() and close() together)"
        ) from None


def _seats_line(env: Any) -> str:
    """What a reset game says of its seats, for the check's line.

    Raises:
        EnvironmentSpecError: ``to_move`` names no seat after ``reset``, or ``observe``
            returns something other than text or None.
    """
    seats = type(env).seats
    first = seat_to_move(env)
    if first is None:
        raise EnvironmentSpecError(
            f"{type(env).__qualname__}.to_move() is None right after reset(): the game is over "
            "before any seat moves; return the seat to move first"
        )
    told = seat_observation(env, first)
    return f"; seats {', '.join(seats)}: {first} moves first" + (" and is told" if told else "")


def _check_tools_render(
    setup: Setup,
    schemas: list[dict[str, Any]],
    row: Mapping[str, Any],
    observation: str | list[Any] | None,
) -> None:
    """Raise ValueError unless every tool's name shows in the rendered first prompt.

    Of a `reset` that returned texts and images, the texts stand in for the whole.
    """
    if isinstance(observation, list):
        observation = "\n".join(value for value in observation if isinstance(value, str))
    renderer = ChatRenderer(setup.tokenizer, setup.template, schemas, setup.template_kwargs)
    messages = prompt_messages(row) if "prompt" in row else []
    messages = messages or [{"role": "user", "content": observation or ""}]
    text = renderer.render(messages, generation_prompt=True)
    missing = [s["function"]["name"] for s in schemas if s["function"]["name"] not in text]
    if missing:
        raise ValueError(f"the chat template does not show the tools {missing} in the prompt")


def check_generation(
    engine: RolloutEngine, rows: Sequence[Mapping[str, Any]], n: int
) -> CheckResult:
    """Check 6: play `n` sampled episodes (rows in turn) and report the model's tool calls.

    Warns when no episode calls a tool, or when calls cannot be parsed: the run works, but
    GRPO can only reinforce calls the model makes. Fails when playing raises.
    """
    played = list(islice(cycle(rows), n))
    try:
        episodes = anyio.run(functools.partial(engine.run, played, 1, 0))
    except Exception as error:
        return CheckResult("generate", Status.FAIL, describe_error(error), "fix what it names")
    calling = sum(e.stats.tool_calls > 0 for e in episodes)
    calls = sum(e.stats.tool_calls for e in episodes)
    parse_failures = sum(e.stats.tool_errors.get("parse", 0) for e in episodes)
    finishes = Tally(e.finish.value for e in episodes)
    message = (
        f"{n} episode(s): {calling} called a tool ({calling / n:.0%}), {calls} call(s), "
        f"{parse_failures} parse failure(s); ended {dict(finishes)}"
    )
    if calling == 0:
        return CheckResult("generate", Status.WARNING, message, _NO_CALLS_FIX)
    if parse_failures:
        return CheckResult("generate", Status.WARNING, message, _PARSE_FIX)
    return CheckResult("generate", Status.OK, message)


_NO_CALLS_FIX = (
    "GRPO only reinforces calls the model makes: warm-start it on the environment's "
    "demonstrations (--warm-start-steps N) or start from a model tuned for tool calls"
)
_PARSE_FIX = (
    "the model writes calls the parser cannot read: check --tool-call-parser against what the "
    "model writes (the episodes' tool messages quote the errors)"
)
