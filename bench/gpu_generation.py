"""Generation on a GPU: agentgrpo's transformers backend, its decoding options, and transformers.

The workload is the decoding half of `bench/gpu_step.py`'s `one-round` step: a Qwen2.5-0.5B-shaped
model with random weights (`bench/configs/qwen2.5-0.5b.json`, seed 0) in bfloat16 on CUDA,
8 prompts of about 220 tokens x 8 samples each (64 rows), 256 new tokens forced (no stop id),
temperature 1.0. Options, each one warm-up run then `--repeats` timed ones:

- `slots-graphs` / `slots-graphs-16`: the backend's `SlotBatch` (static cache, sampling on the
  device), 8 or 16 steps per host round trip, the step replayed as CUDA graphs (the default);
- `slots-eager`: the same without graphs;
- `dynamic`: the CPU path (`DynamicBatch`: growing cache, host sampling each token), on
  `--dynamic-tokens` new tokens only (it is slow), scaled to the full length in the table;
- `hf-generate`: `model.generate` over the 64 left-padded rows with `min_new_tokens`, as TRL's
  transformers path generates;
- `hf-continuous`: transformers' own continuous batching (`model.generate_batch`), when the
  installed transformers has it.

It also checks the sampler: the logprobs `slots-graphs` returned against a teacher-forced forward
of the same model over the same tokens (bf16: differences of about 1e-3 are rounding), and that
greedy decoding gives the same tokens with and without graphs.

Run on a CUDA machine: `python bench/gpu_generation.py --tokenizer DIR` (DIR: any tokenizer
folder, e.g. SmolLM2's, see bench/README.md); `--json FILE` writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(__file__)]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIG = Path(__file__).resolve().parent / "configs" / "qwen2.5-0.5b.json"
GROUPS, GROUP_SIZE = 8, 8
_SENTENCES = (
    "A ferry crosses the lake four times a day and carries bicycles for free.",
    "The old mill by the river now houses a small museum of farm tools.",
    "Snow closed the pass for two weeks, so the village bought a second plough.",
    "Each spring the school plants a row of cherry trees along the north road.",
    "The market sells cheese from six farms and bread baked before dawn.",
    "A new footbridge joins the two halves of the park across the canal.",
    "Volunteers repaired the roof of the chapel with slate from the quarry.",
    "The library keeps a map of every well dug in the valley since 1850.",
)


def random_model(config_path: Path, dtype: Any, device: str, seed: int = 0) -> Any:
    """A causal LM with random weights from a config file (no hub, no weights travel)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_path.read_text())
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(device=device, dtype=dtype)


def long_prompts(tokenizer: Any, count: int) -> list[list[dict]]:
    """`count` user prompts of about 220 tokens each, all different."""
    prompts = []
    for i in range(count):
        text = " ".join(_SENTENCES[(i + k) % len(_SENTENCES)] for k in range(12))
        content = f"Note {i + 1}. {text} Retell the note, then list what it leaves unsaid."
        prompts.append([{"role": "user", "content": content}])
    return prompts


def prompt_ids(tokenizer: Any) -> list[list[int]]:
    """The 64 rows: each of the 8 prompts 8 times, as GRPO groups them."""
    groups = [
        tokenizer.apply_chat_template(
            p, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for p in long_prompts(tokenizer, GROUPS)
    ]
    return [list(ids) for ids in groups for _ in range(GROUP_SIZE)]


def run_backend(
    model: Any, rows: list[list[int]], tokens: int, **options: Any
) -> tuple[float, list]:
    """Seconds to generate every row through a fresh `TransformersBackend`, and the completions."""
    import anyio

    from rollout import SamplingParams, TransformersBackend

    temperature = options.pop("temperature", 1.0)
    backend = TransformersBackend(model, stop_token_ids=[2], pad_token_id=2, seed=0, **options)
    backend.stop_token_ids = frozenset()  # no stop: every row runs to `tokens`
    results: list = [None] * len(rows)

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=tokens, temperature=temperature, seed=i)
        results[i] = await backend.generate(rows[i], params)

    async def all_rows() -> None:
        async with anyio.create_task_group() as group:
            for i in range(len(rows)):
                group.start_soon(one, i)

    _sync()
    started = time.perf_counter()
    anyio.run(all_rows)
    _sync()
    return time.perf_counter() - started, results


