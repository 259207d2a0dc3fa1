"""The `agentgrpo` command (also `python -m agentgrpo`).

    agentgrpo run ENV [options]          train with GRPO on an environment
    agentgrpo eval ENV [--model DIR]     play held-out rows without training
    agentgrpo envs                       list the built-in and installed environments
    agentgrpo init NAME [--dir DIR]      write an installable environment package
    agentgrpo doctor [ENV] [--model M]   check a model, its template and ENV without training
    agentgrpo view RUN_DIR [--html OUT]  a web page of a run's curves and episodes
    agentgrpo vllm-serve --model M ...   start a vLLM server the trainer can push weights to

ENV is `NAME` (an installed environment package), `env:Name` (built-in), `gym:ENV_ID` (a
gymnasium id), `rg:TASK` (reasoning-gym), `vf:ENV_ID` (a verifiers environment),
`agent:file.py:function`, `package.module:Class` or `path/to/file.py:Class`. Mistakes a user
can make (an unknown environment or option, a class that breaks the contract, a missing dataset)
print one `error:` line and exit with status 2; `AGENTGRPO_DEBUG=1` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import typing
from collections.abc import Callable, Sequence

from agentgrpo.cli.lora import add_lora_options
from agentgrpo.cli.options import (
    DEVICE_HELP,
    UsageError,
    add_config_options,
    check_unknown_options,
)

_USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError)
"""Errors that mean the user's input is wrong (each of agentgrpo's user-facing errors is one)."""
ENV_ARGS_HELP = (
    "vf:ENV_ID only: the environment's config as a JSON object, as verifiers' --env.* options "
    """set it: taskset settings under "taskset", the agent's under "agent" """
    """(e.g. '{"agent": {"max_turns": 4}}')"""
)


def command() -> typing.NoReturn:
    """The `agentgrpo` command: `main()`, then exit, even if user code left threads running.

    Launched by torchrun, it also stops once its launcher is gone (`end_with_launcher`).
    """
    from agentgrpo.cli.exiting import EXIT_GRACE_S, end_with_launcher, exit_within

    end_with_launcher()
    status = 1  # an error escaping `main` (Python prints its traceback on the way out)
    try:
        status = main()
    finally:
        exit_within(EXIT_GRACE_S, status)
    sys.exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: `sys.argv[1:]`); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "vllm-serve":
        from agentgrpo.generation.vllm_serve import main as vllm_serve

        return vllm_serve(argv[1:])
    parser, commands = build_parser()
    try:
        namespace, unknown = parser.parse_known_args(argv)
        if namespace.command is None:
            parser.print_help()
            return 2
        _quiet_loading()
        check_unknown_options(unknown, commands[namespace.command])
        namespace.argv = argv  # as typed: `run` rebuilds its resume command from it
        return namespace.handler(namespace)
    except _USAGE_ERRORS + _runtime_user_errors() as error:
        if os.environ.get("AGENTGRPO_DEBUG"):
            raise
        from agentgrpo.reporting.run_log import end_progress_line

        end_progress_line()
        print(f"error: {error}", file=sys.stderr)
        for note in getattr(error, "__notes__", ()):  # e.g. a close() that failed after reset()
            print(f"  {note}", file=sys.stderr)
        return 2


