"""Packed rows (`padding_free`) score every completion token as the padded forward does.

The reference is the padded one-pass forward's logits (`one_pass_states` with `read_logits`), as
in `test_shared_prompt_forward`, whose helpers and tolerances these tests share: logprobs,
entropies and the gradients of a loss reading both, per parameter, on the tiny Llama in float32.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from agentgrpo.learner.batch import TrainingBatch
from agentgrpo.learner.logprobs import completion_logprobs
from agentgrpo.learner.losses import LossConfig
from agentgrpo.learner.token_weights import TokenWeighting
from agentgrpo.models.attention import use_grouped_query_sdpa
from agentgrpo.training.loss_step import LossStep
from tests.agentgrpo.learner.test_shared_prompt_forward import (
    assert_same_numbers,
    batch_of,
    checkpointing,
    episode,
    model_inputs,
    token_ids,
    two_groups,
)
from tests.support.tiny_model import tiny_llama, tiny_model, tiny_qwen2_moe


@pytest.fixture
def model(tokenizer):
    return tiny_llama(tokenizer)


def distinct_prompts() -> TrainingBatch:
    """Four rows, no prompt shared, prompts of 3-9 tokens and completions of 2-11: much padding."""
    return batch_of(
        [episode(n, token_ids(n, 3 + 2 * n), token_ids(30 + n, 11 - 3 * n)) for n in range(4)]
    )


def forked() -> TrainingBatch:
    """Episodes of one and of three rows (each fork a longer prompt), two sharing a prompt."""
    prompt = token_ids(0, 5)
    return batch_of(
        [
            episode(0, prompt, token_ids(40, 6), token_ids(41, 2), token_ids(42, 7)),
            episode(1, prompt, token_ids(43, 3)),
            episode(2, token_ids(1, 8), token_ids(44, 9)),
        ]
    )


def real_tokens(batch: TrainingBatch) -> int:
    return int(batch.attention_mask_B_L.sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_rows_without_a_shared_prompt_score_as_padded(model, temperature):
    assert_same_numbers(model, distinct_prompts(), temperature, padding_free=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_completions_over_shared_prompts_score_as_padded(model, temperature):
    assert_same_numbers(model, two_groups(), temperature, padding_free=True)


def test_forked_episodes_pack_each_row_as_its_own_sequence(model):
    assert_same_numbers(model, forked(), 1.0, padding_free=True)


def test_without_a_shared_prompt_the_real_tokens_run_as_one_row(model):
    batch = distinct_prompts()
    assert model_inputs(model, batch, padding_free=True) == [(1, real_tokens(batch))]
    assert model_inputs(model, batch) == [tuple(batch.input_ids_B_L.shape)]


def test_shared_prompts_run_once_and_the_completions_as_one_row(model):
    batch = two_groups()
    width_P = batch.input_ids_B_L.shape[1] - batch.completion_width
    completions = int(batch.attention_mask_B_L[:, width_P:].sum())
    assert model_inputs(model, batch, padding_free=True) == [(2, width_P), (1, completions)]


def test_eager_attention_reads_the_packed_masks_too(model):
    model.set_attn_implementation("eager")
    assert_same_numbers(model, two_groups(), 1.0, padding_free=True)
    assert_same_numbers(model, distinct_prompts(), 1.0, padding_free=True)


def test_the_policys_grouped_query_sdpa_reads_the_packed_masks_too(model):
    use_grouped_query_sdpa(model)
    assert model.config._attn_implementation == "sdpa_gqa"
    assert_same_numbers(model, two_groups(), 1.0, padding_free=True)
    assert_same_numbers(model, distinct_prompts(), 1.0, padding_free=True)


def test_a_gradient_checkpointing_model_packs_with_the_padded_numbers(model):
    checkpointing(model)
    assert_same_numbers(model, two_groups(), 1.0, padding_free=True)
    assert_same_numbers(model, distinct_prompts(), 1.0, padding_free=True)


def test_a_model_whose_logits_are_not_its_head_reads_them_packed(tokenizer):
    capped = tiny_model(Qwen2ForCausalLM, Qwen2Config, len(tokenizer), logit_scale=0.5)
    assert_same_numbers(capped, two_groups(), 1.0, padding_free=True)


def test_a_load_balancing_loss_packed_equals_the_padded_one(tokenizer):
    moe = tiny_qwen2_moe(tokenizer)
    batch = distinct_prompts()
    padded = completion_logprobs(moe, batch, 1.0, with_aux_loss=True)
    packed = completion_logprobs(moe, batch, 1.0, with_aux_loss=True, padding_free=True)
    assert padded.aux_loss is not None and packed.aux_loss is not None
    torch.testing.assert_close(packed.aux_loss, padded.aux_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.logprobs_B_C, padded.logprobs_B_C, atol=1e-5, rtol=0)


def test_the_loss_step_packs_when_asked_with_the_padded_loss_and_gradients(model):
    batch = two_groups()
    batch = TrainingBatch(**{**batch.__dict__, "num_items": float(batch.loss_mask_B_C.sum())})

    def loss_and_grads(padding_free: bool):
        step = LossStep(
            LossConfig(loss_type="dapo"),
            TokenWeighting(),
            None,
            False,
            0.0,
            1.0,
            padding_free=padding_free,
        )
        model.zero_grad(set_to_none=True)
        loss, _ = step.loss(model, batch, training=True, scale=1.0)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads(True)
    want_loss, want_grads = loss_and_grads(False)
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-5)
    for grad, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(grad, want, atol=1e-4 * float(want.abs().max()), rtol=0)


def test_sharded_weights_are_refused_by_name(model):
    with pytest.raises(ValueError, match=r"padding_free=True .* FSDP2 or DeepSpeed ZeRO-3"):
        completion_logprobs(model, two_groups(), 1.0, sharded=True, padding_free=True)


def test_rows_with_images_are_refused_by_name(model):
    batch = two_groups()
    with_images = TrainingBatch(
        **{**batch.__dict__, "vision_B": tuple({} for _ in batch.episode_B)}
    )
    with pytest.raises(ValueError, match="padding_free=True cannot pack rows with images"):
        completion_logprobs(model, with_images, 1.0, padding_free=True)


def test_layers_other_than_attention_are_refused_by_name(tokenizer):
    hybrid = tiny_model(
        Qwen2ForCausalLM,
        Qwen2Config,
        len(tokenizer),
        layer_types=["full_attention", "linear_attention"],
    )
    with pytest.raises(ValueError, match=r"attention layers only.*'linear_attention'"):
        completion_logprobs(hybrid, two_groups(), 1.0, padding_free=True)


def test_a_row_with_no_prompt_token_is_refused(model):
    batch = batch_of([episode(0, [], token_ids(1, 4)), episode(1, token_ids(2, 3), [5, 6])])
    with pytest.raises(ValueError, match="a prompt token before every completion"):
        completion_logprobs(model, batch, 1.0, padding_free=True)


@pytest.mark.slow
def test_the_real_135m_model_packs_with_the_padded_logprobs(smollm2_path):
    real = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    for batch in (two_groups(), distinct_prompts()):
        with torch.no_grad():
            padded = completion_logprobs(real, batch, 1.0).logprobs_B_C
            packed = completion_logprobs(real, batch, 1.0, padding_free=True).logprobs_B_C
        torch.testing.assert_close(packed, padded, atol=1e-4, rtol=0)
