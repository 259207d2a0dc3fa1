"""The tiny random Llama the tests (and bench/rollout.py) use in place of a real model.

A plain module, not a fixture file, so scripts outside pytest can import it too.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(tokenizer: Any, seed: int = 0, num_attention_heads: int = 4) -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama (hidden 64) over `tokenizer`'s vocabulary.

    About 3.2M parameters with SmolLM2's tokenizer: built from a config, so tests and benchmarks
    get a real transformers model without a hub. Seeded, so equal seeds give equal weights.
    `num_attention_heads=2` gives heads of 32, a size vLLM's CPU attention supports.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()
