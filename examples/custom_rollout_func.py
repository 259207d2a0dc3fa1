"""Generate the completions yourself: a TRL-style `rollout_func` in place of agentgrpo's engine.

Run:

    python examples/custom_rollout_func.py [--model PATH] [--max-steps 4] [--output-dir DIR]

The contract (TRL's): each generation round the trainer calls `rollout_func(prompts, trainer)`
with the `prompt` of every task row it plays, each `trainer.args.num_generations` times in a
row (one entry per completion to sample), and expects a dict with one entry per completion, in
the order of `prompts`:

- `prompt_ids`: list[list[int]], the prompt's token ids;
- `completion_ids`: list[list[int]], the tokens after the prompt, ending with the end-of-turn
  token when the model stopped by itself (otherwise the completion counts as cut off);
- `logprobs`: list[list[float]], the sampler's log-probability of each completion token;
- `env_mask` (optional): list[list[int]], 1 where the model sampled the token, 0 where your code
  appended it (a tool result, say); 0-tokens are kept in context but never trained on;
- any other key: one value per completion, handed to the reward functions as an argument of
  that name (`stopped` below).

This one samples with the policy itself (`generate`), so it is one model turn and appends
nothing of its own: every token is the model's and `env_mask` is left out.
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.models.default_model import default_model_path

QUESTIONS = [
    "Answer in one word: what colour is the sky on a clear day?",
    "Answer in one word: what is the opposite of hot?",
    "Answer in one word: which animal says meow?",
    "Answer in one word: what do bees make?",
]


@torch.no_grad()
def rollout_func(prompts: list[list[dict]], trainer: GRPOTrainer) -> dict[str, list]:
    """Sample `num_generations` answers per prompt with the trainer's current weights."""
    model = trainer.accelerator.unwrap_model(trainer.model)  # in eval mode during rollouts
    tokenizer, args = trainer.processing_class, trainer.args
    end_of_turn = tokenizer.eos_token_id
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "stopped": []}
    for messages in prompts[:: args.num_generations]:  # each task once: it samples a group
        prompt_ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        generated = model.generate(
            torch.tensor([prompt_ids], device=model.device),
            do_sample=True,
            temperature=args.temperature,
            top_k=0,  # plain sampling at `temperature`: the distribution the loss assumes
            top_p=1.0,
            max_new_tokens=args.max_completion_length,
            num_return_sequences=args.num_generations,
            eos_token_id=end_of_turn,
            pad_token_id=tokenizer.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        sampled_G_T = generated.sequences[:, len(prompt_ids) :]
        logits_G_T_V = torch.stack(generated.logits, dim=1).float() / args.temperature
        logprobs_G_T = logits_G_T_V.log_softmax(-1).gather(-1, sampled_G_T[..., None])[..., 0]
        for ids, logprobs in zip(sampled_G_T.tolist(), logprobs_G_T.tolist(), strict=True):
            # generate pads a finished sequence; keep it up to its end-of-turn token.
            length = ids.index(end_of_turn) + 1 if end_of_turn in ids else len(ids)
            out["prompt_ids"].append(prompt_ids)
            out["completion_ids"].append(ids[:length])
            out["logprobs"].append(logprobs[:length])
            out["stopped"].append(end_of_turn in ids)
    return out


def one_word(completions: list[list[dict]], stopped: list[bool], **kwargs) -> list[float]:
    """1.0 for an answer of one word that the model ended itself; `stopped` is rollout_func's."""
    words = [len(completion[-1]["content"].split()) for completion in completions]
    return [1.0 if done and n == 1 else 0.0 for n, done in zip(words, stopped, strict=True)]


def main(cli: argparse.Namespace) -> None:
    args = GRPOConfig(
        output_dir=cli.output_dir,
        max_steps=cli.max_steps,
        per_device_train_batch_size=cli.batch_size,
        num_generations=4,
        learning_rate=5e-5,
        lr_scheduler_type="constant",
        max_completion_length=32,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = GRPOTrainer(
        model=cli.model or str(default_model_path()),
        reward_funcs=one_word,
        args=args,
        train_dataset=Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS] * 25}
        ),
        rollout_func=rollout_func,
    )
    trainer.train()
    trainer.save_model(f"{cli.output_dir}/final")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model folder (default: the embedded SmolLM2)")
    parser.add_argument("--max-steps", type=int, default=4, help="GRPO optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="a multiple of 4 (the group)")
    parser.add_argument("--output-dir", default="runs/custom_rollout")
    main(parser.parse_args())
