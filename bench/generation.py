"""Generation throughput: the same episodes through transformers and through vLLM colocate.

Workload (the same for both backends): SmolLM2-135M-Instruct in float32 on CPU, the Counter
environment with agentgrpo's `chatml_tools` template, 4 prompts x G=4 = 16 concurrent episodes
per round, a 64-token budget per episode (model and tool turns), at most 2 model turns,
temperature 1.0, the same rows and seeds in every round. By default the model is the
tool-call-format warm start that `bench/step.py` caches (so episodes really call the tool and
take a second turn), else the raw model; `--model` picks another folder. vLLM's prefix cache is
reset before each round, as a push does in training (a group's members still share the KV of
their common prompt, as they do in training).

Each backend runs in its own child process (vLLM changes torch's thread settings for the whole
process): one warm-up round, then `--rounds` timed rounds. A child reports the median round
time, episodes per second and model tokens per second. The vLLM child also times `--pushes`
weight pushes of the policy (in-place reload from its tensors, tied lm_head refresh, prefix
cache reset), each after perturbing the policy so every push carries new weights.

Printed ratios: vLLM episodes/s over transformers episodes/s, and one push over one vLLM round.

Run: `python bench/generation.py` (about 3 minutes on 2 idle cores; `--quick` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# `python bench/generation.py` puts bench/ first on the path, where `import rollout` would find
# bench/rollout.py instead of the package: take that entry out.
sys.path.remove(os.path.dirname(os.path.realpath(__file__)))

CHILD_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
PROMPTS = 4
GROUP = 4


def main() -> None:
    args = _parser().parse_args()
    if args.child:
        print(json.dumps(_measure(args)))
        return
    model = args.model or str(_default_model())
    print(f"model: {model}\nthreads: {args.threads}{_busy_warning()}")
    results = {backend: _run_child(backend, model, args) for backend in ("transformers", "vllm")}
    _report(results)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: bench/step.py's warm start)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per backend")
    parser.add_argument("--pushes", type=int, default=3, help="timed weight pushes (vLLM)")
    parser.add_argument("--max-tokens", type=int, default=64, help="token budget per episode")
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads per child")
    parser.add_argument("--quick", action="store_true", help="1 round, 1 push, 32 tokens")
    parser.add_argument("--child", choices=("transformers", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--child-model", help=argparse.SUPPRESS)
    return parser


def _default_model() -> Path:
    from agentgrpo.models.default_model import cache_dir, default_model_path

    warm = cache_dir() / "bench" / "SmolLM2-135M-Instruct-toolcall-format-v1"
    return warm if (warm / "config.json").exists() else default_model_path()


def _run_child(backend: str, model: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", backend, "--child-model", model]
    command += ["--rounds", str(args.rounds), "--pushes", str(args.pushes)]
    command += ["--max-tokens", str(args.max_tokens)] + (["--quick"] if args.quick else [])
    environment = {**os.environ, **CHILD_ENVIRONMENT, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, env=environment, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {backend} child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure(args: argparse.Namespace) -> dict:
    """In the child: time rounds (and pushes) of one backend; returns the figures as a dict."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tokenizer = AutoTokenizer.from_pretrained(args.child_model)
    policy = AutoModelForCausalLM.from_pretrained(args.child_model, dtype=torch.float32).eval()
    rounds, pushes = (1, 1) if args.quick else (args.rounds, args.pushes)
    max_tokens = 32 if args.quick else args.max_tokens
    started = time.perf_counter()
    backend = _backend(args.child, policy, tokenizer)
    result = {"startup_s": time.perf_counter() - started}
    result |= _time_rounds(backend, tokenizer, rounds, max_tokens)
    if args.child == "vllm":
        result["push_s"] = _time_pushes(backend, policy, pushes)
    return result


def _backend(name: str, policy, tokenizer):
    if name == "transformers":
        from rollout import TransformersBackend

        return TransformersBackend.from_tokenizer(policy, tokenizer)
    from rollout.backends.vllm_colocate import VLLMColocateBackend

    return VLLMColocateBackend.start(
        policy.config,
        tokenizer,
        policy.state_dict().items(),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        seed=0,
    )


def _time_rounds(backend, tokenizer, rounds: int, max_tokens: int) -> dict:
    import anyio

    from environments import Counter
    from rollout import EpisodeConfig, RolloutEngine

    engine = RolloutEngine(
        backend,
        tokenizer,
        environment_factory=Counter,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=max_tokens, max_turns=2, temperature=1.0),
    )
    rows = Counter.dataset()
    rows = [rows[i] for i in range(PROMPTS)]
    anyio.run(engine.run, rows, GROUP, 0)  # warm-up
    seconds, tokens, calls = [], 0, 0
    for _ in range(rounds):
        if hasattr(backend, "llm"):  # as after a push: no prompt KV kept from the last round
            backend.llm.reset_prefix_cache()
        started = time.perf_counter()
        episodes = anyio.run(engine.run, rows, GROUP, 0)
        seconds.append(time.perf_counter() - started)
        tokens += sum(e.model_tokens for e in episodes)
        calls += sum(e.stats.tool_calls for e in episodes)
    round_s = statistics.median(seconds)
    episodes_per_round = PROMPTS * GROUP
    return {
        "round_s": round_s,
        "episodes_per_s": episodes_per_round / round_s,
        "model_tokens_per_s": tokens / sum(seconds),
        "tool_calls_per_episode": calls / (episodes_per_round * rounds),
    }


def _time_pushes(backend, policy, pushes: int) -> float:
    """Median seconds of one push; the policy is perturbed before each so the weights change."""
    import torch

    from agentgrpo.generation.weight_sync import ColocatedPush

    sync = ColocatedPush(backend, sleeps=False)
    sync.version = 0  # the start-up already loaded these weights
    seconds = []
    for step in range(1, pushes + 1):
        with torch.no_grad():
            for parameter in policy.parameters():
                parameter.mul_(1.0 + 1e-4)
        started = time.perf_counter()
        with sync.generating(policy, step):
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def _report(results: dict[str, dict]) -> None:
    hf, vllm = results["transformers"], results["vllm"]
    print(f"{'backend':<13} {'start-up s':>10} {'round s':>8} {'episodes/s':>10} {'tokens/s':>9}")
    for name, r in results.items():
        print(
            f"{name:<13} {r['startup_s']:>10.1f} {r['round_s']:>8.2f} "
            f"{r['episodes_per_s']:>10.2f} {r['model_tokens_per_s']:>9.1f}"
        )
    calls = (hf["tool_calls_per_episode"], vllm["tool_calls_per_episode"])
    print(f"tool calls per episode: transformers {calls[0]:.2f}, vLLM {calls[1]:.2f}")
    speedup = vllm["episodes_per_s"] / hf["episodes_per_s"]
    print(f"episodes/s, vLLM colocate / transformers: {speedup:.2f}")
    push_s, rounds = vllm["push_s"], vllm["push_s"] / vllm["round_s"]
    print(f"one weight push: {push_s:.2f} s = {rounds:.2f} vLLM rounds")


def _busy_warning() -> str:
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return f"\n[load average {load:.1f} on {cores} cores: unreliable]" if load > cores else ""


if __name__ == "__main__":
    main()
