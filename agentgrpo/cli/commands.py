"""The subcommands: `run` trains, `eval` plays held-out rows, `envs` lists the built-ins.

Each takes the parsed namespace and returns an exit code. Set-up (options, environment, model,
rows, trainer) happens before anything slow, so user mistakes surface in seconds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import anyio

from agentgrpo.cli import sources
from agentgrpo.cli.options import (
    RUN_DEFAULTS,
    UsageError,
    check_keys,
    config_fields,
    config_file_values,
    config_overrides,
    read_config_file,
)
from agentgrpo.cli.values import FieldType

# Keys a --config file may hold besides GRPOConfig's fields: the command's own options.
RUN_KEYS = ("model", "dataset", "dataset_split", "reward")
_RUN_KEY_TYPES = {key: FieldType.of(str | None) for key in RUN_KEYS} | {
    "reward": FieldType.of(str | list[str] | None)
}
BUILTIN_TEMPLATE = "chatml_tools"  # the default model's own template cannot show tools
DEFAULT_WARM_START_STEPS = 24  # MODELS.md: enough for SmolLM2 to learn the call format


def run(namespace: argparse.Namespace) -> int:
    """Train on an environment and save the model, logs, samples and plot in the output folder."""
    from agentgrpo import GRPOTrainer
    from agentgrpo.run_log import attach_run_callbacks, summary_table

    env_class = sources.environment_class(namespace.env)
    settings = _run_settings(namespace, env_class)
    config = _grpo_config(settings["config"])
    sources.check_output_dir(config.output_dir)
    train_rows = sources.rows(env_class, settings["dataset"], settings["dataset_split"])
    rewards = sources.reward_functions(settings["reward"])
    model = sources.model_path(settings["model"])
    evaluates = config.eval_strategy != "no"  # held-out rows, as `agentgrpo eval` plays them
    eval_rows = sources.rows(env_class, settings["dataset"], "eval") if evaluates else None
    trainer = GRPOTrainer(
        model,
        rewards,
        args=config,
        train_dataset=train_rows,
        eval_dataset=eval_rows,
        environment_factory=env_class,
    )
    if config.chat_template:  # the saved model then plays with the template it learned on
        from rollout import load_template

        tokenizer = trainer.processing_class
        tokenizer.chat_template = load_template(tokenizer, config.chat_template)
    attach_run_callbacks(trainer)
    _print_start(namespace.env, settings["model"], trainer, len(train_rows))
    started = time.monotonic()
    trainer.train()
    final = Path(config.output_dir) / "model"
    trainer.save_model(str(final))
    if trainer.is_world_process_zero():
        print(summary_table(Path(config.output_dir) / "metrics.jsonl"))
        print(f"\ntrained in {time.monotonic() - started:.0f} s; final model: {final}")
        print(f"evaluate it: agentgrpo eval {namespace.env} --model {final}")
    return 0


def evaluate(namespace: argparse.Namespace) -> int:
    """Play one episode per held-out row without training and print the figures."""
    from agentgrpo.evaluate import evaluate as play_and_report

    env_class = sources.environment_class(namespace.env)
    rows = sources.rows(env_class, namespace.dataset, namespace.split)
    if namespace.num_episodes is not None:
        rows = rows.select(range(min(namespace.num_episodes, len(rows))))
    engine, scorer = _eval_engine(namespace, env_class)
    print(
        f"evaluating {namespace.model or sources.DEFAULT_MODEL} on {namespace.env} "
        f"({len(rows)} rows, split {namespace.split!r}, temperature {namespace.temperature})",
        flush=True,
    )
    started = time.monotonic()
    report, episodes, rewards = anyio.run(
        lambda: play_and_report(
            engine, scorer, list(rows), None, namespace.success_threshold, namespace.seed
        )
    )
    print(report.table())
    print(f"({time.monotonic() - started:.0f} s)")
    if namespace.episodes_file:
        _write_episodes(Path(namespace.episodes_file), episodes, rewards)
    return 0


def envs(namespace: argparse.Namespace) -> int:
    """Print each built-in environment with the first line of its docstring."""
    from environments import BUILTIN_ENVIRONMENTS

    width = max(map(len, BUILTIN_ENVIRONMENTS)) + len("env:")
    for name, cls in BUILTIN_ENVIRONMENTS.items():
        summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"{'env:' + name:<{width}}  {summary}")
    return 0


# ---------------------------------------------------------------------- run


def _run_settings(namespace: argparse.Namespace, env_class: type) -> dict[str, Any]:
    """The run's options, merged: command line over config file over the run defaults."""
    from_file = read_config_file(namespace.config) if namespace.config else {}
    check_keys(from_file, [*config_fields(), *RUN_KEYS], f"config file {namespace.config}")
    from_file = config_file_values(from_file, namespace.config, _RUN_KEY_TYPES)
    given = vars(namespace)
    own = {key: given.get(key, from_file.get(key)) for key in RUN_KEYS}
    reward = own["reward"] or []
    own["reward"] = [reward] if isinstance(reward, str) else list(reward)
    own["dataset_split"] = own["dataset_split"] or "train"
    config = dict(RUN_DEFAULTS)
    if own["model"] is None:
        config["chat_template"] = BUILTIN_TEMPLATE
        if hasattr(env_class, "demonstrations"):
            config["warm_start_steps"] = DEFAULT_WARM_START_STEPS
    config["output_dir"] = f"runs/{env_class.__name__}-{time.strftime('%Y%m%d-%H%M%S')}"
    config.update({k: v for k, v in from_file.items() if k in config_fields()})
    config.update(config_overrides(namespace))
    return {**own, "config": config}


