"""Sequence-classification reward models as reward functions, as TRL's GRPOTrainer takes them.

A ``transformers`` sequence-classification model (or a path or hub id to load one with
``num_labels=1``) scores prompt + completion with its tokenizer: the reward is ``logits[:, 0]``.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import PurePath
from typing import Any

import torch

from agentgrpo.models.sharded import whole_copy, zero3_partitioned
from rollout.template import ChatRenderer


def is_reward_model(func: Any) -> bool:
    """Whether `func` is a loaded ``transformers`` model (a reward model, not a function)."""
    if not isinstance(func, torch.nn.Module):
        return False
    from transformers import PreTrainedModel

    return isinstance(func, PreTrainedModel)


def _load(path: str, model_kwargs: dict[str, Any]) -> Any:
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **model_kwargs)


def _load_tokenizer(model: Any, tokenizer_kwargs: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    source = model.config._name_or_path
    if not source:
        raise ValueError(
            f"the reward model {type(model).__name__} has no config._name_or_path to load its "
            "tokenizer from; pass it in processing_classes"
        )
    return AutoTokenizer.from_pretrained(source, **tokenizer_kwargs)


def model_name(model: Any) -> str:
    """The last component of the model's ``config._name_or_path``, else its class name."""
    source = str(model.config._name_or_path or "").rstrip("/")
    return PurePath(source).name if source else type(model).__name__


class SequenceClassifierReward:
    """A sequence-classification model as a reward function: ``logits[:, 0]`` of prompt+completion.

    Text prompts and completions are concatenated; conversational ones (message lists) are
    rendered with the tokenizer's chat template as one conversation, bounded in time and size
    like every render of a template (`rollout.ChatRenderer`). The batch is right-padded;
    sequence-classification heads read the last non-pad token, so the model's config needs
    ``pad_token_id``: a tokenizer without a pad token gets its eos token as pad, and a model
    without ``pad_token_id`` gets the tokenizer's. The model is put in eval mode. A model that
    DeepSpeed ZeRO-3 loaded as shards (a path loaded under a `zero3_init_flag` launch) is
    replaced by a whole copy (`whole_copy`), which every process builds together and holds.
    """

    def __init__(self, model: Any, tokenizer: Any) -> None:
        if zero3_partitioned(model):
            model = whole_copy(model)
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ValueError(
                    f"the tokenizer of reward model {model_name(model)!r} has no pad or eos "
                    "token; set tokenizer.pad_token"
                )
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = model_name(model)

    @classmethod
    def of(
        cls, model: Any, tokenizer: Any, model_kwargs: dict[str, Any]
    ) -> SequenceClassifierReward:
        """The reward of `model` (a model, or a path or hub id to load with `model_kwargs`).

        Without `tokenizer`, the model's is loaded from ``config._name_or_path``, with
        `model_kwargs`' ``trust_remote_code`` and, for a model given by path, its ``revision``.
        """
        tokenizer_kwargs = {"trust_remote_code": model_kwargs.get("trust_remote_code", False)}
        if isinstance(model, str):
            if "revision" in model_kwargs:
                tokenizer_kwargs["revision"] = model_kwargs["revision"]
            model = _load(model, model_kwargs)
        return cls(model, tokenizer or _load_tokenizer(model, tokenizer_kwargs))

    def to(self, device: Any) -> None:
        """Move the model to `device`, unless it was spread over devices (``device_map``)."""
        if not getattr(self.model, "hf_device_map", None):
            self.model.to(device)

    def __call__(self, prompts: list[Any], completions: list[Any]) -> list[float]:
        """One reward per (prompt, completion): the model's first logit on their text."""
        texts = [self._text(p, c) for p, c in zip(prompts, completions, strict=True)]
        inputs = self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            padding_side="right",
            add_special_tokens=False,
        ).to(self.model.device)
        with torch.inference_mode():
            logits_N_L = self.model(**inputs).logits
        return logits_N_L[:, 0].float().tolist()

    def _text(self, prompt: Any, completion: Any) -> str:
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt + completion
        messages = _as_messages(prompt, "user") + _as_messages(completion, "assistant")
        return self._renderer.render(messages, generation_prompt=False)

    @cached_property
    def _renderer(self) -> ChatRenderer:
        template = getattr(self.tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise ValueError(
                f"the tokenizer of reward model {self.name!r} has no chat template, so it cannot "
                "score conversations; pass text prompts and completions, or a tokenizer with a "
                "chat template in processing_classes"
            )
        return ChatRenderer(self.tokenizer, template)


def _as_messages(value: Any, role: str) -> list[dict[str, Any]]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)
