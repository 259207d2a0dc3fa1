"""Vision-language policies: the processor beside the tokenizer.

A VLM's `processing_class` is a processor (a tokenizer and an image processor). The trainer
keeps its tokenizer for everything text (padding, decoding, stop tokens) and hands the
processor to the rollout engine, whose renderer expands image placeholders into image tokens
and turns images into the tensors each episode row carries (`rollout.images`).
"""

from __future__ import annotations

from typing import Any

from agentgrpo.models import load_tokenizer
from rollout.images import is_vision_processor, load_processor


def is_vision_model(model: Any) -> bool:
    """Whether `model`'s config has a vision tower (a `vision_config`)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def is_vision_folder(path: str) -> bool:
    """Whether the model saved at `path` (folder or hub id) has a vision tower."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


def tokenizer_and_processor(
    model: Any, processing_class: Any = None, load_kwargs: dict[str, Any] | None = None
) -> tuple[Any, Any]:
    """The policy's tokenizer, and its processor when it reads images (else None).

    Args:
        model: The loaded policy (its name or path locates what is not given).
        processing_class: A tokenizer, a VLM's processor, or None: the model's own (its
            processor for a VLM, `rollout.images.load_processor`, which works without
            torchvision).
        load_kwargs: Passed to `from_pretrained` (`trust_remote_code`, `revision`).
    """
    if processing_class is None and is_vision_model(model):
        name = getattr(model, "name_or_path", None) or model.config._name_or_path
        processing_class = load_processor(name, **(load_kwargs or {}))
    if not is_vision_processor(processing_class):
        return load_tokenizer(model, processing_class, load_kwargs), None
    tokenizer = load_tokenizer(model, processing_class.tokenizer)
    return tokenizer, processing_class