def run_hf_generate(model: Any, rows: list[list[int]], tokens: int) -> float:
    """Seconds for `model.generate` over the left-padded rows, `tokens` new tokens each."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.tensor([[2] * (width - len(r)) + r for r in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
    _sync()
    started = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        pad_token_id=2,
    )
    _sync()
    return time.perf_counter() - started


def run_hf_continuous(model: Any, rows: list[list[int]], tokens: int) -> float:
    """Seconds for transformers' continuous batching (`generate_batch`) over the rows."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        eos_token_id=-1,
        pad_token_id=2,
    )
    implementation = model.config._attn_implementation
    model.set_attn_implementation("sdpa")  # continuous batching refuses agentgrpo's sdpa_gqa
    try:
        _sync()
        started = time.perf_counter()
        model.generate_batch(inputs=rows, generation_config=config, progress_bar=False)
        _sync()
        return time.perf_counter() - started
    finally:
        model.set_attn_implementation(implementation)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(name: str, run, repeats: int, scale: float = 1.0) -> dict:
    """One warm-up, then `repeats` timed calls of `run()`: median seconds (scaled) and peak GiB."""
    import torch

    cuda = torch.cuda.is_available()
    try:
        run()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        seconds = [run() for _ in range(repeats)]
    except Exception as error:  # an option that cannot run here is reported, not fatal
        return {"option": name, "error": f"{type(error).__name__}: {error}"[:400]}
    median = statistics.median(seconds) * scale
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0
    return {
        "option": name,
        "median_s": round(median, 3),
        "runs_s": seconds,
        "extra_gib": round(extra, 2),
    }


def check_sampler(model: Any, rows: list[list[int]], completions: list) -> dict:
    """Sampler logprobs against a teacher-forced forward over the same tokens (first 8 rows)."""
    import torch

    diffs = []
    for prompt, completion in zip(rows[:8], completions[:8], strict=True):
        ids = torch.tensor([prompt + completion.token_ids], device=model.device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        forward = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        diffs.append((forward.cpu() - torch.tensor(completion.logprobs)).abs())
    every = torch.cat(diffs)
    return {"mean_abs": float(every.mean()), "max_abs": float(every.max()), "tokens": len(every)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--config", default=str(CONFIG), help="the model's config.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dynamic-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--options",
        default="slots-graphs,slots-graphs-16,slots-eager,dynamic,hf-generate,hf-continuous",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    from agentgrpo.models.attention import use_grouped_query_sdpa

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = random_model(Path(args.config), dtype, args.device).eval()
    use_grouped_query_sdpa(model)  # as GRPOTrainer loads a policy
    rows = prompt_ids(tokenizer)
    n = args.tokens
    runs = {
        "slots-graphs": lambda: run_backend(model, rows, n)[0],
        "slots-graphs-16": lambda: run_backend(model, rows, n, chunk_steps=16)[0],
        "slots-eager": lambda: run_backend(model, rows, n, cuda_graphs=False)[0],
        "dynamic": lambda: run_backend(model, rows, args.dynamic_tokens, static_cache=False)[0],
        "hf-generate": lambda: run_hf_generate(model, rows, n),
        "hf-continuous": lambda: run_hf_continuous(model, rows, n),
    }
    results = []
    for name in args.options.split(","):
        scale = n / args.dynamic_tokens if name == "dynamic" else 1.0
        results.append(timed(name, runs[name], args.repeats, scale))
        print(json.dumps(results[-1]), flush=True)
    _, sampled = run_backend(model, rows, n)
    checks = {"sampler_vs_forward": check_sampler(model, rows, sampled)}
    _, graphs = run_backend(model, rows[:16], 64, temperature=0.0)
    _, eager = run_backend(model, rows[:16], 64, temperature=0.0, cuda_graphs=False)
    checks["greedy_graphs_equal_eager"] = [c.token_ids for c in graphs] == [
        c.token_ids for c in eager
    ]
    print(json.dumps(checks), flush=True)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"\n{len(rows)} rows x {n} new tokens, prompts of {len(rows[0])} tokens; {where}")
    print(f"{'option':18} {'s':>8} {'tokens/s':>10} {'extra GiB':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['option']:18} error: {r['error']}")
        else:
            rate = len(rows) * n / r["median_s"]
            print(f"{r['option']:18} {r['median_s']:8.3f} {rate:10.0f} {r['extra_gib']:10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "checks": checks}, indent=1))


if __name__ == "__main__":
    main()
