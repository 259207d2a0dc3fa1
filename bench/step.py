"""GRPO training steps, agentgrpo against TRL's GRPOTrainer, on the same tool workloads.

Two workloads, run one after the other (`--workload`), each side by side: every runner (the
agentgrpo trees, then TRL) in its own subprocess, one after the other, the order reversed on
every other repeat.

- `one-round`: one tool round (agentgrpo `max_turns=2`, TRL `max_tool_calling_iterations=1`),
  max_completion_length 64, `environments.Counter.dataset()` rows, the `BenchCounter`
  environment (`reset` sets the target, tool `increment(step: int) -> int`, `get_reward` 1.0
  when the counter equals the target), agentgrpo's built-in `chatml_tools` template. Targets:
  time ratio <= 0.6, memory ratio <= 0.8.
- `multi-turn`: three tool rounds (agentgrpo `max_turns=4`, TRL `max_tool_calling_iterations=3`),
  max_completion_length 128, targets 7-9 and `StepCounter`, whose `increment` adds at most 3, so
  a target takes three calls. Its template is `chatml_tools` without the `<tool_response>` tags
  around a tool result: with them one round (a 27-token call, a 21-token tool turn) is 48 tokens
  and three rounds and an answer do not fit in 128; without them a round is 38 and the
  three calls and "The counter is now 9." take 122. Targets: time ratio <= 0.5, memory <= 0.8.

Common to both: SmolLM2-135M-Instruct (`agentgrpo.models.default_model.default_model_path()`) in
float32 on CPU (`use_cpu=True`, `bf16=False`: TRL would otherwise default to bf16), gradient
checkpointing OFF for both (both default to ON; at this size recomputation only adds time;
`--gradient-checkpointing` turns it ON for both, non-reentrant, as a TRL script ported by
changing its import runs), rows
not shuffled (step k plays rows 2k and 2k+1 in every runner; the script checks that the prompt
token ids are identical), G=4, batch 8 (2 prompts a step, one optimizer step per generation),
tool-result tokens counted in the budget, temperature 1.0, beta 0, loss `dapo`, constant
lr 5e-5 (one-round) or 0 (multi-turn: the work per step stays that of the warm start),
seed 0, transformers generation. TRL parses tool calls with
`tokenizer.parse_response`, which needs a transformers `response_template`; TRL knows none for
this format, so the script sets one (`RESPONSE_TEMPLATE`). agentgrpo reads it with `hermes`.

Warm start: zero-shot this model never writes a tool call, so neither trainer would run a tool.
Each workload has its own recipe, run once and cached under agentgrpo's cache directory, and
every runner starts from that checkpoint: `one-round` fine-tunes the tool-call FORMAT (24 steps;
the demo prompts carry no number, the step is random); `multi-turn` fine-tunes on the task's
prompts with three successive tool-call turns whose steps (1-3) add up to the target, then a
short answer (32 steps). `--no-warm-start` uses the raw model.

Variants: `--variant LABEL=PATH` (repeatable) runs further agentgrpo source trees (e.g. `git
worktree add /tmp/base <commit>`) in the same invocation; the child puts PATH first on
PYTHONPATH and checks that agentgrpo, rollout and environments are imported from there. The
tree this script lives in runs last, labelled `--label` (default `now`). Per workload the report
has a lever table: each tree against the previous one (step time before, after, change), and
every tree's ratio to TRL.

Per runner it reports the median seconds per optimizer step (over repeats and steps, the first
step of each run dropped as warm-up), the part in `_prepare_inputs` (generation, tools, rewards)
and with a generation call in flight, the peak RSS of its process (`ru_maxrss`, imports and
model included; also before training), mean reward, tool calls and model tokens per episode, the
load average at the child's start and end, and every generation call of every timed step.

Threads: `--threads` (default 1) torch threads in each child. On a shared 2-core machine two
threads per process made step times swing by 2x; one is stable.

TRL is needed only here, never by agentgrpo: `pip install --no-deps trl==1.16.0` (or unpack it
and put it on PYTHONPATH). Run: `python bench/step.py`; `--workload`, `--steps`, `--repeats`,
`--variant`, `--label`, `--no-trl`, `--threads`, `--max-completion-length`, `--model`,
`--no-warm-start`, `--gradient-checkpointing`, `--profile`, `--padding-free` (agentgrpo packs
each micro-batch without padding; TRL's GRPO has no such option, so TRL runs padded).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import itertools
import json
import os
import pstats
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

# `python bench/step.py` puts bench/ first on the path, where bench/rollout.py would shadow the
# `rollout` package that agentgrpo imports: take that entry out (agentgrpo is imported later,
# inside functions).
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _HERE]
MAIN_TREE = str(Path(_HERE).parent)

TRL_VERSION = "1.16.0"
SEED = 0
MEMORY_TARGET = 0.8
MAX_STEP = 3  # the most StepCounter.increment adds in one call
LIBRARY_PACKAGES = ("agentgrpo", "rollout", "environments")

# The transformers response template for the `chatml_tools` format: an assistant turn is free
# text, then zero or more `<tool_call>{json}</tool_call>` blocks, ending with `<|im_end|>`.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
# What the multi-turn template drops from `chatml_tools`: the tags around a tool result.
_TOOL_RESPONSE = "<tool_response>{{ message.content }}</tool_response>"


class BenchCounter:
    """Counter for both trainers: TRL's environment contract is the stricter one.

    TRL exposes every public method except `reset` and `get_reward` as a tool and passes the
    whole row to `reset`, so the reward is `get_reward` and `reset` takes `**row`.
    """

    def reset(self, target: int, **row: Any) -> None:
        """Set the counter to 0 and remember the target; no text, so prompts stay identical."""
        self.value = 0
        self.target = target

    def increment(self, step: int) -> int:
        """Add step to the counter and return its new value.

        Args:
            step: Value to add.

        """
        self.value += step
        return self.value

    def get_reward(self) -> float:
        """1.0 if the counter equals the target, else 0.0."""
        return 1.0 if self.value == self.target else 0.0


class StepCounter(BenchCounter):
    """The multi-turn counter: a call adds at most 3, so targets 7-9 take three calls."""

    def increment(self, step: int) -> int:
        """Add step (at most 3) to the counter and return its new value.

        Args:
            step: Value to add; more than 3 adds 3.

        """
        self.value += min(step, MAX_STEP)
        return self.value


# ---------------------------------------------------------------------- workloads

_ONE_ROUND_DEMO_PROMPTS = (
    "Use the increment tool.",
    "Call increment once.",
    "Change the counter with the increment tool.",
    "Please increment the counter.",
)
_MULTI_TURN_PHRASINGS = (
    "Bring the counter to {target}. Each increment adds at most 3.",
    "Make the counter reach {target}; increment adds at most 3 per call.",
)
Turns = list[tuple[dict, bool]]  # messages, each with whether a warm start trains on it


def _call(step: int) -> dict:
    call = {"type": "function", "function": {"name": "increment", "arguments": {"step": step}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _tool(value: int) -> dict:
    return {"role": "tool", "name": "increment", "content": str(value)}


def _one_round_demo(rng: random.Random) -> Turns:
    """The tool-call format only: the prompt names no target, the step is random."""
    step = rng.randint(1, 9)
    return [
        ({"role": "user", "content": rng.choice(_ONE_ROUND_DEMO_PROMPTS)}, False),
        (_call(step), True),
        (_tool(step), False),
        ({"role": "assistant", "content": f"The counter is now {step}."}, True),
    ]


def _multi_turn_demo(rng: random.Random) -> Turns:
    """A task prompt, three calls of 1-3 that add up to its target (7-9), a short answer."""
    target = rng.randint(7, 9)
    steps = rng.choice([s for s in _three_steps() if sum(s) == target])
    turns: Turns = [({"role": "user", "content": _multi_turn_prompt(rng, target)}, False)]
    value = 0
    for step in steps:
        value += step
        turns += [(_call(step), True), (_tool(value), False)]
    return [*turns, ({"role": "assistant", "content": f"The counter is now {value}."}, True)]


def _three_steps() -> list[tuple[int, int, int]]:
    span = range(1, MAX_STEP + 1)
    return [(a, b, c) for a in span for b in span for c in span]


def _multi_turn_prompt(rng: random.Random, target: int) -> str:
    return rng.choice(_MULTI_TURN_PHRASINGS).format(target=target)


def _one_round_rows():
    from environments import Counter

    return Counter.dataset()


def _multi_turn_rows():
    """320 rows, targets 7-9 (three calls of at most 3 each), the same on every call."""
    import datasets

    rng = random.Random("bench-multi-turn")
    targets = [rng.randint(7, 9) for _ in range(320)]
    prompts = [[{"role": "user", "content": _multi_turn_prompt(rng, t)}] for t in targets]
    return datasets.Dataset.from_dict({"prompt": prompts, "target": targets})


def _chatml_tools(tokenizer: Any) -> str:
    from rollout.template_source import load_template

    return load_template(tokenizer, "chatml_tools")


def _compact_template(tokenizer: Any) -> str:
    """`chatml_tools` with a tool result written bare: 11 tokens a tool turn instead of 21."""
    template = _chatml_tools(tokenizer)
    if _TOOL_RESPONSE not in template:
        sys.exit(f"the chatml_tools template no longer holds {_TOOL_RESPONSE!r}; update step.py")
    return template.replace(_TOOL_RESPONSE, "{{ message.content }}")


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: what both frameworks play, and its warm start."""

    name: str
    max_completion_length: int
    tool_rounds: int  # TRL max_tool_calling_iterations; agentgrpo max_turns = tool_rounds + 1
    time_target: float
    environment: type
    rows: Callable[[], Any]
    template: Callable[[Any], str]
    demonstration: Callable[[random.Random], Turns]
    warm_start_steps: int
    recipe: str  # change when the warm start changes (a new cache folder)
    learning_rate: float


