"""Tiny random vision-language models and their processors, built here from configs.

Three families, as the seeds name them: Qwen2.5-VL (`qwen2_5_vl`), SmolVLM / Idefics3
(`idefics3`) and Gemma3 (`gemma3`). Each comes with a processor made of transformers' own image
processor (the PIL one where there is no torchvision; Qwen's processor is built without its video
processor, `rollout.images.image_only`, which works either way), a byte-level BPE tokenizer trained
here with the family's image tokens, and agentgrpo's `chatml_vision` template. Nothing is
downloaded. Images are tiny (16 or 32 pixels a side) so that an image is 4 tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from rollout.images import image_only
from tests.support.tiny_model import TINY_SIZES, bpe_tokenizer

FAMILIES = ("qwen2_5_vl", "idefics3", "gemma3")
_HIDDEN = TINY_SIZES["hidden_size"]


class TinyVLM(NamedTuple):
    """A tiny model and the processor that feeds it."""

    model: Any
    processor: Any


def tiny_vlm(family: str, seed: int = 0) -> TinyVLM:
    """A randomly initialised VLM of `family` (one of `FAMILIES`) with its processor.

    Seeded, so equal seeds give equal weights. The model is in eval mode, in float32.
    """
    builders = {"qwen2_5_vl": _qwen2_5_vl, "idefics3": _idefics3, "gemma3": _gemma3}
    if family not in builders:
        raise ValueError(f"unknown family {family!r}; pick one of {FAMILIES}")
    processor = _PROCESSORS[family]()
    torch.manual_seed(seed)
    return TinyVLM(builders[family](processor.tokenizer).eval(), processor)


def saved_vlm(family: str, folder: Path) -> Path:
    """`tiny_vlm(family)` and its processor saved in `folder`, a model folder to load; `folder`."""
    model, processor = tiny_vlm(family)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def image_token_of(model: Any) -> int:
    """The id of the token that stands for image features in `model`'s input ids."""
    config = model.config
    return getattr(config, "image_token_id", None) or config.image_token_index


def _language_model(tokenizer: Any, **fields: Any) -> dict[str, Any]:
    """The text config every family shares: TINY_SIZES over `tokenizer`; `fields` add to it."""
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return dict(TINY_SIZES, vocab_size=len(tokenizer), max_position_embeddings=2048, **ids) | fields


def _siglip_tower() -> dict[str, Any]:
    """The vision config Idefics3 and Gemma3 share: one layer, 32-pixel images, 8-pixel patches."""
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )


def _qwen_processor() -> Any:
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    image_tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer = bpe_tokenizer("chatml_vision", image_tokens)
    # Every image becomes 16 x 16 pixels: 4 x 4 patches of 4, merged 2 x 2 into 4 tokens.
    images = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=256, max_pixels=256
    )
    return image_only(Qwen2_5_VLProcessor)(image_processor=images, tokenizer=tokenizer)


def _qwen2_5_vl(tokenizer: Any) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=_language_model(
            tokenizer,
            # head 16: 8 rotary frequencies split over time, height and width
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]},
            bos_token_id=None,
        ),
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 16,
            "out_hidden_size": _HIDDEN,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def _idefics3_processor() -> Any:
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    image_tokens = ["<fake_token_around_image>", "<image>", "<global-img>"]
    tokenizer = bpe_tokenizer("chatml_vision", image_tokens)
    # One 32-pixel image, not split: 4 x 4 patches of 8, shuffled 2 x 2 into 4 tokens.
    images = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": 32},
        max_image_size={"longest_edge": 32},
    )
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4)


def _idefics3(tokenizer: Any) -> Any:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    config = Idefics3Config(
        text_config=_language_model(tokenizer, model_type="llama"),
        vision_config=_siglip_tower(),
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    return Idefics3ForConditionalGeneration(config)


def _gemma3_processor() -> Any:
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    named = {
        "boi_token": "<start_of_image>",
        "image_token": "<image_soft_token>",
        "eoi_token": "<end_of_image>",
    }
    tokenizer = bpe_tokenizer("chatml_vision", list(named.values()), **named)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=4)


def _gemma3(tokenizer: Any) -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        text_config=_language_model(tokenizer, head_dim=16, sliding_window=64, bos_token_id=None),
        vision_config=_siglip_tower(),
        mm_tokens_per_image=4,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
    )
    model = Gemma3ForConditionalGeneration(config)
    # Gemma3 starts its projection at zero (a trained checkpoint fills it): random, so that
    # the pixels reach the logits of the untrained model too.
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.2)
    return model


_PROCESSORS = {
    "qwen2_5_vl": _qwen_processor,
    "idefics3": _idefics3_processor,
    "gemma3": _gemma3_processor,
}
