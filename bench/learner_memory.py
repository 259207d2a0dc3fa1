"""Peak memory and time of the learner's loss step: whole logits vs the chunked output layer.

One micro-batch of `compute_loss`'s work with the policy (completion logprobs, the entropy
detached, a token-mean loss, backward) on a Qwen2.5-0.5B-shaped model with random weights built
from its config (151,936-token vocabulary; nothing is downloaded), two ways:

- whole logits: each distinct prompt once, then the completions' B x C x V logits in one piece,
  upcast to float32 (what the learner did before `output_head`);
- learner: `completion_logprobs`, the final hidden states through the output layer a chunk of
  tokens at a time.

With `--fsdp2` the model is sharded by FSDP2 in accelerate's units (each decoder layer; the final
norm with the tied embedding and output layer; the root) in a process group of one, and the two
ways are those of a sharded model: whole logits from one pass over prompts and completions (what
the learner did before `InForwardScores`), and the learner scoring inside the forward.

Workload: `--rows` rows in groups of `--group` sharing a prompt of `--prompt` tokens, completions
of `--completion` tokens less 8 per row of a group (so they are right-padded), random token ids.
Per way and gradient checkpointing off and on: one warm-up step, then the peak memory of one
step above what was allocated before it (`torch.cuda.max_memory_allocated`; on a CPU the peak
resident memory above the step's start, sampled every millisecond, with allocations of 64 KiB
and more given back to the system when freed) and the median time of `--repeats` steps, and
the largest difference of the two ways' logprobs. `--layers` keeps the first N decoder layers
(the logits' share of the peak does not depend on them). Run on a GPU:
`python bench/learner_memory.py [--fsdp2]` (about a minute on one H100); on the CPU, e.g.
`--layers 4 --rows 8 --repeats 1`; `--tiny` runs a 2-layer model anywhere, as a smoke test.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

# bench/ holds a rollout.py that would shadow the rollout package; the repository root goes first.
HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if os.path.realpath(p or ".") != str(HERE)]

QWEN2_5_0_5B = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
TINY = {**QWEN2_5_0_5B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 4}


def build_batch(args: argparse.Namespace, vocabulary_size: int, device: torch.device):
    """`--rows` rows in groups sharing a prompt, completions right-padded, as a TrainingBatch."""
    from agentgrpo.learner.batch import TrainingBatch

    generator = torch.Generator().manual_seed(0)
    width_P, width_C = args.prompt, args.completion
    ids_B_L = torch.randint(0, vocabulary_size, (args.rows, width_P + width_C), generator=generator)
    mask_B_L = torch.ones_like(ids_B_L)
    for b in range(args.rows):
        ids_B_L[b, :width_P] = ids_B_L[b - b % args.group, :width_P]  # the group's prompt
        mask_B_L[b, width_P + width_C - 8 * (b % args.group) :] = 0
    positions_B_L = (mask_B_L.cumsum(-1) - 1).clamp(min=0)
    loss_mask_B_C = mask_B_L[:, width_P:].float()
    rows_B = torch.arange(args.rows)
    fields = (ids_B_L, mask_B_L, positions_B_L, loss_mask_B_C, loss_mask_B_C * 0)
    return TrainingBatch(*(t.to(device) for t in fields), rows_B.float().to(device), rows_B)


def logprobs(model, batch, way: str) -> torch.Tensor:
    from agentgrpo.learner.logprobs import completion_logprobs, logits_logprobs, one_pass_states
    from agentgrpo.learner.output_head import read_logits
    from agentgrpo.learner.shared_prompt import prompt_groups, shared_prompt_states
    from agentgrpo.models.sharded import fsdp_sharded

    sharded = fsdp_sharded(model)
    if way == "learner":
        return completion_logprobs(model, batch, 1.0, "detached", sharded=sharded).logprobs_B_C
    if sharded:
        logits_B_C_V = one_pass_states(model, batch, read_logits)[0]
    else:
        logits_B_C_V = shared_prompt_states(model, batch, prompt_groups(batch), read_logits)
    real_B_C = batch.attention_mask_B_L[:, -batch.completion_width :].bool()
    targets_B_C = batch.completion_ids_B_C
    return logits_logprobs(logits_B_C_V, targets_B_C, real_B_C, 1.0, "detached")[0]


def step(model, batch, way: str) -> torch.Tensor:
    logprobs_B_C = logprobs(model, batch, way)
    mask_B_C = batch.loss_mask_B_C
    (-(logprobs_B_C * mask_B_C).sum() / mask_B_C.sum()).backward()
    model.zero_grad(set_to_none=True)
    return logprobs_B_C.detach()


def measure(model, batch, way: str, repeats: int, device: torch.device) -> dict:
    cuda = device.type == "cuda"
    step(model, batch, way)  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    times_s = []
    with ResidentPeak() as resident:
        for _ in range(repeats):
            start = time.perf_counter()
            logprobs_B_C = step(model, batch, way)
            if cuda:
                torch.cuda.synchronize()
            times_s.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else resident.above_start
    return {"peak_mib": peak, "s": statistics.median(times_s), "logprobs": logprobs_B_C}


class ResidentPeak:
    """This process's peak resident memory above its start (MiB), sampled every millisecond."""

    def __enter__(self) -> ResidentPeak:
        self.start = self.peak = _resident_mib()
        self.done = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        self.sampler.join()

    def _sample(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, _resident_mib())

    @property
    def above_start(self) -> float:
        return self.peak - self.start


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def map_large_allocations() -> None:
    """Allocations of 64 KiB and more straight from the system, and back to it when freed, so
    that resident memory follows what torch holds (glibc's M_MMAP_THRESHOLD)."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)


def shard_as_accelerate_does(model: torch.nn.Module, device: torch.device) -> None:
    """FSDP2 over a process group of this one process, in accelerate's units."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    store = Path(tempfile.mkdtemp()) / "store"
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(
        [model.model.norm, model.model.embed_tokens, model.lm_head], reshard_after_forward=False
    )
    fully_shard(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--completion", type=int, default=270)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    parser.add_argument("--fsdp2", action="store_true", help="shard the model as accelerate does")
    parser.add_argument("--layers", type=int, help="keep the first N decoder layers")
    args = parser.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        map_large_allocations()
    torch.manual_seed(0)
    config = Qwen2Config(**(TINY if args.tiny else QWEN2_5_0_5B))
    config.num_hidden_layers = args.layers or config.num_hidden_layers
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).train()
    if args.fsdp2:
        shard_as_accelerate_does(model, device)
    batch = build_batch(args, config.vocab_size, device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else ""
    print(f"{device} {name} {dtype}{', FSDP2 (one process)' if args.fsdp2 else ''}")
    print(
        f"rows {args.rows} (groups of {args.group}), prompt {args.prompt} tokens, completions "
        f"up to {args.completion}, vocabulary {config.vocab_size}, "
        f"{config.num_hidden_layers} layers"
    )
    print("| checkpointing | way | peak MiB above start | s/step | learner / whole |")
    print("|---|---|---|---|---|")
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()  # non-reentrant: transformers' default
        whole = measure(model, batch, "whole logits", args.repeats, device)
        learner = measure(model, batch, "learner", args.repeats, device)
        mode = "on" if checkpointing else "off"
        for way, row in (("whole logits", whole), ("learner", learner)):
            ratio = learner["peak_mib"] / whole["peak_mib"] if way == "learner" else float("nan")
            print(f"| {mode} | {way} | {row['peak_mib']:.0f} | {row['s']:.3f} | {ratio:.2f} |")
        real = batch.loss_mask_B_C.bool()
        gap = (whole["logprobs"] - learner["logprobs"])[real].abs().max()
        print(f"checkpointing {mode}: largest logprob difference {float(gap):.2e}", flush=True)


if __name__ == "__main__":
    main()
