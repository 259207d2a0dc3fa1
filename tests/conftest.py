"""Shared fixtures: the real SmolLM2 tokenizer and models built without a model hub."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from agentgrpo.default_model import default_model_path


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct as a safetensors folder (converted once, then cached)."""
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    """SmolLM2's real tokenizer (ChatML, vocab 49152)."""
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    """A randomly initialised 2-layer Llama (hidden 64) over SmolLM2's vocabulary: 3.2M params."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()