WORKLOADS = {
    "one-round": Workload(
        name="one-round",
        max_completion_length=64,
        tool_rounds=1,
        time_target=0.6,
        environment=BenchCounter,
        rows=_one_round_rows,
        template=_chatml_tools,
        demonstration=_one_round_demo,
        warm_start_steps=24,
        recipe="toolcall-format-v1",
        learning_rate=5e-5,
    ),
    "multi-turn": Workload(
        name="multi-turn",
        max_completion_length=128,
        tool_rounds=3,
        time_target=0.5,
        environment=StepCounter,
        rows=_multi_turn_rows,
        template=_compact_template,
        demonstration=_multi_turn_demo,
        warm_start_steps=32,
        recipe="toolcall-3rounds-v1",
        # Every step still runs the whole update (forward, backward, AdamW), but the weights
        # stay the warm start's, so every step plays three tool rounds in both frameworks
        # (with 5e-5 the policy drifted to fewer calls within three steps, each framework
        # differently, and the work per step with it).
        learning_rate=0.0,
    ),
}


class Runner(NamedTuple):
    """One side of the comparison: an agentgrpo source tree, or TRL."""

    label: str
    framework: str  # "agentgrpo" or "trl"
    tree: str  # the folder put first on the child's PYTHONPATH


# ---------------------------------------------------------------------- parent


