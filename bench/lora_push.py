"""LoRA weight pushes into vLLM on CPU: the adapter alone against the merged model.

Workload: SmolLM2-135M-Instruct in float32 with a PEFT LoRA adapter (`--rank`, default 16, on
`--targets`, default the attention projections q/k/v/o), pushed into an in-process vLLM engine
(colocate mode, `enforce_eager`) the way a training run pushes after each optimizer step:

- merged (`vllm_lora_push="merged"`): merge the adapter, reload every weight of the model in
  place (tied lm_head refresh, prefix cache reset), unmerge;
- adapter (`vllm_lora_push="adapter"`): write `adapter_model.safetensors` (lora_A/lora_B only)
  and `adapter_config.json`, load them as a new vLLM LoRA version, evict the previous one.

Each mode runs in its own child process (one engine per process). Before every push the
adapter's B matrices change, so every push carries new weights. A push is timed alone, and
with the first request after it (one prompt, 1 token), which is where vLLM activates a newly
loaded adapter. Printed: the median of `--pushes` pushes of each mode, the bytes each push
carries (merged: the model's tensors; adapter: the two files), and the ratios merged/adapter.

Run: `python bench/lora_push.py` (about 3 minutes on 2 idle cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# `python bench/lora_push.py` puts bench/ first on the path, where `import rollout` would find
# bench/rollout.py instead of the package: the repository's root takes its place.
BENCH = os.path.dirname(os.path.realpath(__file__))
sys.path[sys.path.index(BENCH)] = os.path.dirname(BENCH)

MODEL = "/root/.cache/agentgrpo/models/SmolLM2-135M-Instruct"
CHILD_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
MODES = ("merged", "adapter")


def main() -> None:
    args = _parser().parse_args()
    if args.child:
        print(json.dumps(_measure(args)))
        return
    print(f"model: {args.model}  rank {args.rank} on {args.targets}  load {os.getloadavg()}")
    results = {mode: _run_child(mode, args) for mode in MODES}
    _report(results, args.pushes)
    print(f"load average after: {os.getloadavg()}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, help="model folder")
    parser.add_argument("--pushes", type=int, default=5, help="timed pushes per mode")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument(
        "--targets", default="q_proj,k_proj,v_proj,o_proj", help="LoRA target modules"
    )
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    return parser


def _run_child(mode: str, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, os.path.realpath(__file__), "--child", mode]
    command += ["--model", args.model, "--pushes", str(args.pushes), "--rank", str(args.rank)]
    command += ["--targets", args.targets]
    environment = {**os.environ, **CHILD_ENVIRONMENT}
    done = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {mode} child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure(args: argparse.Namespace) -> dict[str, float]:
    """One mode's pushes in this process: median seconds, and bytes per push."""
    import anyio
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentgrpo import GRPOConfig
    from agentgrpo.generation.adapters import AdapterPush, colocate_limits
    from agentgrpo.generation.weight_sync import ColocatedPush, colocated_vllm, policy_weights
    from rollout import SamplingParams
    from rollout.backends.vllm_colocate import default_stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=args.targets.split(","))
    policy = get_peft_model(base, lora).eval()
    config = GRPOConfig(output_dir="/tmp/agentgrpo-lora-push-bench", report_to="none")
    config.vllm_max_model_length = 512
    adapter = args.child == "adapter"
    limits = colocate_limits(policy) if adapter else None
    stop = default_stop_token_ids(tokenizer)
    backend = colocated_vllm(policy, tokenizer, config, stop, False, limits)
    pushes = ColocatedPush(backend, False, AdapterPush(backend, keep=1) if adapter else None)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer(text).input_ids
    one_token = SamplingParams(max_tokens=1, temperature=0.0, seed=0)
    push_s, with_request_s = [], []
    for step in range(args.pushes + 1):  # the first is a warm-up
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=1e-3)
        started = time.perf_counter()
        pushes.load(policy, step)
        pushed = time.perf_counter()
        anyio.run(backend.generate, list(prompt), one_token)
        if step:
            push_s.append(pushed - started)
            with_request_s.append(time.perf_counter() - started)
    if adapter:
        carried = float(pushes.adapters.pushed_bytes)
    else:
        with policy_weights(policy) as weights:
            carried = float(sum(t.numel() * t.element_size() for _, t in weights))
    return {
        "push_s": statistics.median(push_s),
        "with_request_s": statistics.median(with_request_s),
        "bytes": carried,
    }


def _report(results: dict[str, dict[str, float]], pushes: int) -> None:
    merged, adapter = results["merged"], results["adapter"]
    print(f"\nmedian of {pushes} pushes         merged      adapter   merged/adapter")
    for key, label, scale, unit in (
        ("push_s", "push", 1.0, "s"),
        ("with_request_s", "push + first request", 1.0, "s"),
        ("bytes", "carried", 2**20, "MiB"),
    ):
        m, a = merged[key] / scale, adapter[key] / scale
        print(f"{label + ' (' + unit + ')':<28}{m:>9.3f}{a:>13.3f}{m / a:>14.1f}x")


if __name__ == "__main__":
    main()
