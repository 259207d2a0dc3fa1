"""Generation on a CUDA GPU: the slot path, its CUDA graphs, mixed precision (skipped on a CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from agentgrpo.models.attention import use_grouped_query_sdpa
from rollout import SamplingParams, TransformersBackend
from tests.rollout.backends.test_transformers_backend import PROMPTS, generate_concurrently
from tests.support.tiny_model import tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
STOP = 1999


def qwen(dtype: torch.dtype) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 with grouped heads (4 query, 2 key-value) on the GPU, seeded."""
    sizes = dict(hidden_size=128, intermediate_size=256)
    model = tiny_model(Qwen2ForCausalLM, Qwen2Config, 2000, **sizes).to("cuda", dtype).eval()
    use_grouped_query_sdpa(model)  # as GRPOTrainer loads a policy
    return model


def forward_logprobs(model, prompt, completion, autocast=None) -> torch.Tensor:
    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", autocast or torch.float32, enabled=bool(autocast)):
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()


def greedy_by_forward_passes(model, prompt, n) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.anyio
async def test_on_cuda_the_backend_decodes_in_slots_replaying_cuda_graphs():
    model = qwen(torch.float32)
    backend = TransformersBackend(model, [STOP], 0)
    greedy = SamplingParams(max_tokens=20, temperature=0)
    together = await generate_concurrently(backend, PROMPTS, [greedy] * 3)
    assert backend.decoding == "slots" and backend._running()._graphs  # captured, replayed
    for prompt, completion in zip(PROMPTS, together, strict=True):
        assert completion.token_ids == greedy_by_forward_passes(model, prompt, 20)


@pytest.mark.anyio
async def test_on_cuda_sampled_tokens_and_logprobs_match_a_plain_forward_in_bf16():
    model = qwen(torch.bfloat16)
    backend = TransformersBackend(model, [STOP], 0)
    params = [SamplingParams(max_tokens=40, seed=s) for s in range(3)]
    together = await generate_concurrently(backend, PROMPTS, params)
    for prompt, completion in zip(PROMPTS, together, strict=True):
        expected = forward_logprobs(model, prompt, completion.token_ids)
        gap = (expected - torch.tensor(completion.logprobs)).abs()
        assert gap.mean() < 0.02 and gap.max() < 0.15  # bf16 rounding, not another token


@pytest.mark.anyio
async def test_on_cuda_graphs_and_eager_steps_and_any_batch_draw_the_same_tokens():
    model = qwen(torch.float32)
    params = [SamplingParams(max_tokens=30, seed=s) for s in (11, 12, 13)]
    graphs = await generate_concurrently(TransformersBackend(model, [STOP], 0), PROMPTS, params)
    eager_backend = TransformersBackend(model, [STOP], 0, cuda_graphs=False)
    alone = [await eager_backend.generate(p, q) for p, q in zip(PROMPTS, params, strict=True)]
    assert [c.token_ids for c in graphs] == [c.token_ids for c in alone]


@pytest.mark.anyio
async def test_on_cuda_generation_under_autocast_matches_the_trainers_mixed_precision():
    model = qwen(torch.float32)  # float32 weights, bf16 compute: the trainer's bf16=True
    backend = TransformersBackend(model, [STOP], 0, autocast_dtype=torch.bfloat16)
    params = [SamplingParams(max_tokens=30, seed=s) for s in range(3)]
    together = await generate_concurrently(backend, PROMPTS, params)
    for prompt, completion in zip(PROMPTS, together, strict=True):
        expected = forward_logprobs(model, prompt, completion.token_ids, torch.bfloat16)
        gap = (expected - torch.tensor(completion.logprobs)).abs()
        assert gap.mean() < 0.02 and gap.max() < 0.15


@pytest.mark.anyio
@pytest.mark.parametrize("in_place", [True, False], ids=["updated-in-place", "new-tensors"])
async def test_on_cuda_the_graphs_read_the_weights_as_they_are_now(in_place):
    model = qwen(torch.float32)
    backend = TransformersBackend(model, [STOP], 0)
    params = SamplingParams(max_tokens=20, seed=0)
    before = await backend.generate(PROMPTS[0], params)  # captures the step's graphs
    with torch.no_grad():
        for parameter in model.parameters():
            if in_place:
                parameter.mul_(1.5)  # what an optimizer step does
            else:
                parameter.data = parameter.data * 1.5  # new storage (e.g. weights gathered anew)
    backend.reset_prefix_cache()
    after = await backend.generate(PROMPTS[0], params)
    assert after.logprobs != before.logprobs
    expected = forward_logprobs(model, PROMPTS[0], after.token_ids)
    assert torch.allclose(expected, torch.tensor(after.logprobs), atol=1e-3)


@pytest.mark.anyio
async def test_on_cuda_a_released_backend_frees_its_slot_cache_and_captures_again():
    model = qwen(torch.float32)
    backend = TransformersBackend(model, [STOP], 0)
    params = [SamplingParams(max_tokens=20, seed=s) for s in range(3)]
    first = await generate_concurrently(backend, PROMPTS, params)
    batch = backend._running()
    cache_bytes = sum(t.nbytes for t in batch._buffers.keys + batch._buffers.values)
    held = torch.cuda.memory_allocated()
    backend.release_memory()
    assert held - torch.cuda.memory_allocated() >= cache_bytes and not batch._graphs
    again = await generate_concurrently(backend, PROMPTS, params)
    assert batch._graphs  # captured again, over the new buffers
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
    assert [c.logprobs for c in again] == [c.logprobs for c in first]
