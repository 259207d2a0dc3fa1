"""Two GRPO optimizer steps of a small local model, after which every process reports what it saw.

`tests/end_to_end/test_distributed.py` launches this script under several processes and compares the
reports; it is not a test module itself. By hand, from the repository root:

    accelerate launch --num_processes 2 --cpu --mixed_precision no \
        tests/scripts/distributed_train.py MODEL_DIR OUT_DIR

MODEL_DIR holds a causal LM and its tokenizer (`save_pretrained`). Each process writes
`OUT_DIR/process_<index>.json` with:

- `process_index`, `world_size`, `output_dir` (the run's, with its episode record);
- `rounds`: per generation round, the row ids it played and, per episode, its (group, row id),
  reward and advantage;
- `micro_batch_rows`: the row ids the DataLoader handed it for each micro-batch;
- `log_history`: `trainer.state.log_history`;
- `weights_before` / `weights_after`: the float64 sum of each parameter, by name (after: the
  whole parameter, gathered from its shards under ZeRO-3 or FSDP2; on the main process only
  when the engine gathers to it alone);
- `forward_calls`: how many times the model's forward ran (generation and training);
- `max_rss_mib`: the process's peak resident memory.

The main process also saves the trained weights, whole and in float32, to `OUT_DIR/weights.pt`,
and with `--beta` > 0 the reference model's to `OUT_DIR/reference.pt` (`--sync-ref-model` mixes
the policy into it after every step, half and half).
With `--fixed-completions` the episodes come from a `rollout_func` that answers each prompt
with the same token ids whatever the process, seed or weights, so runs over different numbers
of processes train on identical episodes and their weights can be compared. `--save-steps`,
`--kill-in-step` and `--resume` checkpoint, kill the main process mid-step, and resume.

Recording reads what the trainer computes and changes nothing: the subclass below calls the
original methods and returns their results untouched.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import zlib
from functools import partial
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import load_file

from agentgrpo import GRPOConfig, GRPOTrainer

NUM_ROWS = 16


def length_reward(completions: list[str]) -> list[float]:
    """Characters written, in tens: random tokens give every group a spread of rewards."""
    return [len(completion) / 10 for completion in completions]


class RecordingTrainer(GRPOTrainer):
    """`GRPOTrainer` that notes the rows, rewards and advantages of every round it plays."""

    def __init__(self, *args, **kwargs):
        self.kill_in_step = kwargs.pop("kill_in_step", None)
        super().__init__(*args, **kwargs)
        self.rounds: list[dict] = []
        self.micro_batch_rows: list[list[int]] = []

    def _prepare_inputs(self, rows):
        if self.model.training:
            self.micro_batch_rows.append([row["id"] for row in rows])
        return super()._prepare_inputs(rows)

    def _new_round(self, rows, plan):
        if self.kill_in_step == self.state.global_step + 1 and self.accelerator.is_main_process:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step, as a lost machine would stop
        round_ = super()._new_round(rows, plan)
        self.rounds.append(
            {
                "rows": [row["id"] for row in rows],
                "episodes": [[episode.group, episode.row["id"]] for episode in round_.episodes],
                "rewards": round_.rewards_N_F[:, 0].tolist(),
                "advantages": round_.advantages_N.tolist(),
            }
        )
        return round_


def fixed_completions(
    prompts: list[str], trainer: GRPOTrainer, uneven_forwards: bool = False
) -> dict[str, list]:
    """A `rollout_func`: completion k of a prompt is a function of the prompt's text and k alone.

    Lengths vary (4 to 7 tokens), so rewards and advantages differ within each group. With
    `uneven_forwards` process p also runs the policy p + 1 times on its first prompt, as a
    sampler would whose episodes end at different lengths on different processes: generation
    must not need every process to run the same number of forwards.
    """
    tokenizer, generations = trainer.processing_class, trainer.args.num_generations
    if uneven_forwards:
        policy = trainer.accelerator.unwrap_model(trainer.model)
        ids_1_T = torch.tensor([tokenizer(prompts[0])["input_ids"]], device=policy.device)
        with torch.no_grad():
            for _ in range(trainer.accelerator.process_index + 1):
                policy(ids_1_T)
    prompt_ids, completion_ids = [], []
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        for k in range(generations):
            start = zlib.crc32(f"{prompt}/{k}".encode()) % 10_000 + 1_000
            completion_ids.append([start + 37 * t for t in range(4 + k % 4)])
            prompt_ids.append(ids)
    logprobs = [[0.0] * len(ids) for ids in completion_ids]  # float32: no sampler correction
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def saved_weights(model_dir: str) -> dict[str, torch.Tensor]:
    """The weights saved in `model_dir`, by parameter name (read from the file, not sharded)."""
    return load_file(str(Path(model_dir) / "model.safetensors"))


def parameter_sums(weights: dict[str, torch.Tensor], names: list[str]) -> dict[str, float]:
    """Every named tensor's float64 sum: equal dicts mean (almost surely) equal weights."""
    return {name: weights[name].double().sum().item() for name in names if name in weights}


