"""Asynchronous against synchronous GRPO: the same `agentgrpo run`, with and without `--async`.

For each workload (`env:Chain`, and `bench/slow_chain.py:SlowChain`, Chain with tools that take
about 1 s) and each training seed, the run is made twice, in alternating order (sync first on
even seeds, async first on odd ones, so a drift in the machine's load falls on both). Each run
is its own process. Measured: episodes trained per second of the run's own train time (the GRPO
steps alone: the episode record's lines over the "train time" the run prints), and, with
`--eval`, the held-out success of `agentgrpo eval env:Chain` on the trained model. Printed: each
run, then per workload the median episodes per second of each mode and their ratio (async /
sync), and the eval success of each mode over the seeds (mean and range) with the load average.

Both modes of a seed start from the same warm start: the first run's (`output_dir/warm_start`)
is kept, and the second run trains it with `--warm-start-steps 0`. With `--results DIR`, each
run's figures (`DIR/<workload>-<mode>-seed<seed>.json`, its metrics.jsonl beside them) and each
seed's warm start stay there, and a run already recorded there (with its eval, under `--eval`)
is reported, not run again: a set of runs too long for one sitting is finished in several.

By default both modes use the transformers backend: the generator is a thread of the training
process. With `--server`, both generate with one `agentgrpo vllm-serve` of the run's model,
started once and pinned to core 0, while each run (its learner) is pinned to core 1, both with
one thread: the layout of docs/async.md. Each run's first push replaces the served weights.

Run: `python bench/async_vs_sync.py` (16 steps, seed 0, both workloads); `--max-steps`,
`--seeds 0 1 2`, `--workloads`, `--eval`, `--warm-start-steps`, `--server`, `--results`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

WORKLOADS = {
    "chain": ["env:Chain"],
    "slow-tools": ["bench/slow_chain.py:SlowChain"],
    # The tiny random Llama (tests/support/tiny_model.py), which never calls a tool, on Counter with
    # a reward that takes 1 s: minutes instead of hours on a loaded CPU; no eval.
    "tiny-slow-reward": [
        "env:Counter", "--reward", "bench.slow_chain:slow_reward", "--warm-start-steps", "0",
        "--chat-template", "chatml_tools", "--max-completion-length", "24",
    ],
}  # fmt: skip
MODES = {"sync": [], "async": ["--async"]}
SERVER_CORE, LEARNER_CORE = "0", "1"
SERVER_START_S = 600


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.server and "tiny-slow-reward" in args.workloads:
        parser.error(
            "--server serves the default model and tiny-slow-reward trains the tiny one: "
            "pass --workloads chain slow-tools"
        )
    print(f"load average {_load()} (1/5/15 min); {os.cpu_count()} cores", flush=True)
    with _served() if args.server else contextlib.nullcontext() as server:
        args.generator = server or []
        _compare(args)
    print(f"load average at the end {_load()}")


def _compare(args: argparse.Namespace) -> None:
    for workload in args.workloads:
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for seed in args.seeds:
            order = list(MODES) if seed % 2 == 0 else list(reversed(MODES))
            with _kept(args.results) as kept:
                for mode in order:
                    recorded = kept / f"{workload}-{mode}-seed{seed}.json"
                    run = json.loads(recorded.read_text()) if recorded.is_file() else {}
                    if run and ("success" in run or not args.eval):
                        source = f" ({recorded})"
                    else:
                        run = _run(workload, mode, seed, kept, args)
                        source = ""
                        recorded.write_text(json.dumps(run))
                    runs[mode].append(run)
                    print(
                        f"  {workload:10} {mode:5} seed {seed}: {_describe(run)}{source}",
                        flush=True,
                    )
        _report(workload, runs)


@contextlib.contextmanager
def _kept(results: Path | None) -> Iterator[Path]:
    """`results` (made if missing), or a temporary folder for one seed's warm start and runs."""
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        yield results
        return
    with tempfile.TemporaryDirectory(prefix="agentgrpo-async-bench-seed-") as folder:
        yield Path(folder)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="training seeds")
    parser.add_argument("--max-steps", type=int, default=16, help="GRPO steps of each run")
    parser.add_argument("--eval", action="store_true", help="evaluate each trained model")
    parser.add_argument("--warm-start-steps", type=int, help="default: the run's own")
    parser.add_argument(
        "--server", action="store_true", help="generate with a vLLM server on its own core"
    )
    parser.add_argument(
        "--results", type=Path, help="keep each run's figures and warm start here; reuse them"
    )
    return parser


