"""The whole default run, `agentgrpo run env:Counter`, with transformers and with `--use-vllm`.

Each run is its own process, timed from the outside: wall seconds from start to exit (model
load, the 24 warm-start steps, vLLM's start-up, 16 GRPO steps with their weight pushes, the
checkpoints and the final save) and its peak resident memory (`ru_maxrss` of the child). The
two generators alternate, transformers first on even repeats, vLLM first on odd ones, so a
drift in the machine's load falls on both. Printed: each run, then per generator the median
wall time, the median "train time" the run reports (the GRPO steps alone), the median peak
memory, and the ratios vLLM / transformers with the load average before and after.

Run: `python bench/cli_run.py` (about 20 minutes on 2 idle cores with the default 2 repeats).
Options: `--repeats`, `--max-steps` (default: the run's own 16), `--env`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

GENERATORS = {"transformers": [], "vllm": ["--use-vllm"]}


def main() -> None:
    args = _parser().parse_args()
    print(f"load average {_load()} (1/5/15 min); {os.cpu_count()} cores; env {args.env}")
    runs: dict[str, list[dict]] = {name: [] for name in GENERATORS}
    for repeat in range(args.repeats):
        order = list(GENERATORS) if repeat % 2 == 0 else list(reversed(GENERATORS))
        for name in order:
            run = _run(args, GENERATORS[name])
            runs[name].append(run)
            print(f"  {name:12} repeat {repeat}: {_describe(run)}", flush=True)
    _report(runs)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="env:Counter", help="the ENV argument of the runs")
    parser.add_argument("--repeats", type=int, default=2, help="runs per generator")
    parser.add_argument("--max-steps", type=int, help="GRPO steps (default: the run's own)")
    return parser


def _run(args: argparse.Namespace, extra: list[str]) -> dict:
    """One `agentgrpo run` in a child process: wall s, train s, peak RSS MiB, load."""
    steps = ["--max-steps", str(args.max_steps)] if args.max_steps else []
    with tempfile.TemporaryDirectory(prefix="agentgrpo-cli-bench-") as folder:
        command = [sys.executable, "-m", "agentgrpo", "run", args.env, "--output-dir", folder]
        command += steps + extra
        load_start, start = _load(), time.perf_counter()
        with open(os.path.join(folder, "output.txt"), "w+") as output:
            child = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(child.pid, 0)  # this child's own peak memory
            wall_s = time.perf_counter() - start
            output.seek(0)
            printed = output.read()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(command)} failed:\n{printed[-3000:]}")
    return {
        "wall_s": wall_s,
        "train_s": _train_seconds(printed),
        "rss_mib": usage.ru_maxrss / 1024,
        "load": f"{load_start} -> {_load()}",
    }


def _train_seconds(output: str) -> float:
    """The run's own train time (its GRPO steps): "42.3 s", "3m 41s" or "1h 02m 05s"."""
    found = re.findall(r"train time (?:(\d+)h )?(?:(\d+)m )?([\d.]+) ?s", output)
    if not found:
        sys.exit("the run printed no 'train time': has its summary changed?")
    hours, minutes, seconds = found[-1]
    return 3600 * int(hours or 0) + 60 * int(minutes or 0) + float(seconds)


def _describe(run: dict) -> str:
    return (
        f"wall {run['wall_s']:.0f} s, train {run['train_s']:.0f} s, "
        f"peak RSS {run['rss_mib']:.0f} MiB, load {run['load']}"
    )


def _report(runs: dict[str, list[dict]]) -> None:
    keys = ("wall_s", "train_s", "rss_mib")
    medians = {
        name: {key: statistics.median(r[key] for r in rs) for key in keys}
        for name, rs in runs.items()
    }
    print("\n| generator | wall s | train s | peak RSS MiB |  (medians)\n|---|---|---|---|")
    for name, m in medians.items():
        print(f"| {name} | {m['wall_s']:.0f} | {m['train_s']:.0f} | {m['rss_mib']:.0f} |")
    for key, what in (("wall_s", "wall"), ("train_s", "train"), ("rss_mib", "peak memory")):
        ratio = medians["vllm"][key] / medians["transformers"][key]
        print(f"vLLM / transformers, {what}: {ratio:.2f}")
    print(f"load average at the end {_load()}")


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
