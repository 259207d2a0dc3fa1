"""GRPO steps on one GPU: agentgrpo's GRPOTrainer against TRL's, side by side.

Both trainers train the same Qwen2.5-0.5B-shaped model with random weights
(`bench/configs/qwen2.5-0.5b.json`, seed 0; no weights travel, nothing is downloaded) in
bfloat16 on CUDA, generating with transformers (no vLLM), gradient checkpointing off, beta 0,
loss `dapo`, temperature 1.0, 4 micro-batches of 16 rows per optimizer step (64 episodes in
groups of G=8), rows unshuffled. Each runner is its own subprocess, one after the other, the
order reversed on every other repeat; the first step of each run is a warm-up and is dropped.

- `one-round`: 16 prompts of about 220 tokens, no tools, 256 completion tokens forced (TRL:
  `min_new_tokens`; agentgrpo: no stop id), a deterministic spread reward. Targets: step time
  <= 0.6x TRL's, peak GPU memory <= 0.8x.
- `multi-turn`: `bench/step.py`'s three-tool-round counter (`StepCounter`, targets 7-9, a call
  adds at most 3) with its compact `chatml_tools` template, 128 completion tokens, agentgrpo
  `max_turns=4`, TRL `max_tool_calling_iterations=3`, lr 0 (every step runs the whole update,
  but the weights stay those of the warm start, so both keep playing three tool rounds). A
  random model writes no tool call, so the model first learns the call format: supervised
  steps on the workload's demonstrations (16 a step, lr 3e-4) until the loss is under 0.05
  (the digits of the calls are random: about 0.013 nats a token cannot be learned),
  cached per config. Targets: the same.

Per runner it prints the median seconds per optimizer step, the part with a generation call in
flight, peak GPU memory (`torch.cuda.max_memory_allocated` from the built trainer on) and its
peak in each phase (`PhasePeaks`: generation and scoring, loss and backward, the rest), tool
calls and completion tokens per episode (both sides did the same work), and the ratios.

Run on a CUDA machine: `python bench/gpu_step.py --tokenizer DIR` (bench/README.md says how to
carry a tokenizer and TRL to a machine without network); `--workload`, `--steps`, `--repeats`,
`--no-trl`, `--json FILE`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != str(HERE)]
sys.path.insert(0, str(ROOT))

SEED = 0
TIME_TARGET, MEMORY_TARGET = 0.6, 0.8
WARM_START_LOSS, WARM_START_MAX_STEPS = 0.05, 500


def _load(name: str) -> Any:
    """A sibling bench script as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def spread_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """A deterministic reward in [0, 1) per completion, so advantages are not all zero."""
    return [((sum(ids) * 2654435761 + len(ids)) % 1009) / 1009 for ids in completion_ids]


# ---------------------------------------------------------------------- workloads


def _one_round(tokenizer: Any, framework: str) -> dict:
    import datasets

    generation = _load("gpu_generation")
    prompts = generation.long_prompts(tokenizer, 16)
    config = {"max_completion_length": 256}
    if framework == "trl":
        config["generation_kwargs"] = {"min_new_tokens": 256}
    return {
        "dataset": datasets.Dataset.from_dict({"prompt": prompts}),
        "config": config,
        "trainer": {"reward_funcs": [spread_reward]},
        "no_stop": framework == "agentgrpo",
    }


def _multi_turn(tokenizer: Any, framework: str) -> dict:
    step = _load("step")
    template = step._compact_template(tokenizer)
    config: dict[str, Any] = {"max_completion_length": 128, "learning_rate": 0.0}
    if framework == "agentgrpo":
        config |= {"max_turns": 4, "chat_template": template, "tool_call_parser": "hermes"}
    else:
        tokenizer.chat_template = template
        tokenizer.response_template = step.RESPONSE_TEMPLATE
        config["max_tool_calling_iterations"] = 3
    return {
        "dataset": step._multi_turn_rows(),
        "config": config,
        "trainer": {"environment_factory": step.StepCounter},
        "no_stop": False,
    }


WORKLOADS = {"one-round": _one_round, "multi-turn": _multi_turn}


# ---------------------------------------------------------------------- child


def _common(output_dir: str, steps: int, cuda: bool) -> dict:
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 4,
        "num_generations": 8,
        "temperature": 1.0,
        "beta": 0.0,
        "loss_type": "dapo",
        "learning_rate": 1e-6,
        "lr_scheduler_type": "constant",
        "max_steps": steps,
        "gradient_checkpointing": False,
        "bf16": cuda,
        "use_cpu": not cuda,
        "seed": SEED,
        "shuffle_dataset": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "use_vllm": False,
    }


