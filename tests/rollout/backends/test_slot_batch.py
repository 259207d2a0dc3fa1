"""The GPU decoding path (`SlotBatch`: static cache, sampling on the device), run on the CPU.

CUDA graphs need a GPU (tests/end_to_end/test_gpu.py replays them); everything else the slot
path does is the same code on a CPU, checked here against plain forward passes of the tiny real
model.
"""

from __future__ import annotations

import weakref

import anyio
import pytest
import torch

from rollout import SamplingParams, TransformersBackend
from rollout.backends.sampling import counter_uniform, sample_plain, sample_tokens
from tests.rollout.backends.test_transformers_backend import (
    PROMPTS,
    ForwardLog,
    forward_logprobs,
    generate_concurrently,
    greedy_by_whole_forward_passes,
)
from tests.support.tiny_model import tiny_llama

STOP = 49_000  # an id these prompts never lead the tiny model to: rows run to their budget


def slots(model, **kwargs) -> TransformersBackend:
    kwargs.setdefault("chunk_steps", 4)
    return TransformersBackend(
        model, stop_token_ids=[STOP], pad_token_id=2, static_cache=True, **kwargs
    )


def test_the_backend_decodes_in_slots_on_request_and_dynamically_on_a_cpu_by_default(tiny_model):
    assert slots(tiny_model).decoding == "slots"
    assert TransformersBackend(tiny_model, [STOP], 2).decoding == "dynamic"


@pytest.mark.anyio
async def test_greedy_decoding_in_slots_equals_whole_forward_passes(tiny_model):
    greedy = SamplingParams(max_tokens=11, temperature=0)  # not a multiple of the chunk
    together = await generate_concurrently(slots(tiny_model), PROMPTS, [greedy] * 3)
    for prompt, completion in zip(PROMPTS, together, strict=True):
        assert completion.token_ids == greedy_by_whole_forward_passes(tiny_model, prompt, 11)


@pytest.mark.anyio
async def test_sampled_logprobs_in_slots_equal_a_forward_pass_at_the_temperature(tiny_model):
    params = [SamplingParams(max_tokens=9, temperature=0.7, seed=s) for s in range(3)]
    together = await generate_concurrently(slots(tiny_model), PROMPTS, params)
    for prompt, completion in zip(PROMPTS, together, strict=True):
        assert len(completion.token_ids) == 9 and not completion.stopped
        expected = forward_logprobs(tiny_model, prompt, completion.token_ids, temperature=0.7)
        assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=1e-4)


@pytest.mark.anyio
async def test_a_seeded_request_draws_the_same_tokens_in_slots_alone_or_in_any_batch(tiny_model):
    params = [SamplingParams(max_tokens=10, seed=s) for s in (5, 6, 7)]
    backend = slots(tiny_model)
    together = await generate_concurrently(backend, PROMPTS, params)
    alone = [await backend.generate(p, q) for p, q in zip(PROMPTS, params, strict=True)]
    reversed_ = await generate_concurrently(backend, PROMPTS[::-1], params[::-1])
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.token_ids for c in reversed_[::-1]] == [c.token_ids for c in alone]


@pytest.mark.anyio
async def test_released_slots_free_their_cache_and_then_decode_as_before(tiny_model):
    params = [SamplingParams(max_tokens=10, seed=s) for s in (5, 6, 7)]
    backend = slots(tiny_model)
    first = await generate_concurrently(backend, PROMPTS, params)
    cache = weakref.ref(backend._running()._buffers.keys[0])  # the first layer's slot keys
    assert cache() is not None and backend.prefixes.tokens > 0
    backend.release_memory()
    assert cache() is None and backend.prefixes.tokens == 0
    again = await generate_concurrently(backend, PROMPTS, params)
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
    assert [c.logprobs for c in again] == [c.logprobs for c in first]


@pytest.mark.anyio
async def test_an_fsdp2_model_decodes_in_slots_as_the_plain_model(one_process_group, tokenizer):
    # On a GPU the trainer gives it no CUDA graphs (`generation.local.transformers_backend`):
    # its forward hooks make FSDP's streams wait on the current one, which a capture cannot take.
    from torch.distributed.fsdp import fully_shard

    plain, sharded = tiny_llama(tokenizer), tiny_llama(tokenizer)
    units = [fully_shard(layer, reshard_after_forward=False) for layer in sharded.model.layers]
    units.append(fully_shard(sharded, reshard_after_forward=False))
    for unit in units:  # held whole, as the trainer's rounds hold them (fsdp2_unsharded)
        unit.unshard()
    greedy = SamplingParams(max_tokens=7, temperature=0)
    expected = await generate_concurrently(slots(plain), PROMPTS, [greedy] * 3)
    got = await generate_concurrently(slots(sharded), PROMPTS, [greedy] * 3)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]