def main() -> None:
    args = _parse_args()
    if args.child:
        _run_child(args)
        return
    if args.trl:
        _require_trl()
    runners = _runners(args)
    load_start = os.getloadavg()
    print(
        f"load average {_load(load_start)}; {os.cpu_count()} cores; torch threads "
        f"{args.threads} in each child; {args.steps} steps a run, first dropped; "
        f"{args.repeats} repeat(s); workloads: {', '.join(_workloads(args))}; gradient "
        f"checkpointing {'ON' if args.gradient_checkpointing else 'OFF'} in both"
    )
    for runner in runners:
        print(f"{runner.label}: {runner.framework} {_revision(runner)} ({runner.tree})")
    summaries = {name: _run_workload(WORKLOADS[name], runners, args) for name in _workloads(args)}
    _print_summary(summaries, runners, load_start)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--workload", choices=(*WORKLOADS, "both"), default="both", help="default: both")
    add("--steps", type=int, default=4, help="optimizer steps per run (>= 2; default 4)")
    add("--repeats", type=int, default=1, help="runs per runner, order alternating (default 1)")
    add(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="another agentgrpo source tree to run (repeatable; in the order given)",
    )
    add("--label", default="now", help="label of this script's own tree (default: now)")
    add("--no-trl", dest="trl", action="store_false", help="run agentgrpo only (no ratios)")
    add("--threads", type=int, default=1, help="torch threads in each child (default 1)")
    add("--max-completion-length", type=int, help="override the workload's token budget")
    add("--no-warm-start", dest="warm_start", action="store_false", help="use the raw model")
    add("--model", help="a model folder to use instead (skips the warm start)")
    add(
        "--gradient-checkpointing",
        action="store_true",
        help="checkpoint activations in both frameworks (their default; a ported script's)",
    )
    add("--profile", action="store_true", help="cProfile each child's training (adds overhead)")
    add(
        "--padding-free",
        action="store_true",
        help="agentgrpo packs each micro-batch without padding (padding_free=True; TRL's GRPO "
        "has no such option)",
    )
    add("--child", choices=("agentgrpo", "trl", "warm-start"), help=argparse.SUPPRESS)
    add("--tree", help=argparse.SUPPRESS)
    add("--model-dir", help=argparse.SUPPRESS)
    add("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is dropped as warm-up)")
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    return args


