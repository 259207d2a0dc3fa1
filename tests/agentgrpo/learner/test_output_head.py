"""The output layer a chunk of tokens at a time: the full-logits numbers without the full logits.

`head_logprobs` is checked against `logits_logprobs` (the same numbers from whole logits) as a
pure function, then through `completion_logprobs` on real transformers models: chunked and
checkpointed, with the output layer cast to float32, with a LoRA adapter on it, and for the
models whose logits are not `lm_head(hidden)`, which must read their logits whole. That no
B x C x V tensor exists is checked structurally: every tensor an operator returns, forward and
backward, is recorded through a `TorchDispatchMode`.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
)

from agentgrpo.learner import output_head
from agentgrpo.learner.logprobs import completion_logprobs, logits_logprobs
from agentgrpo.learner.output_head import chunk_tokens, head_logprobs
from agentgrpo.models.loading import cast_lm_head_to_fp32
from agentgrpo.models.sharded import fsdp_sharded
from tests.agentgrpo.learner.test_shared_prompt_forward import (
    ENTROPY_TOLERANCE,
    GRADIENT_TOLERANCE,
    LOGPROB_TOLERANCE,
    assert_same_numbers,
    batch_of,
    episode,
    learner,
    numbers,
    one_pass,
    real_columns,
    token_ids,
    two_groups,
)
from tests.support.tiny_model import tiny_llama, tiny_model


@pytest.fixture
def model(tokenizer):
    return tiny_llama(tokenizer)


@pytest.fixture
def chunks_of(monkeypatch):
    """Set how many tokens one chunk computes, for a vocabulary of V."""

    def set_tokens(tokens: int, vocabulary_size: int) -> None:
        monkeypatch.setattr(output_head, "LOGITS_PER_CHUNK", tokens * vocabulary_size)
        assert chunk_tokens(vocabulary_size) == tokens

    return set_tokens


def head_and_states(seed: int = 0):
    """A random output layer (H=8, V=50, with a bias) and final states of 3 rows x 5 columns."""
    generator = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(8, 50)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 8, generator=generator))
        head.bias.copy_(torch.randn(50, generator=generator))
    hidden_B_C_H = torch.randn(3, 5, 8, generator=generator, requires_grad=True)
    targets_B_C = torch.randint(0, 50, (3, 5), generator=generator)
    real_B_C = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]]).bool()
    return head, hidden_B_C_H, targets_B_C, real_B_C


def values_and_gradients(score, head, hidden_B_C_H, real_B_C):
    """Logprobs, entropies and the gradients (states, weight, bias) of a loss reading both."""
    for tensor in (hidden_B_C_H, head.weight, head.bias):
        tensor.grad = None
    logprobs_B_C, entropy_B_C = score()
    weights_B_C = torch.linspace(-1, 2, logprobs_B_C.numel()).view_as(logprobs_B_C)
    ((logprobs_B_C * weights_B_C + entropy_B_C) * real_B_C).sum().backward()
    grads = [t.grad.clone() for t in (hidden_B_C_H, head.weight, head.bias)]
    return logprobs_B_C.detach(), entropy_B_C.detach(), grads


@pytest.mark.parametrize("tokens", [1, 4, 13, 100])
def test_chunks_of_any_size_give_the_whole_logits_numbers_and_gradients(chunks_of, tokens):
    head, hidden_B_C_H, targets_B_C, real_B_C = head_and_states()
    chunks_of(tokens, 50)

    def chunked():
        return head_logprobs(head, hidden_B_C_H, targets_B_C, real_B_C, 0.7, "differentiable")

    def whole():
        logits_B_C_V = head(hidden_B_C_H)
        return logits_logprobs(logits_B_C_V, targets_B_C, real_B_C, 0.7, "differentiable")

    got = values_and_gradients(chunked, head, hidden_B_C_H, real_B_C)
    want = values_and_gradients(whole, head, hidden_B_C_H, real_B_C)
    torch.testing.assert_close(got[0], want[0], atol=LOGPROB_TOLERANCE, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=LOGPROB_TOLERANCE, rtol=ENTROPY_TOLERANCE)
    for grad, want_grad in zip(got[2], want[2], strict=True):
        scale = float(want_grad.abs().max())
        torch.testing.assert_close(grad, want_grad, atol=GRADIENT_TOLERANCE * scale, rtol=0)


def test_padding_positions_score_zero_and_a_detached_entropy_has_no_gradient():
    head, hidden_B_C_H, targets_B_C, real_B_C = head_and_states()
    logprobs_B_C, entropy_B_C = head_logprobs(
        head, hidden_B_C_H, targets_B_C, real_B_C, 1.0, "detached"
    )
    assert logprobs_B_C.requires_grad and not entropy_B_C.requires_grad
    assert (logprobs_B_C[~real_B_C] == 0).all() and (entropy_B_C[~real_B_C] == 0).all()
    assert (logprobs_B_C[real_B_C] < 0).all() and (entropy_B_C[real_B_C] > 0).all()
    assert head_logprobs(head, hidden_B_C_H, targets_B_C, real_B_C, 1.0)[1] is None


def test_an_unknown_entropy_mode_is_an_error():
    head, hidden_B_C_H, targets_B_C, real_B_C = head_and_states()
    with pytest.raises(ValueError, match="entropy='yes' is not one of"):
        head_logprobs(head, hidden_B_C_H, targets_B_C, real_B_C, 1.0, "yes")


def test_a_chunk_holds_as_many_tokens_as_the_logit_budget_allows():
    budget = output_head.LOGITS_PER_CHUNK
    assert chunk_tokens(49152) == budget // 49152
    assert chunk_tokens(151936) == budget // 151936 > 100  # Qwen2.5
    assert chunk_tokens(budget * 2) == 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_checkpointed_chunks_through_a_model_give_the_one_pass_numbers(
    model, chunks_of, temperature
):
    chunks_of(5, model.config.vocab_size)
    assert_same_numbers(model, two_groups(), temperature)  # 27 real tokens: 6 chunks


def test_a_lora_adapter_on_the_output_layer_gets_the_one_pass_gradients(model, chunks_of):
    chunks_of(5, model.config.vocab_size)
    lora = LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    assert type(output_head.output_head(peft_model)).__module__.startswith("peft")
    assert_same_numbers(peft_model, two_groups(), 0.7)


def test_an_output_layer_cast_to_float32_scores_as_its_whole_logits(model, chunks_of):
    model.to(torch.bfloat16)
    cast_lm_head_to_fp32(model)
    chunks_of(5, model.config.vocab_size)
    batch = batch_of([episode(n, token_ids(n, 5 + n), token_ids(10 + n, 4)) for n in range(3)])
    with torch.no_grad():
        got = learner(model, batch, 0.7)  # one pass: the same hidden states as the reference
        logits_B_C_V = model(
            input_ids=batch.input_ids_B_L,
            attention_mask=batch.attention_mask_B_L,
            position_ids=batch.position_ids_B_L,
        ).logits[:, -batch.completion_width - 1 : -1]
    assert logits_B_C_V.dtype == torch.float32
    want = logits_logprobs(
        logits_B_C_V, batch.completion_ids_B_C, real_columns(batch), 0.7, "detached"
    )
    torch.testing.assert_close(got[0], want[0], atol=LOGPROB_TOLERANCE, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=LOGPROB_TOLERANCE, rtol=ENTROPY_TOLERANCE)


def test_float32_states_meet_a_bfloat16_output_layer_as_the_bfloat16_states_they_were():
    # accelerate's mixed precision hands the forward's outputs back in float32.
    head, hidden_B_C_H, targets_B_C, real_B_C = head_and_states()
    head.to(torch.bfloat16)
    states_B_C_H = hidden_B_C_H.detach().to(torch.bfloat16)
    want = head_logprobs(head, states_B_C_H, targets_B_C, real_B_C, 0.7, "detached")
    got = head_logprobs(head, states_B_C_H.float(), targets_B_C, real_B_C, 0.7, "detached")
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0, rtol=0)


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operator returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in torch.utils._pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.numel = max(self.numel, leaf.numel())
        return out


def largest_tensor(score, model, batch) -> int:
    """The largest tensor made while scoring `batch` and back-propagating a loss on it."""
    with LargestTensor() as mode:
        logprobs_B_C, entropy_B_C = score(model, batch, 1.0)
        (logprobs_B_C.sum() + entropy_B_C.sum()).backward()
    return mode.numel


def test_no_tensor_of_the_full_logits_size_exists_forward_or_backward(model, chunks_of):
    vocabulary_size = model.config.vocab_size
    chunks_of(8, vocabulary_size)
    prompt = token_ids(0, 5)
    batch = batch_of([episode(n, prompt, token_ids(10 + n, 12)) for n in range(8)])
    full_logits = batch.completion_width * len(batch) * vocabulary_size  # 96 tokens x V
    weight = model.lm_head.weight.numel()  # 64 x V: the weight and its gradient
    assert weight < full_logits
    assert largest_tensor(learner, model, batch) == weight
    whole = largest_tensor(one_pass, model, batch)  # the instrument sees whole logits
    assert whole >= full_logits


def tiny(config_class, model_class, tokenizer, **fields):
    return tiny_model(
        model_class, config_class, len(tokenizer), head_dim=16, pad_token_id=tokenizer.pad_token_id,
        **fields,
    ).eval()  # fmt: skip


TRANSFORMED_LOGITS = {
    "a soft cap (Gemma 2)": (Gemma2Config, Gemma2ForCausalLM, {"final_logit_softcapping": 3.0}),
    "a division (Granite)": (GraniteConfig, GraniteForCausalLM, {"logits_scaling": 8.0}),
    "a multiplication (Cohere)": (CohereConfig, CohereForCausalLM, {"logit_scale": 0.0625}),
}


@pytest.mark.parametrize("transform", TRANSFORMED_LOGITS)
def test_a_model_that_transforms_its_logits_is_scored_on_its_own_logits(tokenizer, transform):
    config_class, model_class, fields = TRANSFORMED_LOGITS[transform]
    transformed = tiny(config_class, model_class, tokenizer, **fields)
    with torch.no_grad():
        transformed.get_output_embeddings().weight.mul_(30.0)  # logits big enough to be capped
    batch = two_groups()
    real_B_C, targets_B_C = real_columns(batch), batch.completion_ids_B_C
    assert output_head.output_head(transformed) is None
    with torch.no_grad():
        got_B_C = completion_logprobs(transformed, batch, 1.0).logprobs_B_C
        out = transformed(
            input_ids=batch.input_ids_B_L,
            attention_mask=batch.attention_mask_B_L,
            position_ids=batch.position_ids_B_L,
            output_hidden_states=True,
        )
        width_C = batch.completion_width
        logits_B_C_V = out.logits[:, -width_C - 1 : -1]
        hidden_B_C_H = out.hidden_states[-1][:, -width_C - 1 : -1]
        head = transformed.get_output_embeddings()
        plain_B_C = head_logprobs(head, hidden_B_C_H, targets_B_C, real_B_C, 1.0)[0]
    want_B_C = logits_logprobs(logits_B_C_V, targets_B_C, real_B_C, 1.0)[0]
    torch.testing.assert_close(got_B_C, want_B_C, atol=LOGPROB_TOLERANCE, rtol=0)
    assert (plain_B_C - want_B_C).abs().max() > 0.1  # the plain output layer would be wrong


def test_the_same_model_without_the_transform_uses_the_chunked_output_layer(tokenizer):
    plain = tiny(Gemma2Config, Gemma2ForCausalLM, tokenizer, final_logit_softcapping=None)
    assert output_head.output_head(plain) is plain.lm_head


def accelerate_units(model: torch.nn.Module, root_policy=None) -> torch.nn.Module:
    """`model` sharded by FSDP2 in the one-process group in accelerate's units: each decoder
    layer; the final norm with the tied embedding and output layer, kept gathered after the
    forward; the root, with `root_policy` (its `MixedPrecisionPolicy`) if given."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    tail = [model.model.norm, model.model.embed_tokens, model.lm_head]
    fully_shard(tail, reshard_after_forward=False)
    return fully_shard(model, mp_policy=root_policy or MixedPrecisionPolicy())


