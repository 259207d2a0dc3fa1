"""One GRPO training step, agentgrpo against TRL's GRPOTrainer, on the same tool workload.

Workload (the same for both, each framework in its own subprocess, one after the other):

- Model: SmolLM2-135M-Instruct (`agentgrpo.default_model.default_model_path()`), float32, on
  CPU (`use_cpu=True`, `bf16=False`: TRL would otherwise default to bf16), gradient
  checkpointing OFF for both (agentgrpo and TRL both default to ON; at this size memory is not
  the limit and recomputation would only add time).
- Template: agentgrpo's built-in `chatml_tools` (ChatML with Hermes `<tool_call>` JSON) for
  both; the model's own template ignores tools. TRL parses tool calls with
  `tokenizer.parse_response`, which needs a transformers `response_template`; TRL knows none for
  this template, so the benchmark gives the tokenizer one for exactly this format
  (`RESPONSE_TEMPLATE`). agentgrpo reads the same format with its `hermes` parser.
- Environment: `BenchCounter` (`reset` sets the target, tool `increment(step: int) -> int`,
  `get_reward` 1.0 when the counter equals the target), passed as `environment_factory` to both.
  `reset` returns no text, so both render byte-identical prompts (the script checks the ids).
- Data: `environments.Counter.dataset()` rows, not shuffled, so step k plays rows 2k and 2k+1
  in both frameworks. G=4, batch 8 (2 prompts a step, one optimizer step per generation),
  max_completion_length 48 (tool-response tokens included), one tool round (agentgrpo
  `max_turns=2`, TRL `max_tool_calling_iterations=1`), temperature 1.0, beta 0 (no reference
  model), loss `dapo`, lr 5e-5 constant, seed 0, transformers generation for both.
- Warm start: zero-shot, this model never writes a tool call (0 of 16 sampled episodes when this
  script was written), so neither trainer would run a tool. The script first fine-tunes the
  model for 24 steps on the tool-call FORMAT only (demo prompts carry no number, the
  demonstrated step is random; 2-4 minutes, cached under agentgrpo's cache directory) and both
  trainers start from that checkpoint. `--no-warm-start` uses the raw model.
- Threads: `--threads` (default 1) torch threads in each child, the same for both. On a shared
  2-core machine two threads per process made step times swing by 2x; one is stable.

Budget edge at 48 tokens: a one-digit tool call is 27 tokens and its tool turn 21, exactly 48.
agentgrpo ends such an episode there; TRL appends the tool turn, generates a post-tool turn and
truncates it to nothing. `--max-completion-length 64` gives both room for the answer turn, so
both do the same generation work.

Per framework it reports the median seconds per optimizer step (first step dropped as warm-up),
the part of it spent in `_prepare_inputs` (generation, tools, rewards) and in generation calls,
the peak RSS of its process (`ru_maxrss`, imports and model included; also before training),
the mean reward, tool calls per episode and model tokens per episode it saw, and every
generation call of every timed step. Then the agentgrpo/TRL ratios against the targets
(time <= 0.8, memory <= 1.0).

TRL is needed only here, never by agentgrpo: `pip install --no-deps trl==1.16.0` (or unpack it
and put it on PYTHONPATH). Run: `python bench/step.py` (about 5 minutes per repeat on 2 cores,
plus the one-time warm start); `--steps`, `--repeats`, `--threads`, `--max-completion-length`,
`--model`, `--no-warm-start`, `--profile`.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
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
from pathlib import Path
from typing import Any

# `python bench/step.py` puts bench/ first on the path, where bench/rollout.py would shadow the
# `rollout` package that agentgrpo imports: take that entry out (agentgrpo is imported later,
# inside functions).
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _HERE]

TRL_VERSION = "1.16.0"
FRAMEWORKS = ("agentgrpo", "trl")
SEED = 0
WARM_START_STEPS = 24
WARM_START_RECIPE = "toolcall-format-v1"  # change when the warm start changes (new cache folder)
TIME_TARGET, MEMORY_TARGET = 0.8, 1.0

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


# ---------------------------------------------------------------------- parent


def main() -> None:
    args = _parse_args()
    if args.child:
        _run_child(args)
        return
    _require_trl()
    threads = args.threads
    print(
        f"load average (1 min) {os.getloadavg()[0]:.1f}; {os.cpu_count()} cores; torch threads "
        f"{threads} in each child; {args.steps} steps a run, first dropped; "
        f"{args.repeats} repeat(s); max_completion_length {args.max_completion_length}"
    )
    print(f"agentgrpo {_git_revision()}; TRL {_trl_version()}")
    model_dir = args.model or _model_dir(args.warm_start, threads)
    print(f"model: {model_dir}")
    runs: dict[str, list[dict]] = {name: [] for name in FRAMEWORKS}
    for repeat in range(args.repeats):
        order = FRAMEWORKS if repeat % 2 == 0 else FRAMEWORKS[::-1]
        for name in order:
            result = _spawn(name, model_dir, args)
            runs[name].append(result)
            print(
                f"  {name:9s} repeat {repeat}: steps "
                + ", ".join(f"{s:.1f}" for s in result["step_s"])
                + f" s; peak RSS {result['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
    _report(runs, threads, args)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (>= 2)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per framework, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    parser.add_argument(
        "--max-completion-length", type=int, default=48, help="token budget of an episode"
    )
    parser.add_argument(
        "--no-warm-start", dest="warm_start", action="store_false", help="use the raw model"
    )
    parser.add_argument("--model", help="a model folder to use instead (skips the warm start)")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile each child's training (adds overhead)"
    )
    parser.add_argument("--child", choices=(*FRAMEWORKS, "warm-start"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is dropped as warm-up)")
    return args


def _require_trl() -> None:
    if importlib.util.find_spec("trl") is None:
        sys.exit(
            "bench/step.py compares against TRL, which agentgrpo does not depend on. Install it "
            f"for the benchmark only: pip install --no-deps trl=={TRL_VERSION}\n"
            "(or unpack the wheel and put it on PYTHONPATH)."
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


def _git_revision() -> str:
    """The commit the benchmark runs, with '+changes' when the library code differs from it."""
    root = Path(_HERE).parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    changed = git("status", "--porcelain", "--", "agentgrpo", "rollout", "environments", "tools")
    return commit + ("+changes" if changed else "")


def _model_dir(warm_start: bool, threads: int) -> str:
    from agentgrpo.default_model import cache_dir, default_model_path

    base = default_model_path()
    if not warm_start:
        return str(base)
    target = cache_dir() / "bench" / f"{base.name}-{WARM_START_RECIPE}"
    if not (target / "config.json").exists():
        print(f"warm start: {WARM_START_STEPS} supervised steps on the tool-call format (once)")
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="agentgrpo-step-") as tmp:
            _call_child(["--child", "warm-start", "--model-dir", str(target)], threads, tmp)
        print(f"warm start: done in {time.perf_counter() - started:.0f} s")
    return str(target)


def _spawn(framework: str, model_dir: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="agentgrpo-step-") as tmp:
        result = Path(tmp) / "result.json"
        command = ["--child", framework, "--model-dir", model_dir, "--result", str(result)]
        command += ["--steps", str(args.steps), "--threads", str(args.threads)]
        command += ["--max-completion-length", str(args.max_completion_length)]
        command += ["--profile"] if args.profile else []
        _call_child(command, args.threads, tmp)
        return json.loads(result.read_text())


def _call_child(command: list[str], threads: int, output_dir: str) -> None:
    env = dict(os.environ)
    env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env |= {"TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(_HERE).parent), env.get("PYTHONPATH")])
    )
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


def _report(runs: dict[str, list[dict]], threads: int, args: argparse.Namespace) -> None:
    rows = {name: _summary(results) for name, results in runs.items()}
    print()
    print(
        f"{'framework':10s} {'s/step':>7s} {'prep s':>7s} {'gen s':>6s} {'peak RSS MiB':>13s} "
        f"{'(built)':>8s} {'reward':>7s} {'calls/ep':>9s} {'tokens/ep':>10s} {'prompt tok':>11s}"
    )
    for name, row in rows.items():
        print(
            f"{name:10s} {row['step_s']:7.2f} {row['prepare_s']:7.2f} {row['generate_s']:6.2f} "
            f"{row['peak_rss_mib']:13.0f} {row['built_rss_mib']:8.0f} {row['reward']:7.3f} "
            f"{row['calls_per_episode']:9.2f} {row['model_tokens']:10.1f} "
            f"{row['prompt_tokens']:11d}"
        )
    ours, theirs = rows["agentgrpo"], rows["trl"]
    time_ratio = ours["step_s"] / theirs["step_s"]
    memory_ratio = ours["peak_rss_mib"] / theirs["peak_rss_mib"]
    print()
    print(f"agentgrpo/TRL time ratio: {time_ratio:.2f} (target <= {TIME_TARGET})")
    print(f"memory ratio: {memory_ratio:.2f} (target <= {MEMORY_TARGET})")
    print(
        f"torch threads: {threads} in both (--threads); s/step is the median over "
        f"{args.repeats} run(s) x {args.steps - 1} steps; prep s = time in _prepare_inputs "
        "(generation, tools, rewards), gen s = time in generation calls (medians); (built) = "
        "peak RSS before training; calls/ep = tool calls per episode; tokens/ep = model tokens "
        "per episode (tool tokens excluded)"
    )
    same_prompt = len({r["prompt_ids_hash"] for rs in runs.values() for r in rs}) == 1
    print(f"identical prompt token ids in both frameworks: {same_prompt}")
    print(
        "generation calls per timed step, rows x new tokens (s): agentgrpo = backend batches, "
        "TRL = model.generate calls"
    )
    for name, results in runs.items():
        for result in results:
            for step, calls in enumerate(result["generations"][1:], start=2):
                shown = ", ".join(f"{rows}x{tokens} ({s:.1f})" for rows, tokens, s in calls)
                print(f"  {name:9s} step {step}: {shown}")
    for name, results in runs.items():
        for result in results:
            if result.get("profile"):
                print(f"\n--- cProfile of {name} (train(), cumulative) ---\n{result['profile']}")


def _summary(results: list[dict]) -> dict[str, Any]:
    steps = [s for r in results for s in r["step_s"][1:]]
    prepares = [s for r in results for s in r["prepare_s"][1:]]
    generates = [sum(c[2] for c in calls) for r in results for calls in r["generations"][1:]]
    logs = [log for r in results for log in r["logs"]]
    return {
        "step_s": statistics.median(steps),
        "prepare_s": statistics.median(prepares),
        "generate_s": statistics.median(generates),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in results),
        "built_rss_mib": max(r["built_rss_mib"] for r in results),
        "reward": _mean(logs, "reward"),
        "calls_per_episode": _mean(logs, "calls_per_episode"),
        "model_tokens": _mean(logs, "completions/mean_length"),
        "prompt_tokens": results[0]["prompt_tokens"],
    }


def _mean(logs: list[dict], key: str) -> float:
    values = [log[key] for log in logs if key in log]
    return statistics.fmean(values) if values else float("nan")


# ---------------------------------------------------------------------- children


def _run_child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.child == "warm-start":
        _warm_start(Path(args.model_dir))
        return
    started = time.perf_counter()
    output_dir = str(Path(args.result).parent / "output")
    trainer, timer, prompt_ids = _build(args, output_dir)
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
        "peak_rss_mib": _peak_rss_mib(),
        "built_rss_mib": built_rss_mib,
        "logs": timer.logs,
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt_ids),
        "prompt_ids_hash": hash(tuple(prompt_ids)),
        "generations": timer.generations,
        "max_completion_length": args.max_completion_length,
        "profile": _profile_text(profiler) if profiler else None,
    }
    Path(args.result).write_text(json.dumps(result))


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _build(args: argparse.Namespace, output_dir: str):
    """The trainer for one framework, its step timer, and the first row's prompt ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from environments import Counter
    from rollout.template import load_template

    framework = args.child
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    template = load_template(tokenizer, "chatml_tools")
    dataset = Counter.dataset()
    timer = _make_step_timer()()
    common = {
        "output_dir": output_dir,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "num_generations": 4,
        "max_completion_length": args.max_completion_length,
        "max_tool_calling_iterations": 1,
        "temperature": 1.0,
        "beta": 0.0,
        "loss_type": "dapo",
        "learning_rate": 5e-5,
        "lr_scheduler_type": "constant",
        "max_steps": args.steps,
        "gradient_checkpointing": False,
        "bf16": False,
        "use_cpu": True,
        "seed": SEED,
        "shuffle_dataset": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }
    first_prompt = dataset[0]["prompt"]
    if framework == "agentgrpo":
        from agentgrpo import GRPOConfig, GRPOTrainer

        config = GRPOConfig(
            **common, max_turns=2, chat_template=template, tool_call_parser="hermes"
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
        environment_factory=BenchCounter,
        callbacks=[timer],
    )
    timer.attach(trainer, framework)
    return trainer, timer, _prompt_ids(trainer, framework, first_prompt, template)