class CommandParser(argparse.ArgumentParser):
    """An argparse parser whose mistakes raise `UsageError` instead of exiting.

    `main` then prints them like every other user error: one `error:` line, status 2.
    """

    def error(self, message: str) -> typing.NoReturn:
        """Raise argparse's complaint as a `UsageError`, worded as `--option takes X, not V`."""
        about_option = re.fullmatch(r"argument (\S+): (.*)", message, flags=re.DOTALL)
        if about_option and about_option[2].startswith("takes "):  # from `value_parser`
            raise UsageError(" ".join(about_option.groups()))
        if about_option:
            message = ": ".join(about_option.groups())
        raise UsageError(f"{message}; see `{self.prog} --help`")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's parser by name."""
    from agentgrpo.cli import commands as run_commands
    from agentgrpo.cli import doctor, envs_command, eval_command, init_command, view

    parser = CommandParser(
        prog="agentgrpo", description="Train LLM agents with GRPO on tool-calling episodes."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("vllm-serve", help="start a vLLM server for training (see its --help)")
    commands = {
        "run": _run_parser(sub, run_commands.run),
        "eval": _eval_parser(sub, eval_command.evaluate),
        "envs": _command(
            sub, "envs", envs_command.envs, "list the built-in and installed environments"
        ),
        "init": init_command.add_parser(sub, init_command.init),
        "doctor": doctor.add_parser(sub, doctor.doctor),
        "view": view.add_parser(sub, view.view),
    }
    return parser, commands


def _command(
    sub: argparse._SubParsersAction, name: str, handler: Callable, help_text: str
) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
    parser.set_defaults(handler=handler)
    return parser


def _run_parser(sub: argparse._SubParsersAction, handler: Callable) -> argparse.ArgumentParser:
    parser = _command(sub, "run", handler, "train with GRPO on an environment")
    parser.usage = "agentgrpo run ENV [--model M] [--config FILE.yaml] [options]"
    parser.epilog = (
        "Defaults differ from GRPOConfig's where shown: they are a CPU recipe under which the "
        "embedded 135M model learns in minutes. Without --model, the embedded model plays "
        "with the chatml_tools template and first takes 24 warm-start steps on the "
        "environment's demonstrations() (if it has any)."
    )
    from agentgrpo.cli.options import value_parser

    _add_env(parser)
    own = parser.add_argument_group("run options")
    own.add_argument("--config", metavar="FILE", help="YAML file of option: value (any below)")
    own.add_argument(
        "--model",
        default=argparse.SUPPRESS,
        help="hub id or local folder (default: the embedded SmolLM2-135M-Instruct)",
    )
    own.add_argument(
        "--dataset",
        default=argparse.SUPPRESS,
        help="task rows: a .json/.jsonl/.csv/.parquet file, a save_to_disk folder or a "
        "datasets name (default: the environment's dataset())",
    )
    own.add_argument(
        "--dataset-split", default=argparse.SUPPRESS, help="split to train on (default: train)"
    )
    own.add_argument(
        "--dataset-size",
        type=value_parser("dataset_size", int),
        default=argparse.SUPPRESS,
        metavar="N",
        help="train rows: N generated by a dataset() that takes a size (rg:TASK: default 256), "
        "else the first N",
    )
    own.add_argument(
        "--reward",
        action="append",
        default=argparse.SUPPRESS,
        metavar="MODULE:FUNCTION",
        help="a reward function, added to the environment's reward(); repeatable",
    )
    own.add_argument(
        "--env-args",
        default=argparse.SUPPRESS,
        metavar="JSON",
        help=ENV_ARGS_HELP,
    )
    own.add_argument("--device", default=argparse.SUPPRESS, metavar="DEVICE", help=DEVICE_HELP)
    own.add_argument(
        "--resume",
        action="store_true",
        default=argparse.SUPPRESS,
        help="continue the run in --output-dir from its latest intact checkpoint (a new run "
        "starts if it has none yet); --resume-from-checkpoint PATH names one instead, and "
        "without --output-dir writes beside it",
    )
    add_lora_options(parser)
    add_config_options(parser)
    return parser


def _eval_parser(sub: argparse._SubParsersAction, handler: Callable) -> argparse.ArgumentParser:
    from agentgrpo.cli.options import add_mcp_server_option, value_parser

    parser = _command(sub, "eval", handler, "play held-out rows without training")
    _add_env(parser)
    add_mcp_server_option(parser)
    add = parser.add_argument
    add("--seat-players", type=value_parser("seat_players"), help="as for `agentgrpo run`")
    add(
        "--seat-temperatures",
        type=value_parser("seat_temperatures"),
        help="as for `agentgrpo run`: a frozen seat's own temperature, e.g. '{\"o\": 0}'",
    )
    add("--model", help="hub id or local folder (default: the embedded SmolLM2-135M-Instruct)")
    add("--dataset", help="rows file or datasets name (default: the environment's dataset())")
    add("--split", default="eval", help="split of the rows to play (default: eval)")
    add(
        "--dataset-size",
        type=value_parser("dataset_size", int),
        metavar="N",
        help="rows: N generated by a dataset() that takes a size (rg:TASK: default 64 eval "
        "rows), else the first N",
    )
    add(
        "--num-episodes",
        type=value_parser("num_episodes", int),
        help="play only the first N rows (default: all)",
    )
    add("--reward", action="append", default=[], metavar="MODULE:FUNCTION", help="repeatable")
    add("--env-args", metavar="JSON", help=ENV_ARGS_HELP)
    _add_eval_episode_options(parser)
    add(
        "--success-threshold",
        type=value_parser("success_threshold", float),
        default=1.0,
        help="reward that counts as a success",
    )
    add("--seed", type=value_parser("seed", int), default=0, help="sampling seed")
    add("--device", metavar="DEVICE", help=DEVICE_HELP)
    add("--episodes-file", metavar="FILE", help="also write every episode as text to FILE")
    add(
        "--server-url",
        metavar="URL",
        help="generate with this OpenAI-compatible server (e.g. `agentgrpo vllm-serve`, "
        "http://localhost:8000) instead of loading the model here; --model still names the "
        "tokenizer",
    )
    add(
        "--server-timeout",
        type=value_parser("server_timeout", float),
        default=240.0,
        help="seconds to wait for the server",
    )
    return parser


def _add_eval_episode_options(parser: argparse.ArgumentParser) -> None:
    """`eval`'s sampling and episode options, with training's defaults."""
    from agentgrpo.cli.options import (
        EVAL_EPISODE_FIELDS,
        RUN_DEFAULTS,
        config_fields,
        option_name,
        value_parser,
    )

    add = parser.add_argument
    add(
        "--temperature",
        type=value_parser("temperature", float),
        default=1.0,
        help="sampling temperature; 1.0, the default, is training's, so the success rate is "
        "that of the policy GRPO trains; 0 is greedy",
    )
    for name in EVAL_EPISODE_FIELDS:
        default = config_fields()[name].default
        help_text = config_fields()[name].metadata["help"].replace("%", "%%")
        add(
            option_name(name),
            dest=name,
            type=value_parser(name),
            default=default,
            help=f"{help_text} (default: {default}, as in training)",
        )
    add(
        "--max-turns",
        type=value_parser("max_turns", int),
        help="model turns (default: the environment's episode_limits, else "
        f"{RUN_DEFAULTS['max_turns']}, as in training)",
    )
    add(
        "--max-completion-length",
        type=value_parser("max_completion_length", int),
        help="tokens per episode, tool turns included (default: the environment's "
        f"episode_limits, else {RUN_DEFAULTS['max_completion_length']}, as in training)",
    )
    add("--chat-template", help="template name or jinja (default: the model's own)")
    add("--tool-call-parser", help="hermes or llama3_json (default: detected)")


def _add_env(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "env",
        metavar="ENV",
        help="NAME (an installed environment package), env:Name, gym:ENV_ID, rg:TASK, "
        "vf:ENV_ID, agent:file.py:function, package.module:Class or path/to/file.py:Class",
    )


def _quiet_loading() -> None:
    """Hide transformers' per-file loading and saving bars: the run has its own progress bar."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def _runtime_user_errors() -> tuple[type[BaseException], ...]:
    """Errors raised mid-run that a user's environment, reward function or server caused."""
    from agentgrpo.doctor import SetupCheckError
    from agentgrpo.rewards.calls import RewardFunctionError
    from agentgrpo.run_folder import OutputDirBusy, OutputDirUnwritable
    from environments import (
        EnvironmentCloseError,
        EnvironmentDoneError,
        EnvironmentInitError,
        EnvironmentResetError,
        EnvironmentRewardError,
        EnvironmentTimeoutError,
    )
    from rollout import TemplateDriftError
    from rollout.agents import AgentError
    from tools import StuckCallsError

    return (
        ConnectionError,  # a generation server that does not answer, or went away
        UsageError,
        RewardFunctionError,
        EnvironmentInitError,
        EnvironmentResetError,
        EnvironmentRewardError,
        EnvironmentCloseError,
        EnvironmentDoneError,
        EnvironmentTimeoutError,  # the user's environment code ignores environment_timeout_s
        StuckCallsError,  # the user's tools ignore their timeout
        TemplateDriftError,
        SetupCheckError,  # a start-up check of the template, parser or stop tokens failed
        AgentError,  # an agent used wrongly (it never asked the model, or returned no reward)
        OutputDirBusy,  # another run writes to --output-dir
        OutputDirUnwritable,  # --output-dir is full, read-only or not ours to write
    )