def _workloads(args: argparse.Namespace) -> list[str]:
    return list(WORKLOADS) if args.workload == "both" else [args.workload]


def _runners(args: argparse.Namespace) -> list[Runner]:
    """The variants in the order given, this tree (`--label`), then TRL unless `--no-trl`."""
    runners = []
    for spec in args.variant:
        label, sep, path = spec.partition("=")
        tree = os.path.realpath(os.path.expanduser(path))
        if not sep or not label or not path:
            sys.exit(f"--variant {spec!r}: write LABEL=PATH, e.g. base=/tmp/base")
        if not os.path.isfile(os.path.join(tree, "agentgrpo", "__init__.py")):
            sys.exit(f"--variant {spec!r}: {tree} holds no agentgrpo/__init__.py (a source tree)")
        runners.append(Runner(label, "agentgrpo", tree))
    runners.append(Runner(args.label, "agentgrpo", MAIN_TREE))
    if args.trl:
        runners.append(Runner("TRL", "trl", MAIN_TREE))
    labels = [r.label for r in runners]
    if len(set(labels)) != len(labels):
        sys.exit(f"labels must be unique (TRL is taken): {labels}; rename a --variant or --label")
    return runners


def _require_trl() -> None:
    if importlib.util.find_spec("trl") is None:
        sys.exit(
            "bench/step.py compares against TRL, which agentgrpo does not depend on. Install it "
            f"for the benchmark only: pip install --no-deps trl=={TRL_VERSION}\n"
            "(or unpack the wheel and put it on PYTHONPATH), or pass --no-trl."
        )
    found = _trl_version()
    if found != TRL_VERSION:
        print(f"warning: TRL {found} found; this benchmark was written against {TRL_VERSION}")


def _trl_version() -> str:
    """TRL's version from its metadata next to the package (found on PYTHONPATH too)."""
    from importlib.metadata import PackageNotFoundError, distributions, version

    spec = importlib.util.find_spec("trl")
    root = os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else None
    for dist in distributions(path=[root] if root else None):
        if (dist.metadata["Name"] or "").lower() == "trl":
            return dist.version
    try:
        return version("trl")
    except PackageNotFoundError:
        return "unknown"


def _revision(runner: Runner) -> str:
    """TRL's version, or the tree's commit with '+changes' when its library code differs."""
    if runner.framework == "trl":
        return _trl_version()

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=runner.tree, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "(no git commit)"
    changed = git("status", "--porcelain", "--", "agentgrpo", "rollout", "environments", "tools")
    return commit + ("+changes" if changed else "")


def _load(load: tuple[float, ...]) -> str:
    return "/".join(f"{x:.1f}" for x in load) + " (1/5/15 min)"


def _model_dir(workload: Workload, args: argparse.Namespace) -> str:
    """The folder every runner loads: `--model`, the raw model, or the cached warm start."""
    from agentgrpo.models.default_model import cache_dir, default_model_path

    base = default_model_path()
    if args.model or not args.warm_start:
        return args.model or str(base)
    target = cache_dir() / "bench" / f"{base.name}-{workload.recipe}"
    if not (target / "config.json").exists():
        print(f"warm start {workload.recipe}: {workload.warm_start_steps} supervised steps (once)")
        started = time.perf_counter()
        command = ["--child", "warm-start", "--model-dir", str(target)]
        with tempfile.TemporaryDirectory(prefix="agentgrpo-step-") as tmp:
            _call_child([*command, "--workload", workload.name], MAIN_TREE, args.threads, tmp)
        print(f"warm start: done in {time.perf_counter() - started:.0f} s")
    return str(target)


def _run_workload(workload: Workload, runners: list[Runner], args: argparse.Namespace) -> dict:
    """Every runner `--repeats` times, the order reversed on odd repeats; the report's rows."""
    budget = args.max_completion_length or workload.max_completion_length
    print(
        f"\n=== workload {workload.name}: max_completion_length {budget}, {workload.tool_rounds} "
        f"tool round(s) (agentgrpo max_turns={workload.tool_rounds + 1}, TRL "
        f"max_tool_calling_iterations={workload.tool_rounds})"
    )
    model_dir = _model_dir(workload, args)
    print(f"model: {model_dir}")
    runs: dict[str, list[dict]] = {runner.label: [] for runner in runners}
    for repeat in range(args.repeats):
        for runner in runners if repeat % 2 == 0 else runners[::-1]:
            result = _spawn(runner, workload, model_dir, args)
            runs[runner.label].append(result)
            _print_run(runner, repeat, result)
    return _report(workload, runners, runs, args)