def _prompt_ids(trainer: Any, framework: str, prompt: list[dict], template: str) -> list[int]:
    """The first row's prompt as the framework tokenizes it (reset adds no text)."""
    if framework == "agentgrpo":
        renderer = trainer.engine.context.renderer
        return renderer.encode(renderer.render(prompt, generation_prompt=True))
    tools = [BenchCounter().increment]
    return trainer.processing_class.apply_chat_template(
        prompt,
        tools=tools,
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


def _make_step_timer():
    """The callback class; built on demand so that the parent never imports transformers."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Per optimizer step: wall time, time in `_prepare_inputs`, generation calls; logs.

        A generation call is recorded as (rows, new tokens of the longest row, seconds): for
        agentgrpo each batch its backend samples, for TRL each `model.generate`.
        """

        def __init__(self):
            self.step_s: list[float] = []
            self.prepare_s: list[float] = []
            self.generations: list[list[tuple[int, int, float]]] = []
            self.logs: list[dict] = []
            self._started = 0.0
            self._prepare = 0.0
            self._calls: list[tuple[int, int, float]] = []

        def attach(self, trainer: Any, framework: str) -> None:
            """Wrap the trainer's `_prepare_inputs` and its generation entry point."""
            trainer._prepare_inputs = self._timed(trainer._prepare_inputs)
            if framework == "agentgrpo":
                backend = trainer.engine.context.backend
                sample = backend._sample

                def recorded(prompts, params):
                    started = time.perf_counter()
                    completions = sample(prompts, params)
                    longest = max(len(c.token_ids) for c in completions)
                    self._calls.append((len(prompts), longest, time.perf_counter() - started))
                    return completions

                backend._sample = recorded
            else:
                model = trainer.model
                generate = model.generate

                def recorded(*args, **kwargs):
                    started = time.perf_counter()
                    out = generate(*args, **kwargs)
                    width = kwargs["input_ids"].shape[1]
                    self._calls.append(
                        (len(out), out.shape[1] - width, time.perf_counter() - started)
                    )
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
            self._prepare, self._calls = 0.0, []
            self._started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_s.append(time.perf_counter() - self._started)
            self.prepare_s.append(self._prepare)
            self.generations.append(self._calls)

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = dict(logs or {})
            # Tool calls per episode (calls / completions), under TRL's name in both trainers.
            if "tools/call_frequency" in logs:
                logs["calls_per_episode"] = logs["tools/call_frequency"]
            self.logs.append({k: v for k, v in logs.items() if isinstance(v, int | float)})

    return StepTimer


# ---------------------------------------------------------------------- warm start


def _warm_start(target: Path) -> None:
    """Teach the tool-call format (not the task): prompts carry no number, steps are random."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentgrpo.default_model import default_model_path
    from rollout.template import load_template

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    base = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    template = load_template(tokenizer, "chatml_tools")
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    model.train()
    for step in range(WARM_START_STEPS):
        ids, labels = _demonstration(tokenizer, template, rng)
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"warm-start step {step}: loss {loss.item():.3f}", flush=True)
    with tempfile.TemporaryDirectory(dir=_ensure_parent(target)) as tmp:
        model.save_pretrained(tmp + "/model")
        tokenizer.save_pretrained(tmp + "/model")
        os.replace(tmp + "/model", target)


_DEMO_PROMPTS = (
    "Use the increment tool.",
    "Call increment once.",
    "Change the counter with the increment tool.",
    "Please increment the counter.",
)


def _demonstration(tokenizer: Any, template: str, rng: random.Random) -> tuple[list, list]:
    """One conversation as ids, with labels on the assistant turns only (-100 elsewhere)."""
    step = rng.randint(1, 9)
    call = {"type": "function", "function": {"name": "increment", "arguments": {"step": step}}}
    turns = [
        ({"role": "user", "content": rng.choice(_DEMO_PROMPTS)}, False),
        ({"role": "assistant", "content": "", "tool_calls": [call]}, True),
        ({"role": "tool", "name": "increment", "content": str(step)}, False),
        ({"role": "assistant", "content": f"The counter is now {step}."}, True),
    ]
    tools = [BenchCounter().increment]
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