def count_forward_calls(model: torch.nn.Module) -> list[int]:
    """A one-item list that counts the model's forward calls from now on."""
    calls = [0]

    def count(*_) -> None:
        calls[0] += 1

    model.register_forward_pre_hook(count)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model_dir", help="a saved causal LM with its tokenizer")
    parser.add_argument("out_dir", help="where each process writes process_<index>.json")
    parser.add_argument("--gpu", action="store_true", help="train on the GPU (default: CPU)")
    parser.add_argument("--scale-rewards", default="batch", choices=["group", "batch", "none"])
    parser.add_argument("--per-device-batch", type=int, default=4, help="episodes a micro-batch")
    parser.add_argument("--fixed-completions", action="store_true", help="see the docstring")
    parser.add_argument("--uneven-forwards", action="store_true", help="see fixed_completions")
    parser.add_argument("--beta", type=float, default=0.0, help="KL weight (a reference model)")
    parser.add_argument("--sync-ref-model", action="store_true", help="see the docstring")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--kill-in-step", type=int, help="SIGKILL the main process in step K")
    parser.add_argument("--resume", action="store_true", help="from the latest checkpoint")
    cli = parser.parse_args()

    out_dir = Path(cli.out_dir)
    config = GRPOConfig(
        output_dir=str(out_dir / "run"),
        use_cpu=not cli.gpu,
        per_device_train_batch_size=cli.per_device_batch,
        gradient_accumulation_steps=2,  # two micro-batches per round: two groups per process
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-3,  # large enough that two steps move every weight in float32
        scale_rewards=cli.scale_rewards,
        beta=cli.beta,  # "batch": advantages need every process's rewards
        sync_ref_model=cli.sync_ref_model,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=0.5,
        logging_steps=1,
        report_to="none",
        save_strategy="steps" if cli.save_steps else "no",
        save_steps=cli.save_steps or 500,
        seed=0,
    )
    dataset = Dataset.from_list(
        [{"id": i, "prompt": f"Tell me a fact about the number {i}."} for i in range(NUM_ROWS)]
    )
    trainer = RecordingTrainer(
        model=cli.model_dir,
        reward_funcs=length_reward,
        args=config,
        train_dataset=dataset,
        kill_in_step=cli.kill_in_step,
        rollout_func=(
            partial(fixed_completions, uneven_forwards=cli.uneven_forwards)
            if cli.fixed_completions
            else None
        ),
    )
    names = [name for name, _ in trainer.model.named_parameters()]
    forward_calls = count_forward_calls(trainer.model)
    trainer.train(resume_from_checkpoint=True if cli.resume else None)

    # Every process takes part: under ZeRO-3 and FSDP2 this gathers the shards.
    weights_after = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    out_dir.mkdir(parents=True, exist_ok=True)
    if trainer.accelerator.is_main_process:
        whole = {name: weights_after[name].float().cpu() for name in names}
        torch.save(whole, out_dir / "weights.pt")
        if trainer.ref_model is not None:
            reference = {n: t.float().cpu() for n, t in trainer.ref_model.named_parameters()}
            torch.save(reference, out_dir / "reference.pt")
    report = {
        "process_index": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "output_dir": config.output_dir,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "rounds": trainer.rounds,
        "micro_batch_rows": trainer.micro_batch_rows,
        "log_history": trainer.state.log_history,
        "weights_before": parameter_sums(saved_weights(cli.model_dir), names),
        "weights_after": parameter_sums(weights_after or {}, names),
        "forward_calls": forward_calls[0],
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
    }
    path = out_dir / f"process_{report['process_index']}.json"
    path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