def _print_run(runner: Runner, repeat: int, result: dict) -> None:
    steps = ", ".join(f"{s:.1f}" for s in result["step_s"])
    where = (
        f"; agentgrpo from {result['agentgrpo_file']}" if runner.framework == "agentgrpo" else ""
    )
    print(
        f"  {runner.label:10s} repeat {repeat}: steps {steps} s; peak RSS "
        f"{result['peak_rss_mib']:.0f} MiB; load {result['load_start'][0]:.1f} -> "
        f"{result['load_end'][0]:.1f}{where}",
        flush=True,
    )


def _spawn(runner: Runner, workload: Workload, model_dir: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="agentgrpo-step-") as tmp:
        result = Path(tmp) / "result.json"
        command = ["--child", runner.framework, "--workload", workload.name, "--tree", runner.tree]
        command += ["--model-dir", model_dir, "--result", str(result), "--steps", str(args.steps)]
        command += ["--threads", str(args.threads)]
        if args.max_completion_length:
            command += ["--max-completion-length", str(args.max_completion_length)]
        command += ["--profile"] if args.profile else []
        command += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
        command += ["--padding-free"] if args.padding_free else []
        _call_child(command, runner.tree, args.threads, tmp)
        return json.loads(result.read_text())


def _call_child(command: list[str], tree: str, threads: int, output_dir: str) -> None:
    """Run this script as a child with `tree` first on PYTHONPATH; exit with its log on failure."""
    env = dict(os.environ)
    env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env |= {"TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    log = Path(output_dir) / "child.log"
    with open(log, "w") as out:
        done = subprocess.run(
            [sys.executable, os.path.realpath(__file__), *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if done.returncode != 0:
        sys.exit(f"child {command[1]} failed (exit {done.returncode}):\n{log.read_text()[-4000:]}")


# ---------------------------------------------------------------------- report


def _report(
    workload: Workload, runners: list[Runner], runs: dict[str, list[dict]], args: argparse.Namespace
) -> dict[str, dict]:
    """Print one workload's table, ratios, lever table and generation calls; return its rows."""
    rows = {label: _summary(results) for label, results in runs.items()}
    print()
    print(
        f"{'runner':10s} {'s/step':>7s} {'prep s':>7s} {'gen s':>6s} {'peak RSS MiB':>13s} "
        f"{'(built)':>8s} {'reward':>7s} {'calls/ep':>9s} {'tokens/ep':>10s} {'prompt tok':>11s}"
    )
    for label, row in rows.items():
        print(
            f"{label:10s} {row['step_s']:7.2f} {row['prepare_s']:7.2f} {row['generate_s']:6.2f} "
            f"{row['peak_rss_mib']:13.0f} {row['built_rss_mib']:8.0f} {row['reward']:7.3f} "
            f"{row['calls_per_episode']:9.2f} {row['model_tokens']:10.1f} "
            f"{row['prompt_tokens']:11d}"
        )
    print(
        f"s/step: median over {args.repeats} run(s) x {args.steps - 1} steps; prep s = time in "
        "_prepare_inputs (generation, tools, rewards), gen s = time with a generation call in "
        "flight (medians); (built) = peak RSS before training; calls/ep = tool calls per "
        "episode; tokens/ep = model tokens per episode (tool tokens excluded)"
    )
    same_prompt = len({r["prompt_ids_hash"] for rs in runs.values() for r in rs}) == 1
    print(f"identical prompt token ids in every runner: {same_prompt}")
    _print_ratios(workload, rows)
    _print_levers(runners, rows)
    _print_generations(runs)
    return rows


def _print_ratios(workload: Workload, rows: dict[str, dict]) -> None:
    if "TRL" not in rows:
        return
    trl = rows["TRL"]
    print(f"\nratio to TRL (time target <= {workload.time_target}, memory <= {MEMORY_TARGET}):")
    for label, row in rows.items():
        if label != "TRL":
            time_ratio = row["step_s"] / trl["step_s"]
            memory_ratio = row["peak_rss_mib"] / trl["peak_rss_mib"]
            print(f"  {label:10s} time {time_ratio:.2f}, memory {memory_ratio:.2f}")


def _print_levers(runners: list[Runner], rows: dict[str, dict]) -> None:
    """Each agentgrpo tree against the previous one, as a markdown table."""
    trees = [r.label for r in runners if r.framework == "agentgrpo"]
    if len(trees) < 2:
        return
    print("\n| lever (label) | step s before | after | change |\n|---|---|---|---|")
    for before, after in itertools.pairwise(trees):
        old, new = rows[before]["step_s"], rows[after]["step_s"]
        print(f"| {after} | {old:.2f} | {new:.2f} | {100 * (new / old - 1):+.1f}% |")


def _print_generations(runs: dict[str, list[dict]]) -> None:
    print(
        "generation calls per timed step, rows x new tokens (s): agentgrpo = backend batches "
        "(continuous batching: runs of decoding steps over the same number of rows), "
        "TRL = model.generate calls"
    )
    for label, results in runs.items():
        for result in results:
            for step, calls in enumerate(result["generations"][1:], start=2):
                shown = ", ".join(f"{rows}x{tokens} ({s:.1f})" for rows, tokens, s in calls)
                print(f"  {label:10s} step {step}: {shown or '-'}")
    for label, results in runs.items():
        for result in results:
            if result.get("profile"):
                print(f"\n--- cProfile of {label} (train(), cumulative) ---\n{result['profile']}")


def _summary(results: list[dict]) -> dict[str, Any]:
    logs = [log for r in results for log in r["logs"]]
    return {
        "step_s": statistics.median(s for r in results for s in r["step_s"][1:]),
        "prepare_s": statistics.median(s for r in results for s in r["prepare_s"][1:]),
        "generate_s": statistics.median(s for r in results for s in r["generate_s"][1:]),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in results),
        "built_rss_mib": max(r["built_rss_mib"] for r in results),
        "reward": _mean(logs, "reward"),
        "calls_per_episode": _mean(logs, "calls_per_episode"),
        "model_tokens": _mean(logs, "completions/mean_length"),
        "prompt_tokens": results[0]["prompt_tokens"],
        "loads": [r[key][0] for r in results for key in ("load_start", "load_end")],
    }


def _mean(logs: list[dict], key: str) -> float:
    values = [log[key] for log in logs if key in log]
    return statistics.fmean(values) if values else float("nan")


def _print_summary(
    summaries: dict[str, dict[str, dict]], runners: list[Runner], load_start: tuple
) -> None:
    print("\n=== summary")
    for name, rows in summaries.items():
        target = WORKLOADS[name].time_target
        trl = rows.get("TRL")
        for runner in runners:
            row = rows[runner.label]
            line = f"{name:10s} {runner.label:10s} {row['step_s']:6.2f} s/step"
            if trl and runner.framework == "agentgrpo":
                time_ratio = row["step_s"] / trl["step_s"]
                memory_ratio = row["peak_rss_mib"] / trl["peak_rss_mib"]
                line += f"  time ratio {time_ratio:.2f} ({_verdict(time_ratio, target)})"
                line += f"  memory ratio {memory_ratio:.2f} "
                line += f"({_verdict(memory_ratio, MEMORY_TARGET)})"
            print(line)
        loads = [x for row in rows.values() for x in row["loads"]]
        print(f"{name:10s} load average (1 min) in the children: {min(loads):.1f}-{max(loads):.1f}")
    print(f"load average at the start {_load(load_start)}, at the end {_load(os.getloadavg())}")


def _verdict(ratio: float, target: float) -> str:
    return f"target <= {target}: {'met' if ratio <= target else 'missed'}"


# ---------------------------------------------------------------------- children


def _run_child(args: argparse.Namespace) -> None:
    load_start = os.getloadavg()
    import torch

    torch.set_num_threads(args.threads)
    workload = WORKLOADS[args.workload]
    if args.child == "warm-start":
        _warm_start(Path(args.model_dir), workload)
        return
    # TRL's child imports only what it uses from the library (the rows, the template).
    agentgrpo_file = _check_tree(args.tree) if args.child == "agentgrpo" else None
    started = time.perf_counter()
    output_dir = str(Path(args.result).parent / "output")
    trainer, timer, prompt_ids = _build(args, workload, output_dir)
    print(f"built in {time.perf_counter() - started:.1f} s", flush=True)
    built_rss_mib = _peak_rss_mib()
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    trainer.train()
    if profiler:
        profiler.disable()
    result = {
        "step_s": timer.step_s,
        "prepare_s": timer.prepare_s,
        "generate_s": timer.generate_s,
        "peak_rss_mib": _peak_rss_mib(),
        "built_rss_mib": built_rss_mib,
        "logs": timer.logs,
        "prompt_tokens": len(prompt_ids),
        "prompt_ids_hash": hash(tuple(prompt_ids)),
        "generations": timer.generations,
        "agentgrpo_file": agentgrpo_file,
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "profile": _profile_text(profiler) if profiler else None,
    }
    Path(args.result).write_text(json.dumps(result))


def _check_tree(tree: str) -> str:
    """Exit unless the library packages are imported from `tree`; agentgrpo's file otherwise."""
    import importlib

    root = os.path.realpath(tree) + os.sep
    for name in LIBRARY_PACKAGES:
        found = os.path.realpath(importlib.import_module(name).__file__ or "")
        if not found.startswith(root):
            sys.exit(f"{name} was imported from {found}, not from {tree}: check PYTHONPATH")
    agentgrpo_file = sys.modules["agentgrpo"].__file__ or ""
    print(f"agentgrpo imported from {agentgrpo_file}", flush=True)
    return agentgrpo_file


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _common_config(args: argparse.Namespace, workload: Workload, output_dir: str) -> dict:
    """The GRPOConfig fields both frameworks take with the same meaning."""
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "num_generations": 4,
        "max_completion_length": args.max_completion_length or workload.max_completion_length,
        "max_tool_calling_iterations": workload.tool_rounds,
        "temperature": 1.0,
        "beta": 0.0,
        "loss_type": "dapo",
        "learning_rate": workload.learning_rate,
        "lr_scheduler_type": "constant",
        "max_steps": args.steps,
        "gradient_checkpointing": args.gradient_checkpointing,
        "bf16": False,
        "use_cpu": True,
        "seed": SEED,
        "shuffle_dataset": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


def _build(args: argparse.Namespace, workload: Workload, output_dir: str):
    """The trainer for one framework, its step timer, and the first row's prompt ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    template = workload.template(tokenizer)
    dataset = workload.rows()
    timer = _make_step_timer()()
    common = _common_config(args, workload, output_dir)
    if args.child == "agentgrpo":
        from agentgrpo import GRPOConfig, GRPOTrainer

        turns = workload.tool_rounds + 1
        config = GRPOConfig(
            **common,
            max_turns=turns,
            chat_template=template,
            tool_call_parser="hermes",
            padding_free=args.padding_free,
        )
    else:
        from trl import GRPOConfig, GRPOTrainer

        tokenizer.chat_template = template
        tokenizer.response_template = RESPONSE_TEMPLATE
        config = GRPOConfig(**common)
    trainer = GRPOTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=workload.environment,
        callbacks=[timer],
    )
    timer.attach(trainer, args.child)
    prompt = dataset[0]["prompt"]
    return trainer, timer, _prompt_ids(trainer, args.child, workload, prompt, template)


def _prompt_ids(
    trainer: Any, framework: str, workload: Workload, prompt: list[dict], template: str
) -> list[int]:
    """The first row's prompt as the framework tokenizes it (reset adds no text)."""
    if framework == "agentgrpo":
        renderer = trainer.engine.context.renderer
        return renderer.encode(renderer.render(prompt, generation_prompt=True))
    return trainer.processing_class.apply_chat_template(
        prompt,
        tools=[workload.environment().increment],
        chat_template=template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]


def _profile_text(profiler: cProfile.Profile, top: int = 30) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the (start, end) spans."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > covered_to:
            total += end - max(start, covered_to)
            covered_to = end
    return total


def _running_rows(backend: Any) -> int:
    """Rows the backend is decoding (`running_rows`; `_rows` in trees from before it)."""
    if hasattr(backend, "running_rows"):
        return backend.running_rows
    return len(backend._rows)


def _make_step_timer():
    """The callback class; built on demand so that the parent never imports transformers."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Per optimizer step: wall time, time in `_prepare_inputs` and generating; logs.

        Generation time is the time with at least one generation call in flight: agentgrpo's
        `backend.generate` requests (concurrent), TRL's `model.generate` calls. A call is also
        listed as (rows, new tokens of the longest row, seconds): TRL's `model.generate`, and
        for agentgrpo each batch its backend samples, when the backend has `_sample`.
        """

        def __init__(self):
            self.step_s: list[float] = []
            self.prepare_s: list[float] = []
            self.generate_s: list[float] = []
            self.generations: list[list[tuple[int, int, float]]] = []
            self.logs: list[dict] = []
            self._started = 0.0
            self._prepare = 0.0
            self._spans: list[tuple[float, float]] = []
            self._calls: list[tuple[int, int, float]] = []

        def attach(self, trainer: Any, framework: str) -> None:
            """Wrap the trainer's `_prepare_inputs` and its generation entry points."""
            trainer._prepare_inputs = self._timed(trainer._prepare_inputs)
            if framework == "agentgrpo":
                self._attach_backend(trainer.engine.context.backend)
            else:
                self._attach_model(trainer.model)

        def _attach_backend(self, backend: Any) -> None:
            generate = backend.generate

            async def timed_generate(prompt_ids, params):
                started = time.perf_counter()
                try:
                    return await generate(prompt_ids, params)
                finally:
                    self._spans.append((started, time.perf_counter()))

            backend.generate = timed_generate
            if hasattr(backend, "_step"):
                self._attach_steps(backend)
            sample = getattr(backend, "_sample", None)
            if sample is None:
                return

            def recorded(prompts, params):
                started = time.perf_counter()
                completions = sample(prompts, params)
                longest = max(len(c.token_ids) for c in completions)
                self._calls.append((len(prompts), longest, time.perf_counter() - started))
                return completions

            backend._sample = recorded

        def _attach_steps(self, backend: Any) -> None:
            """Continuous batching: each `_step` decodes one token for its running rows.
            Consecutive steps over the same number of rows are recorded as one batch."""
            step = backend._step

            def recorded(admitted):
                rows = _running_rows(backend) + len(admitted)
                started = time.perf_counter()
                step(admitted)
                seconds = time.perf_counter() - started
                if self._calls and self._calls[-1][0] == rows:
                    _, passes, before = self._calls.pop()
                    self._calls.append((rows, passes + 1, before + seconds))
                else:
                    self._calls.append((rows, 1, seconds))

            backend._step = recorded

        def _attach_model(self, model: Any) -> None:
            generate = model.generate

            def recorded(*args, **kwargs):
                started = time.perf_counter()
                out = generate(*args, **kwargs)
                ended = time.perf_counter()
                self._spans.append((started, ended))
                width = kwargs["input_ids"].shape[1]
                self._calls.append((len(out), out.shape[1] - width, ended - started))
                return out

            model.generate = recorded

        def _timed(self, prepare):
            def timed(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return prepare(*args, **kwargs)
                finally:
                    self._prepare += time.perf_counter() - started

            return timed

        def on_step_begin(self, args, state, control, **kwargs):
            self._prepare, self._spans, self._calls = 0.0, [], []
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self._started)
            self.prepare_s.append(self._prepare)
            self.generate_s.append(_union_s(self._spans))
            self.generations.append(self._calls)

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = dict(logs or {})
            # Tool calls per episode (calls / completions), under TRL's name in both trainers.
            if "tools/call_frequency" in logs:
                logs["calls_per_episode"] = logs["tools/call_frequency"]
            self.logs.append({k: v for k, v in logs.items() if isinstance(v, int | float)})

    return StepTimer


# ---------------------------------------------------------------------- warm start


def _warm_start(target: Path, workload: Workload) -> None:
    """Fine-tune on the workload's demonstrations, one conversation a step; save to `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentgrpo.models.default_model import default_model_path

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    base = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    template = workload.template(tokenizer)
    tools = [workload.environment().increment]
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    model.train()
    for step in range(workload.warm_start_steps):
        turns = workload.demonstration(rng)
        ids, labels = _encode_demonstration(tokenizer, template, tools, turns)
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"warm-start step {step}: loss {loss.item():.3f}", flush=True)
    with tempfile.TemporaryDirectory(dir=_ensure_parent(target)) as tmp:
        model.save_pretrained(tmp + "/model")
        tokenizer.save_pretrained(tmp + "/model")
        os.replace(tmp + "/model", target)


def _encode_demonstration(
    tokenizer: Any, template: str, tools: list, turns: Turns
) -> tuple[list[int], list[int]]:
    """One conversation as ids, with labels on the trained turns only (-100 elsewhere)."""
    ids: list[int] = []
    labels: list[int] = []
    rendered = ""
    for index, (_, trained) in enumerate(turns):
        # Render up to this turn; a following assistant turn adds its header to this segment.
        generation_prompt = index + 1 < len(turns) and turns[index + 1][0]["role"] == "assistant"
        text = tokenizer.apply_chat_template(
            [m for m, _ in turns[: index + 1]],
            tools=tools,
            chat_template=template,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )
        segment, rendered = text[len(rendered) :], text
        header = "<|im_start|>assistant\n" if generation_prompt else ""
        body, tail = (segment[: -len(header)], header) if header else (segment, "")
        for part, learn in ((body, trained), (tail, False)):
            part_ids = tokenizer.encode(part, add_special_tokens=False)
            ids += part_ids
            labels += part_ids if learn else [-100] * len(part_ids)
    return ids, labels


def _ensure_parent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.parent


if __name__ == "__main__":
    main()
