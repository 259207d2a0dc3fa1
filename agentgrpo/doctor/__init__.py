"""`agentgrpo doctor`: checks that a model, its chat template and an environment can train.

Each check returns a `CheckResult` (ok / warning / fail, one line, and the fix); none trains.

1. `check_template`: the template shows tool schemas, tool calls and tool results.
2. `check_parser`: the parser reads back the call the template writes (a round trip), and
   whether markers such as `<tool_call>` are single tokens of the model.
3. `check_history`: every rendering of a growing tool conversation starts with the one before;
   if not, the first rewritten turn and what changed (the run forks training rows there).
4. `check_stop_tokens`: the token that ends an assistant turn is a generation stop token.
5. `check_environment_runs`: the environment meets the contract, resets, and its tools render.
6. `check_generation`: a few sampled episodes through the real model: tool-call rate and parse
   failures.

`fast_checks` runs 1 to 4 in well under a second; `startup_checks` runs them on a built engine
(as `agentgrpo run` and `eval` do before playing) and stops on a failure.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentgrpo.doctor.checks import (
    PROBE_TOOL,
    CheckResult,
    Setup,
    Status,
    check_parser,
    check_stop_tokens,
    check_template,
    probe_call,
)
from agentgrpo.doctor.history import check_history, probe_conversation
from agentgrpo.doctor.live import check_environment_runs, check_generation
from rollout import RolloutEngine

__all__ = [
    "PROBE_TOOL",
    "CheckResult",
    "Setup",
    "SetupCheckError",
    "Status",
    "check_environment_runs",
    "check_generation",
    "check_history",
    "check_parser",
    "check_stop_tokens",
    "check_template",
    "fast_checks",
    "probe_call",
    "probe_conversation",
    "setup_of",
    "startup_checks",
]


class SetupCheckError(ValueError):
    """A start-up check found that the run would fail; the message is the check's line."""


def fast_checks(setup: Setup) -> list[CheckResult]:
    """Checks 1 to 4. When the template cannot show tools, the others are not run."""
    template = check_template(setup)
    if template.status is Status.FAIL:
        return [template]
    return [template, check_parser(setup), check_history(setup), check_stop_tokens(setup)]


def setup_of(engine: RolloutEngine) -> Setup:
    """What `engine` renders, parses and stops with."""
    context = engine.context
    renderer = context.renderer
    return Setup(
        tokenizer=renderer.tokenizer,
        template=renderer.template,
        stop_token_ids=frozenset(context.backend.stop_token_ids),
        tools=tuple(renderer.tools),
        parser=context.parser,
        template_kwargs=renderer.template_kwargs,
    )


def startup_checks(engine: RolloutEngine, show: bool = True) -> Sequence[CheckResult]:
    """The fast checks on a run's engine: print each problem, raise on the first failure.

    An engine without tools has nothing to check. Warnings (a template that forks, say) are
    printed when `show` and the run goes on.

    Raises:
        SetupCheckError: A check failed; the message is its line, fix included.

    """
    if not engine.context.has_tools:
        return []
    results = fast_checks(setup_of(engine))
    for result in results:
        if result.status is Status.FAIL:
            raise SetupCheckError(f"{result.name}: {result.message}; fix: {result.fix}")
        if show and result.status is Status.WARNING:
            print(result.line(), flush=True)
    return results
