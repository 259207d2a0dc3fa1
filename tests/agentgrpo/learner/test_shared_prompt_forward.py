"""Rows that share a prompt run it through the model once, with the one-pass numbers.

The reference is the model's own logits over whole rows (`one_pass_states` with `read_logits`),
as the learner read them before it chunked the output layer and shared prompts. Measured on the
tiny Llama in float32, the learner's ways differ from it by at most about 1e-6 in logprobs, 1e-6
of their value in entropies and 1e-5 of the largest gradient entry of a parameter (float32
rounding: the same sums in another order); the tolerances below leave a margin of 10. Gradient
checkpointing keeps the shared prompt pass when it is non-reentrant (transformers' and TRL's
default).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from agentgrpo.learner.batch import TrainingBatch, collate_episodes
from agentgrpo.learner.logprobs import (
    batched_logprobs,
    completion_logprobs,
    logits_logprobs,
    one_pass_states,
)
from agentgrpo.learner.output_head import read_logits
from agentgrpo.learner.prefix_cache import PrefixCache, RecordingCache
from agentgrpo.learner.shared_prompt import can_share_prompts, prompt_groups
from rollout import Episode, EpisodeRow, EpisodeStats, Finish
from tests.support.tiny_model import tiny_llama, tiny_model, tiny_qwen2_moe

LOGPROB_TOLERANCE = 1e-5
ENTROPY_TOLERANCE = 1e-5  # relative: an entropy sums V terms (near log V = 10.8 here)
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


def real_columns(batch: TrainingBatch) -> torch.Tensor:
    return batch.attention_mask_B_L[:, -batch.completion_width :].bool()


def one_pass(model, batch: TrainingBatch, temperature: float, **flags):
    """The reference: logprobs and entropies from the model's logits over whole rows."""
    logits_B_C_V = one_pass_states(model, batch, read_logits)[0]
    targets_B_C = batch.completion_ids_B_C
    return logits_logprobs(
        logits_B_C_V, targets_B_C, real_columns(batch), temperature, "differentiable"
    )


def learner(model, batch: TrainingBatch, temperature: float, **flags):
    """What the learner computes: `completion_logprobs`."""
    forward = completion_logprobs(model, batch, temperature, entropy="differentiable", **flags)
    return forward.logprobs_B_C, forward.entropy_B_C


def numbers(model, batch: TrainingBatch, scoring, *args, **kwargs):
    """Logprobs, entropies and the gradient of a loss that reads both, per parameter."""
    model.zero_grad(set_to_none=True)
    logprobs_B_C, entropy_B_C = scoring(model, batch, *args, **kwargs)
    weights_B_C = torch.linspace(-1, 2, logprobs_B_C.numel()).view_as(logprobs_B_C)
    loss = (logprobs_B_C * weights_B_C * batch.loss_mask_B_C).sum() + entropy_B_C.sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    return logprobs_B_C.detach(), entropy_B_C.detach(), grads


def assert_same_numbers(model, batch: TrainingBatch, *args, **kwargs) -> None:
    """The learner's logprobs, entropies and gradients are the reference's."""
    logprobs, entropy, grads = numbers(model, batch, learner, *args, **kwargs)
    want_logprobs, want_entropy, want_grads = numbers(model, batch, one_pass, *args, **kwargs)
    torch.testing.assert_close(logprobs, want_logprobs, atol=LOGPROB_TOLERANCE, rtol=0)
    torch.testing.assert_close(entropy, want_entropy, atol=0, rtol=ENTROPY_TOLERANCE)
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
    assert_same_numbers(model, batch, 0.7)


def test_a_lora_models_adapter_gradients_equal_the_one_pass_ones(model):
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    assert can_share_prompts(peft_model)
    assert_same_numbers(peft_model, two_groups(), 1.0)


def test_a_load_balancing_loss_needs_whole_rows_so_takes_one_pass(tokenizer):
    moe = tiny_qwen2_moe(tokenizer)
    batch = two_groups()
    assert model_inputs(moe, batch, with_aux_loss=True) == [(6, 16)]
    assert completion_logprobs(moe, batch, 1.0, with_aux_loss=True).aux_loss > 0.0
    assert_same_numbers(moe, batch, 1.0, with_aux_loss=True)
    assert_same_numbers(moe, batch, 1.0)  # without it, the shared prompt pass


