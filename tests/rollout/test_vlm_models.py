"""The tiny VLM families and `rollout.images`: processors built here, images read by the model."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from rollout.images import join_vision_inputs, load_processor
from rollout.template import encode_with_images, image_placeholder
from tests.support.vlm_models import FAMILIES, tiny_vlm

RED = Image.new("RGB", (20, 20), (255, 0, 0))
BLUE = Image.new("RGB", (20, 20), (0, 0, 255))


def _prompt(processor, images=1):
    placeholders = " ".join([image_placeholder(processor)] * images)
    return f"<|im_start|>user\nWhat colour? {placeholders}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_expands_its_placeholder_into_image_tokens_the_model_reads(family):
    model, processor = tiny_vlm(family)
    ids, vision = encode_with_images(processor, _prompt(processor), [RED])
    image_token = (
        model.config.image_token_id if family != "gemma3" else model.config.image_token_index
    )
    assert ids.count(image_token) == 4
    last = {}
    for name, image in (("red", RED), ("blue", BLUE)):
        ids, vision = encode_with_images(processor, _prompt(processor), [image])
        with torch.no_grad():
            last[name] = model(input_ids=torch.tensor([ids]), **vision).logits[0, -1]
    assert not torch.allclose(last["red"], last["blue"])  # the pixels reach the logits


@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_processor_loads_back_and_encodes_the_same(family, tmp_path):
    processor = tiny_vlm(family).processor
    processor.save_pretrained(tmp_path)
    loaded = load_processor(str(tmp_path))
    assert type(loaded).__name__ == type(processor).__name__
    assert (
        encode_with_images(loaded, _prompt(loaded), [RED])[0]
        == (encode_with_images(processor, _prompt(processor), [RED])[0])
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_images_encoded_apart_join_into_the_inputs_of_both_at_once(family):
    processor = tiny_vlm(family).processor
    _, together = encode_with_images(processor, _prompt(processor, images=2), [RED, BLUE])
    parts = [encode_with_images(processor, _prompt(processor), [im])[1] for im in (RED, BLUE)]
    joined = join_vision_inputs(parts)
    assert joined.keys() == together.keys()
    for key in together:
        assert torch.equal(joined[key], together[key]), key


def test_a_text_whose_placeholders_do_not_match_the_images_is_refused():
    processor = tiny_vlm("idefics3").processor
    with pytest.raises(ValueError, match=r"1 image placeholders .* but 2 images"):
        encode_with_images(processor, _prompt(processor), [RED, BLUE])
