"""Win rates on TicTacToe after GRPO: against a scripted player and against the warm start.

The warm start is `agentgrpo run env:TicTacToe`'s own: 32 steps of TicTacToe's demonstrations,
seed 0, made once by `agentgrpo run env:TicTacToe --max-steps 1` and cached (`--warm-start DIR`
reuses an earlier run's `warm_start` folder instead). Each configuration then trains from it for
`--budget-minutes` of wall-clock time per seed, in its own process (`--side-by-side`: every
seed and configuration asked for at the same time, each with `--threads` torch threads, so they
share whatever load the machine has); `bench/learn_vs_trl.py`'s clock saves the model every
`--eval-every-minutes` of training time and at the end of the budget.

Configurations (`--configs`), all with 8 trained episodes a step in groups of 4, TicTacToe's
episode limits, temperature 1, a constant `--learning-rate` (1e-5, `agentgrpo run`'s: at 5e-5
the policy's tool calls broke, docs/measurements.md), beta 0 and the DAPO loss:
- `vs-warm-start`: x is trained against the frozen warm start playing o (`"model:WARM"`).
- `vs-greedy-warm-start`: the same, the warm start playing greedily (`seat_temperatures`
  ``{"o": 0}``), as it plays in the greedy evaluation; x still samples at temperature 1.
- `vs-good`: x is trained against `environments.tictactoe:good_player` playing o.
- `self-play`: both seats are the policy, both trained.

Every save (`--last-save-only`: each run's last), and the warm start at 0 minutes, then plays
x on the first `--eval-rows` held-out rows (`agentgrpo eval`, greedy, seed 0) against each
opponent: `good` (`environments.tictactoe:good_player`) and `warm-start` (the warm start,
greedy; `--eval-temperature 1` samples both seats as training does, seed 0). The win rate is
eval's `success_rate` (x's reward reached 1.0: a win); the mean reward counts a win 1, a draw
0 and a loss, an illegal move or a forfeit -1. `--opponents` picks which of them to play.

Run: `python bench/games.py --seeds 0 1 2 --budget-minutes 30 --side-by-side`.
`--results DIR` keeps every run and evaluation (one already there is reused, not redone).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _HERE]  # bench/rollout.py

GOOD = "environments.tictactoe:good_player"
CONFIGS = {
    "vs-warm-start": "model:{warm}",
    "vs-greedy-warm-start": "model:{warm}",
    "vs-good": GOOD,
    "self-play": None,
}
GREEDY_OPPONENT = {"vs-greedy-warm-start"}  # its o samples at temperature 0 in training
OPPONENTS = {"good": GOOD, "warm-start": "model:{warm}"}


def main() -> None:
    """Parse the options; run a child, or the whole benchmark."""
    args = _parse_args()
    if args.child:
        _run_child(args)
        return
    print(f"load average at start: {_load()}", flush=True)
    results = Path(args.results)
    warm = _warm_start(results, args)
    runs = _train(warm, results, args)
    if args.train_only:
        return
    for by_config in runs.values():
        for run in by_config.values():
            run["saves"] = run["saves"][-1:] if args.last_save_only else run["saves"]
    models = [warm] + [
        s["folder"] for r in runs.values() for run in r.values() for s in run["saves"]
    ]
    jobs = [(model, opponent) for model in models for opponent in args.opponents]
    with ThreadPoolExecutor(args.eval_workers) as pool:
        scores = dict(
            zip(jobs, pool.map(lambda job: _evaluate(*job, warm, args), jobs), strict=True)
        )
    for seed, by_config in runs.items():
        _report(seed, by_config, warm, scores, args)
    print(f"load average at the end: {_load()}", flush=True)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--seeds", nargs="+", type=int, default=[0, 1, 2])
    add("--configs", nargs="+", choices=list(CONFIGS), default=["vs-warm-start", "self-play"])
    add("--budget-minutes", type=float, default=30.0, help="training time per run")
    add("--eval-every-minutes", type=float, default=10.0, help="a save every this much training")
    add("--eval-rows", type=int, default=64, help="held-out rows played per model and opponent")
    add("--learning-rate", type=float, default=1e-5)
    add("--threads", type=int, default=1, help="torch threads in each child")
    add("--side-by-side", action="store_true", help="train every seed and configuration at once")
    add("--train-only", action="store_true", help="train (or reuse) the runs; no evaluation")
    add("--last-save-only", action="store_true", help="evaluate each run's last save only")
    add("--opponents", nargs="+", choices=list(OPPONENTS), default=list(OPPONENTS))
    add(
        "--eval-temperature",
        type=float,
        default=0.0,
        help="both seats' sampling temperature in evaluation (0: greedy; 1: as in training)",
    )
    add("--eval-workers", type=int, default=2, help="evaluations run at the same time")
    add("--warm-start", help="a run's warm_start folder to start from (default: made once)")
    add("--results", default=str(Path(tempfile.gettempdir()) / "agentgrpo-games"))
    add("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    add("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add("--model-dir", help=argparse.SUPPRESS)
    add("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.budget_minutes <= 0 or args.eval_every_minutes <= 0 or args.eval_rows < 1:
        parser.error("--budget-minutes and --eval-every-minutes must be > 0, --eval-rows >= 1")
    return args


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _child_env(args: argparse.Namespace) -> dict[str, str]:
    threads = str(args.threads)
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def _warm_start(results: Path, args: argparse.Namespace) -> str:
    """The warm-started model folder: `--warm-start`, or `agentgrpo run`'s, made once."""
    target = results / "warm-start"
    if not (target / "config.json").exists():
        results.mkdir(parents=True, exist_ok=True)
        if args.warm_start:
            shutil.copytree(args.warm_start, target)
        else:
            print("warm start: agentgrpo run env:TicTacToe --max-steps 1 (once)", flush=True)
            run = results / "warm-start-run"
            command = ["agentgrpo", "run", "env:TicTacToe", "--max-steps", "1"]
            command += ["--output-dir", str(run), "--save-strategy", "no"]
            done = subprocess.run(command, capture_output=True, text=True, env=_child_env(args))
            if done.returncode != 0:
                sys.exit(f"the warm start failed:\n{done.stderr[-3000:]}")
            shutil.copytree(run / "warm_start", target)
    return str(target)


