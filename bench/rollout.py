"""Rollout benchmarks: the async engine against a lock-step loop, and the engine's own overhead.

1. Engine vs lock-step, with a real tiny model (a random 2-layer Llama, hidden 64, over
   SmolLM2's tokenizer, tests/support/tiny_model.py). A random model never writes a tool call,
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
   the tool calls of turn k run, then turn k + 1. TRL 1.16 runs those calls one completion after
   another (`_tool_call_loop` loops over completions; a completion's async calls are gathered
   and awaited before the next), so that is the baseline the target is measured against. The
   script also times an idealised lock-step that runs all of a round's calls at once, to show
   which part of the gain is overlap of tools and which is not waiting per round. All loops use
   the same renderer, parser, tool caller and `TokenRow`, and the script checks that they end
   with the same token ids.

   Against the idealised lock-step the engine can hide at most the wait for each round's
   slowest tool, and only if its batches (formed from whatever requests are pending, hence
   often smaller) generate no slower than full ones; the script prints that bound. With every
   episode making the same number of calls of similar latency, that bound stays near 0.75 here.

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
# The tiny model is the tests' own (tests/support/tiny_model.py), so the benchmark measures the
# model the tests use. The repository root is appended last, for the `tests` package only.
sys.path.append(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import torch
from transformers import AutoTokenizer

from agentgrpo.models.default_model import default_model_path
from environments import Counter, environment_tools, reset_environment
from rollout import (
    ChatRenderer,
    Completion,
    EpisodeConfig,
    Pictures,
    RolloutEngine,
    SamplingParams,
    ScriptedBackend,
    TokenRow,
    TransformersBackend,
    get_parser,
    prompt_messages,
)
from tests.support.tiny_model import tiny_llama
from tools import call_tool

TOOL_ROUNDS = 3
TARGET = TOOL_ROUNDS  # each call adds 1, so the counter ends on target
PROMPT = f"Make the counter reach {TARGET}."
CONFIG = EpisodeConfig(max_completion_length=512, max_turns=10)
SPREAD = (0.5, 1.5)  # each tool call sleeps latency_s * uniform(*SPREAD)
LATENCIES_S = (0.0, 0.2)
TARGETS = {0.2: 0.5}  # tool latency -> the engine/lock-step ratio to reach


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
    """The real transformers backend, recording the rows and duration of every step it runs."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[int, float]] = []  # (rows, seconds) per step

    def _step(self, admitted: list) -> None:
        started, rows = time.perf_counter(), self.running_rows + len(admitted)
        super()._step(admitted)
        self.batches.append((rows, time.perf_counter() - started))


