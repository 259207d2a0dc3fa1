"""The learner's loss forward and backward: one pass over whole rows vs each prompt run once.

Times what `GRPOTrainer.compute_loss` does with the policy, one micro-batch: the completion
logprobs and the entropy (detached), a token-mean loss, and its backward. Three ways:

- one pass: the model's logits over all B x (P + C) columns, B x C x V at once (what the
  learner did before prompts were shared);
- shared prompt: each distinct prompt once, then the completions over its keys and values
  (`shared_prompt_states`), still reading B x C x V logits;
- learner: `completion_logprobs`, what the learner does now: the shared prompt, and the output
  layer over the final hidden states a chunk of tokens at a time (`output_head`).

`--gradient-checkpointing` turns on transformers' (non-reentrant) gradient checkpointing in every
way, as a ported TRL script has it.

Workload: SmolLM2-135M-Instruct in float32 on CPU, `--threads` torch threads (default 1), B=8
rows = 2 prompts x G=4 (prompts of 133 and 127 tokens of real text, so the second is
left-padded), completions of random token ids, right-padded: row g of a group has C - 4g
tokens, C from `--completion-lengths`. Each (C, way) runs in its own subprocess: one warm-up
step, whose peak RSS above the RSS before it (VmHWM after resetting it through
/proc/self/clear_refs) is the memory figure, then `--repeats` timed steps (median printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

# This folder holds a rollout.py, which would shadow the rollout package.
sys.path.remove(os.path.dirname(os.path.realpath(__file__)))

WAYS = ("one pass", "shared prompt", "learner")
TEXT = (
    "You are a helpful assistant that can call tools to change a counter. The counter starts "
    "at zero and every call to increment adds the given step to it. Reach the target number "
    "exactly, using as few calls as you can, then say what the counter is. "
)


def build_batch(tokenizer, completion_width: int, group_size: int = 4):
    """The B = 2 x G rows described in the module docstring, as a `TrainingBatch`."""
    from agentgrpo.learner.batch import TrainingBatch

    ids = tokenizer.encode(TEXT * 4, add_special_tokens=False)
    prompts = [ids[:133], ids[6:133]]
    generator = torch.Generator().manual_seed(0)
    rows = [
        (prompt, torch.randint(0, len(tokenizer), (completion_width - 4 * g,), generator=generator))
        for prompt in prompts
        for g in range(group_size)
    ]
    width_P = max(len(prompt) for prompt, _ in rows)
    ids_B_L = torch.full((len(rows), width_P + completion_width), tokenizer.pad_token_id)
    mask_B_L = torch.zeros_like(ids_B_L)
    for b, (prompt, completion) in enumerate(rows):
        start, end = width_P - len(prompt), width_P + len(completion)
        ids_B_L[b, start:end] = torch.cat([torch.tensor(prompt), completion])
        mask_B_L[b, start:end] = 1
    positions_B_L = (mask_B_L.cumsum(-1) - 1).clamp(min=0)
    loss_mask_B_C = mask_B_L[:, width_P:].float()
    zeros_B = torch.zeros(len(rows))
    episodes_B = torch.arange(len(rows))
    return TrainingBatch(
        ids_B_L, mask_B_L, positions_B_L, loss_mask_B_C, loss_mask_B_C * 0, zeros_B, episodes_B
    )


def loss_step(model, batch, way: str) -> None:
    """Forward and backward of a token-mean logprob loss, with the entropy (detached)."""
    from agentgrpo.learner.logprobs import completion_logprobs, logits_logprobs, one_pass_states
    from agentgrpo.learner.output_head import read_logits
    from agentgrpo.learner.shared_prompt import prompt_groups, shared_prompt_states

    real_B_C = batch.attention_mask_B_L[:, -batch.completion_width :].bool()
    if way == "learner":
        logprobs_B_C = completion_logprobs(model, batch, 1.0, entropy="detached").logprobs_B_C
    else:
        if way == "one pass":
            logits_B_C_V = one_pass_states(model, batch, read_logits)[0]
        else:
            logits_B_C_V = shared_prompt_states(model, batch, prompt_groups(batch), read_logits)
        targets_B_C = batch.completion_ids_B_C
        logprobs_B_C = logits_logprobs(logits_B_C_V, targets_B_C, real_B_C, 1.0, "detached")[0]
    mask_B_C = batch.loss_mask_B_C
    loss = -(logprobs_B_C * mask_B_C).sum() / mask_B_C.sum()
    loss.backward()
    model.zero_grad(set_to_none=True)


def vm_kib(field: str) -> int:
    """A VmRSS / VmHWM line of /proc/self/status, in KiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def child(way: str, completion_width: int, repeats: int, threads: int, checkpointing: bool) -> dict:
    """Run one (way, C) measurement in this process; its numbers as a dict."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentgrpo.models.default_model import default_model_path

    torch.set_num_threads(threads)
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    if checkpointing:
        model.gradient_checkpointing_enable()  # non-reentrant: transformers' default
    batch = build_batch(tokenizer, completion_width)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current RSS
    before_kib = vm_kib("VmRSS")
    loss_step(model, batch, way)
    peak_mib = (vm_kib("VmHWM") - before_kib) / 1024
    times_s = []
    for _ in range(repeats):
        start = time.perf_counter()
        loss_step(model, batch, way)
        times_s.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times_s), "times_s": times_s, "peak_mib": peak_mib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completion-lengths", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("WAY", "C"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        way, width = args.child
        result = child(way, int(width), args.repeats, args.threads, args.gradient_checkpointing)
        print(json.dumps(result))
        return
    mode = "on" if args.gradient_checkpointing else "off"
    print(f"load average {os.getloadavg()}; gradient checkpointing {mode}", flush=True)
    print("| C | way | s per step (median) | steps (s) | peak RSS above start |")
    print("|---|---|---|---|---|")
    for width in args.completion_lengths:
        for way in WAYS:
            command = [sys.executable, __file__, "--child", way, str(width)]
            command += ["--repeats", str(args.repeats), "--threads", str(args.threads)]
            command += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
            result = json.loads(subprocess.run(command, check=True, capture_output=True).stdout)
            steps = ", ".join(f"{t:.2f}" for t in result["times_s"])
            print(
                f"| {width} | {way} | {result['median_s']:.2f} | {steps} |"
                f" {result['peak_mib']:.0f} MiB |",
                flush=True,
            )
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
