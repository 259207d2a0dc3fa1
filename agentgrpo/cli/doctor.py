"""`agentgrpo doctor`: check a model, its chat template and an environment before training.

The checks live in `agentgrpo.doctor`; this module turns the command line into their inputs
and prints one line per check. Exit status: 0 when a run would work (warnings included), 1
when a check failed, 2 for a mistake on the command line.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from agentgrpo.cli import sources
from agentgrpo.cli.options import (
    DEVICE_HELP,
    RUN_DEFAULTS,
    UsageError,
    grpo_config,
    template_source,
    value_parser,
)
from agentgrpo.devices import resolve_device
from agentgrpo.doctor import CheckResult, Setup, Status

if TYPE_CHECKING:
    import torch

    from agentgrpo.config import GRPOConfig

FAILED = 1


def add_parser(sub: argparse._SubParsersAction, handler: Any) -> argparse.ArgumentParser:
    """The `doctor` subcommand's parser, its handler set to `handler`."""
    help_text = "check a model, its chat template and an environment without training"
    parser = sub.add_parser("doctor", help=help_text, description=help_text, allow_abbrev=False)
    parser.set_defaults(handler=handler)
    parser.usage = (
        "agentgrpo doctor [--model M] [--chat-template T] [--tool-call-parser P] "
        "[--generate N [--device D]] [ENV]"
    )
    add = parser.add_argument
    add(
        "env",
        nargs="?",
        metavar="ENV",
        help="NAME (an installed package's), env:Name, gym:ENV_ID, module:Class or file.py:Class",
    )
    add("--model", help="hub id or local folder (default: the embedded SmolLM2-135M-Instruct)")
    add(
        "--chat-template",
        help="a built-in name (chatml_tools), a .jinja file, or jinja source (default: the "
        "model's own; chatml_tools for the embedded model)",
    )
    add("--tool-call-parser", help="parser name (default: chosen as a run chooses it)")
    add(
        "--generate",
        type=value_parser("generate", int),
        metavar="N",
        help="also play N short sampled episodes of ENV with the model",
    )
    add("--device", metavar="DEVICE", help=f"with --generate: {DEVICE_HELP}")
    return parser


def doctor(namespace: argparse.Namespace) -> int:
    """Run the checks the options ask for, print one line each, and return the exit status."""
    from transformers import AutoTokenizer

    from agentgrpo import doctor as checks
    from agentgrpo.models.loading import load_tokenizer
    from environments import resolve_environment

    if namespace.generate and not namespace.env:
        raise UsageError("--generate plays episodes of ENV; name one, e.g. env:Counter")
    if namespace.device is not None and not namespace.generate:
        raise UsageError("--device is where --generate plays; without --generate no model runs")
    device = resolve_device(namespace.device) if namespace.generate else None
    if namespace.env and namespace.env.startswith((sources.AGENT_PREFIX, sources.VERIFIERS_PREFIX)):
        raise UsageError(
            f"doctor checks environment classes, and {namespace.env} is an agent (its tools come "
            f"with its requests): check the model alone with `agentgrpo doctor`, then play a "
            f"few episodes with `agentgrpo eval {namespace.env} --num-episodes 2`"
        )
    env_class = resolve_environment(namespace.env) if namespace.env else None
    path = sources.model_path(namespace.model)
    tokenizer = load_tokenizer(None, AutoTokenizer.from_pretrained(path))
    print(f"agentgrpo doctor: {namespace.model or sources.DEFAULT_MODEL}", flush=True)
    setup = _setup(namespace, path, tokenizer, env_class)
    results = checks.fast_checks(setup) if isinstance(setup, Setup) else [setup]
    if env_class is not None and isinstance(setup, Setup):
        template_ok = all(r.status is not Status.FAIL for r in results if r.name == "template")
        rendered_in = setup if template_ok else None
        results.append(checks.check_environment_runs(env_class, _rows(env_class), rendered_in))
    for result in results:
        print(result.line(), flush=True)
    failed = any(r.status is Status.FAIL for r in results)
    if device is not None and not failed:
        assert isinstance(setup, Setup)  # a setup that did not load is a failed check
        result = _generate(namespace, path, tokenizer, env_class, setup, device)
        print(result.line(), flush=True)
        failed = result.status is Status.FAIL
    return FAILED if failed else 0


def _setup(
    namespace: argparse.Namespace, path: str, tokenizer: Any, env_class: type | None
) -> Setup | CheckResult:
    """What a run with these options would render, parse and stop with, or why it cannot load."""
    from agentgrpo.generation.evaluation import stop_token_ids_of
    from environments import class_tools
    from rollout import load_template

    try:
        template = load_template(tokenizer, _template_option(namespace))
    except ValueError as error:  # no template, or neither a name nor jinja
        return CheckResult("template", Status.FAIL, str(error), "pass --chat-template")
    try:
        tools = tuple(t.schema for t in class_tools(env_class).values()) if env_class else ()
    except ValueError:  # the environment check reports it
        tools = ()
    return Setup(
        tokenizer=tokenizer,
        template=template,
        stop_token_ids=frozenset(stop_token_ids_of(tokenizer, _generation_config(path))),
        tools=tools,
        tool_call_parser=namespace.tool_call_parser,
    )


def _template_option(namespace: argparse.Namespace) -> str | None:
    """`--chat-template` as `load_template` takes it: a file is read; none is the run default."""
    from agentgrpo.cli.options import BUILTIN_TEMPLATE

    value = namespace.chat_template
    if value is None:
        return BUILTIN_TEMPLATE if namespace.model is None else None
    return template_source(value)


def _generation_config(path: str) -> Any:
    """The generation config a model loaded from `path` has (a run stops on its eos ids).

    Read without the weights: the fast checks load no model.
    """
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: transformers derives it from config.json
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))


def _rows(env_class: type) -> Any:
    """The environment's own train rows, or None when it has no `dataset()`."""
    if getattr(env_class, "dataset", None) is None:
        return None
    return lambda: sources.rows(env_class, None, "train")


def _generate(
    namespace: argparse.Namespace,
    path: str,
    tokenizer: Any,
    env_class: Any,
    setup: Setup,
    device: torch.device,
) -> CheckResult:
    """Check 6 with the model loaded here and episodes played as `agentgrpo run` plays them.

    The model is loaded as `agentgrpo eval` loads it, and the engine built as a run's is
    (`wiring.build_engine`), from the `GRPOConfig` of a run with these options.
    """
    from agentgrpo.doctor import check_generation
    from agentgrpo.generation.evaluation import evaluation_backend
    from agentgrpo.rounds.wiring import build_engine

    backend, where = evaluation_backend(path, tokenizer, device, seed=0)
    print(f"generating on {where}", flush=True)
    engine = build_engine(_run_config(namespace, env_class, setup), backend, tokenizer, env_class)
    return check_generation(
        engine, list(sources.rows(env_class, None, "train")), namespace.generate
    )


def _run_config(namespace: argparse.Namespace, env_class: Any, setup: Setup) -> GRPOConfig:
    """The `GRPOConfig` of `agentgrpo run` with these options: its limits, template and parser.

    The limits are the environment's `episode_limits`, else `agentgrpo run`'s defaults.
    """
    from environments.contract import episode_limits

    limits = {**RUN_DEFAULTS, **episode_limits(env_class)}
    return grpo_config(
        {
            "max_completion_length": limits["max_completion_length"],
            "max_turns": limits["max_turns"],
            "chat_template": setup.template,
            "tool_call_parser": namespace.tool_call_parser,
            "seed": 0,
            "report_to": "none",
        }
    )
