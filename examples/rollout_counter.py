"""Play Counter episodes with the embedded SmolLM2-135M-Instruct and print them.

Run: `python examples/rollout_counter.py [--rows 4] [--generations 2] [--temperature 1.0]`
(`--model DIR` plays another local model instead).

This drives the rollout engine as the trainer will: a fresh Counter per episode, the project's
ChatML tool template, the transformers backend, all episodes concurrent. Untrained, SmolLM2
answers in prose instead of calling `increment` (it never calls tools zero-shot); training is
what changes that.
"""

from __future__ import annotations

import argparse

import anyio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgrpo.models.default_model import default_model_path
from environments import Counter
from rollout import EpisodeConfig, RolloutEngine, TransformersBackend


def show(episode, tokenizer) -> None:
    """Print an episode's completions with tool/template tokens (mask 0) marked, row by row."""
    print(
        f"--- group {episode.group} episode {episode.index}: {episode.finish}, "
        f"reward {episode.env_reward}, {episode.stats}, {len(episode.rows)} row(s)"
    )
    for number, row in enumerate(episode.rows):
        if number:
            print("[fork: a new row starts from the template's fresh rendering]")
        spans, start = [], 0
        for i in range(1, len(row.loss_mask) + 1):
            if i == len(row.loss_mask) or row.loss_mask[i] != row.loss_mask[start]:
                spans.append((row.loss_mask[start], row.completion_ids[start:i]))
                start = i
        for mask, ids in spans:
            text = tokenizer.decode(ids)
            print(text if mask else f"[tool turn, not trained on]{text}[/tool turn]")


async def main(args: argparse.Namespace) -> None:
    path = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = RolloutEngine(
        TransformersBackend.from_tokenizer(model, tokenizer),
        tokenizer,
        environment_factory=Counter,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=96, max_turns=3, temperature=args.temperature),
    )
    rows = Counter.dataset("eval").select(range(args.rows))
    episodes = await engine.run(list(rows), num_generations=args.generations)
    for episode in episodes:
        show(episode, tokenizer)
    called = sum(e.stats.tool_calls > 0 for e in episodes)
    solved = sum(e.env_reward == 1.0 for e in episodes)
    print(f"\n{len(episodes)} episodes: {called} called a tool, {solved} reached the target")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local model folder (default: the embedded SmolLM2)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    anyio.run(main, parser.parse_args())
