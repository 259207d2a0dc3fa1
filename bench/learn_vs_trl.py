"""Held-out success per hour of training: agentgrpo against TRL 1.16, on the same task.

One environment class goes through TRL's `GRPOTrainer(environment_factory=...)` and through
agentgrpo's with only the import changed (plus the two fields TRL has no name for:
`chat_template` and `tool_call_parser`; TRL gets the same template on its tokenizer). Both start
from the same folder: the environment's supervised warm start (`warm_start_steps` of its
`demonstrations()`, agentgrpo's warm start, seed 0), made once per environment and cached. Each
trainer then trains for `--budget-minutes` of wall-clock time, in its own process: one after the
other, or, with `--side-by-side`, a seed's configurations at the same time, so that they share
whatever load the machine has (each child keeps `--threads` torch threads). A callback saves the
model every `--eval-every-minutes` of training time and at the end of the budget; the saves (and
the start-up before the first step) are not counted. Once every seed has trained, every saved
model (and the warm start, at 0 minutes) is played on the same first `--eval-rows` held-out rows
by the same evaluator, `agentgrpo eval` with greedy decoding (`--eval-workers` at a time).

Printed per environment and seed: held-out success at each mark for each configuration, the
training time each needs to reach TRL's final success (its first save at or above it), and the
ratio to TRL's. The load average at each child's start and end is printed with the results:
the runs share the machine's cores with whatever else runs there.

The class both trainers get is `trl_contract(Counter)` / `trl_contract(Chain)`: TRL passes the
whole row to `reset` and exposes every public method but `reset` and `get_reward` as a tool, so
the class takes `reset(**row)`, scores itself with `get_reward` and hides `reward` (the tools,
rows and rewards are the environment's own). Its `reset` adds no text to the prompt, so both
trainers render the same prompts (TRL appends an observation with no separator, agentgrpo on
a new line; Counter's observation, "The counter is at 0.", carries nothing).

Run: `python bench/learn_vs_trl.py --envs counter --seeds 0 --budget-minutes 8`; `--configs`
picks among trl, agentgrpo, agentgrpo+options (dynamic_sampling, curriculum and async_grpo on).
`--results DIR` keeps every run (a run or an eval already there is reused, not redone).
TRL is needed only here: `pip install --no-deps trl==1.16.0`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any

# `python bench/learn_vs_trl.py` puts bench/ first on the path, where bench/rollout.py would
# shadow the `rollout` package agentgrpo imports.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _HERE]

from environments import Chain, Counter  # noqa: E402

TEMPLATE = "chatml_tools"
CONFIGS: dict[str, dict[str, bool]] = {
    "trl": {},
    "agentgrpo": {},
    "agentgrpo+options": {"dynamic_sampling": True, "curriculum": True, "async_grpo": True},
}


def trl_contract(base: type) -> type:
    """A subclass of `base` that TRL 1.16's `environment_factory` accepts as it is.

    `reset(**row)` passes `base.reset` only the columns it names and returns None (no prompt
    text); `get_reward()` is `base.reward()`; `reward` becomes None, so neither trainer offers it
    as a tool. Tools, `dataset()` and `demonstrations()` are the base class's.
    """
    wanted = inspect.signature(base.reset).parameters

    def reset(self: Any, **row: Any) -> None:
        base.reset(self, **{k: v for k, v in row.items() if k in wanted})

    def get_reward(self: Any) -> float:
        return base.reward(self)

    reset.__doc__ = base.reset.__doc__
    get_reward.__doc__ = base.reward.__doc__
    members = {"reset": reset, "get_reward": get_reward, "reward": None, "__doc__": base.__doc__}
    return type(f"Trl{base.__name__}", (base,), {**members, "__module__": __name__})


TrlCounter = trl_contract(Counter)
TrlChain = trl_contract(Chain)


@dataclass(frozen=True)
class Setup:
    """One environment's workload, the same for every trainer."""

    environment: type  # the trl_contract class both trainers get
    source: str  # what `agentgrpo eval` loads
    tool_rounds: int  # max_tool_calling_iterations (agentgrpo: max_turns = rounds + 1)
    max_completion_length: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int  # one optimizer step per per_device x this episodes
    learning_rate: float
    warm_start_steps: int