def whole_gradients(numbers_of) -> tuple:
    logprobs, entropy, grads = numbers_of
    return logprobs, entropy, [getattr(g, "full_tensor", lambda g=g: g)() for g in grads]


@pytest.mark.parametrize("outputs", ["float32", "cast to bfloat16"])
def test_an_fsdp2_sharded_model_is_scored_inside_its_forward_as_a_whole_one_is(
    one_process_group, tokenizer, chunks_of, outputs
):
    # Its head called outside the forward, or gradients through cached prompt keys, would pass
    # FSDP2's hooks by: a segmentation fault in backward under accelerate's FSDP2 on gloo. So it
    # is scored inside its forward, in one pass, and the scores leave as its logits: in pairs
    # that survive FSDP2's cast of the outputs to bfloat16 (accelerate's bf16 sets it).
    from torch.distributed.fsdp import MixedPrecisionPolicy

    whole = tiny_llama(tokenizer)
    chunks_of(5, whole.config.vocab_size)  # 27 real tokens: 6 checkpointed chunks
    bfloat16 = outputs != "float32"
    policy = MixedPrecisionPolicy(output_dtype=torch.bfloat16) if bfloat16 else None
    sharded = accelerate_units(copy.deepcopy(whole), policy)
    assert fsdp_sharded(sharded) and not fsdp_sharded(whole)
    head_calls = []
    sharded.lm_head.register_forward_pre_hook(lambda *_: head_calls.append(1))
    batch = two_groups()
    got = whole_gradients(numbers(sharded, batch, learner, 0.7, sharded=True))
    assert len(head_calls) == 1  # the engine's hooks ran once, not once per chunk
    assert "forward" not in vars(sharded.lm_head)  # its own forward is back
    want = numbers(whole, batch, learner, 0.7)
    torch.testing.assert_close(got[0], want[0], atol=LOGPROB_TOLERANCE, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=ENTROPY_TOLERANCE)
    # Through the cast the gradients come back in bfloat16 (1.4e-3 of the largest, measured)
    tolerance = 2**-7 if bfloat16 else GRADIENT_TOLERANCE
    for grad, want_grad in zip(got[2], want[2], strict=True):
        scale = float(want_grad.abs().max())
        torch.testing.assert_close(grad, want_grad, atol=tolerance * scale, rtol=0)


