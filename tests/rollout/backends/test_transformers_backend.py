"""The transformers backend and the sampling function, on the tiny real model."""

from __future__ import annotations

import threading
from dataclasses import replace

import anyio
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollout import GenerationBackend, SamplingParams, TransformersBackend
from rollout.backends.sampling import sample_tokens
from tests.support.tiny_model import tiny_model

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


class ForwardLog:
    """Records the shape of every forward pass the model runs (input_ids: rows x tokens)."""

    def __init__(self, model):
        self.shapes: list[tuple[int, int]] = []
        self.handle = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        self.shapes.append(tuple(kwargs["input_ids"].shape))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.anyio
async def test_concurrent_requests_decode_together_and_keep_their_own_max_tokens(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[len(PROMPTS)], pad_token_id=2)
    params = [SamplingParams(max_tokens=n, temperature=1.0) for n in (3, 9, 5)]
    with ForwardLog(tiny_model) as log:
        results = await generate_concurrently(backend, PROMPTS, params)
    assert (3, 1) in log.shapes  # one decoding step ran all three rows
    assert all(len(c.token_ids) <= p.max_tokens for p, c in zip(params, results, strict=True))
    assert [len(c.token_ids) for c in results if not c.stopped] == [
        p.max_tokens for p, c in zip(params, results, strict=True) if not c.stopped
    ]


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
async def test_a_failing_step_fails_every_request_in_it_and_the_backend_goes_on(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[2], pad_token_id=2)
    with ForwardLog(tiny_model) as log:

        def out_of_memory_on_the_first_decoding_step(module, args, kwargs):
            if kwargs["input_ids"].shape == (3, 1) and (3, 1) not in log.shapes[:-1]:
                raise RuntimeError("out of memory")

        hook = tiny_model.register_forward_pre_hook(
            out_of_memory_on_the_first_decoding_step, with_kwargs=True
        )
        try:
            with pytest.raises(BaseExceptionGroup) as failures:
                await generate_concurrently(backend, PROMPTS, [SamplingParams(max_tokens=4)] * 3)
        finally:
            hook.remove()
    assert failures.group_contains(RuntimeError, match="out of memory")
    assert len(failures.value.exceptions) == 3
    after = await backend.generate(PROMPTS[0], SamplingParams(max_tokens=4))
    assert 1 <= len(after.token_ids) <= 4


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