def test_a_recording_cache_keeps_each_layers_first_keys_and_values_only():
    cache = RecordingCache()
    keys, values = torch.ones(2, 1, 3, 4), torch.zeros(2, 1, 3, 4)
    assert cache.update(keys, values, 0) == (keys, values)
    replayed = cache.update(keys + 1, values + 1, 0)  # a checkpoint's replay
    assert torch.equal(replayed[0], keys + 1)
    assert cache.layers[0].keys is keys and cache.get_seq_length() == 3


def test_a_prefix_cache_reads_each_rows_prompt_and_stores_nothing():
    recorded = RecordingCache()
    recorded.update(torch.arange(2.0).view(2, 1, 1, 1), torch.zeros(2, 1, 1, 1), 0)
    cache = PrefixCache(recorded, torch.tensor([1, 1, 0]))
    new = torch.full((3, 1, 2, 1), 7.0)
    for _ in range(2):  # the forward, then the replay: the same result
        keys, _ = cache.update(new, new, 0)
        assert keys[:, 0, :, 0].tolist() == [[1, 7, 7], [1, 7, 7], [0, 7, 7]]
    assert cache.get_seq_length() == 1
    with pytest.raises(ValueError, match="recorded no keys"):
        PrefixCache(RecordingCache(), torch.tensor([0]))


def checkpointing(model, **kwargs):
    """`model` in training mode with transformers' gradient checkpointing (non-reentrant)."""
    model.gradient_checkpointing_enable(**kwargs)
    return model.train()


def test_a_gradient_checkpointing_model_shares_prompts_with_the_one_pass_numbers(model):
    checkpointing(model)
    batch = two_groups()
    assert can_share_prompts(model)
    assert model_inputs(model, batch) == [(2, 9), (6, 7)]
    assert_same_numbers(model, batch, 0.7)


def test_checkpointing_replays_neither_write_nor_keep_the_caches_flag(model):
    checkpointing(model)
    layers = model.model.layers
    assert_same_numbers(model, two_groups(), 1.0)  # forward and backward (the replays)
    assert all("_can_checkpoint_with_cache" not in vars(layer) for layer in layers)
    assert not any(layer._can_checkpoint_with_cache for layer in layers)


def test_checkpointing_only_some_layers_shares_prompts_too(model):
    checkpointing(model, every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]
    assert model_inputs(model, two_groups()) == [(2, 9), (6, 7)]
    assert_same_numbers(model, two_groups(), 0.7)


def test_reentrant_checkpointing_takes_one_pass(model):
    checkpointing(model, gradient_checkpointing_kwargs={"use_reentrant": True})
    batch = two_groups()
    assert not can_share_prompts(model)
    assert model_inputs(model, batch) == [(6, 16)]
    assert_same_numbers(model, batch, 1.0)


def test_a_checkpointing_model_in_eval_mode_shares_prompts_whatever_its_checkpoints(model):
    checkpointing(model, gradient_checkpointing_kwargs={"use_reentrant": True}).eval()
    assert can_share_prompts(model)


def test_a_checkpointing_lora_model_shares_prompts_with_the_one_pass_gradients(model):
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    peft_model.gradient_checkpointing_enable()
    peft_model.enable_input_require_grads()  # as models.load_policy does for checkpointing
    peft_model.train()
    assert can_share_prompts(peft_model)
    assert model_inputs(peft_model, two_groups()) == [(2, 9), (6, 7)]
    assert_same_numbers(peft_model, two_groups(), 1.0)


def test_a_checkpointing_mixture_of_experts_model_shares_prompts(tokenizer):
    moe = checkpointing(tiny_qwen2_moe(tokenizer))
    assert model_inputs(moe, two_groups()) == [(2, 9), (6, 7)]
    assert_same_numbers(moe, two_groups(), 1.0)


def test_a_sliding_window_model_takes_one_pass(tokenizer):
    sliding = tiny_model(
        Qwen2ForCausalLM, Qwen2Config, len(tokenizer), use_sliding_window=True,
        sliding_window=4,  # shorter than the prompts: its cache would keep only 4 positions
        max_window_layers=1,
    ).eval()  # fmt: skip
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
