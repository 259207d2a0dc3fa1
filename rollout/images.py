"""Images in prompts: a vision-language model's processor, the row's images, pixel tensors.

A vision-language model (VLM) reads an image as a run of image tokens in its input ids, whose
embeddings its vision tower computes from the image's pixels. The chat template writes one
*placeholder* per image; rendering expands each into the image's tokens with the processor
(`rollout.template.encode_with_images`), so the expansion is part of the ids the model sees:
prompt and tool-turn tokens, mask 0. This module loads processors (`load_processor`), puts a
row's images in its messages (`with_row_images`), and joins and batches the tensors the model's
forward takes (`pixel_values`, and per family `image_grid_thw`, `pixel_attention_mask`, ...).

Without torchvision (CPU machines here: the registries' torchvision wheels are CUDA builds
that do not load beside the CPU torch), transformers cannot build a processor that has a video
processor (Qwen2-VL, Qwen2.5-VL), even for images only. `load_processor` then builds it without
one (`image_only`): images work; videos, which agentgrpo never feeds, do not.

Every picture shown to the model is a PIL image of at most `tools.MAX_PICTURE_PIXELS` pixels
(`tools.picture_problem`): a path or a URL is never opened nor fetched, an empty or oversized
picture from a row or an environment is an error, and one from a tool is a tool error the model
reads.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from rollout.template import content_parts, encode_with_images, image_placeholder
from tools import picture_problem
from tools.call import PICTURES_ARE_PIL

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def has_torchvision() -> bool:
    """Whether torchvision can be imported (transformers' video processors need it)."""
    return importlib.util.find_spec("torchvision") is not None


@functools.cache
def image_only(processor_class: type) -> Any:
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


def with_row_images(messages: list[dict[str, Any]], row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The messages with the row's `image` or `images` column put in their image parts.

    TRL's format: the images fill the prompt's empty image parts (`{"type": "image"}`) in order;
    a prompt without image parts gets them at the start of its first user message. Messages of
    a row without those columns come back unchanged.

    Raises:
        ValueError: The row has both columns, a different number of images than the prompt
            has empty image parts, or an image that is not a PIL image, or is empty or oversized
            (`tools.picture_problem`: a path or a URL is never opened nor fetched).
    """
    if "image" in row and "images" in row:
        raise ValueError("a row has both an 'image' and an 'images' column; keep one")
    if "image" not in row and "images" not in row:
        return messages
    column = "image" if "image" in row else "images"
    images = [row["image"]] if column == "image" else list(row["images"] or [])
    if problem := next(filter(None, map(picture_problem, images)), None):
        raise ValueError(f"the row's {column!r} column holds {problem}; {PICTURES_ARE_PIL}")
    empty = [
        (m, p)
        for m, message in enumerate(messages)
        for p, part in enumerate(content_parts(message.get("content")))
        if part.get("type") == "image" and part.get("image") is None
    ]
    if not empty:
        return _prepend_images(messages, images)
    if len(empty) != len(images):
        raise ValueError(
            f"the prompt has {len(empty)} image parts but the row has {len(images)} images; "
            f"give one image per {{'type': 'image'}} part"
        )
    filled = [
        {**m, "content": [dict(p) for p in m["content"]]}
        if isinstance(m.get("content"), list)
        else dict(m)
        for m in messages
    ]
    for (m, p), image in zip(empty, images, strict=True):
        filled[m]["content"][p]["image"] = image
    return filled


def _prepend_images(messages: list[dict[str, Any]], images: list[Any]) -> list[dict[str, Any]]:
    """The first user message with image parts for `images` before its text."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first is None or not images:
        return messages
    content = messages[first].get("content") or ""
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    parts = [{"type": "image", "image": image} for image in images]
    return [*messages[:first], {**messages[first], "content": parts + text}, *messages[first + 1 :]]


def feature_token_ids(config: PreTrainedConfig) -> list[int]:
    """The ids a VLM replaces by image (or video) features: a sampled one would break its forward.

    Empty for a text model. The generation backends never sample them (`suppress_tokens`);
    the sampler logprobs stay those before suppression, which the learner recomputes.
    """
    if getattr(config, "vision_config", None) is None:
        return []
    names = ("image_token_id", "image_token_index", "video_token_id")
    return sorted({value for name in names if (value := getattr(config, name, None)) is not None})


def tool_content(text: str, images: Sequence[Any]) -> str | list[dict[str, Any]]:
    """A tool message's content: `text`, or with images, their parts and then the text's."""
    if not images:
        return text
    parts: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images]
    return [*parts, {"type": "text", "text": text}] if text else parts


def text_of(content: Any) -> str:
    """The text of a message's content: itself, or its text parts joined."""
    if isinstance(content, str):
        return content
    texts = (part.get("text", "") for part in content_parts(content) if part.get("type") == "text")
    return "".join(texts)


def with_observation_parts(
    messages: list[dict[str, Any]], observation: Sequence[Any]
) -> list[dict[str, Any]]:
    """Add what `reset` returned, texts and images in order, to the last user message.

    Texts become text parts (the first on a new line after the message's own text), images
    image parts; with no messages, they are the user's message.
    """
    added: list[Mapping[str, Any]] = [
        {"type": "text", "text": value}
        if isinstance(value, str)
        else {"type": "image", "image": value}
        for value in observation
    ]
    if not messages:
        return [{"role": "user", "content": added}]
    content = messages[-1].get("content") or ""
    own: list[Mapping[str, Any]]
    if isinstance(content, str):
        own = [{"type": "text", "text": content + "\n"}] if content else []
    else:
        own = [*content_parts(content), {"type": "text", "text": "\n"}]
    return [*messages[:-1], {**messages[-1], "content": own + added}]


def vision_forward_kwargs(
    config: PreTrainedConfig,
    input_ids_B_L: torch.Tensor,
    vision: Mapping[str, torch.Tensor],
) -> dict[str, Any]:
    """What a VLM's forward takes besides ids and attention mask, for a batch with images.

    The vision inputs themselves, and what the model family needs per token: Qwen2-VL's
    family takes `mm_token_type_ids` (1 on image tokens) and computes its own 3-D rotary
    positions from them and the attention mask, so `position_ids` is None for it (the
    sampler and the learner both call the model this way, so their logprobs agree). Other
    families read plain positions. Empty `vision`: nothing (a text-only batch).
    """
    if not vision:
        return {}
    kwargs: dict[str, Any] = dict(vision)
    if getattr(config, "vision_start_token_id", None) is not None:
        kwargs["mm_token_type_ids"] = (input_ids_B_L == config.image_token_id).int()
        kwargs["position_ids"] = None
    return kwargs


def batch_vision(vision_B: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The vision inputs of B sequences, as one forward over them takes them.

    Images are listed sequence by sequence; Idefics3's per-sequence layout (B x images x ...)
    is padded with all-zero images, which its model skips. Empty: no sequence has images.
    """
    present = [v for v in vision_B if v]
    if not present:
        return {}
    if present[0]["pixel_values"].dim() != 5:
        return join_vision_inputs(present)
    most = max(v["pixel_values"].shape[1] for v in present)
    template = present[0]
    return {
        key: torch.cat([_padded_images(v.get(key), template[key], most) for v in vision_B])
        for key in template
    }


def _padded_images(value: torch.Tensor | None, like: torch.Tensor, count: int) -> torch.Tensor:
    """`value` (1 x n x ...) with zero images added up to `count`; None: all zero."""
    shape = (1, count, *like.shape[2:])
    padded = like.new_zeros(shape)
    if value is not None:
        padded[:, : value.shape[1]] = value
    return padded


def unexpanded_ids(processor: Any, ids: Sequence[int], images: Sequence[Any]) -> list[int]:
    """`ids` with each image's expanded tokens put back to its placeholder's ids.

    `encode_with_images` expands every placeholder; vLLM expands the placeholders of the ids it
    is given itself (always, even where they are expanded already), so it is given these ids.
    Each image's expansion is found in order: the ids of its placeholder encoded alone.

    Raises:
        ValueError: An image's expansion is not in `ids` after the previous one's (its tokens
            depend on the text around it, or `images` are not those `ids` were encoded with).
    """
    placeholder = image_placeholder(processor)
    short = processor.tokenizer.encode(placeholder, add_special_tokens=False)
    unexpanded, start = [], 0
    for number, image in enumerate(images):
        expanded = encode_with_images(processor, placeholder, [image])[0]
        at = _find(ids, expanded, start)
        if at is None:
            raise ValueError(
                f"image {number}'s tokens ({len(expanded)} ids, its placeholder {placeholder!r} "
                "expanded alone) are not in the prompt ids: this family's expansion depends on "
                "the text around it, so vLLM cannot be given its unexpanded prompt; generate "
                "with transformers (use_vllm=False)"
            )
        unexpanded += [*ids[start:at], *short]
        start = at + len(expanded)
    return unexpanded + list(ids[start:])


def _find(ids: Sequence[int], part: Sequence[int], start: int) -> int | None:
    """Where `part` first occurs in `ids` from `start` on (None: nowhere)."""
    for at in range(start, len(ids) - len(part) + 1):
        if list(ids[at : at + len(part)]) == list(part):
            return at
    return None
