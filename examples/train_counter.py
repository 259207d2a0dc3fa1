"""Train SmolLM2 to play Counter with the Python API: a warm start, then GRPO.

Run (the same recipe as `agentgrpo run env:Counter`; docs/measurements.md has its measured time):

    python examples/train_counter.py [--model PATH] [--max-steps 16] [--output-dir runs/counter]

On several processes (GPUs, or CPU processes over gloo), the same script:

    accelerate launch --config_file examples/accelerate/ddp.yaml examples/train_counter.py

Counter asks the model to bring a counter to a target (1-9) by calling its `increment` tool; the
environment scores each episode itself (`Counter.reward`: 1.0 on the target), so no reward
function is passed. Untrained, SmolLM2 never calls a tool, so every episode of a group would
earn 0 and GRPO would have nothing to compare: the warm start first fine-tunes it on
`Counter.demonstrations()`, which show the call format (not the answers). Watch `reward` and
`tools/call_frequency` (tool calls per episode) in the logs.
"""

from __future__ import annotations

import argparse

import torch

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.models.default_model import default_model_path
from environments import Counter


def main(cli: argparse.Namespace) -> None:
    args = GRPOConfig(
        output_dir=cli.output_dir,
        max_steps=cli.max_steps,
        per_device_train_batch_size=cli.batch_size,  # completions per process per step
        num_generations=4,  # episodes per task row: rewards are compared within these groups
        learning_rate=5e-5,
        lr_scheduler_type="constant",
        max_completion_length=64,  # tokens per episode, tool responses included
        max_turns=2,  # model turns per episode: call increment, then answer
        beta=0.0,
        loss_type="dapo",
        gradient_checkpointing=False,  # a 135M model fits; recomputing only costs time
        chat_template="chatml_tools",  # SmolLM2's own template has no tool support
        warm_start_steps=cli.warm_start_steps,
        report_to="none",
        logging_steps=1,
        use_cpu=not torch.cuda.is_available(),  # lets ddp.yaml run DDP over CPU processes
    )
    trainer = GRPOTrainer(
        model=cli.model or str(default_model_path()),
        args=args,
        train_dataset=Counter.dataset(),  # 320 rows: a `prompt` and the `target` reset() reads
        environment_factory=Counter,  # a fresh Counter per episode; its methods are the tools
    )
    trainer.train()
    trainer.save_model(f"{cli.output_dir}/final")  # the model and its tokenizer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model folder (default: the embedded SmolLM2)")
    parser.add_argument("--max-steps", type=int, default=16, help="GRPO optimizer steps")
    parser.add_argument("--warm-start-steps", type=int, default=24, help="supervised steps first")
    parser.add_argument("--batch-size", type=int, default=8, help="a multiple of 4 (the group)")
    parser.add_argument("--output-dir", default="runs/counter")
    main(parser.parse_args())
