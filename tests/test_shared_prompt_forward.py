"""Rows that share a prompt run it through the model once, with the one-pass numbers.

The reference is `one_pass_logits`: the model over whole rows, as `completion_logprobs` ran
before. Measured on the tiny Llama in float32, the two ways differ by at most about 1e-6 in
logprobs and logits and 1e-5 of the largest gradient entry of a parameter (float32 rounding:
the same sums in another order); the tolerances below leave a margin of 10.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_trl_metrics import tiny_qwen2_moe
from tiny_model import tiny_llama
from transformers import Qwen2Config, Qwen2ForCausalLM

from agentgrpo.learner.batch import TrainingBatch, collate_episodes
from agentgrpo.learner.logprobs import (
    batched_logprobs,
    completion_logprobs,
    logprobs_from_logits,
    one_pass_logits,
)
from agentgrpo.learner.shared_prompt import can_share_prompts, prompt_groups
from agentgrpo.learner.token_weights import entropy_from_logits
from rollout import Episode, EpisodeRow, EpisodeStats, Finish

LOGPROB_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-4  # of the parameter's largest gradient entry


def token_ids(seed: int, n: int) -> list[int]:
    return torch.randint(1, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def episode(index: int, prompt: list[int], *completions: list[int]) -> Episode:
    """An episode whose first row continues `prompt`; each later row forks from the one before."""
    rows, context = [], prompt
    for k, completion in enumerate(completions):
        mask = [1] * len(completion)
        rows.append(EpisodeRow(context, completion, mask, [0.0] * len(completion)))
        context = context + completion + token_ids(100 + k, 3)  # a tool turn, then a new row
    stats = EpisodeStats(len(completions), len(completions) - 1, {})
    return Episode(tuple(rows), [], Finish.STOP, stats, {}, 0, index)


def batch_of(episodes: list[Episode]) -> TrainingBatch:
    return collate_episodes(episodes, torch.linspace(-1, 1, len(episodes)), pad_token_id=0)


def two_groups() -> TrainingBatch:
    """Two groups of 3 rows; the second group's prompt is shorter (more left padding)."""
    long_prompt, short_prompt = token_ids(0, 9), token_ids(1, 4)
    return batch_of(
        [episode(g, long_prompt, token_ids(10 + g, 3 + 2 * g)) for g in range(3)]
        + [episode(3 + g, short_prompt, token_ids(20 + g, 6 - g)) for g in range(3)]
    )


def one_pass(model, batch: TrainingBatch, temperature: float, with_logits: bool = False):
    """The reference: logprobs (and logits) from one pass over whole rows."""
    logits_B_C_V = one_pass_logits(model, batch)[0].float() / temperature
    logprobs_B_C = logprobs_from_logits(logits_B_C_V, batch.completion_ids_B_C)
    return logprobs_B_C, logits_B_C_V if with_logits else None


def shared(model, batch: TrainingBatch, temperature: float, with_logits: bool = False, **flags):
    """What the learner computes: `completion_logprobs`."""
    forward = completion_logprobs(model, batch, temperature, with_logits=with_logits, **flags)
    return forward.logprobs_B_C, forward.logits_B_C_V


def numbers(model, batch: TrainingBatch, scoring, *args, **kwargs):
    """Logprobs, logits (or None) and the gradient of a loss that reads both, per parameter."""
    model.zero_grad(set_to_none=True)
    logprobs_B_C, logits_B_C_V = scoring(model, batch, *args, **kwargs)
    weights_B_C = torch.linspace(-1, 2, logprobs_B_C.numel()).view_as(logprobs_B_C)
    loss = (logprobs_B_C * weights_B_C * batch.loss_mask_B_C).sum()
    if logits_B_C_V is not None:
        loss = loss + entropy_from_logits(logits_B_C_V).sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    return logprobs_B_C.detach(), logits_B_C_V, grads


def assert_same_numbers(model, batch: TrainingBatch, *args, **kwargs) -> None:
    logprobs, logits, grads = numbers(model, batch, shared, *args, **kwargs)
    kwargs.pop("with_aux_loss", None)
    want_logprobs, want_logits, want_grads = numbers(model, batch, one_pass, *args, **kwargs)
    torch.testing.assert_close(logprobs, want_logprobs, atol=LOGPROB_TOLERANCE, rtol=0)
    if want_logits is not None:
        torch.testing.assert_close(logits, want_logits, atol=LOGPROB_TOLERANCE, rtol=0)
    assert len(grads) == len(want_grads)
    for grad, want in zip(grads, want_grads, strict=True):
        scale = float(want.abs().max())
        assert scale > 0.0
        torch.testing.assert_close(grad, want, atol=GRADIENT_TOLERANCE * scale, rtol=0)