def _grpo_config(fields: dict[str, Any]) -> Any:
    """GRPOConfig(**fields), its errors turned into usage errors naming the option."""
    from agentgrpo import GRPOConfig

    try:
        return GRPOConfig(**fields)
    except (TypeError, ValueError) as error:
        raise UsageError(f"invalid options: {error}") from None


def _print_start(env: str, model: str | None, trainer: Any, rows: int) -> None:
    if not trainer.is_world_process_zero():
        return
    args = trainer.args
    backend = f"vLLM ({args.vllm_mode})" if args.use_vllm else "transformers"
    lines = {
        "environment": f"{env} ({rows} rows)",
        "model": model or sources.DEFAULT_MODEL,
        "device": f"{args.device} x {args.world_size} process(es)",
        "generation": backend,
        "steps": f"{args.max_steps} x {args.per_device_train_batch_size} episodes "
        f"({args.num_generations} per prompt), lr {args.learning_rate:g}",
        "warm start": f"{args.warm_start_steps} steps" if args.warm_start_steps else "none",
        "output": args.output_dir,
    }
    print("agentgrpo run")
    for name, value in lines.items():
        print(f"  {name:<12} {value}")
    print(flush=True)


# ---------------------------------------------------------------------- eval


def _eval_engine(namespace: argparse.Namespace, env_class: type) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    from agentgrpo.models import load_tokenizer
    from agentgrpo.reward_calls import reward_functions
    from agentgrpo.rounds import Scorer, environment_reward_name
    from rollout import EpisodeConfig, RolloutEngine

    path = sources.model_path(namespace.model)
    tokenizer = load_tokenizer(None, AutoTokenizer.from_pretrained(path))
    template = namespace.chat_template or (BUILTIN_TEMPLATE if namespace.model is None else None)
    engine = RolloutEngine(
        _eval_backend(namespace, path, tokenizer),
        tokenizer,
        environment_factory=env_class,
        chat_template=template,
        tool_call_parser=namespace.tool_call_parser,
        config=EpisodeConfig(
            max_completion_length=namespace.max_completion_length,
            max_turns=namespace.max_turns,
            temperature=namespace.temperature,
        ),
    )
    scorer = Scorer(
        funcs=reward_functions(sources.reward_functions(namespace.reward), None),
        env_reward_name=environment_reward_name(env_class),
        with_environments=True,
        text_completions=False,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        trainer_state=lambda: None,
        log_extra=lambda column, values: None,
        log_metric=lambda name, value: None,
    )
    if not scorer.names:
        raise UsageError(f"{env_class.__name__} has no reward(); pass --reward module:function")
    return engine, scorer


def _eval_backend(namespace: argparse.Namespace, path: str, tokenizer: Any) -> Any:
    """The model in this process, or the OpenAI-compatible server at `--server-url`."""
    if namespace.server_url:
        from rollout.vllm_backend import default_stop_token_ids
        from rollout.vllm_server import ServerConnection, VLLMServerBackend

        connection = ServerConnection(namespace.server_url, namespace.server_timeout)
        return VLLMServerBackend.connect(
            connection, stop_token_ids=default_stop_token_ids(tokenizer)
        )
    import torch
    from transformers import AutoModelForCausalLM

    from rollout import TransformersBackend

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return TransformersBackend.from_tokenizer(model, tokenizer, seed=namespace.seed)


def _write_episodes(path: Path, episodes: list, rewards: list[float]) -> None:
    from agentgrpo.run_log import format_episode

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "\n\n".join(format_episode(e, r) for e, r in zip(episodes, rewards, strict=True))
    )
    print(f"episodes written to {path}")