def forward_logprobs(model, prompt: list[int], completion: list[int], temperature=1.0):
    """The logprobs a training forward pass gives `completion` after `prompt`."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]


@pytest.mark.anyio
async def test_a_next_turn_prefills_only_the_tokens_after_what_the_last_turn_read(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[len(PROMPTS)], pad_token_id=2)
    first = await backend.generate(PROMPTS[1], SamplingParams(max_tokens=6, seed=1))
    tool_turn = [17, 18, 19, 20]
    second_prompt = PROMPTS[1] + first.token_ids + tool_turn
    with ForwardLog(tiny_model) as log:
        second = await backend.generate(second_prompt, SamplingParams(max_tokens=6, seed=2))
    # The cache holds the prompt and all but the last sampled token: that one and the tool
    # turn are all the next turn reads.
    assert log.shapes[0] == (1, 1 + len(tool_turn))
    expected = forward_logprobs(tiny_model, second_prompt, second.token_ids)
    assert torch.allclose(expected, torch.tensor(second.logprobs), atol=1e-4)


@pytest.mark.anyio
async def test_requests_of_different_cached_lengths_prefill_in_one_pass(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[len(PROMPTS)], pad_token_id=2)
    firsts = await generate_concurrently(
        backend, PROMPTS[:2], [SamplingParams(max_tokens=4, seed=s) for s in range(2)]
    )
    next_turns = [
        PROMPTS[0] + firsts[0].token_ids + [17, 18, 19, 20, 21],
        PROMPTS[1] + firsts[1].token_ids + [22, 23],
        PROMPTS[2],  # nothing cached, and shorter than the others' reads: left-padded
    ]
    params = [SamplingParams(max_tokens=5, temperature=0.8, seed=s) for s in range(3)]
    with ForwardLog(tiny_model) as log:
        together = await generate_concurrently(backend, next_turns, params)
    assert log.shapes[0] == (3, 1 + 5)  # the longest reads its last sampled token and 5 more
    for prompt, completion in zip(next_turns, together, strict=True):
        expected = forward_logprobs(tiny_model, prompt, completion.token_ids, temperature=0.8)
        assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=1e-4)
    alone = TransformersBackend(tiny_model, stop_token_ids=[len(PROMPTS)], pad_token_id=2)
    for prompt, param, completion in zip(next_turns, params, together, strict=True):
        assert (await alone.generate(prompt, param)).token_ids == completion.token_ids


@pytest.mark.anyio
async def test_a_long_prompt_and_a_short_next_turn_prefill_apart(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[len(PROMPTS)], pad_token_id=2)
    first = await backend.generate(PROMPTS[2], SamplingParams(max_tokens=3, seed=0))
    long_prompt = list(range(100, 161))  # shares no prefix with what is cached
    with ForwardLog(tiny_model) as log:
        await generate_concurrently(
            backend,
            [long_prompt, PROMPTS[2] + first.token_ids + [5]],
            [SamplingParams(max_tokens=2, seed=s) for s in range(2)],
        )
    # Reading 61 tokens for a row that needs 2 would cost more than a second pass.
    assert log.shapes[:2] == [(1, len(long_prompt)), (1, 2)]


@pytest.mark.anyio
async def test_a_sliding_window_model_generates_as_a_plain_forward_pass_would():
    model = tiny_model(
        Qwen2ForCausalLM, Qwen2Config, 2000, use_sliding_window=True,
        sliding_window=4,  # shorter than every context below
        max_window_layers=1,
    ).eval()  # fmt: skip
    backend = TransformersBackend(model, stop_token_ids=[1999], pad_token_id=0)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    prompts = [PROMPTS[1], [1, 520, 33, 8, 9, 10, 11], PROMPTS[2]]
    together = await generate_concurrently(backend, prompts, [greedy] * 3)
    next_turn = prompts[1] + together[1].token_ids + [5, 6]  # read over the prefix cache
    contexts = [*prompts, next_turn]
    completions = [*together, await backend.generate(next_turn, greedy)]
    for context, completion in zip(contexts, completions, strict=True):
        assert completion.token_ids == greedy_by_whole_forward_passes(model, context, 8)


def greedy_by_whole_forward_passes(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.anyio
async def test_a_groups_members_read_their_shared_prompt_once(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[len(PROMPTS)], pad_token_id=2)
    group = [PROMPTS[1]] * 4
    params = [SamplingParams(max_tokens=5, seed=s) for s in range(4)]
    with ForwardLog(tiny_model) as log:
        completions = await generate_concurrently(backend, group, params)
    # The first member reads the prompt; the other three then read its last token together.
    assert log.shapes[:2] == [(1, len(PROMPTS[1])), (3, 1)]
    for completion in completions:
        expected = forward_logprobs(tiny_model, PROMPTS[1], completion.token_ids)
        assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=1e-4)


@pytest.mark.anyio
async def test_a_request_joins_the_running_batch_instead_of_waiting_for_it(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[len(PROMPTS)], pad_token_id=2)
    long, short = SamplingParams(max_tokens=60, seed=0), SamplingParams(max_tokens=3, seed=1)
    five_forward_passes = threading.Event()
    finished: list[str] = []

    def count(module, args, kwargs):
        if len(log.shapes) >= 5:
            five_forward_passes.set()

    async def run(name, prompt, params, wait=None):
        if wait is not None:
            await anyio.to_thread.run_sync(wait.wait)
        await backend.generate(prompt, params)
        finished.append(name)

    with ForwardLog(tiny_model) as log:
        hook = tiny_model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "long", PROMPTS[0], long)
                tg.start_soon(run, "late", PROMPTS[2], short, five_forward_passes)
        finally:
            hook.remove()
    assert finished == ["late", "long"]
    assert (2, 1) in log.shapes


@pytest.mark.anyio
async def test_without_a_prefix_cache_every_prompt_is_read_whole(tiny_model):
    backend = TransformersBackend(
        tiny_model, stop_token_ids=[len(PROMPTS)], pad_token_id=2, prefix_cache_tokens=0
    )
    with ForwardLog(tiny_model) as log:
        await generate_concurrently(backend, [PROMPTS[1]] * 2, [SamplingParams(max_tokens=2)] * 2)
    assert log.shapes[0] == (2, len(PROMPTS[1]))  # both read whole, in one pass


@pytest.mark.anyio
async def test_reset_prefix_cache_forgets_keys_and_values_of_old_weights(tiny_model):
    backend = TransformersBackend(tiny_model, stop_token_ids=[2], pad_token_id=2)
    await backend.generate(PROMPTS[1], SamplingParams(max_tokens=3))
    assert backend.prefixes.tokens > 0
    backend.reset_prefix_cache()
    assert backend.prefixes.tokens == 0


def test_generation_kwargs_the_backend_cannot_apply_are_refused_by_name(tiny_model):
    with pytest.raises(ValueError, match=r"\{'num_beams': 3\} cannot be used for GRPO"):
        TransformersBackend(tiny_model, [2], 2, sampling_overrides={"min_p": 0.1, "num_beams": 3})


@pytest.mark.anyio
async def test_generation_kwargs_win_over_the_requests_own_sampling(tiny_model):
    greedy = TransformersBackend(tiny_model, [2], 2, sampling_overrides={"temperature": 0.0})
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    argmax = SamplingParams(max_tokens=8, temperature=0.0)
    assert (await greedy.generate(PROMPTS[1], sampled)).token_ids == (
        await TransformersBackend(tiny_model, [2], 2).generate(PROMPTS[1], argmax)
    ).token_ids


@pytest.mark.anyio
async def test_a_model_with_recurrent_layers_generates_alone_and_token_exact():
    from transformers import Lfm2Config, Lfm2ForCausalLM

    layers = ["conv", "full_attention"]
    model = tiny_model(Lfm2ForCausalLM, Lfm2Config, 300, layer_types=layers).eval()
    backend = TransformersBackend(model, stop_token_ids=[2], pad_token_id=0)
    assert not backend.reuses_keys_and_values
    prompts = [[1, 5, 6, 7], [1, 9]]
    params = [SamplingParams(max_tokens=6, seed=s) for s in (0, 1)]
    completions = await generate_concurrently(backend, prompts, params)
    for prompt, completion in zip(prompts, completions, strict=True):
        expected = forward_logprobs(model, prompt, completion.token_ids)
        assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=1e-4)


def test_repetition_penalty_makes_seen_tokens_less_likely_and_leaves_the_logprobs():
    logits = torch.tensor([[2.0, 1.9, -1.0]]).repeat(400, 1)
    seen = torch.tensor([[True, False, False]]).repeat(400, 1)
    plain = (torch.ones(400), torch.zeros(400, dtype=torch.long), torch.ones(400))
    generators = [torch.Generator().manual_seed(i) for i in range(400)]
    tokens, _ = sample_tokens(logits, *plain, generators)
    penalized, penalized_logprobs = sample_tokens(
        logits, *plain, generators, penalty_B=torch.full((400,), 3.0), seen_B_V=seen
    )
    assert (penalized == 0).sum() < (tokens == 0).sum() / 2
    assert torch.allclose(
        penalized_logprobs, torch.log_softmax(logits, -1).gather(-1, penalized[:, None])[:, 0]
    )


def test_min_p_never_samples_a_token_below_min_p_times_the_likeliest():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(300, 1)
    plain = (torch.ones(300), torch.zeros(300, dtype=torch.long), torch.ones(300))
    generators = [torch.Generator().manual_seed(i) for i in range(300)]
    tokens, _ = sample_tokens(logits, *plain, generators, min_p_B=torch.full((300,), 0.35))
    assert set(tokens.tolist()) == {0, 1}


def test_the_sampler_draws_each_token_with_its_probability():
    probs = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.0, 0.4] + [0.0] * 500)
    logits = probs.log().repeat(4000, 1)
    generators = [torch.Generator().manual_seed(i) for i in range(4000)]
    tokens, _ = sample_tokens(
        logits, torch.ones(4000), torch.zeros(4000, dtype=torch.long), torch.ones(4000), generators
    )
    frequencies = torch.bincount(tokens, minlength=len(probs)).float() / 4000
    assert frequencies[probs == 0].sum() == 0
    # Seeded draws: a fixed outcome; 4 standard deviations of a binomial proportion.
    assert torch.all((frequencies - probs).abs() <= 4 * (probs * (1 - probs) / 4000).sqrt())