@pytest.mark.anyio
async def test_a_row_that_samples_a_stop_token_ends_there_while_the_others_go_on(tiny_model):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    free = await generate_concurrently(slots(tiny_model), PROMPTS, [greedy] * 3)
    stop = free[1].token_ids[5]  # row 1 samples it sixth (greedy: deterministic)
    backend = TransformersBackend(tiny_model, [stop], 2, static_cache=True, chunk_steps=4)
    stopped = await generate_concurrently(backend, PROMPTS, [greedy] * 3)
    first = free[1].token_ids.index(stop)
    assert stopped[1].token_ids == free[1].token_ids[: first + 1] and stopped[1].stopped
    for before, after in zip(free, stopped, strict=True):
        cut = before.token_ids.index(stop) + 1 if stop in before.token_ids else None
        assert after.token_ids == before.token_ids[:cut]


@pytest.mark.anyio
async def test_a_next_turn_in_slots_prefills_only_its_new_tokens(tiny_model):
    backend = slots(tiny_model)
    first = await backend.generate(PROMPTS[1], SamplingParams(max_tokens=6, seed=1))
    second_prompt = [*PROMPTS[1], *first.token_ids, 17, 18, 19, 20]
    with ForwardLog(tiny_model) as log:
        second = await backend.generate(second_prompt, SamplingParams(max_tokens=6, seed=2))
    assert log.shapes[0] == (1, 5)  # the last sampled token and the 4-token tool turn
    expected = forward_logprobs(tiny_model, second_prompt, second.token_ids)
    assert torch.allclose(expected, torch.tensor(second.logprobs), atol=1e-4)


@pytest.mark.anyio
async def test_a_long_request_joining_a_narrow_batch_widens_it_and_both_stay_exact(tiny_model):
    backend = slots(tiny_model)
    long_prompt = list(range(100, 300))  # wider than the first buffer (128 columns)
    short, late = SamplingParams(max_tokens=40, seed=0), SamplingParams(max_tokens=7, seed=1)
    results = {}

    async def run(name, prompt, params, delay):
        await anyio.sleep(delay)
        results[name] = (prompt, await backend.generate(prompt, params))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "short", PROMPTS[0], short, 0)
        tg.start_soon(run, "long", long_prompt, late, 0.05)
    for prompt, completion in results.values():
        expected = forward_logprobs(tiny_model, prompt, completion.token_ids)
        assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=1e-4)


@pytest.mark.anyio
async def test_rows_with_top_k_sample_in_slots_only_among_their_k_likeliest(tiny_model):
    params = [SamplingParams(max_tokens=6, top_k=2, seed=s) for s in range(3)]
    together = await generate_concurrently(slots(tiny_model), PROMPTS, params)
    for prompt, completion in zip(PROMPTS, together, strict=True):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = tiny_model(ids).logits[0, len(prompt) - 1 : -1]
        top_2 = logits.topk(2).indices
        assert all(t in top_2[i] for i, t in enumerate(completion.token_ids))
        expected = forward_logprobs(tiny_model, prompt, completion.token_ids)
        assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=1e-4)


@pytest.mark.anyio
async def test_a_cancelled_request_gives_its_slot_back(tiny_model):
    backend = slots(tiny_model, max_batch_size=1)

    async def cancelled():
        with anyio.move_on_after(0.05):
            await backend.generate(PROMPTS[0], SamplingParams(max_tokens=2000, seed=0))

    await cancelled()
    completion = await backend.generate(PROMPTS[1], SamplingParams(max_tokens=5, seed=1))
    assert len(completion.token_ids) == 5 and backend.running_rows == 0


def test_plain_sampling_on_the_device_equals_the_general_sampler():
    torch.manual_seed(0)
    logits = torch.randn(64, 1000) * 3
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.5]).repeat(16)
    uniform = counter_uniform(torch.arange(64) * 977, torch.arange(64))
    plain = sample_plain(logits, temperature, uniform)
    general = sample_tokens(
        logits, temperature, torch.zeros(64, dtype=torch.long), torch.ones(64), uniform_B=uniform
    )
    assert torch.equal(plain[0], general[0]) and torch.allclose(plain[1], general[1])


def test_counter_uniforms_depend_on_seed_and_draw_number_alone():
    seeds, draws = torch.tensor([3, 3, 2**40 + 3, -5]), torch.tensor([0, 1, 0, 0])
    values = counter_uniform(seeds, draws)
    assert len(set(values.tolist())) == 4  # a new draw number or seed: a new value
    assert torch.equal(values[1:2], counter_uniform(torch.tensor([3]), torch.tensor([1])))
    many = counter_uniform(torch.full((20_000,), 12345), torch.arange(20_000))
    counts = torch.histc(many, bins=10, min=0, max=1)
    assert ((many >= 0) & (many < 1)).all() and counts.min() > 1800  # expect 2000 each
