"""The subcommand `run` (trains); `eval` is `eval_command`, `envs` is `envs_command`.

Each takes the parsed namespace and returns an exit code. Set-up (options, environment, model,
rows, trainer) happens before anything slow, so user mistakes surface in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentgrpo import run_folder
from agentgrpo.cli import resume_check, sources
from agentgrpo.cli.lora import (
    LORA_KEY_TYPES,
    LORA_KEYS,
    adapter_settings,
    lora_config,
    naming_target_modules,
)
from agentgrpo.cli.options import (
    BUILTIN_TEMPLATE,
    CHECKPOINT_ABOVE_TOKENS,
    RUN_DEFAULTS,
    UsageError,
    check_keys,
    config_fields,
    config_file_values,
    config_overrides,
    grpo_config,
    read_config_file,
    template_source,
)
from agentgrpo.cli.values import FieldType
from agentgrpo.training import checkpoints
from environments.contract import run_defaults

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig

# Keys a --config file may hold besides GRPOConfig's fields: the command's own options.
RUN_KEYS = (
    "model",
    "dataset",
    "dataset_split",
    "dataset_size",
    "reward",
    "resume",
    "env_args",
    "device",
    *LORA_KEYS,
)
_RUN_KEY_TYPES = {key: FieldType.of(str | None) for key in RUN_KEYS} | {
    "dataset_size": FieldType.of(int | None),
    "reward": FieldType.of(str | list[str] | None),
    "resume": FieldType.of(bool | None),
    "env_args": FieldType.of(dict | str | None),
    **LORA_KEY_TYPES,
}
INTERRUPTED = 130  # the shell's status for a process ended by Ctrl-C (128 + SIGINT)
DEFAULT_WARM_START_STEPS = 24  # MODELS.md: enough for SmolLM2 to learn the call format


def run(namespace: argparse.Namespace) -> int:
    """Train on an environment and save the model, logs, samples and plot in the output folder.

    Resumes from `--resume-from-checkpoint PATH`, or with `--resume` from the latest intact
    checkpoint of `--output-dir`. The output folder is locked for the whole command: a second
    run into it fails at once, naming this one's pid. Ctrl-C stops the run with one line saying
    how to resume it, and status 130.
    """
    env_args = _env_args(namespace)
    source = sources.task_source(namespace.env, env_args)
    settings = _run_settings(namespace, source)
    settings["config"] |= _device_fields(settings["device"], settings["config"])
    settings["peft_config"] = lora_config(settings)
    config = grpo_config(settings["config"])
    sources.check_output_dir(config.output_dir)
    with run_folder.hold(config.output_dir) if config.should_save else contextlib.nullcontext():
        return _run_in_folder(namespace, source, settings | {"env_args": env_args}, config)


def _run_in_folder(
    namespace: argparse.Namespace, source: Any, settings: dict[str, Any], config: GRPOConfig
) -> int:
    """`run`, once the output folder is this run's alone."""
    from agentgrpo import GRPOTrainer
    from agentgrpo.generation.generator import shut_down

    checkpoint = _resume_from(settings["resume"], config)
    model = sources.model_path(settings["model"])
    kept = resume_check.run_settings(
        namespace.env,
        settings["env_args"],
        config,
        settings["reward"],
        adapter_settings(settings["peft_config"]),
    )
    if checkpoint is not None:
        for warning in resume_check.check_resume(checkpoint, _output_dir(config), kept, model):
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    if config.should_save:  # a resumed run records the rewards it goes on with
        resume_check.write_run_settings(_output_dir(config), kept)
    train_rows = sources.rows(
        source, settings["dataset"], settings["dataset_split"], settings["dataset_size"]
    )
    rewards = sources.reward_functions(settings["reward"])
    evaluates = config.eval_strategy != "no"  # held-out rows, as `agentgrpo eval` plays them
    eval_rows = sources.rows(source, settings["dataset"], "eval") if evaluates else None
    with naming_target_modules(settings["peft_config"]):
        trainer = GRPOTrainer(
            model,
            rewards,
            args=config,
            train_dataset=train_rows,
            eval_dataset=eval_rows,
            peft_config=settings["peft_config"],
            **sources.played_by(source),
        )
    try:
        return _train_and_save(trainer, namespace, settings, config, checkpoint, train_rows)
    finally:
        # Every process of a launch leaves its process group first: at exit, the threads of a
        # gloo group still alive can abort the process (SIGABRT) after a run that succeeded.
        # A colocated vLLM engine leaves its own groups before that.
        shut_down(trainer.generator)
        trainer.accelerator.end_training()


