"""Short GRPO runs of the tiny model on the CPU: their config, a reward, and what they logged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from agentgrpo import GRPOConfig, GRPOTrainer
from environments import ColourSquare, Counter
from tests.support.runs import QUIET_CPU_RUN
from tests.support.tiny_model import tiny_llama


def short_run_config(output_dir: str | Path, **fields: Any) -> GRPOConfig:
    """Two steps of 4 rows in groups of 4, up to 8 tokens each, at lr 1e-2, seed 0, quietly.

    `fields` add to or override any of it (QUIET_CPU_RUN included).
    """
    run = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        max_steps=2,
        seed=0,
    )
    return GRPOConfig(**(run | QUIET_CPU_RUN | fields))


def tiny_trainer(tokenizer, /, *arguments, **keywords) -> GRPOTrainer:
    """GRPOTrainer(tiny_llama(tokenizer), *arguments, processing_class=tokenizer, **keywords)."""
    return GRPOTrainer(tiny_llama(tokenizer), *arguments, processing_class=tokenizer, **keywords)


def rank_in_call(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Rewards 0, 1, 2, ... in the order the completions come: no group ever ties.

    The trainer scores whole groups, so the rewards inside every group differ whatever was
    sampled: every GRPO step has nonzero advantages (a reward read from the samples, such as
    their length, can tie in a whole group and leave a step without a gradient).
    """
    return [float(k) for k in range(len(completion_ids))]


def colour_square_run(model, processor, output_dir: str | Path, **fields: Any) -> GRPOTrainer:
    """One GRPO step of the VLM `model` on ColourSquare's first 4 rows; the trained trainer.

    short_run_config's run in groups of 2, in `chatml_vision`, with its episodes logged, rewarded
    by rank_in_call (an untrained model never answers right); `fields` add to or override it.
    """
    run = dict(num_generations=2, max_steps=1, chat_template="chatml_vision", log_episodes=True)
    args = short_run_config(output_dir, **(run | fields))
    rows = ColourSquare.dataset("train").select(range(4))
    trainer = GRPOTrainer(
        model,
        rank_in_call,
        args,
        rows,
        processing_class=processor,
        environment_factory=ColourSquare,
    )
    trainer.train()
    return trainer


def logged(trainer: Any, name: str) -> list[Any]:
    """The values `trainer` logged under `name`, one per log entry that has it, in order."""
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def train_after_warm_start(model, tokenizer, output_dir, steps: int, **fields) -> GRPOTrainer:
    """Counter: `steps` warm-start steps at lr 1e-3, then one GRPO step at lr 0; the trainer.

    GRPO changes nothing, so every change to the weights is the warm start's. 2 rows in groups
    of 2, up to 16 tokens each; `fields` add to the config.
    """
    run = dict(max_steps=1, per_device_train_batch_size=2, num_generations=2)
    warm = dict(warm_start_steps=steps, warm_start_learning_rate=1e-3, learning_rate=0.0)
    quiet = dict(save_strategy="no", report_to="none", use_cpu=True)
    args = GRPOConfig(str(output_dir), max_completion_length=16, **run, **warm, **quiet, **fields)
    trainer = GRPOTrainer(model, args=args, processing_class=tokenizer, environment_factory=Counter)
    trainer.train()
    return trainer


class StopAfter(TrainerCallback):
    """Stops a run after `step` optimizer steps: a crash, politely (with a checkpoint if `save`)."""

    def __init__(self, step: int, save: bool = False):
        self.step, self.save = step, save

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = self.save or control.should_save
            control.should_training_stop = True