def model_inputs(model, batch: TrainingBatch, **flags) -> list[tuple[int, int]]:
    """The (rows, columns) of `input_ids` of each forward call `completion_logprobs` makes."""
    shapes: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    with torch.no_grad():
        completion_logprobs(model, batch, 1.0, **flags)
    hook.remove()
    return shapes


@pytest.fixture
def model(tokenizer):
    return tiny_llama(tokenizer)


def test_rows_that_share_a_prompt_are_grouped_by_its_ids_and_padding():
    rows_U, prompt_B = prompt_groups(two_groups())
    assert rows_U == [0, 3]
    assert prompt_B.tolist() == [0, 0, 0, 1, 1, 1]


def test_each_distinct_prompt_runs_through_the_model_once(model):
    batch = two_groups()  # 9 prompt and 7 completion columns
    assert model_inputs(model, batch) == [(2, 9), (6, 7)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_groups_with_differently_padded_prompts_score_as_in_one_pass(model, temperature):
    assert_same_numbers(model, two_groups(), temperature)


def test_the_logits_and_their_gradients_equal_the_one_pass_ones(model):
    assert_same_numbers(model, two_groups(), 0.7, with_logits=True)


def test_rows_with_distinct_prompts_take_one_pass(model):
    batch = batch_of([episode(n, token_ids(n, 5 + n), token_ids(10 + n, 4)) for n in range(3)])
    assert model_inputs(model, batch) == [(3, 7 + 4)]
    assert_same_numbers(model, batch, 1.0)


def test_forked_rows_share_only_the_prompts_they_have_in_common(model):
    prompt = token_ids(0, 6)
    batch = batch_of(
        [episode(n, prompt, token_ids(10 + n, 3), token_ids(20 + n, 4)) for n in range(2)]
        + [episode(2, prompt, token_ids(30, 5))]
    )
    assert prompt_groups(batch)[1].tolist() == [0, 1, 0, 2, 0]  # forks: new prompts
    assert_same_numbers(model, batch, 0.7, with_logits=True)


def test_a_lora_models_adapter_gradients_equal_the_one_pass_ones(model):
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    assert can_share_prompts(peft_model)
    assert_same_numbers(peft_model, two_groups(), 1.0, with_logits=True)


def test_a_load_balancing_loss_needs_whole_rows_so_takes_one_pass(tokenizer):
    moe = tiny_qwen2_moe(tokenizer)
    batch = two_groups()
    assert model_inputs(moe, batch, with_aux_loss=True) == [(6, 16)]
    assert completion_logprobs(moe, batch, 1.0, with_aux_loss=True).aux_loss > 0.0
    assert_same_numbers(moe, batch, 1.0, with_aux_loss=True)
    assert_same_numbers(moe, batch, 1.0)  # without it, the shared prompt pass


def test_a_gradient_checkpointing_model_takes_one_pass(model):
    model.gradient_checkpointing_enable()
    model.train()
    batch = two_groups()
    assert not can_share_prompts(model)
    assert model_inputs(model, batch) == [(6, 16)]
    assert_same_numbers(model, batch, 1.0)


def test_a_sliding_window_model_takes_one_pass(tokenizer):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=4,  # shorter than the prompts: its cache would keep only 4 positions
        max_window_layers=1,
    )
    sliding = Qwen2ForCausalLM(config).eval()
    batch = two_groups()
    assert not can_share_prompts(sliding)
    assert model_inputs(sliding, batch) == [(6, 16)]


def test_batched_logprobs_share_prompts_within_each_pass(model):
    batch = two_groups()
    logprobs_B_C = batched_logprobs(model, batch, 0.7, rows_per_pass=4)
    with torch.no_grad():
        want_B_C = one_pass(model, batch, 0.7)[0]
    mask_B_C = batch.loss_mask_B_C.bool()  # a pass trims columns its rows do not use
    torch.testing.assert_close(
        logprobs_B_C[mask_B_C], want_B_C[mask_B_C], atol=LOGPROB_TOLERANCE, rtol=0
    )