class RealComputeScriptedText:
    """A generation backend that spends real compute but answers with the scripted turn.

    The real backend samples exactly `len(turn)` tokens (its only stop id is outside the
    vocabulary); their logprobs are returned with the scripted ids.
    """

    def __init__(self, backend: TransformersBackend, script: Script):
        self.backend = backend
        self.script = script
        self.context_limit = backend.context_limit
        self.stop_token_ids = frozenset({script.eos})

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, pictures: Pictures | None = None
    ) -> Completion:
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

    tools: dict[str, Any]
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
        tokens = TokenRow(renderer.encode(prompt_text))
        return cls(environment_tools(env), messages, prompt_text, tokens)

    async def generate(self, backend: Any, renderer: ChatRenderer, parser: Callable) -> None:
        budget = CONFIG.max_completion_length - len(self.tokens)
        params = CONFIG.sampling(budget, None)  # unseeded: the backend seeds it, at the same cost
        completion = await backend.generate(self.tokens.context_ids, params)
        self.tokens.append_sampled(completion.token_ids, completion.logprobs)
        parsed = parser(renderer.tokenizer.decode(completion.token_ids[:-1]))
        self.calls = parsed.tool_calls
        self.done = not self.calls
        calls = [
            {"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
            for c in self.calls
        ]
        message = {"role": "assistant", "content": parsed.content}
        self.messages.append({**message, "tool_calls": calls} if calls else message)

    async def run_tools(self, renderer: ChatRenderer) -> None:
        results = [
            await call_tool(self.tools, c.name, c.arguments, CONFIG.tool_timeout_s)
            for c in self.calls
        ]
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


async def lock_step(
    backend: Any, renderer: ChatRenderer, rows: list[dict], tools_at_once: bool
) -> list[TokenRow]:
    """Generate turn k of every live episode as one batch, then run their tools.

    `tools_at_once=False` is what TRL 1.16's `_tool_call_loop` does: it runs the tool calls of
    one completion after another (a completion's async calls are gathered, then awaited before
    the next completion's start). `True` runs every episode's calls concurrently: an idealised
    lock-step, shown to separate the two gains (overlapping tools, and not waiting per round).
    """
    parser = get_parser("hermes")
    episodes = [LockStepEpisode.start(renderer, row, seed) for seed, row in enumerate(rows)]
    for _ in range(CONFIG.max_turns):
        live = [e for e in episodes if not e.done]
        if not live:
            break
        await together([lambda e=e: e.generate(backend, renderer, parser) for e in live])
        calling = [e for e in live if e.calls]
        if tools_at_once:
            await together([lambda e=e: e.run_tools(renderer) for e in calling])
        else:
            for episode in calling:
                await episode.run_tools(renderer)
    return [e.tokens for e in episodes]


@dataclasses.dataclass
class Timing:
    """Medians over the repeats of one loop at one tool latency."""

    wall_s: float
    generating_s: float  # time the backend spent running batches
    batch_sizes: list[int]  # of the last repeat


def time_loops(
    loops: dict[str, Callable], real: BatchRecordingBackend, rows: list[dict], repeats: int
) -> dict[str, Timing]:
    """Run each loop `repeats` times, interleaved; check that they all produce the same tokens."""
    walls: dict[str, list[float]] = {name: [] for name in loops}
    busy: dict[str, list[float]] = {name: [] for name in loops}
    sizes: dict[str, list[int]] = {}
    outputs = {}
    for _ in range(repeats):
        for name, run in loops.items():
            real.batches.clear()
            started = time.perf_counter()
            outputs[name] = anyio.run(run, rows)
            walls[name].append(time.perf_counter() - started)
            busy[name].append(sum(seconds for _, seconds in real.batches))
            sizes[name] = [size for size, _ in real.batches]
    first, *others = outputs.values()
    assert all(other == first for other in others), "the loops produced different tokens"
    return {
        name: Timing(statistics.median(walls[name]), statistics.median(busy[name]), sizes[name])
        for name in loops
    }


def engine_vs_lock_step(
    tokenizer: Any, episodes: int, repeats: int, latencies_s: Sequence[float]
) -> None:
    """Print the median wall time of both loops, and their ratio, for each tool latency."""
    script = Script(tokenizer)
    # The only stop id is outside the vocabulary: each request samples exactly max_tokens.
    real = BatchRecordingBackend(
        tiny_llama(tokenizer), [len(tokenizer)], tokenizer.pad_token_id, max_batch_size=episodes
    )
    backend = RealComputeScriptedText(real, script)
    engine = RolloutEngine(
        backend,
        tokenizer,
        environment_factory=SlowCounter,
        chat_template="chatml_tools",
        config=CONFIG,
    )

    async def run_engine(rows: list[dict]) -> list[list[int]]:
        return [e.completion_ids for e in await engine.run(rows)]

    def lock_step_loop(tools_at_once: bool) -> Callable:
        async def run(rows: list[dict]) -> list[list[int]]:
            tokens = await lock_step(backend, engine.context.renderer, rows, tools_at_once)
            return [t.completion_ids for t in tokens]

        return run

    loops = {
        "engine": run_engine,
        "lock-step": lock_step_loop(tools_at_once=False),
        "lock-step, tools at once": lock_step_loop(tools_at_once=True),
    }
    time_loops(loops, real, task_rows(min(episodes, 4), 0.0), repeats=1)  # warm-up
    print(
        f"\n[1] engine vs lock-step: {episodes} episodes x {TOOL_ROUNDS} tool rounds + answer, "
        f"real tiny model ({len(script.turns[0])} decode steps per tool-call turn), "
        f"median of {repeats}\n"
        f"    tool latency per call = latency x uniform{SPREAD}, from an RNG seeded per episode "
        f"(the same draws for both loops)"
    )
    for latency_s in latencies_s:
        rows = task_rows(episodes, latency_s)
        timings = time_loops(loops, real, rows, repeats)
        engine_s, lock_s = timings["engine"].wall_s, timings["lock-step"].wall_s
        ideal_s = timings["lock-step, tools at once"].wall_s
        print(
            f"  tools {latency_s * 1000:.0f} ms: engine {engine_s:.2f} s, "
            f"lock-step (TRL) {lock_s:.2f} s, engine/lock-step {engine_s / lock_s:.2f}"
            + (f" (target <= {TARGETS[latency_s]})" if latency_s in TARGETS else "")
            + busy_warning()
            + f"\n      vs lock-step with tools at once {ideal_s:.2f} s: "
            + f"ratio {engine_s / ideal_s:.2f}"
        )
        for name, timing in timings.items():
            sizes = timing.batch_sizes
            print(
                f"      {name + ':':10} {len(sizes):3} steps (mean {statistics.mean(sizes):4.1f} "
                f"rows), generating {timing.generating_s:.2f} s"
            )
        # With tools at once, lock-step still waits each round for that round's slowest call;
        # the engine can hide at most that waiting, and only if it generates no slower.
        waiting_s = sum(max(row["latencies_s"][k] for row in rows) for k in range(TOOL_ROUNDS))
        if waiting_s:
            print(
                f"      tools-at-once lock-step waits {waiting_s:.2f} s for the slowest tool of "
                f"each round; hiding all of it would give {(ideal_s - waiting_s) / ideal_s:.2f}"
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
            + busy_warning()
        )
        if profiler:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(10)


def busy_warning() -> str:
    """A warning when other processes compete for the cores (torch's threads then stall)."""
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    return f"  [load average {load:.1f} on {cores} cores: unreliable]" if load > cores else ""


def python_speed_ms() -> float:
    """Best of 5 of a fixed pure-Python loop: on a shared machine, how fast a core is just now."""
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        sum(range(10**6))
        timings.append(time.perf_counter() - started)
    return min(timings) * 1000


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

    print(
        f"cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}, "
        f"load average (1 min) {os.getloadavg()[0]:.1f}; "
        f"sum(range(10**6)) takes {python_speed_ms():.1f} ms (a shared core's speed varies)"
    )
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    engine_vs_lock_step(tokenizer, episodes, repeats, LATENCIES_S)
    engine_overhead(tokenizer, overhead_episodes, args.profile)
    print(f"\nsum(range(10**6)) takes {python_speed_ms():.1f} ms at the end")


if __name__ == "__main__":
    main()