def _child(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Sync(TrainerCallback):
        """Step wall times hold their own GPU work."""

        def on_step_begin(self, *_, **__):
            sync()

        def on_step_end(self, *_, **__):
            sync()

    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    work = WORKLOADS[args.workload](tokenizer, args.child)
    output_dir = str(Path(args.result).parent / "output")
    config = _common(output_dir, args.steps, cuda) | work["config"]
    if args.child == "agentgrpo":
        from agentgrpo import GRPOConfig, GRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer
    timer = _load("step")._make_step_timer()()
    trainer = GRPOTrainer(
        model=model,
        args=GRPOConfig(**config),
        train_dataset=work["dataset"],
        processing_class=tokenizer,
        callbacks=[Sync(), timer],
        **work["trainer"],
    )
    if work["no_stop"]:
        trainer.engine.context.backend.stop_token_ids = frozenset()  # run to the full length
    timer.attach(trainer, args.child)
    phases = PhasePeaks(torch) if cuda else None
    if phases:
        phases.attach(trainer)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    built_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    trainer.train()
    result = {
        "step_s": timer.step_s,
        "generate_s": timer.generate_s,
        "peak_gib": phases.peak() if phases else 0.0,
        "phase_peaks_gib": phases.peaks if phases else {},
        "built_gib": built_gib,
        "logs": timer.logs,
        "device": torch.cuda.get_device_name() if cuda else args.device,
    }
    if args.child == "agentgrpo":
        result["decoding"] = trainer.engine.context.backend.decoding
    Path(args.result).write_text(json.dumps(result))


class PhasePeaks:
    """Peak GPU memory (GiB) in each phase of the run, read where one phase gives way to another.

    `prepare`: `_prepare_inputs` (each round's generation and scoring, in both trainers);
    `loss`: `training_step` (a micro-batch's forward and backward); `other`: the rest (the
    optimizer step, logging). The run's peak is the largest of the three.
    """

    def __init__(self, torch: Any):
        self.cuda = torch.cuda
        self.peaks = {"prepare": 0.0, "loss": 0.0, "other": 0.0}

    def attach(self, trainer: Any) -> None:
        """Wrap the trainer's `_prepare_inputs` and `training_step`."""
        trainer._prepare_inputs = self._phase("prepare", trainer._prepare_inputs)
        trainer.training_step = self._phase("loss", trainer.training_step)

    def peak(self) -> float:
        """The run's peak so far (closing the phase in progress as `other`)."""
        self._close("other")
        return max(self.peaks.values())

    def _phase(self, name: str, method: Any) -> Any:
        def measured(*args: Any, **kwargs: Any) -> Any:
            self._close("other")
            try:
                return method(*args, **kwargs)
            finally:
                self._close(name)

        return measured

    def _close(self, name: str) -> None:
        self.cuda.synchronize()
        peak = self.cuda.max_memory_allocated() / 2**30
        self.peaks[name] = round(max(self.peaks[name], peak), 2)
        self.cuda.reset_peak_memory_stats()


# ---------------------------------------------------------------------- models


def _model_dir(workload: str, args: argparse.Namespace) -> Path:
    """The random model (and, for `multi-turn`, its warm start), saved once under the cache."""
    import torch
    from transformers import AutoTokenizer

    generation = _load("gpu_generation")
    config = Path(args.config)
    name = ("random" if workload == "one-round" else "toolcalls") + "-" + config.stem
    target = Path(args.cache) / name
    if (target / "config.json").exists():
        return target
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    model = generation.random_model(config, torch.float32, args.device)
    if workload == "multi-turn":
        _learn_call_format(model, tokenizer, args.device, args.call_format_steps)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model.to(dtype).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def _learn_call_format(model: Any, tokenizer: Any, device: str, most_steps: int) -> None:
    """Supervised steps on the multi-turn demonstrations until the loss is under the bar."""
    import torch

    step = _load("step")
    template = step._compact_template(tokenizer)
    tools = [step.StepCounter().increment]
    rng = random.Random(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    warm_up = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 20))
    model.train()
    recent: list[float] = []
    for index in range(most_steps):
        demos = [
            step._encode_demonstration(tokenizer, template, tools, step._multi_turn_demo(rng))
            for _ in range(16)
        ]
        width = max(len(ids) for ids, _ in demos)
        ids = torch.tensor([i + [2] * (width - len(i)) for i, _ in demos], device=device)
        labels = torch.tensor(
            [lab + [-100] * (width - len(lab)) for _, lab in demos], device=device
        )
        cuda = device.startswith("cuda")  # bfloat16 autocast on the CPU: seconds a step
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        warm_up.step()
        optimizer.zero_grad()
        recent = [*recent[-9:], loss.item()]
        if index % 20 == 0:
            print(f"call-format step {index}: loss {loss.item():.4f}", flush=True)
        if len(recent) == 10 and max(recent) < WARM_START_LOSS:
            print(f"call format learned in {index + 1} steps (loss {loss.item():.4f})", flush=True)
            break
    model.eval()


