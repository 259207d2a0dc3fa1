"""The transformers backend and the sampling function, on the tiny real model."""

from __future__ import annotations

from dataclasses import replace

import anyio
import pytest
import torch

from rollout import GenerationBackend, SamplingParams, TransformersBackend
from rollout.sampling import sample_tokens

PROMPTS = [[1, 520, 33, 8], [1, 1823, 9, 44, 101, 7, 3], [1, 77]]


async def generate_concurrently(backend, prompts, params) -> list:
    results = [None] * len(prompts)

    async def one(i):
        results[i] = await backend.generate(prompts[i], params[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


def test_the_transformers_backend_is_a_generation_backend(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[2, 3], pad_token_id=2)
    assert isinstance(backend, GenerationBackend)
    assert backend.stop_token_ids == {2, 3}


@pytest.mark.anyio
async def test_batched_greedy_generation_equals_one_request_at_a_time(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[2], pad_token_id=2)
    greedy = [SamplingParams(max_tokens=12, temperature=0)] * 3
    alone = [await backend.generate(p, g) for p, g in zip(PROMPTS, greedy, strict=True)]
    together = await generate_concurrently(backend, PROMPTS, greedy)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    for a, b in zip(alone, together, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


@pytest.mark.anyio
async def test_concurrent_requests_share_a_batch_and_keep_their_own_max_tokens(
    tiny_model, monkeypatch
):
    backend = TransformersBackend(tiny_model, stop_token_ids=[2], pad_token_id=2)
    batches = []
    sample = backend._sample
    monkeypatch.setattr(backend, "_sample", lambda p, s: batches.append(len(p)) or sample(p, s))
    params = [SamplingParams(max_tokens=n, temperature=1.0) for n in (3, 9, 5)]
    results = await generate_concurrently(backend, PROMPTS, params)
    assert batches == [3]
    assert [len(c.token_ids) for c in results if not c.stopped] == [
        p.max_tokens for p, c in zip(params, results, strict=True) if not c.stopped
    ]
    assert all(len(c.token_ids) <= p.max_tokens for p, c in zip(params, results, strict=True))


@pytest.mark.anyio
async def test_sampled_logprobs_equal_a_forward_pass_at_the_sampling_temperature(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[2], pad_token_id=2, seed=3)
    completion = await backend.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.6))
    ids = torch.tensor([PROMPTS[1] + completion.token_ids])
    with torch.no_grad():
        logits = tiny_model(ids).logits[0, len(PROMPTS[1]) - 1 : -1] / 0.6
    expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(PROMPTS[1]) :, None])[:, 0]
    assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=1e-4)


@pytest.mark.anyio
async def test_a_seeded_request_samples_the_same_tokens_alone_or_in_any_batch(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[2], pad_token_id=2)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=42)
    others = [SamplingParams(max_tokens=n, temperature=1.0) for n in (4, 12)]
    alone = await backend.generate(PROMPTS[0], seeded)
    batched = await generate_concurrently(backend, PROMPTS, [seeded, *others])
    assert batched[0].token_ids == alone.token_ids
    different_seed = replace(seeded, seed=43)
    assert (await backend.generate(PROMPTS[0], different_seed)).token_ids != alone.token_ids


@pytest.mark.anyio
async def test_a_failing_batch_fails_every_request_in_it(tiny_model, monkeypatch):
    backend = TransformersBackend(tiny_model, stop_token_ids=[2], pad_token_id=2)

    def broken(prompts, params):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(backend, "_sample", broken)
    with pytest.raises(BaseExceptionGroup) as failures:
        await generate_concurrently(backend, PROMPTS, [SamplingParams(max_tokens=4)] * 3)
    assert failures.group_contains(RuntimeError, match="out of memory")


@pytest.mark.anyio
async def test_a_request_past_the_context_is_refused(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[2], pad_token_id=2)
    with pytest.raises(ValueError, match="exceed the model's context of 2048"):
        await backend.generate([1] * 2040, SamplingParams(max_tokens=16))


def test_top_k_never_samples_outside_the_k_most_likely_tokens():
    torch.manual_seed(0)
    logits = torch.randn(1, 50).repeat(200, 1)
    top3 = set(logits[0].topk(3).indices.tolist())
    tokens, _ = sample_tokens(logits, torch.ones(200), torch.full((200,), 3), torch.ones(200))
    assert set(tokens.tolist()) <= top3


def test_top_p_keeps_the_smallest_set_holding_p_of_the_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(300, 1)
    tokens, logprobs = sample_tokens(
        logits, torch.ones(300), torch.zeros(300, dtype=torch.long), torch.full((300,), 0.7)
    )
    assert set(tokens.tolist()) == {0, 1}
    assert torch.allclose(logprobs, probs.log()[tokens])  # logprobs are before filtering


def test_greedy_rows_and_sampled_rows_mix_in_one_batch():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    tokens, logprobs = sample_tokens(
        logits, torch.tensor([0.0, 2.0]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0])
    )
    assert tokens[0].item() == 1
    assert logprobs[1].item() == pytest.approx(
        torch.log_softmax(logits[1] / 2, -1)[tokens[1]].item()
    )
