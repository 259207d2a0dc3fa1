"""The engine on real models: a tiny Llama taught one episode, and the real SmolLM2-135M."""

from __future__ import annotations

import pytest
import torch

from environments import Counter
from rollout import EpisodeConfig, Finish, RolloutEngine, TransformersBackend
from tests.support.episodes import COUNTER_ROW, counter_segments, single_row

pytestmark = pytest.mark.anyio


def engine_for(model, tokenizer, temperature: float = 0.0) -> RolloutEngine:
    return RolloutEngine(
        TransformersBackend.from_tokenizer(model, tokenizer),
        tokenizer,
        environment_factory=Counter,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=256, max_turns=5, temperature=temperature),
    )


def teacher_forced_logprobs(model, episode, temperature: float) -> list[float]:
    """log p(token) at each completion position from one forward pass over the whole episode."""
    ids = torch.tensor([single_row(episode).prompt_ids + single_row(episode).completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(single_row(episode).prompt_ids) - 1 : -1] / temperature
    logprobs = torch.log_softmax(logits, -1)
    return logprobs.gather(-1, torch.tensor(single_row(episode).completion_ids)[:, None])[
        :, 0
    ].tolist()


def sampled_logprob_gap(model, episode, temperature: float) -> float:
    """Largest |sampler logprob - teacher-forced logprob| over the policy's (mask-1) tokens."""
    forward = teacher_forced_logprobs(model, episode, temperature)
    return max(
        abs(s - f)
        for s, f, m in zip(
            single_row(episode).sampler_logprobs,
            forward,
            single_row(episode).loss_mask,
            strict=True,
        )
        if m
    )


async def test_a_tiny_real_model_plays_two_tool_rounds_with_exact_masks(
    tokenizer, tool_calling_tiny_model
):
    [episode] = await engine_for(tool_calling_tiny_model, tokenizer).run([COUNTER_ROW])
    segments = counter_segments(tokenizer)
    assert single_row(episode).completion_ids == [t for ids, _ in segments for t in ids]
    assert single_row(episode).loss_mask == [m for ids, m in segments for _ in ids]
    assert episode.finish is Finish.STOP
    assert episode.env_reward == 1.0
    assert episode.stats.tool_calls == 2 and episode.stats.tool_failures == 0


async def test_sampled_logprobs_match_a_training_forward_pass_over_the_episode(
    tokenizer, tool_calling_tiny_model
):
    engine = engine_for(tool_calling_tiny_model, tokenizer, temperature=0.7)
    episodes = await engine.run([COUNTER_ROW], num_generations=4)
    for episode in episodes:
        assert sampled_logprob_gap(tool_calling_tiny_model, episode, temperature=0.7) < 1e-4
        assert all(
            lp == 0.0
            for lp, m in zip(
                single_row(episode).sampler_logprobs, single_row(episode).loss_mask, strict=True
            )
            if not m
        )


@pytest.mark.slow
async def test_the_real_smollm2_plays_a_tool_calling_episode_end_to_end(
    tokenizer, tool_calling_smollm2
):
    [episode] = await engine_for(tool_calling_smollm2, tokenizer).run([COUNTER_ROW])
    assert episode.stats.tool_calls >= 1
    assert [m["role"] for m in episode.messages[:3]] == ["user", "assistant", "tool"]
    assert episode.messages[1]["tool_calls"][0]["function"]["name"] == "increment"
    assert sampled_logprob_gap(tool_calling_smollm2, episode, temperature=1.0) < 1e-3
    first_tool_turn = single_row(episode).loss_mask.index(0)
    assert tokenizer.decode(single_row(episode).completion_ids[first_tool_turn:]).startswith(
        "\n<|im_start|>tool\n<tool_response>"
    )