def test_no_tensor_of_the_full_logits_size_exists_in_a_sharded_model_either(
    one_process_group, tokenizer, chunks_of
):
    whole = tiny_llama(tokenizer)
    chunks_of(8, whole.config.vocab_size)
    prompt = token_ids(0, 5)
    batch = batch_of([episode(n, prompt, token_ids(10 + n, 12)) for n in range(8)])
    full_logits = batch.completion_width * len(batch) * whole.config.vocab_size  # 96 x V
    sharded = accelerate_units(whole)
    # The largest is the gathered norm, embedding and output layer (64 + 64 x V)
    assert largest_tensor(functools.partial(learner, sharded=True), sharded, batch) < full_logits


def test_the_output_layers_own_forward_is_back_when_the_model_fails(tokenizer):
    model = tiny_llama(tokenizer)
    targets_B_C = torch.ones(1, 2, dtype=torch.long)
    real_B_C = torch.ones(1, 2, dtype=torch.bool)
    scores = output_head.InForwardScores(model.lm_head, targets_B_C, real_B_C, 1.0, "none")
    with pytest.raises(ValueError, match="entropy='none' is not one of"):
        scores(model, 3, input_ids=torch.ones(1, 4, dtype=torch.long))
    assert "forward" not in vars(model.lm_head)
