"""Rollout benchmarks: the async engine against a lock-step loop, and the engine's own overhead.

1. Engine vs lock-step, with a real tiny model (a random 2-layer Llama, hidden 64, over
   SmolLM2's tokenizer, built as in tests/conftest.py). A random model never writes a tool call,
   so every generation request goes through `RealComputeScriptedText`: it runs the REAL
   `TransformersBackend` (real batched forward passes and sampling, exactly as many decode steps
   as the scripted turn has tokens, since the backend is given a stop id outside the vocabulary
   and so never stops early), then returns the scripted token ids in place of the sampled ones,
   with the real sampler logprobs (one per token). The compute is real; the text is scripted so
   that every episode makes exactly 3 tool calls, then answers. The tool sleeps
   `latency_s * uniform(0.5, 1.5)` per call (`await anyio.sleep`), drawn from an RNG seeded per
   episode, so both loops see the same latencies.

   The lock-step loop is written here, the way TRL runs tool episodes: turn k of every episode
   is generated in one batch (all requests submitted concurrently to the same backend), then
   every tool call of turn k runs (concurrently), then turn k + 1. It uses the same renderer,
   parser, tool caller and `TokenRow`, and the script checks that both loops end with the same
   token ids.

2. Engine overhead: `ScriptedBackend` with no delay, 1,000 episodes of 3 instant tool rounds
   each; seconds per turn, and a cProfile top 10 with `--profile`.

Run: `python bench/rollout.py` (`--quick` for a smoke run).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import random
import statistics
import sys
import time

# This script is named like the package it measures, and `python bench/rollout.py` puts bench/
# first on the path, where `import rollout` would find this file: take that entry out.
sys.path.remove(os.path.dirname(os.path.realpath(__file__)))

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from agentgrpo.default_model import default_model_path
from environments import Counter, environment_tools, reset_environment
from rollout import (
    ChatRenderer,
    Completion,
    EpisodeConfig,
    RolloutEngine,
    SamplingParams,
    ScriptedBackend,
    TokenRow,
    TransformersBackend,
    get_parser,
    prompt_messages,
)
from tools import call_tool

TOOL_ROUNDS = 3
TARGET = TOOL_ROUNDS  # each call adds 1, so the counter ends on target
PROMPT = f"Make the counter reach {TARGET}."
CONFIG = EpisodeConfig(max_completion_length=512, max_turns=10)
SPREAD = (0.5, 1.5)  # each tool call sleeps latency_s * uniform(*SPREAD)


class Script:
    """The scripted turns: `TOOL_ROUNDS` calls of `increment(step=1)`, then an answer.

    Called with an episode's context, it returns the ids of the episode's next turn (ending on
    the end-of-turn token). The turn number is read from the ChatML headers in the context: the
    prompt opens 3 turns (system, user, assistant) and every tool round opens 2 (tool, assistant).
    """

    def __init__(self, tokenizer: Any):
        call = json.dumps({"name": "increment", "arguments": {"step": 1}})
        texts = [f"<tool_call>{call}</tool_call>"] * TOOL_ROUNDS + ["Done."]
        self.eos = tokenizer.eos_token_id
        self.turns = [[*tokenizer.encode(t, add_special_tokens=False), self.eos] for t in texts]
        self.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")

    def __call__(self, context: list[int]) -> list[int]:
        turn = (context.count(self.im_start) - 3) // 2
        return self.turns[min(turn, len(self.turns) - 1)]


class BatchRecordingBackend(TransformersBackend):
    """The real transformers backend, recording the size of every batch it runs."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.batch_sizes: list[int] = []

    def _run_batch(self, batch: list) -> None:
        self.batch_sizes.append(len(batch))
        super()._run_batch(batch)


class RealComputeScriptedText:
    """A generation backend that spends real compute but answers with the scripted turn.

    The real backend samples exactly `len(turn)` tokens (its only stop id is outside the
    vocabulary); their logprobs are returned with the scripted ids.
    """

    def __init__(self, backend: TransformersBackend, script: Script):
        self.backend = backend
        self.script = script
        self.context_limit = backend.context_limit

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        ids = self.script(prompt_ids)[: params.max_tokens]
        real = dataclasses.replace(params, max_tokens=len(ids))
        sampled = await self.backend.generate(prompt_ids, real)
        assert len(sampled.token_ids) == len(ids), "the real backend stopped early"
        return Completion(ids, sampled.logprobs, stopped=ids[-1] == self.script.eos)