def _run_folder(seed: int, config: str, results: Path, args: argparse.Namespace) -> Path:
    return results / f"seed{seed}-{config}-{args.budget_minutes:g}min"


def _train(warm: str, results: Path, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Each seed's run records (`result.json`) by configuration; a run is made once.

    With `--side-by-side` every missing run trains at the same time, else one after the other.
    """
    started: list[tuple[subprocess.Popen, Path]] = []
    for seed in args.seeds:
        for config in args.configs:
            out = _run_folder(seed, config, results, args)
            if (out / "result.json").exists():
                continue
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            print(f"seed {seed} {config}: training {args.budget_minutes:g} min", flush=True)
            started.append((_start_child(seed, config, warm, out, args), out))
            if not args.side_by_side:
                _wait(*started[-1])
    try:
        for child, out in started:
            _wait(child, out)
    finally:  # one failed: the others would no longer be side by side
        for child, _ in started:
            child.kill()
    return {
        seed: {
            config: json.loads(
                (_run_folder(seed, config, results, args) / "result.json").read_text()
            )
            for config in args.configs
        }
        for seed in args.seeds
    }


def _start_child(
    seed: int, config: str, warm: str, out: Path, args: argparse.Namespace
) -> subprocess.Popen:
    """This script as the child that trains `config` with `seed` into `out`."""
    command = [sys.executable, os.path.realpath(__file__), "--child", config]
    command += ["--seed", str(seed), "--out", str(out), "--model-dir", warm]
    command += ["--budget-minutes", str(args.budget_minutes), "--threads", str(args.threads)]
    command += ["--eval-every-minutes", str(args.eval_every_minutes)]
    command += ["--learning-rate", str(args.learning_rate)]
    with open(out / "child.log", "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_child_env(args))


def _wait(child: subprocess.Popen, out: Path) -> None:
    if child.wait() != 0:
        log = (out / "child.log").read_text()[-4000:]
        sys.exit(f"{out.name} failed (exit {child.returncode}):\n{log}")


def _evaluate(model: str, opponent: str, warm: str, args: argparse.Namespace) -> dict[str, float]:
    """x's greedy win rate and mean reward against `opponent` on the held-out rows; cached."""
    sampled = f"-t{args.eval_temperature:g}" if args.eval_temperature else ""  # greedy: none
    cached = Path(model) / f"eval-{opponent}-{args.eval_rows}{sampled}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    players = json.dumps({"o": OPPONENTS[opponent].format(warm=warm)})
    command = ["agentgrpo", "eval", "env:TicTacToe", "--model", model, "--seat-players", players]
    command += ["--temperature", str(args.eval_temperature)]
    command += ["--num-episodes", str(args.eval_rows), "--seed", "0"]
    done = subprocess.run(command, capture_output=True, text=True, env=_child_env(args))
    figures = {
        name: re.search(rf"^{name}\s+(-?[0-9.]+)", done.stdout, re.MULTILINE)
        for name in ("success_rate", "mean_reward")
    }
    if done.returncode != 0 or None in figures.values():
        sys.exit(f"eval of {model} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    scores = {name: float(found.group(1)) for name, found in figures.items() if found}
    cached.write_text(json.dumps(scores))
    print(f"  eval {'/'.join(Path(model).parts[-2:])} vs {opponent}: {scores}", flush=True)
    return scores


def _report(
    seed: int,
    runs: dict[str, Any],
    warm: str,
    scores: dict[tuple[str, str], dict[str, float]],
    args: argparse.Namespace,
) -> None:
    """One seed's markdown table: win rate (mean reward) at each save, against each opponent."""
    how = f"T={args.eval_temperature:g}" if args.eval_temperature else "greedy"
    print(f"\nseed {seed}: x's {how} win rate (mean reward) on {args.eval_rows} held-out rows")
    print("at the warm start and each save (training minutes in brackets)")
    print("| config | steps | opponent | at each save | load |")
    print("|---|---|---|---|---|")
    for config, run in runs.items():
        points = [(0.0, warm)] + [(s["trained_s"], s["folder"]) for s in run["saves"]]
        for opponent in args.opponents:
            text = ", ".join(
                f"{scores[(m, opponent)]['success_rate']:.3f} "
                f"({scores[(m, opponent)]['mean_reward']:+.2f}) [{s / 60:.0f}]"
                for s, m in points
            )
            load = f"{run['load_start']} -> {run['load_end']}"
            print(f"| {config} | {run['steps']} | {opponent} | {text} | {load} |")


# ---------------------------------------------------------------------- children


def _run_child(args: argparse.Namespace) -> None:
    """One configuration's budgeted run; writes `result.json` in its folder."""
    load_start = _load()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentgrpo import GRPOConfig, GRPOTrainer
    from environments.tictactoe import TicTacToe

    torch.set_num_threads(args.threads)
    opponent = CONFIGS[args.child]
    config = GRPOConfig(
        output_dir=str(Path(args.out) / "output"),
        seat_players=None if opponent is None else {"o": opponent.format(warm=args.model_dir)},
        seat_temperatures={"o": 0.0} if args.child in GREEDY_OPPONENT else None,
        per_device_train_batch_size=8,  # 8 trained episodes a step in every configuration
        num_generations=4,
        **TicTacToe.episode_limits,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        max_steps=100_000,  # the budget clock stops the run
        gradient_checkpointing=False,
        use_cpu=True,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    clock = _learn_vs_trl()._budget_clock(args, tokenizer)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32),
        args=config,
        train_dataset=TicTacToe.dataset("train"),
        processing_class=tokenizer,
        environment_factory=TicTacToe,
        callbacks=[clock],
    )
    trainer.train()
    record = {
        "config": args.child,
        "steps": trainer.state.global_step,
        "saves": clock.saves,
        "load_start": load_start,
        "load_end": _load(),
        "logs": [
            {k: v for k, v in log.items() if isinstance(v, int | float)}
            for log in trainer.state.log_history
        ],
    }
    Path(args.out, "result.json").write_text(json.dumps(record))


def _learn_vs_trl() -> Any:
    """bench/learn_vs_trl.py as a module (bench/ is not a package): its budget clock."""
    spec = importlib.util.spec_from_file_location("learn_vs_trl", Path(_HERE) / "learn_vs_trl.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