@contextlib.contextmanager
def _served() -> Iterator[list[str]]:
    """`agentgrpo vllm-serve` of the default model on `SERVER_CORE`; yields the runs' options."""
    from agentgrpo.models.default_model import default_model_path

    port = _free_port()
    command = ["taskset", "-c", SERVER_CORE, sys.executable, "-m", "agentgrpo", "vllm-serve"]
    command += ["--model", str(default_model_path()), "--port", str(port), "--host", "127.0.0.1"]
    command += ["--dtype", "float32", "--max-model-len", "4096", "--disable-log-stats"]
    environment = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_OMP_THREADS_BIND": SERVER_CORE,
        "OMP_NUM_THREADS": "1",
    }
    with tempfile.NamedTemporaryFile("w+", prefix="agentgrpo-bench-server-", suffix=".log") as log:
        server = subprocess.Popen(
            command, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_until_up(url, server, log.name)
            print(f"vLLM server at {url} on core {SERVER_CORE}; learners on core {LEARNER_CORE}")
            yield ["--use-vllm", "--vllm-mode", "server", "--vllm-server-base-url", url]
        finally:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _wait_until_up(url: str, server: subprocess.Popen, log: str) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the vLLM server exited:\n{Path(log).read_text()[-3000:]}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(url + "/v1/models", timeout=5) as reply,
        ):
            json.load(reply)
            return
        time.sleep(2)
    sys.exit(f"the vLLM server did not answer within {SERVER_START_S} s")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(workload: str, mode: str, seed: int, kept: Path, args: argparse.Namespace) -> dict:
    """One `agentgrpo run` (and its eval) in child processes; its metrics.jsonl is kept.

    The run starts from the seed's warm start in `kept` if one is there, and otherwise leaves
    its own warm start (if it makes one) there.
    """
    env, extra = WORKLOADS[workload], MODES[mode]
    warm = kept / f"warm-start-{workload}-seed{seed}"
    with tempfile.TemporaryDirectory(prefix="agentgrpo-async-bench-") as folder:
        command = [sys.executable, "-m", "agentgrpo", "run", *env, "--output-dir", folder]
        if "env:Counter" in env:
            command += ["--model", _tiny_model(folder)]
        elif warm.is_dir():
            command += ["--model", str(warm), "--warm-start-steps", "0"]
        command += ["--max-steps", str(args.max_steps), "--seed", str(seed), *extra]
        if args.warm_start_steps is not None and not warm.is_dir():
            command += ["--warm-start-steps", str(args.warm_start_steps)]
        environment = None
        if args.generator:  # the learner on its own core, beside the server's
            command = ["taskset", "-c", LEARNER_CORE, *command, *args.generator]
            command += ["--vllm-group-port", str(_free_port())]
            environment = os.environ | {"OMP_NUM_THREADS": "1"}
        load = _load()
        printed = _child(command, environment)
        run = {"train_s": _train_seconds(printed), "episodes": _episodes(folder), "load": load}
        run["episodes_per_s"] = run["episodes"] / run["train_s"]
        shutil.copy(
            Path(folder) / "metrics.jsonl", kept / f"{workload}-{mode}-seed{seed}.metrics.jsonl"
        )
        if (Path(folder) / "warm_start").is_dir() and not warm.is_dir():
            shutil.copytree(Path(folder) / "warm_start", warm)
        if args.eval:
            evaluated = _child(
                [sys.executable, "-m", "agentgrpo", "eval", "env:Chain"]
                + ["--model", str(Path(folder) / "model"), "--seed", str(seed)]
            )
            run["success"] = float(_figures(evaluated)["success_rate"])
    return run


def _tiny_model(folder: str) -> str:
    """The tiny Llama with the default model's tokenizer, saved under `folder`."""
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from transformers import AutoTokenizer

    from agentgrpo.models.default_model import default_model_path
    from tests.support.tiny_model import tiny_llama  # the tests' model: a config, no download

    path = Path(folder) / "tiny-model"
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    tiny_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _child(command: list[str], environment: dict[str, str] | None = None) -> str:
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
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