class SlowCounter(Counter):
    """The Counter task, whose tool takes the row's latencies, one per call."""

    def reset(self, target: int, latencies_s: Sequence[float]) -> str:
        """Start at 0; `latencies_s` are the sleeps of this episode's calls, in order."""
        self.latencies_s = list(latencies_s)
        return super().reset(target)

    async def increment(self, step: int) -> int:
        """Add step to the counter and return its new value.

        Args:
            step: Value to add.
        """
        await anyio.sleep(self.latencies_s.pop(0) if self.latencies_s else 0.0)
        return super().increment(step)


def task_rows(episodes: int, latency_s: float) -> list[dict[str, Any]]:
    """One row per episode; its tool latencies come from an RNG seeded with its index."""
    rows = []
    for i in range(episodes):
        rng = random.Random(i)
        latencies_s = [latency_s * rng.uniform(*SPREAD) for _ in range(TOOL_ROUNDS)]
        rows.append({"prompt": PROMPT, "target": TARGET, "latencies_s": latencies_s})
    return rows


@dataclasses.dataclass
class LockStepEpisode:
    """One episode of the lock-step loop: the same bookkeeping the engine does, step by step."""

    env: SlowCounter
    messages: list[dict[str, Any]]
    prompt_text: str
    tokens: TokenRow
    calls: list = dataclasses.field(default_factory=list)
    done: bool = False

    @classmethod
    def start(cls, renderer: ChatRenderer, row: dict[str, Any], seed: int) -> LockStepEpisode:
        env = SlowCounter()
        messages = prompt_messages(row)
        observation = reset_environment(env, row, seed)
        messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']}\n{observation}"}
        prompt_text = renderer.render(messages, generation_prompt=True)
        return cls(env, messages, prompt_text, TokenRow(renderer.encode(prompt_text)))

    async def generate(self, backend: Any, renderer: ChatRenderer, parser: Callable) -> None:
        budget = CONFIG.max_completion_length - len(self.tokens)
        completion = await backend.generate(self.tokens.context_ids, CONFIG.sampling(budget))
        self.tokens.append_sampled(completion.token_ids, completion.logprobs)
        parsed = parser(renderer.tokenizer.decode(completion.token_ids[:-1]))
        self.calls = parsed.tool_calls
        self.done = not self.calls
        calls = [{"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
                 for c in self.calls]  # fmt: skip
        message = {"role": "assistant", "content": parsed.content}
        self.messages.append({**message, "tool_calls": calls} if calls else message)

    async def run_tools(self, renderer: ChatRenderer) -> None:
        tools = environment_tools(self.env)
        results = [await call_tool(tools, c.name, c.arguments, CONFIG.tool_timeout_s)
                   for c in self.calls]  # fmt: skip
        replies = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        stop_text = renderer.tokenizer.decode([self.tokens.completion_ids[-1]])
        delta, self.prompt_text = renderer.tool_turn_ids(
            self.prompt_text, self.messages, replies, stop_text
        )
        self.messages.extend(replies)
        self.tokens.append_context(delta)


async def together(jobs: Sequence[Callable[[], Awaitable[None]]]) -> None:
    """Run the jobs concurrently and wait for all of them."""
    async with anyio.create_task_group() as group:
        for job in jobs:
            group.start_soon(job)


async def lock_step(backend: Any, renderer: ChatRenderer, rows: list[dict]) -> list[TokenRow]:
    """TRL's loop: generate turn k of every live episode as one batch, then run their tools."""
    parser = get_parser("hermes")
    episodes = [LockStepEpisode.start(renderer, row, seed) for seed, row in enumerate(rows)]
    for _ in range(CONFIG.max_turns):
        live = [e for e in episodes if not e.done]
        if not live:
            break
        await together([lambda e=e: e.generate(backend, renderer, parser) for e in live])
        await together([lambda e=e: e.run_tools(renderer) for e in live if e.calls])
    return [e.tokens for e in episodes]


def tiny_model(tokenizer: Any) -> LlamaForCausalLM:
    """The tests' tiny model: a seeded random 2-layer Llama (hidden 64) over SmolLM2's vocab."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def engine_vs_lock_step(
    tokenizer: Any, episodes: int, repeats: int, latencies_s: Sequence[float]
) -> None:
    """Print the median wall time of both loops, and their ratio, for each tool latency."""
    script = Script(tokenizer)
    model = tiny_model(tokenizer)
    # The only stop id is outside the vocabulary: each request samples exactly max_tokens.
    real = BatchRecordingBackend(
        model, [len(tokenizer)], tokenizer.pad_token_id, max_batch_size=episodes
    )
    backend = RealComputeScriptedText(real, script)
    engine = RolloutEngine(
        backend,
        tokenizer,
        environment_factory=SlowCounter,
        chat_template="chatml_tools",
        config=CONFIG,
    )
    renderer = engine.context.renderer

    async def run_engine(rows: list[dict]) -> list[list[int]]:
        return [e.completion_ids for e in await engine.run(rows, seed=0)]

    async def run_lock_step(rows: list[dict]) -> list[list[int]]:
        return [t.completion_ids for t in await lock_step(backend, renderer, rows)]

    loops = {"engine": run_engine, "lock-step": run_lock_step}
    for run in loops.values():  # warm-up, untimed
        anyio.run(run, task_rows(min(episodes, 4), 0.0))
    print(
        f"\n[1] engine vs lock-step: {episodes} episodes x {TOOL_ROUNDS} tool rounds + answer, "
        f"real tiny model, median of {repeats}"
    )
    print(
        f"    tool latency per call = latency x uniform{SPREAD}, seeded per episode (same draws "
        f"for both); {len(script.turns[0])} real decode steps per tool-call turn"
    )
    for latency_s in latencies_s:
        rows = task_rows(episodes, latency_s)
        seconds: dict[str, list[float]] = {name: [] for name in loops}
        batches: dict[str, list[int]] = {}
        outputs = {}
        for _ in range(repeats):
            for name, run in loops.items():
                real.batch_sizes.clear()
                started = time.perf_counter()
                outputs[name] = anyio.run(run, rows)
                seconds[name].append(time.perf_counter() - started)
                batches[name] = list(real.batch_sizes)
        assert outputs["engine"] == outputs["lock-step"], "the loops produced different tokens"
        engine_s, lock_s = (statistics.median(seconds[name]) for name in loops)
        print(
            f"  tools {latency_s * 1000:.0f} ms: engine {engine_s:.2f} s, "
            f"lock-step {lock_s:.2f} s, engine/lock-step {engine_s / lock_s:.2f} "
            f"(target <= 0.5 at 200 ms)"
        )
        for name, sizes in batches.items():
            print(
                f"      {name}: {sum(sizes)} requests in {len(sizes)} batches "
                f"(mean {statistics.mean(sizes):.1f}, max {max(sizes)})"
            )


def engine_overhead(tokenizer: Any, episodes: int, profile: bool) -> None:
    """Print the engine's seconds per turn against an instant backend and instant tools."""
    script = Script(tokenizer)
    print(f"\n[2] engine overhead: ScriptedBackend (no delay), {episodes} episodes")
    kinds = {
        "sync tool (Counter, worker thread)": (Counter, {}),
        "async tool (SlowCounter, 0 s)": (SlowCounter, {"latencies_s": [0.0] * TOOL_ROUNDS}),
    }
    for name, (environment, columns) in kinds.items():
        engine = RolloutEngine(
            ScriptedBackend(script, [script.eos]),
            tokenizer,
            environment_factory=environment,
            chat_template="chatml_tools",
            config=CONFIG,
        )
        rows = [{"prompt": PROMPT, "target": TARGET, **columns}] * episodes
        profiler = cProfile.Profile() if profile else None
        started = time.perf_counter()
        if profiler:
            results = profiler.runcall(anyio.run, engine.run, rows)
        else:
            results = anyio.run(engine.run, rows)
        seconds = time.perf_counter() - started
        turns = sum(e.stats.turns for e in results)
        assert turns == episodes * (TOOL_ROUNDS + 1), "episodes did not play the script"
        print(
            f"  {name}: {turns} turns in {seconds:.2f} s = {seconds / turns * 1000:.3f} ms per "
            f"turn (target well under 1 ms){' [under cProfile]' if profiler else ''}"
        )
        if profiler:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32, help="episodes per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per loop and latency")
    parser.add_argument("--quick", action="store_true", help="small numbers, for a smoke run")
    parser.add_argument("--profile", action="store_true", help="cProfile the overhead run")
    args = parser.parse_args()
    episodes, repeats, overhead_episodes = args.episodes, args.repeats, 1000
    if args.quick:
        episodes, repeats, overhead_episodes = min(episodes, 4), 1, 100

    print(f"cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}")
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    engine_vs_lock_step(tokenizer, episodes, repeats, latencies_s=(0.0, 0.2))
    engine_overhead(tokenizer, overhead_episodes, args.profile)


if __name__ == "__main__":
    main()
