"""Images in prompts: loading a vision-language model's processor and encoding text with images.

A vision-language model (VLM) reads an image as a run of image tokens in its input ids, whose
embeddings its vision tower computes from the image's pixels. The chat template writes one
*placeholder* per image (`image_placeholder`); the model's processor expands each placeholder
into the image's tokens and turns the image into the tensors the model reads (`pixel_values`,
and per family `image_grid_thw`, `pixel_attention_mask`, ...). `encode_with_images` does both, so
the expansion is part of the ids the model sees: prompt and tool-turn tokens, mask 0.

Without torchvision (CPU machines here: the registries' torchvision wheels are CUDA builds
that do not load beside the CPU torch), transformers cannot build a processor that has a video
processor (Qwen2-VL, Qwen2.5-VL), even for images only. `load_processor` then builds it without
one (`image_only`): images work; videos, which agentgrpo never feeds, do not.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

import torch

# What a processor returns besides the pixel tensors; the rest is the model's vision input.
_TEXT_KEYS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}


def has_torchvision() -> bool:
    """Whether torchvision can be imported (transformers' video processors need it)."""
    return importlib.util.find_spec("torchvision") is not None


@functools.cache
def image_only(processor_class: type) -> type:
    """`processor_class` without its video processor, under the same name.

    A processor's sub-processors are the arguments of its ``__init__``; this subclass takes the
    image processor and the tokenizer only and hands None for the video processor, so it builds
    and saves (as `processor_class`'s name, loadable with or without torchvision) where
    transformers has no video processors.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        processor_class.__init__(
            self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs
        )

    namespace = {"__init__": __init__, "__doc__": processor_class.__doc__}
    return type(processor_class.__name__, (processor_class,), namespace)


def load_processor(name_or_path: str, **kwargs: Any) -> Any:
    """The processor of a model directory or hub id (`AutoProcessor`), images-only if need be.

    Where torchvision is missing and the model's processor has a video processor, it is built
    by `image_only`. `kwargs` go to `from_pretrained`.
    """
    from transformers import AutoProcessor, ProcessorMixin
    from transformers.models.auto.processing_auto import processor_class_from_name

    processor_class = None
    if not has_torchvision():
        config = ProcessorMixin.get_processor_dict(name_or_path, **kwargs)[0]
        name = config.get("processor_class")
        processor_class = processor_class_from_name(name) if name else None
    if processor_class is not None and "video_processor" in processor_class.get_attributes():
        return image_only(processor_class).from_pretrained(name_or_path, **kwargs)
    return AutoProcessor.from_pretrained(name_or_path, **kwargs)


def is_vision_processor(processing_class: Any) -> bool:
    """Whether `processing_class` is a processor with an image processor (not a tokenizer)."""
    return getattr(processing_class, "image_processor", None) is not None


def image_placeholder(processor: Any) -> str:
    """The text a chat template writes for one image, which `processor` expands into its tokens.

    Qwen2-VL's family wraps its image token in vision start and end tokens; Gemma3's
    processor expands its begin-of-image token; the others expand their image token.
    """
    tokenizer = processor.tokenizer
    start = getattr(tokenizer, "vision_start_token", None) or _token(tokenizer, "<|vision_start|>")
    end = getattr(tokenizer, "vision_end_token", None) or _token(tokenizer, "<|vision_end|>")
    if start and end:
        return f"{start}{processor.image_token}{end}"
    boi = getattr(processor, "boi_token", None)
    return boi or processor.image_token


def _token(tokenizer: Any, token: str) -> str | None:
    """`token` when the tokenizer has it as one id, else None."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    return token if len(ids) == 1 and ids[0] != tokenizer.unk_token_id else None


def encode_with_images(
    processor: Any, text: str, images: Sequence[Any]
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Token ids of rendered `text`, each image placeholder expanded, and the images' tensors.

    Args:
        processor: A VLM processor (`load_processor`).
        text: Rendered template text holding one `image_placeholder` per image, in order.
        images: The images (PIL), one per placeholder.

    Returns:
        The ids (the template, not the tokenizer, adds special tokens) and the vision inputs
        the model's forward takes with them (empty when there are no images).

    Raises:
        ValueError: The text holds a different number of placeholders than there are images.
    """
    placeholder = image_placeholder(processor)
    if text.count(placeholder) != len(images):
        raise ValueError(
            f"the text has {text.count(placeholder)} image placeholders ({placeholder!r}) but "
            f"{len(images)} images were given; each image needs one image part in the messages"
        )
    if not images:
        return processor.tokenizer.encode(text, add_special_tokens=False), {}
    encoded = processor(
        text=[text], images=[list(images)], return_tensors="pt", add_special_tokens=False
    )
    ids = encoded["input_ids"][0].tolist()
    return ids, {k: v for k, v in encoded.items() if k not in _TEXT_KEYS}


def join_vision_inputs(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The vision inputs of several encodings of one sequence, as one (images in order).

    The processors list images (or their patches) along dimension 0, except Idefics3's, whose
    `pixel_values` (batch x images x C x H x W) and `pixel_attention_mask` list them along
    dimension 1 after a batch dimension of 1.
    """
    parts = [part for part in parts if part]
    if len(parts) <= 1:
        return dict(parts[0]) if parts else {}
    batched = parts[0]["pixel_values"].dim() == 5
    return {
        key: torch.cat([part[key] for part in parts], dim=int(batched and key in _PER_SEQUENCE))
        for key in parts[0]
    }


# Keys whose tensors have a batch dimension before the images, where `pixel_values` has 5.
_PER_SEQUENCE = {"pixel_values", "pixel_attention_mask"}
