"""Two GRPO optimizer steps of a small local model, after which every process reports what it saw.

`tests/test_distributed.py` launches this script under several processes and compares the
reports; it is not a test module itself. By hand, from the repository root:

    accelerate launch --num_processes 2 --cpu --mixed_precision no \
        tests/distributed_train.py MODEL_DIR OUT_DIR

MODEL_DIR holds a causal LM and its tokenizer (`save_pretrained`). Each process writes
`OUT_DIR/process_<index>.json` with:

- `process_index`, `world_size`, `output_dir` (the run's, with its episode record);
- `rounds`: per generation round, the row ids it played and, per episode, its (group, row id),
  reward and advantage;
- `micro_batch_rows`: the row ids the DataLoader handed it for each micro-batch;
- `log_history`: `trainer.state.log_history`;
- `weights_before` / `weights_after`: the float64 sum of each parameter, by name.

Recording reads what the trainer computes and changes nothing: the subclass below calls the
original methods and returns their results untouched.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from datasets import Dataset

from agentgrpo import GRPOConfig, GRPOTrainer

NUM_ROWS = 16


def length_reward(completions: list[str]) -> list[float]:
    """Characters written, in tens: random tokens give every group a spread of rewards."""
    return [len(completion) / 10 for completion in completions]


class RecordingTrainer(GRPOTrainer):
    """`GRPOTrainer` that notes the rows, rewards and advantages of every round it plays."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds: list[dict] = []
        self.micro_batch_rows: list[list[int]] = []

    def _prepare_inputs(self, rows):
        if self.model.training:
            self.micro_batch_rows.append([row["id"] for row in rows])
        return super()._prepare_inputs(rows)

    def _new_round(self, rows, plan):
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


def parameter_sums(model: torch.nn.Module) -> dict[str, float]:
    """Every parameter's float64 sum, by name: equal dicts mean (almost surely) equal weights."""
    return {name: p.detach().double().sum().item() for name, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("model_dir", help="a saved causal LM with its tokenizer")
    parser.add_argument("out_dir", help="where each process writes process_<index>.json")
    parser.add_argument("--gpu", action="store_true", help="train on the GPU (default: CPU)")
    parser.add_argument("--scale-rewards", default="batch", choices=["group", "batch", "none"])
    cli = parser.parse_args()

    out_dir = Path(cli.out_dir)
    config = GRPOConfig(
        output_dir=str(out_dir / "run"),
        use_cpu=not cli.gpu,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,  # two micro-batches per round: two groups per process
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-3,  # large enough that two steps move every weight in float32
        scale_rewards=cli.scale_rewards,  # "batch": advantages need every process's rewards
        logging_steps=1,
        report_to="none",
        save_strategy="no",
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
    )
    weights_before = parameter_sums(trainer.model)
    trainer.train()

    model = trainer.accelerator.unwrap_model(trainer.model)
    report = {
        "process_index": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "output_dir": config.output_dir,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "rounds": trainer.rounds,
        "micro_batch_rows": trainer.micro_batch_rows,
        "log_history": trainer.state.log_history,
        "weights_before": weights_before,
        "weights_after": parameter_sums(model),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"process_{report['process_index']}.json"
    path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