# ---------------------------------------------------------------------- parent


def _spawn(framework: str, workload: str, model_dir: Path, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", framework, "--workload", workload]
        command += ["--model-dir", str(model_dir), "--steps", str(args.steps)]
        command += ["--result", str(result), "--device", args.device]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, check=False)
        if done.returncode != 0 or not result.exists():
            return {
                "error": f"{framework} exited {done.returncode}",
                "wall_s": time.perf_counter() - started,
            }
        return json.loads(result.read_text()) | {"wall_s": time.perf_counter() - started}


def _summary(runs: list[dict]) -> dict:
    good = [r for r in runs if "step_s" in r]
    steps = [s for r in good for s in r["step_s"][1:]]
    gens = [g for r in good for g in r["generate_s"][1:]]
    logs = [log for r in good for log in r["logs"] if "reward" in log]

    def mean(key: str) -> float | None:
        values = [log[key] for log in logs if key in log]
        return round(statistics.mean(values), 3) if values else None

    return {
        "median_step_s": round(statistics.median(steps), 3) if steps else None,
        "median_generate_s": round(statistics.median(gens), 3) if gens else None,
        "peak_gib": round(max(r["peak_gib"] for r in good), 2) if good else None,
        "phase_peaks_gib": good[0].get("phase_peaks_gib", {}) if good else {},
        "calls_per_episode": mean("calls_per_episode"),
        "completion_length": mean("completions/mean_length"),
        "steps_s": [round(s, 3) for s in steps],
        "errors": [r["error"] for r in runs if "error" in r],
        "decoding": sorted({r.get("decoding", "") for r in good} - {""}),
    }


def _verdict(ratio: float | None, target: float) -> str:
    if ratio is None:
        return "n/a"
    return f"{ratio:.2f} ({'meets' if ratio <= target else 'misses'} <= {target})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer")
    parser.add_argument("--workload", default="both", choices=[*WORKLOADS, "both"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument(
        "--cache", default=os.path.join(tempfile.gettempdir(), "agentgrpo-gpu-bench")
    )
    parser.add_argument("--json")
    parser.add_argument("--config", default=str(HERE / "configs" / "qwen2.5-0.5b.json"))
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    parser.add_argument(
        "--call-format-steps",
        type=int,
        default=WARM_START_MAX_STEPS,
        help="the most supervised steps of the multi-turn warm start",
    )
    parser.add_argument("--child", choices=["agentgrpo", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    if not args.tokenizer:
        parser.error("--tokenizer DIR is needed (a tokenizer folder; see bench/README.md)")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is a warm-up)")
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    frameworks = ["agentgrpo"] if args.no_trl else ["agentgrpo", "trl"]
    report = {}
    for workload in workloads:
        model_dir = _model_dir(workload, args)
        runs: dict[str, list[dict]] = {f: [] for f in frameworks}
        for repeat in range(args.repeats):
            for framework in frameworks if repeat % 2 == 0 else frameworks[::-1]:
                runs[framework].append(_spawn(framework, workload, model_dir, args))
        summary = {f: _summary(r) for f, r in runs.items()}
        report[workload] = summary
        _print(workload, summary, os.getloadavg())
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def _print(workload: str, summary: dict, load: tuple[float, ...]) -> None:
    print(f"\n== {workload}  (load average {load[0]:.2f})")
    for framework, s in summary.items():
        print(
            f"{framework:10} step {s['median_step_s']} s (generating {s['median_generate_s']} s), "
            f"peak {s['peak_gib']} GiB, calls/episode {s['calls_per_episode']}, "
            f"completion tokens {s['completion_length']}, steps {s['steps_s']} "
            f"{s['decoding']} {s['errors']}"
        )
        print(f"{'':10} peak GiB by phase {s['phase_peaks_gib']}")
    ours, trl = summary.get("agentgrpo", {}), summary.get("trl", {})
    if ours.get("median_step_s") and trl.get("median_step_s") and trl.get("peak_gib"):
        time_ratio = ours["median_step_s"] / trl["median_step_s"]
        memory_ratio = ours["peak_gib"] / trl["peak_gib"]
        verdicts = _verdict(time_ratio, TIME_TARGET), _verdict(memory_ratio, MEMORY_TARGET)
        print("agentgrpo / TRL: time {}, memory {}".format(*verdicts))


if __name__ == "__main__":
    main()