SETUPS = {
    # docs/measurements.md and /work/shared/MODELS.md: the CPU recipe that learns Counter.
    "counter": Setup(TrlCounter, f"{__file__}:TrlCounter", 1, 64, 8, 1, 5e-5, 24),
    # Chain's own episode_limits and run_defaults (environments/chain.py): 16 episodes a step,
    # learned 4 at a time. Side by side the peaks were then 5.8 (agentgrpo), 7.0 (with the
    # options) and 11.2 GB (TRL); learned 16 at once, 11, 12 and 16.5 GB, killed on 24 GB.
    "chain": Setup(TrlChain, f"{__file__}:TrlChain", 4, 224, 4, 4, 3e-5, 96),
}


def main() -> None:
    """Parse the options; run a child, or the whole benchmark."""
    args = _parse_args()
    if args.child:
        _run_child(args)
        return
    print(f"load average at start: {_load()}", flush=True)
    results = Path(args.results)
    for env in args.envs:
        model_dir = _warm_start(env, results, args)
        runs = {seed: _train_seed(env, seed, model_dir, results, args) for seed in args.seeds}
        folders = [model_dir] + [
            save["folder"]
            for by_config in runs.values()
            for run in by_config.values()
            for save in run["saves"]
        ]
        with ThreadPoolExecutor(args.eval_workers) as pool:
            scores = pool.map(_evaluate, folders, repeat(env), repeat(args))
            success = dict(zip(folders, scores, strict=True))
        for seed, by_config in runs.items():
            curves = {
                config: [(0.0, success[model_dir])]
                + [(save["trained_s"], success[save["folder"]]) for save in run["saves"]]
                for config, run in by_config.items()
            }
            _report(env, seed, by_config, curves, args)
    print(f"load average at the end: {_load()}", flush=True)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--envs", nargs="+", choices=sorted(SETUPS), default=sorted(SETUPS))
    add("--seeds", nargs="+", type=int, default=[0, 1, 2])
    add("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    add("--budget-minutes", type=float, default=10.0, help="training time per run")
    add("--eval-every-minutes", type=float, default=2.5, help="a save every this much training")
    add("--eval-rows", type=int, default=32, help="held-out rows played per saved model")
    add("--threads", type=int, default=1, help="torch threads in each child")
    add(
        "--side-by-side",
        action="store_true",
        help="train a seed's configurations at the same time (they share the machine's load)",
    )
    add("--eval-workers", type=int, default=1, help="evaluations run at the same time")
    add("--model", help="the model to warm-start (default: the embedded SmolLM2-135M-Instruct)")
    add("--results", default=str(Path(tempfile.gettempdir()) / "agentgrpo-learn-vs-trl"))
    add("--child", choices=("warm-start", *CONFIGS), help=argparse.SUPPRESS)
    add("--env", help=argparse.SUPPRESS)
    add("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add("--model-dir", help=argparse.SUPPRESS)
    add("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.budget_minutes <= 0 or args.eval_every_minutes <= 0 or args.eval_rows < 1:
        parser.error("--budget-minutes and --eval-every-minutes must be > 0, --eval-rows >= 1")
    if args.eval_workers < 1:
        parser.error("--eval-workers must be >= 1")
    if "trl" not in args.configs and not args.child:
        parser.error("--configs must include trl: every figure is relative to TRL's run")
    if importlib.util.find_spec("trl") is None:
        parser.error("TRL is not installed: pip install --no-deps trl==1.16.0 (bench only)")
    return args


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _call_child(args: argparse.Namespace, command: list[str], log: Path) -> None:
    """Run this script as a child with `args.threads` threads; exit with its log on failure."""
    _wait_child(_start_child(args, command, log), command, log)


def _start_child(args: argparse.Namespace, command: list[str], log: Path) -> subprocess.Popen:
    """Start this script as a child with `args.threads` threads, its output to `log`."""
    env = dict(os.environ)
    env |= {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    env |= {"TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command += ["--threads", str(args.threads)]
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, os.path.realpath(__file__), *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _wait_child(child: subprocess.Popen, command: list[str], log: Path) -> None:
    """Wait for a started child; exit with its log on failure."""
    if child.wait() != 0:
        sys.exit(f"child {command[1]} failed (exit {child.returncode}):\n{log.read_text()[-4000:]}")


def _warm_start(env: str, results: Path, args: argparse.Namespace) -> str:
    """The environment's warm-started model folder, made once (seed 0) and reused."""
    target = results / f"{env}-warm-start"
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        print(f"{env}: warm start, {SETUPS[env].warm_start_steps} steps (once)", flush=True)
        started = time.perf_counter()
        command = ["--child", "warm-start", "--env", env, "--out", str(target)]
        command += ["--model", args.model] if args.model else []
        _call_child(args, command, results / f"{env}-warm-start.log")
        print(f"{env}: warm start done in {time.perf_counter() - started:.0f} s", flush=True)
    return str(target)


def _train_seed(
    env: str, seed: int, model_dir: str, results: Path, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Each configuration's run record (`result.json`) for one seed; a run is made once.

    With `--side-by-side` the seed's missing runs train at the same time, else one after the
    other.
    """
    started: list[tuple[subprocess.Popen, list[str], Path]] = []
    for config in args.configs:
        out = _run_folder(env, seed, config, results, args)
        if (out / "result.json").exists():
            continue
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        print(f"{env} seed {seed} {config}: training {args.budget_minutes:g} min", flush=True)
        command = ["--child", config, "--env", env, "--seed", str(seed), "--out", str(out)]
        command += ["--budget-minutes", str(args.budget_minutes)]
        command += ["--eval-every-minutes", str(args.eval_every_minutes)]
        command += ["--model-dir", model_dir]
        started.append((_start_child(args, command, out / "child.log"), command, out / "child.log"))
        if not args.side_by_side:
            _wait_child(*started[-1])
    try:
        for child in started:
            _wait_child(*child)
    finally:  # one failed: the others' figures would not be side by side any more
        for child, _, _ in started:
            child.kill()
    return {config: _run_record(env, seed, config, results, args) for config in args.configs}


def _run_folder(env: str, seed: int, config: str, results: Path, args: argparse.Namespace) -> Path:
    return results / f"{env}-seed{seed}-{config}-{args.budget_minutes:g}min"


def _run_record(
    env: str, seed: int, config: str, results: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """A finished run's record, its summary printed."""
    run = json.loads((_run_folder(env, seed, config, results, args) / "result.json").read_text())
    print(
        f"  seed {seed} {config}: {run['steps']} steps, {len(run['saves'])} saves, built in "
        f"{run['build_s']:.0f} s, {run.get('train_cpu_s', 0) / 60:.1f} CPU min training; "
        f"load {run['load_start']} -> {run['load_end']}",
        flush=True,
    )
    return run


def _evaluate(model_dir: str, env: str, args: argparse.Namespace) -> float:
    """Greedy held-out success of a saved model on the first `--eval-rows` rows; cached."""
    cached = Path(model_dir) / f"eval-{args.eval_rows}.json"
    if cached.exists():
        return float(json.loads(cached.read_text())["success_rate"])
    setup = SETUPS[env]
    command = ["agentgrpo", "eval", setup.source, "--model", model_dir, "--temperature", "0"]
    command += ["--num-episodes", str(args.eval_rows), "--seed", "0"]
    command += ["--max-turns", str(setup.tool_rounds + 1), "--chat-template", TEMPLATE]
    command += ["--max-completion-length", str(setup.max_completion_length)]
    command += ["--tool-call-parser", "hermes"]
    env_vars = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env_vars)
    found = re.search(r"^success_rate\s+([0-9.]+)", done.stdout, re.MULTILINE)
    if done.returncode != 0 or found is None:
        sys.exit(f"eval of {model_dir} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    success = float(found.group(1))
    cached.write_text(json.dumps({"success_rate": success, "stdout": done.stdout}))
    name = "/".join(Path(model_dir).parts[-2:])
    print(f"  eval {name}: success {success:.3f}", flush=True)
    return success


def _reach_s(curve: list[tuple[float, float]], goal: float) -> float | None:
    """Training seconds of the first point at or above `goal`; None if none reaches it."""
    return next((seconds for seconds, success in curve if success >= goal), None)


def _report(
    env: str,
    seed: int,
    runs: dict[str, dict[str, Any]],
    curves: dict[str, list[tuple[float, float]]],
    args: argparse.Namespace,
) -> None:
    """The markdown table of one environment and seed."""
    goal = curves["trl"][-1][1]
    trl_s = _reach_s(curves["trl"], goal)
    print(f"\n{env}, seed {seed}: held-out success (greedy, {args.eval_rows} eval rows)")
    print(f"at each save (training minutes in brackets); goal = TRL's final success {goal:.3f}")
    print("| config | steps | success at each save | time to goal | ratio to TRL | load |")
    print("|---|---|---|---|---|---|")
    for config, curve in curves.items():
        points = ", ".join(f"{success:.3f} [{seconds / 60:.1f}]" for seconds, success in curve)
        reach = _reach_s(curve, goal)
        reach_text = "not reached" if reach is None else f"{reach / 60:.1f} min"
        ratio = "-" if reach is None or not trl_s else f"{reach / trl_s:.2f}"
        run = runs[config]
        load = f"{run['load_start']} -> {run['load_end']}"
        print(f"| {config} | {run['steps']} | {points} | {reach_text} | {ratio} | {load} |")


# ---------------------------------------------------------------------- children


def _run_child(args: argparse.Namespace) -> None:
    """The warm start, or one trainer's budgeted run; writes its folder."""
    load_start = _load()
    import torch

    torch.set_num_threads(args.threads)
    if args.child == "warm-start":
        _warm_start_child(args)
        return
    started = time.perf_counter()
    trainer, clock = _build(args)
    build_s = time.perf_counter() - started
    cpu_before = time.process_time()
    trainer.train()
    record = {
        "config": args.child,
        "steps": trainer.state.global_step,
        "saves": clock.saves,
        "build_s": build_s,
        "train_cpu_s": time.process_time() - cpu_before,  # all its threads, saves included
        "load_start": load_start,
        "load_end": _load(),
        "logs": [
            {k: v for k, v in log.items() if isinstance(v, int | float)}
            for log in trainer.state.log_history
        ],
    }
    Path(args.out, "result.json").write_text(json.dumps(record))


def _common(setup: Setup, seed: int, output_dir: str) -> dict[str, Any]:
    """The GRPOConfig fields both trainers take, with the same meaning."""
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": setup.per_device_train_batch_size,
        "gradient_accumulation_steps": setup.gradient_accumulation_steps,
        "num_generations": 4,
        "max_completion_length": setup.max_completion_length,
        "max_tool_calling_iterations": setup.tool_rounds,
        "temperature": 1.0,
        "beta": 0.0,
        "loss_type": "dapo",
        "learning_rate": setup.learning_rate,
        "lr_scheduler_type": "constant",
        "max_steps": 100_000,  # the budget callback stops the run
        "gradient_checkpointing": False,
        "bf16": False,
        "use_cpu": True,
        "seed": seed,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


def _build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The trainer of one configuration, and its budget clock."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.template_source import load_template

    setup = SETUPS[args.env]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    common = _common(setup, args.seed, str(Path(args.out) / "output"))
    if args.child == "trl":
        from trl import GRPOConfig, GRPOTrainer

        tokenizer.chat_template = load_template(tokenizer, TEMPLATE)
        tokenizer.response_template = _step_bench().RESPONSE_TEMPLATE  # TRL parses calls with it
        config = GRPOConfig(**common)
    else:
        from agentgrpo import GRPOConfig, GRPOTrainer

        extra = {"chat_template": TEMPLATE, "tool_call_parser": "hermes"}
        config = GRPOConfig(**common, **extra, **CONFIGS[args.child])
    clock = _budget_clock(args, tokenizer)
    trainer = GRPOTrainer(
        model=model,
        args=config,
        train_dataset=setup.environment.dataset(),
        processing_class=tokenizer,
        environment_factory=setup.environment,
        callbacks=[clock],
    )
    return trainer, clock


def _budget_clock(args: argparse.Namespace, tokenizer: Any) -> Any:
    """A callback that saves the model at each mark of training time and stops at the budget.

    Training time runs from the first step's start; each save's own time is taken out of it.
    A save happens at the first step end at or past its mark, so marks are approximate (a step
    is 10-60 s here); each save records the training seconds it was made at.
    """
    from transformers import TrainerCallback

    budget_s, every_s = args.budget_minutes * 60, args.eval_every_minutes * 60

    class BudgetClock(TrainerCallback):
        def __init__(self) -> None:
            self.saves: list[dict[str, Any]] = []
            self.started = self.paused = 0.0
            self.next_mark = every_s

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            trained_s = time.perf_counter() - self.started - self.paused
            if trained_s < min(self.next_mark, budget_s):
                return
            paused = time.perf_counter()
            folder = Path(args.out) / f"save-{len(self.saves) + 1}"
            kwargs["model"].save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            self.saves.append(
                {"folder": str(folder), "trained_s": trained_s, "step": state.global_step}
            )
            print(f"saved {folder.name} at {trained_s:.0f} s, step {state.global_step}", flush=True)
            while self.next_mark <= trained_s:
                self.next_mark += every_s
            self.paused += time.perf_counter() - paused
            control.should_training_stop = trained_s >= budget_s

    return BudgetClock()


def _warm_start_child(args: argparse.Namespace) -> None:
    """agentgrpo's warm start on the base environment's demonstrations, saved to `--out`."""
    from transformers import TrainerCallback

    from agentgrpo import GRPOConfig, GRPOTrainer
    from agentgrpo.models.default_model import default_model_path

    setup = SETUPS[args.env]
    base = setup.environment.__mro__[1]  # the environment's own class: its own demonstrations
    model = args.model or str(default_model_path())

    class _Stop(Exception):
        pass

    class StopBeforeGRPO(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            raise _Stop  # the warm start is done and saved; no GRPO step

    with tempfile.TemporaryDirectory(prefix="learn-vs-trl-") as tmp:
        common = _common(setup, 0, tmp) | {"max_steps": 1}
        config = GRPOConfig(
            **common,
            chat_template=TEMPLATE,
            tool_call_parser="hermes",
            warm_start_steps=setup.warm_start_steps,
            save_warm_start=True,
        )
        trainer = GRPOTrainer(
            model=model, args=config, environment_factory=base, callbacks=[StopBeforeGRPO()]
        )
        with contextlib.suppress(_Stop):
            trainer.train()
        shutil.copytree(Path(tmp) / "warm_start", args.out)


def _step_bench() -> Any:
    """bench/step.py as a module (bench/ is not a package): its `chatml_tools` response template."""
    spec = importlib.util.spec_from_file_location("bench_step", Path(_HERE) / "step.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
