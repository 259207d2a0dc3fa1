"""The grouped-query SDPA attention: the same results as transformers' "sdpa", without copies."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from agentgrpo import GRPOConfig
from agentgrpo.models.attention import NAME, grouped_decode_attention, use_grouped_query_sdpa
from agentgrpo.models.loading import load_policy
from tests.support.tiny_model import tiny_config


def grouped_query_llama(attn_implementation: str = "sdpa") -> LlamaForCausalLM:
    config = tiny_config(LlamaConfig, 100, intermediate_size=64)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def logits_and_grads(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A left-padded batch's logits, and the gradients of their sum over real tokens."""
    ids_B_L = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(1))
    mask_B_L = torch.ones(3, 9, dtype=torch.long)
    mask_B_L[0, :3] = 0
    mask_B_L[1, :1] = 0
    model.zero_grad()
    logits_B_L_V = model(input_ids=ids_B_L, attention_mask=mask_B_L).logits
    (logits_B_L_V * mask_B_L[..., None]).sum().backward()
    return logits_B_L_V.detach(), [p.grad.clone() for p in model.parameters()]


def test_grouped_query_sdpa_gives_sdpas_logits_and_gradients_without_copying_heads(monkeypatch):
    model = grouped_query_llama()
    expected_logits, expected_grads = logits_and_grads(model)
    grouped_calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        grouped_calls.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    assert use_grouped_query_sdpa(model)
    logits, grads = logits_and_grads(model)
    assert grouped_calls == [True, True]  # both layers read the 2 key-value heads in place
    assert torch.allclose(logits, expected_logits, atol=1e-6)
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert torch.allclose(grad, expected, atol=1e-6)


def test_a_model_on_another_attention_is_left_as_it_is():
    model = grouped_query_llama("eager")
    assert not use_grouped_query_sdpa(model)
    assert model.config._attn_implementation == "eager"


def test_the_policy_runs_on_it_and_a_saved_policy_does_not_record_it(tmp_path):
    grouped_query_llama().save_pretrained(tmp_path / "saved")
    policy = load_policy(str(tmp_path / "saved"), GRPOConfig(output_dir=str(tmp_path)))
    assert policy.config._attn_implementation == NAME
    policy.save_pretrained(tmp_path / "again")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert reloaded.config._attn_implementation == "sdpa"


def test_grouped_decode_attention_equals_sdpa_over_repeated_heads():
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 6, 1, 8), torch.randn(3, 2, 10, 8), torch.randn(3, 2, 10, 8)
    mask = torch.rand(3, 1, 1, 10) > 0.4
    mask[..., 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), attn_mask=mask
    )
    output = grouped_decode_attention(query, key, value, mask)
    assert torch.allclose(output, expected.transpose(1, 2), atol=1e-5)
