"""The transformers backend's prefix cache, keyed by a prompt's pictures as well as its ids."""

from __future__ import annotations

import anyio
import pytest
import torch
from PIL import Image

from rollout.backends.image_prefixes import prefix_key, reusable_length
from rollout.backends.transformers import TransformersBackend
from rollout.images import vision_forward_kwargs
from rollout.template import encode_with_images, image_placeholder
from rollout.types import Pictures, SamplingParams
from tests.support.vlm_models import tiny_vlm

RED = Image.new("RGB", (32, 32), (220, 30, 30))
BLUE = Image.new("RGB", (32, 32), (30, 30, 220))


def test_a_key_pairs_each_pictures_tokens_with_its_digest():
    red, blue = (
        prefix_key([1, 9, 9, 2, 9, 3], [RED, BLUE], {9}),
        prefix_key([1, 9, 9, 2, 9, 3], [RED, RED], {9}),
    )
    assert red is not None and blue is not None
    assert red[0] == 1 and red[3] == 2 and red[:3] == blue[:3] and red[4] != blue[4]
    assert red[1] == red[2] == blue[4]  # the same picture, the same key
    assert prefix_key([1, 9, 2, 9], [RED], {9}) is None  # two pictures' tokens, one picture


def test_a_reused_prefix_covers_every_picture_or_stops_before_the_first():
    ids = [1, 9, 9, 2, 9, 3, 4]  # pictures at 1-2 and 4
    assert reusable_length(7, ids, {9}) == 6  # the last token is read again
    assert reusable_length(5, ids, {9}) == 5
    assert reusable_length(3, ids, {9}) == 1  # would split the pictures: text before them only
    assert reusable_length(4, [1, 2, 3, 4, 5], {9}) == 4


def prompt(processor, image) -> tuple[list[int], dict]:
    text = f"<|im_start|>user\n{image_placeholder(processor)}What colour?<|im_end|>\n"
    return encode_with_images(processor, text + "<|im_start|>assistant\n", [image])


def prefill_lengths(model) -> list[int]:
    """The number of ids each forward of `model` reads (a hook that only records)."""
    lengths: list[int] = []

    def record(module, args, kwargs):
        lengths.append(kwargs["input_ids"].shape[1])

    model.register_forward_pre_hook(record, with_kwargs=True)
    return lengths


def generate(backend, ids, vision, image, seed=3):
    params = SamplingParams(max_tokens=6, seed=seed)
    return anyio.run(lambda: backend.generate(ids, params, Pictures((image,), vision)))


def forward_logprobs(model, ids, vision, completion) -> torch.Tensor:
    full_1_L = torch.tensor([ids + completion.token_ids])
    inputs = vision_forward_kwargs(model.config, full_1_L, vision)
    with torch.no_grad():
        logits = model(input_ids=full_1_L, **inputs).logits[0, len(ids) - 1 : -1]
    picked = torch.tensor(completion.token_ids)[:, None]
    return torch.log_softmax(logits, -1).gather(-1, picked)[:, 0]


def test_a_prompt_with_the_same_picture_prefills_only_its_last_token_again():
    model, processor = tiny_vlm("idefics3")
    backend = TransformersBackend.from_tokenizer(model, processor.tokenizer)
    ids, vision = prompt(processor, RED)
    lengths = prefill_lengths(model)
    first = generate(backend, ids, vision, RED)
    again = lengths.index(len(ids)), len(lengths)
    second = generate(backend, ids, vision, RED)
    assert lengths[again[0]] == len(ids) and lengths[again[1]] == 1
    # Same seed, same cached prompt: the same tokens. Their logprobs come from a cache built by
    # another pass (one position, not the whole prompt), which CPU kernels may round otherwise
    # (measured: 5e-7 at one token on an AMD EPYC; other CPUs gave equal logprobs).
    assert second.token_ids == first.token_ids
    assert second.logprobs == pytest.approx(first.logprobs, abs=1e-5)


def test_the_same_ids_with_another_picture_never_reuse_the_cache():
    model, processor = tiny_vlm("idefics3")
    backend = TransformersBackend.from_tokenizer(model, processor.tokenizer)
    red_ids, red_vision = prompt(processor, RED)
    blue_ids, blue_vision = prompt(processor, BLUE)
    assert red_ids == blue_ids  # only the pictures tell them apart
    generate(backend, red_ids, red_vision, RED)
    lengths = prefill_lengths(model)
    blue = generate(backend, blue_ids, blue_vision, BLUE)
    # only the text before the picture is reused: the prefill reads from the picture on
    assert lengths[0] == len(blue_ids) - blue_ids.index(model.config.image_token_id)
    own = forward_logprobs(model, blue_ids, blue_vision, blue)
    torch.testing.assert_close(torch.tensor(blue.logprobs), own, atol=1e-5, rtol=0)
    other = forward_logprobs(model, blue_ids, red_vision, blue)
    assert (torch.tensor(blue.logprobs) - other).abs().max() > 1e-3  # the picture matters