def _train_and_save(
    trainer: Any,
    namespace: argparse.Namespace,
    settings: dict[str, Any],
    config: GRPOConfig,
    checkpoint: str | None,
    train_rows: Any,
) -> int:
    """`run` with its trainer: train (or finish a finished run), save, and say what is next."""
    from agentgrpo.doctor import startup_checks
    from agentgrpo.reporting.run_log import attach_run_callbacks, summary_table

    if config.chat_template:  # the saved model then plays with the template it learned on
        from rollout import load_template

        tokenizer = trainer.processing_class
        tokenizer.chat_template = load_template(tokenizer, config.chat_template)
    startup_checks(trainer.engine, show=trainer.is_world_process_zero())
    final = Path(_output_dir(config)) / "model"
    if checkpoint is not None and _finished(checkpoint, config):
        return _finish_without_training(trainer, checkpoint, final)
    attach_run_callbacks(trainer)
    _print_start(namespace.env, settings, trainer, train_rows, checkpoint)
    started = time.monotonic()
    if not _train(trainer, checkpoint, namespace):
        return INTERRUPTED
    trainer.save_model(str(final))
    if trainer.is_world_process_zero():
        print(summary_table(Path(_output_dir(config)) / "metrics.jsonl"))
        print(f"\ntrained in {time.monotonic() - started:.0f} s; final model: {final}")
        _print_eval_commands(
            namespace.env, settings["env_args"], config, warm_started=checkpoint is None
        )
    return 0


def _print_eval_commands(
    env: str, env_args: dict[str, Any] | None, config: GRPOConfig, warm_started: bool
) -> None:
    """The `agentgrpo eval` lines for the final model and, when saved, the warm start alone."""
    from agentgrpo.training.trainer import WARM_START_DIR

    again = f" --env-args {shlex.quote(json.dumps(env_args))}" if env_args is not None else ""
    output_dir = Path(_output_dir(config))
    print(f"evaluate it: agentgrpo eval {env}{again} --model {output_dir / 'model'}")
    if config.save_warm_start and warm_started:
        warm = output_dir / WARM_START_DIR
        print(f"and the warm start alone: agentgrpo eval {env}{again} --model {warm}")


# ---------------------------------------------------------------------- run


def _env_args(namespace: argparse.Namespace) -> dict[str, Any] | None:
    """`--env-args`, else the config file's `env_args` (parsed; None when neither is given)."""
    value = getattr(namespace, "env_args", None)
    if value is not None or not namespace.config:
        return sources.env_args(value)
    in_file = {"env_args": read_config_file(namespace.config).get("env_args")}
    value = config_file_values(in_file, namespace.config, _RUN_KEY_TYPES)["env_args"]
    try:
        return sources.env_args(value)
    except UsageError as error:  # JSON text under the key: say where it came from
        raise UsageError(f"config file {namespace.config}: env_args: {error}") from None


def _run_settings(namespace: argparse.Namespace, source: Any) -> dict[str, Any]:
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
        if hasattr(source, "demonstrations"):
            config["warm_start_steps"] = DEFAULT_WARM_START_STEPS
    limits, recipe = sources.source_limits(source), _recipe(source, "warm_start_steps" in config)
    config.update(limits | recipe)
    user = {k: v for k, v in from_file.items() if k in config_fields()}
    user.update(config_overrides(namespace))
    config.update(user)
    if config.get("chat_template"):  # a .jinja file, as `agentgrpo doctor` accepts it
        config["chat_template"] = template_source(config["chat_template"])
    if "gradient_checkpointing" not in user:
        config["gradient_checkpointing"] = _long_steps(config)
    if "save_warm_start" not in user:  # the warm start alone, to evaluate beside the result
        config["save_warm_start"] = config.get("warm_start_steps", 0) > 0
    config["model_init_kwargs"] = _float32_weights(config.get("model_init_kwargs"))
    if "output_dir" not in config:
        config["output_dir"] = _default_output_dir(source, config, bool(own["resume"]))
    # The trackers' names for the run (transformers' defaults: project "huggingface", a random
    # run name): a run resumed in its output folder then continues its own trackio run.
    config.setdefault("project", sources.source_name(source))
    config.setdefault("run_name", config["output_dir"])
    return {
        **own,
        "config": config,
        "from_environment": sorted(set(limits) - set(user)),
        "recipe": {key: config[key] for key in recipe if key not in user},
        "limits_of": "environment" if isinstance(source, type) else "agent",
    }


def _float32_weights(model_init_kwargs: dict[str, Any] | str | None) -> dict[str, Any] | str:
    """`model_init_kwargs` with `dtype="float32"` unless it names a dtype (or is JSON text).

    The optimizer keeps float32 master weights; on a GPU the forward passes run under the
    config's mixed precision (bf16 where supported). A bf16 checkpoint loaded as bf16 would
    take pure-bf16 AdamW steps, which at lr 1e-5 round most updates away.
    """
    if isinstance(model_init_kwargs, str):  # GRPOConfig parses it; a dtype there is the user's
        return model_init_kwargs
    return {"dtype": "float32", **(model_init_kwargs or {})}


