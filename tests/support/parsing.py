"""Chat templates and tokenizers for parser tests: TRL's own templates, an offline tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from environments import Counter
from rollout import EpisodeConfig, RolloutEngine

HERMES_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": {"open": "<think>", "close": "</think>"},
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"content": "text"},
    },
}


def offline_tokenizer(response_template: dict | None) -> PreTrainedTokenizerFast:
    vocab = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab)
    tokenizer.response_template = response_template
    return tokenizer


def trl_template(name: str) -> str:
    """The source of TRL's `trl/chat_templates/<name>.jinja`, found without importing trl."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("trl is not installed (make install puts it in as a test dependency)")
    return (
        Path(spec.submodule_search_locations[0]) / "chat_templates" / f"{name}.jinja"
    ).read_text()


def qwen3_engine(tokenizer, backend, template: str, **kwargs) -> RolloutEngine:
    return RolloutEngine(
        backend,
        tokenizer,
        environment_factory=Counter,
        chat_template=template,
        tool_call_parser="hermes",
        config=EpisodeConfig(max_completion_length=512, max_turns=5),
        **kwargs,
    )
