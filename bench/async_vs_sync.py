"""Asynchronous against synchronous GRPO: the same `agentgrpo run`, with and without `--async`.

For each workload (`env:Chain`, and `bench/slow_chain.py:SlowChain`, Chain with tools that take
about 1 s) and each training seed, the run is made twice, in alternating order (sync first on
even seeds, async first on odd ones, so a drift in the machine's load falls on both). Each run
is its own process. Measured: episodes trained per second of the run's own train time (the GRPO
steps alone: the episode record's lines over the "train time" the run prints), and, with
`--eval`, the held-out success of `agentgrpo eval env:Chain` on the trained model. Printed: each
run, then per workload the median episodes per second of each mode and their ratio (async /
sync), and the eval success of each mode over the seeds (mean and range) with the load average.

Both modes use the transformers backend here: the generator is a thread of the training
process (see docs/async.md for what that overlaps on one machine).

Run: `python bench/async_vs_sync.py` (16 steps, seed 0, both workloads); `--max-steps`,
`--seeds 0 1 2`, `--workloads`, `--eval`, `--warm-start-steps`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOADS = {
    "chain": ["env:Chain"],
    "slow-tools": ["bench/slow_chain.py:SlowChain"],
    # The tiny random Llama (tests/tiny_model.py), which never calls a tool, on Counter with a
    # reward that takes 1 s: minutes instead of hours on a loaded CPU; no eval.
    "tiny-slow-reward": [
        "env:Counter", "--reward", "bench.slow_chain:slow_reward", "--warm-start-steps", "0",
        "--chat-template", "chatml_tools", "--max-completion-length", "24",
    ],
}  # fmt: skip
MODES = {"sync": [], "async": ["--async"]}


def main() -> None:
    args = _parser().parse_args()
    print(f"load average {_load()} (1/5/15 min); {os.cpu_count()} cores", flush=True)
    for workload in args.workloads:
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for seed in args.seeds:
            order = list(MODES) if seed % 2 == 0 else list(reversed(MODES))
            for mode in order:
                run = _run(WORKLOADS[workload], MODES[mode], seed, args)
                runs[mode].append(run)
                print(f"  {workload:10} {mode:5} seed {seed}: {_describe(run)}", flush=True)
        _report(workload, runs)
    print(f"load average at the end {_load()}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="training seeds")
    parser.add_argument("--max-steps", type=int, default=16, help="GRPO steps of each run")
    parser.add_argument("--eval", action="store_true", help="evaluate each trained model")
    parser.add_argument("--warm-start-steps", type=int, help="default: the run's own")
    return parser


def _run(env: list[str], extra: list[str], seed: int, args: argparse.Namespace) -> dict:
    """One `agentgrpo run` (and its eval) in child processes."""
    with tempfile.TemporaryDirectory(prefix="agentgrpo-async-bench-") as folder:
        command = [sys.executable, "-m", "agentgrpo", "run", *env, "--output-dir", folder]
        if "env:Counter" in env:
            command += ["--model", _tiny_model(folder)]
        command += ["--max-steps", str(args.max_steps), "--seed", str(seed), *extra]
        if args.warm_start_steps is not None:
            command += ["--warm-start-steps", str(args.warm_start_steps)]
        load = _load()
        printed = _child(command)
        run = {"train_s": _train_seconds(printed), "episodes": _episodes(folder), "load": load}
        run["episodes_per_s"] = run["episodes"] / run["train_s"]
        if args.eval:
            evaluated = _child(
                [sys.executable, "-m", "agentgrpo", "eval", "env:Chain"]
                + ["--model", folder, "--seed", str(seed)]
            )
            run["success"] = float(_figures(evaluated)["success_rate"])
    return run


def _tiny_model(folder: str) -> str:
    """The tiny Llama with the default model's tokenizer, saved under `folder`."""
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root), str(root / "tests")]
    from tiny_model import tiny_llama  # the tests' model: a config, no download
    from transformers import AutoTokenizer

    from agentgrpo.default_model import default_model_path

    path = Path(folder) / "tiny-model"
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    tiny_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _child(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout + done.stderr


def _train_seconds(output: str) -> float:
    """The run's own train time (its GRPO steps): "42.3 s", "3m 41s" or "1h 02m 05s"."""
    found = re.findall(r"train time (?:(\d+)h )?(?:(\d+)m )?([\d.]+) ?s", output)
    if not found:
        sys.exit("the run printed no 'train time': has its summary changed?")
    hours, minutes, seconds = found[-1]
    return 3600 * int(hours or 0) + 60 * int(minutes or 0) + float(seconds)


def _episodes(folder: str) -> int:
    """Episodes trained on: the lines of the run's episode record (one per trained episode)."""
    files = sorted((Path(folder) / "episodes").glob("step-*.jsonl"))
    return sum(len(path.read_text().splitlines()) for path in files)


def _figures(output: str) -> dict[str, str]:
    """`agentgrpo eval`'s printed `name value` lines."""
    return dict(line.split() for line in output.splitlines() if len(line.split()) == 2)


def _describe(run: dict) -> str:
    text = (
        f"{run['episodes']} episodes in {run['train_s']:.0f} s = "
        f"{run['episodes_per_s']:.2f} episodes/s (load {run['load']})"
    )
    return text + (f", eval success {run['success']:.3f}" if "success" in run else "")


def _report(workload: str, runs: dict[str, list[dict]]) -> None:
    rates = {mode: statistics.median(r["episodes_per_s"] for r in rs) for mode, rs in runs.items()}
    print(
        f"{workload}: episodes/s sync {rates['sync']:.3f}, async {rates['async']:.3f}, "
        f"ratio async/sync {rates['async'] / rates['sync']:.2f}"
    )
    if all("success" in r for rs in runs.values() for r in rs):
        for mode, rs in runs.items():
            success = [r["success"] for r in rs]
            print(
                f"{workload}: eval success {mode} mean {statistics.mean(success):.3f} "
                f"range {min(success):.3f}-{max(success):.3f} over {len(rs)} seed(s)"
            )


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