def _device_fields(device: str | None, config: dict[str, Any]) -> dict[str, Any]:
    """The config fields `--device` sets (`use_cpu`); a GPU is made the only visible one.

    Raises:
        UsageError: A bad or unavailable device, or `--device` against `--use-cpu`.
    """
    from agentgrpo.devices import pin_training_device

    if config.get("use_cpu") and device not in (None, "cpu"):
        raise UsageError(f"--use-cpu and --device {device} disagree: give only --device")
    try:
        return pin_training_device(device, os.environ)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _recipe(source: Any, warm_starts: bool) -> dict[str, float]:
    """The environment's `run_defaults`; its `warm_start_steps` only for a run that warm-starts."""
    recipe = run_defaults(source) if isinstance(source, type) else {}
    if not warm_starts:
        recipe.pop("warm_start_steps", None)
    return recipe


def _long_steps(config: dict[str, Any]) -> bool:
    """Whether a step's completions may pass `CHECKPOINT_ABOVE_TOKENS` (checkpointing pays)."""
    tokens = config["per_device_train_batch_size"] * config["max_completion_length"]
    return tokens > CHECKPOINT_ABOVE_TOKENS


def _default_output_dir(source: Any, config: dict[str, Any], resume: bool) -> str:
    """The folder holding `--resume-from-checkpoint`, else a new one named after the run."""
    if resume:
        raise UsageError(
            "--resume continues the run in --output-dir DIR; give the output folder of the run "
            "to continue"
        )
    if config.get("resume_from_checkpoint"):
        return str(Path(config["resume_from_checkpoint"]).parent)
    return f"runs/{sources.source_name(source)}-{time.strftime('%Y%m%d-%H%M%S')}"


def _resume_from(resume: bool, config: GRPOConfig) -> str | None:
    """The checkpoint the run resumes from (None: a new run), checked before anything loads.

    `--resume` with no intact checkpoint in the output folder starts a new run and says so,
    so one command both starts a run and continues it after a crash or Ctrl-C.
    """
    path = config.resume_from_checkpoint
    if resume and path:
        raise UsageError(
            "give --resume (the latest checkpoint of --output-dir) or --resume-from-checkpoint "
            "PATH, not both"
        )
    if path:
        return checkpoints.checked_checkpoint(path)
    if not resume:
        return None
    latest, skipped = checkpoints.latest_checkpoint(_output_dir(config))
    for line in skipped:
        print(f"warning: skipping incomplete checkpoint {line}", file=sys.stderr)
    if latest is None:
        print(f"no checkpoint in {config.output_dir} yet: starting a new run", flush=True)
        return None
    return str(latest)


def _output_dir(config: GRPOConfig) -> str:
    """The run's output folder, which TrainingArguments always sets (its type allows None)."""
    assert config.output_dir is not None
    return config.output_dir


def _finished(checkpoint: str, config: GRPOConfig) -> bool:
    """Whether the checkpoint to resume from already reached `max_steps` (nothing to train).

    Without this check the Trainer would take one more step before it noticed.
    """
    return config.max_steps > 0 and checkpoints.checkpoint_step(checkpoint) >= config.max_steps


def _finish_without_training(trainer: Any, checkpoint: str, final: Path) -> int:
    """Save the finished run's final model from its checkpoint if it is missing, and say so."""
    step = checkpoints.checkpoint_step(checkpoint)
    if not (final / "config.json").is_file() and not (final / "adapter_config.json").is_file():
        trainer._load_from_checkpoint(checkpoint)
        trainer.save_model(str(final))
    if trainer.is_world_process_zero():
        print(
            f"{checkpoint} is at step {step}, which reaches --max-steps {trainer.args.max_steps}: "
            f"nothing to train (raise --max-steps to train further); final model: {final}"
        )
    return 0


def _train(trainer: Any, checkpoint: str | None, namespace: argparse.Namespace) -> bool:
    """Train; on Ctrl-C print where the run stopped and how to resume it, and return False."""
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    except KeyboardInterrupt:
        _close_progress_bar(trainer)
        if trainer.is_world_process_zero():
            print(_interrupted_line(trainer, namespace), file=sys.stderr, flush=True)
            _print_abandoned_calls()
        return False
    return True


def _print_abandoned_calls() -> None:
    """Name the user's calls the interrupt walked away from (e.g. a `close()` that hangs)."""
    from tools.threads import USER_CODE

    if stuck := USER_CODE.stuck:
        print(f"  left running (abandoned): {', '.join(stuck)}", file=sys.stderr, flush=True)


