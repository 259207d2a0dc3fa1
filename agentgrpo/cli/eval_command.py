"""`agentgrpo eval`: play one episode per held-out row without training, and print the figures.

The episodes are played as the run that trained the model played them (`eval_config`): its
template, token and turn limits, on the device `--device` names or on a vLLM server.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import anyio

from agentgrpo.cli import sources
from agentgrpo.cli.options import (
    BUILTIN_TEMPLATE,
    EVAL_EPISODE_FIELDS,
    RUN_DEFAULTS,
    UsageError,
    grpo_config,
    template_source,
)
from environments.contract import EPISODE_LIMITS, run_defaults


def evaluate(namespace: argparse.Namespace) -> int:
    """Play one episode per held-out row without training and print the figures."""
    from agentgrpo.reporting.evaluate import evaluate as play_and_report

    device = _eval_device(namespace)
    source = sources.task_source(namespace.env, sources.env_args(namespace.env_args))
    rows = sources.rows(source, namespace.dataset, namespace.split, namespace.dataset_size)
    rows = list(sources.first(rows, namespace.num_episodes))  # each is played, streams included
    engine, scorer, weights, where = _eval_engine(namespace, source, device)
    print(
        f"evaluating {namespace.model or sources.DEFAULT_MODEL} on {namespace.env} "
        f"({len(rows)} rows, {_split_line(namespace, source)}, temperature "
        f"{namespace.temperature}) on {where}",
        flush=True,
    )
    started = time.monotonic()
    try:
        report, episodes, rewards = anyio.run(
            lambda: play_and_report(
                engine, scorer, rows, weights, namespace.success_threshold, namespace.seed
            )
        )
    finally:
        engine.close()  # its MCP servers stop, an agent endpoint's port is given back
    print(report.table())
    print(f"({time.monotonic() - started:.0f} s)")
    if namespace.episodes_file:
        _write_episodes(Path(namespace.episodes_file), episodes, rewards)
    return 0


def _split_line(namespace: argparse.Namespace, source: Any) -> str:
    """Which split the rows are, for the start-up line: none where their source has no splits."""
    split = sources.split_read(source, namespace.dataset, namespace.split)
    if split is not None:
        return f"split {split!r}"
    if namespace.dataset is not None:
        return f"no split: {namespace.dataset} has none"
    return f"no split: {sources.source_name(source)}'s dataset() takes none"


def _eval_device(namespace: argparse.Namespace) -> Any:
    """The device `--device` names (checked), None with `--server-url` (the server generates)."""
    from agentgrpo.devices import resolve_device

    if namespace.server_url is None:
        return resolve_device(namespace.device)
    if namespace.device is not None:
        raise UsageError(
            f"--device places the model loaded here, and with --server-url "
            f"{namespace.server_url} the server generates: leave one of them out"
        )
    return None


def _eval_engine(
    namespace: argparse.Namespace, source: Any, device: Any
) -> tuple[Any, Any, list[float], str]:
    """The engine, scorer and reward weights `wiring.build_parts` builds, from eval's options.

    Also where generation runs, for the start-up line.
    """
    from transformers import AutoTokenizer

    from agentgrpo.doctor import startup_checks
    from agentgrpo.generation.evaluation import adapter_seat_backends, evaluation_backend
    from agentgrpo.models.loading import is_vision_folder, load_tokenizer
    from agentgrpo.rewards.calls import reward_functions
    from agentgrpo.rounds.scoring import environment_reward_name
    from agentgrpo.rounds.wiring import build_parts
    from agentgrpo.training.seat_models import model_seat_backends
    from rollout.images import load_processor

    rewards = reward_functions(sources.reward_functions(namespace.reward), None)
    played_by = sources.played_by(source)
    if not rewards and "agent" not in played_by and environment_reward_name(source) is None:
        raise UsageError(f"{source.__name__} has no reward(); pass --reward module:function")
    path = sources.model_path(namespace.model)
    # a VLM folder: its processor renders the pictures, its tokenizer the rest
    processor = load_processor(path) if is_vision_folder(path) else None
    text = AutoTokenizer.from_pretrained(path) if processor is None else processor.tokenizer
    tokenizer = load_tokenizer(None, text)
    backend, where = evaluation_backend(
        path,
        tokenizer,
        device,
        seed=namespace.seed,
        server_url=namespace.server_url,
        server_timeout_s=namespace.server_timeout,
        processor=processor,
    )
    config = eval_config(namespace, source)
    factory = played_by.get("environment_factory")  # a game: its "model:PATH" seats load here
    adapters = adapter_seat_backends(factory, config.seat_players, backend, namespace.seed)
    seats = model_seat_backends(
        config, factory, backend, tokenizer, device, namespace.seed, given=adapters
    )
    parts = build_parts(
        config,
        backend,
        tokenizer if processor is None else processor,
        factory,
        (),
        rewards,
        agent=played_by.get("agent"),
        seat_backends=seats,
    )
    try:
        startup_checks(parts.engine)
    except BaseException:
        parts.engine.close()
        raise
    return parts.engine, parts.scorer, parts.reward_weights, where


def eval_config(namespace: argparse.Namespace, source: Any) -> Any:
    """The `GRPOConfig` of a run whose episodes are played as `agentgrpo eval` plays them.

    The token and turn limits are the command line's, else the environment's
    `episode_limits`, else `agentgrpo run`'s defaults: as the run that trained the model; so is
    `max_context` (the command line's, else the environment's `run_defaults`'), and the MCP
    servers (`--mcp-server`, whose tools every episode offers, as `agentgrpo run`'s do).
    """
    template: str | None
    if namespace.chat_template:
        template = template_source(namespace.chat_template)
    else:
        template = BUILTIN_TEMPLATE if namespace.model is None else None
    limits = {**RUN_DEFAULTS, **sources.source_limits(source)}
    for name in EPISODE_LIMITS:
        if getattr(namespace, name) is not None:
            limits[name] = getattr(namespace, name)
    return grpo_config(
        {
            "max_completion_length": limits["max_completion_length"],
            "max_turns": limits["max_turns"],
            "temperature": namespace.temperature,
            **{name: getattr(namespace, name) for name in EVAL_EPISODE_FIELDS},
            "max_context": namespace.max_context or _recipe_window(source),
            "chat_template": template,
            "tool_call_parser": namespace.tool_call_parser,
            "mcp_servers": getattr(namespace, "mcp_servers", None),  # --mcp-server, as in run
            "seat_players": getattr(namespace, "seat_players", None),  # a game: its other seats
            "seat_temperatures": getattr(namespace, "seat_temperatures", None),
            "seed": namespace.seed,
            "report_to": "none",
        }
    )


def _recipe_window(source: Any) -> int | None:
    """The `max_context` of the environment's `run_defaults`: the window its runs train in."""
    window = run_defaults(source).get("max_context") if isinstance(source, type) else None
    return None if window is None else int(window)


def _write_episodes(path: Path, episodes: list, rewards: list[float]) -> None:
    from agentgrpo.reporting.run_log import format_episode

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "\n\n".join(format_episode(e, r) for e, r in zip(episodes, rewards, strict=True))
    )
    print(f"episodes written to {path}")