def _close_progress_bar(trainer: Any) -> None:
    from agentgrpo.reporting.run_log import ProgressBar

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ProgressBar):
            callback.on_train_end(trainer.args, trainer.state, trainer.control)


def _interrupted_line(trainer: Any, namespace: argparse.Namespace) -> str:
    """`interrupted at step N; last checkpoint DIR/checkpoint-M; resume with: agentgrpo ...`."""
    output_dir = trainer.args.output_dir
    latest, _ = checkpoints.latest_checkpoint(output_dir)
    where = f"last checkpoint {latest}" if latest else "no checkpoint saved yet"
    command = shlex.join([*_command_line(namespace), "--output-dir", output_dir, "--resume"])
    return f"interrupted at step {trainer.state.global_step}; {where}; resume with: {command}"


def _command_line(namespace: argparse.Namespace) -> list[str]:
    """`agentgrpo` and the words the user typed, bar the output folder and resume options.

    The words are kept as typed (not rebuilt from parsed values), so `--save-steps 1` stays
    `1` and a JSON or list value keeps its spelling.
    """
    words, typed = ["agentgrpo"], iter(namespace.argv)
    for word in typed:
        name = word.split("=", 1)[0]
        if name in _RESUME_OPTIONS:
            if "=" not in word and _RESUME_OPTIONS[name]:
                next(typed, None)  # the option's value
            continue
        words.append(word)
    return words


# Options the resume command replaces, and whether each takes a value.
_RESUME_OPTIONS = {"--output-dir": True, "--resume-from-checkpoint": True, "--resume": False}


def _print_start(
    env: str, settings: dict[str, Any], trainer: Any, rows: Any, checkpoint: str | None
) -> None:
    from agentgrpo.devices import describe_device
    from agentgrpo.precision import describe_precision, mixed_precision_dtype

    if not trainer.is_world_process_zero():
        return
    args = trainer.args
    backend = f"vLLM ({args.vllm_mode})" if args.use_vllm else "transformers"
    autocast = mixed_precision_dtype(args)
    # DeepSpeed casts the module to its mixed precision when it prepares it (ZeRO-3 builds it so)
    weights = autocast if trainer.placement.uses_deepspeed and autocast else trainer.model.dtype
    lines = {
        "environment": f"{env} ({len(rows) if hasattr(rows, '__len__') else 'streamed'} rows)",
        "model": settings["model"] or sources.DEFAULT_MODEL,
        "adapter": _adapter_line(trainer.model),
        "device": f"{describe_device(args.device, os.environ)} x {args.world_size} process(es)",
        "precision": describe_precision(weights, autocast),
        "generation": backend,
        "steps": f"{args.max_steps} x {args.per_device_train_batch_size} episodes "
        f"({trainer.plan.per_prompt}), lr {args.learning_rate:g}",
        "episodes": _episode_line(args.max_completion_length, args.max_turns, settings),
        "warm start": _warm_start_line(args),
        "output": args.output_dir,
    }
    if settings.get("recipe"):
        chosen = ", ".join(f"{key} {value:g}" for key, value in settings["recipe"].items())
        lines["defaults"] = f"{chosen} (the environment's run_defaults)"
    if args.gradient_checkpointing:
        lines["memory"] = "gradient checkpointing (activations recomputed in the backward pass)"
    if checkpoint:
        lines["warm start"] = "skipped (resuming)"
        lines["resume from"] = checkpoint
    print("agentgrpo run")
    for name, value in lines.items():
        if value is not None:  # an adapter line only where one trains
            print(f"  {name:<12} {value}")
    print(flush=True)


def _adapter_line(model: Any) -> str | None:
    """The LoRA adapter the run trains (`--use-peft`); None where every weight trains."""
    from agentgrpo.cli.lora import describe

    configs = getattr(model, "peft_config", None)
    return describe(configs[model.active_adapter]) if configs else None


def _warm_start_line(args: GRPOConfig) -> str:
    """How many warm-start steps, and where the warm-started model is saved."""
    from agentgrpo.training.trainer import WARM_START_DIR

    if not args.warm_start_steps:
        return "none"
    saved = Path(_output_dir(args)) / WARM_START_DIR
    return f"{args.warm_start_steps} steps" + (
        f", saved to {saved}" if args.save_warm_start else ""
    )


def _episode_line(tokens: int, turns: int | None, settings: dict[str, Any]) -> str:
    """`tokens` and `turns` per episode, and which of them the source's own limits chose."""
    line = f"up to {tokens} tokens, {turns if turns is not None else 'any number of'} turns"
    chosen = settings.get("from_environment")
    whose = settings.get("limits_of", "environment")
    return f"{line} (the {whose}'s {', '.join(chosen)})" if chosen else line
