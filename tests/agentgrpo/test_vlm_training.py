"""GRPO on vision-language models: image rows, token-exact episodes, pixels in every forward."""

from __future__ import annotations

import anyio
import pytest
import torch
from datasets import Dataset
from PIL import Image

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.learner.batch import collate_episodes
from agentgrpo.learner.logprobs import completion_logprobs
from rollout import (
    ChatRenderer,
    EpisodeConfig,
    Pictures,
    RolloutEngine,
    SamplingParams,
    TransformersBackend,
)
from rollout.images import vision_forward_kwargs, with_row_images
from tests.support.trainer import rank_in_call, short_run_config
from tests.support.vlm_models import FAMILIES, image_token_of, tiny_vlm

RED, BLUE = (Image.new("RGB", (20, 20), colour) for colour in ((255, 0, 0), (0, 0, 255)))
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]


def image_rows(count: int = 4) -> Dataset:
    """TRL's VLM format: a conversational prompt with an image part, and an `image` column."""
    return Dataset.from_dict({"prompt": [QUESTION] * count, "image": [RED, BLUE] * (count // 2)})


def config(tmp_path, **overrides) -> GRPOConfig:
    """short_run_config's run made smaller: 1 step of 4 rows in groups of 2, up to 6 tokens."""
    run = dict(num_generations=2, max_completion_length=6, max_steps=1)
    return short_run_config(tmp_path, **(run | overrides))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_grpo_step_on_image_rows_moves_the_language_and_the_vision_weights(family, tmp_path):
    model, processor = tiny_vlm(family)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = GRPOTrainer(
        model, rank_in_call, config(tmp_path), image_rows(), processing_class=processor
    )
    trainer.train()
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert any("vision" in name or "visual" in name for name in moved), sorted(moved)
    assert any("layers.1." in name and "vision" not in name for name in moved), sorted(moved)
    # The learner read the images as the sampler did: same logprobs over the same pixels.
    logged = trainer.state.log_history[0]
    assert logged["sampling/sampling_logp_difference/max"] < 1e-4, logged


@pytest.mark.parametrize("family", FAMILIES)
def test_the_sampler_logprobs_equal_a_plain_forward_over_the_same_ids_and_pixels(family):
    model, processor = tiny_vlm(family)
    renderer = ChatRenderer(
        processor.tokenizer, processor.tokenizer.chat_template, processor=processor
    )
    messages = with_row_images(QUESTION, {"image": RED})
    fresh = renderer.fresh(messages)
    ids, vision = fresh.ids, fresh.vision
    backend = TransformersBackend.from_tokenizer(model, processor.tokenizer)
    params = SamplingParams(max_tokens=8, seed=3)
    completion = anyio.run(lambda: backend.generate(ids, params, Pictures((RED,), vision)))
    full_1_L = torch.tensor([ids + completion.token_ids])
    inputs = {"position_ids": torch.arange(full_1_L.shape[1])[None]}
    inputs |= vision_forward_kwargs(model.config, full_1_L, vision)
    with torch.no_grad():
        logits_C_V = model(input_ids=full_1_L, **inputs).logits[0, len(ids) - 1 : -1]
    picked_C = torch.log_softmax(logits_C_V, -1).gather(
        -1, torch.tensor(completion.token_ids)[:, None]
    )[:, 0]
    assert len(completion.token_ids) == 8
    torch.testing.assert_close(picked_C, torch.tensor(completion.logprobs), atol=1e-5, rtol=0)


def play(model, processor, rows, **engine_kwargs):
    backend = TransformersBackend.from_tokenizer(model, processor.tokenizer)
    engine = RolloutEngine(backend, processor, **engine_kwargs)
    return anyio.run(lambda: engine.run(rows, num_generations=1, seed=0))


@pytest.mark.parametrize("family", FAMILIES)
def test_an_episode_prompt_holds_the_expanded_image_and_the_row_its_tensors(family):
    model, processor = tiny_vlm(family)
    (episode,) = play(model, processor, [{"prompt": QUESTION, "image": RED}])
    (row,) = episode.rows
    assert row.prompt_ids.count(image_token_of(model)) == 4  # the placeholder, expanded
    assert image_token_of(model) not in row.completion_ids
    assert row.loss_mask == [1] * len(row.completion_ids)
    assert row.images == (RED,)
    assert "pixel_values" in row.vision_inputs


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_of_rows_with_and_without_images_scores_each_as_alone(family):
    model, processor = tiny_vlm(family)
    rows = [
        {"prompt": QUESTION, "image": RED},
        {"prompt": "Colour?"},
        {"prompt": QUESTION, "image": BLUE},
    ]
    episodes = play(model, processor, rows, chat_template="chatml_vision")
    batch = collate_episodes(episodes, torch.zeros(3), processor.tokenizer.pad_token_id)
    with torch.no_grad():
        together_B_C = completion_logprobs(model, batch, 1.0).logprobs_B_C
        for b in range(3):
            alone_1_C = completion_logprobs(model, batch.select([b]), 1.0).logprobs_B_C
            width = alone_1_C.shape[1]
            torch.testing.assert_close(together_B_C[b, :width], alone_1_C[0], atol=1e-5, rtol=0)
    sampler_B_C = batch.sampler_logprobs_B_C
    torch.testing.assert_close(together_B_C, sampler_B_C, atol=1e-5, rtol=0)


def test_lora_on_the_projection_layers_trains_only_the_adapters(tmp_path):
    from peft import LoraConfig

    model, processor = tiny_vlm("qwen2_5_vl")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "mlp.0", "mlp.2"])
    trainer = GRPOTrainer(
        model,
        rank_in_call,
        config(tmp_path, learning_rate=1e-1),
        image_rows(),
        processing_class=processor,
        peft_config=lora,
    )
    adapters = {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad
    }
    assert adapters and all("lora_" in name for name in adapters)
    assert any("merger" in name for name in adapters)  # the vision-to-text projection
    trainer.train()
    moved = [
        n
        for n, p in trainer.model.named_parameters()
        if n in adapters and not torch.equal(p, adapters[n])
    ]
    assert any("merger" in name for name in moved) and any(
        "language_model" in name for name in moved
    )


def test_the_sampler_never_draws_a_token_the_model_replaces_by_image_features():
    model, processor = tiny_vlm("idefics3")
    image_token = image_token_of(model)

    def favour_image_token(module, inputs, logits):
        return logits + 100.0 * torch.nn.functional.one_hot(
            torch.tensor(image_token), logits.shape[-1]
        )

    model.lm_head.register_forward_hook(favour_image_token)
    rows = [{"prompt": QUESTION, "image": RED}]
    (episode,) = play(model, processor, rows, config=EpisodeConfig(max_completion_length=12))
    (row,) = episode.rows
    assert image_token not in row.completion_ids  # unsuppressed, it has probability ~1
    assert len(row.completion_ids) == 12
    batch = collate_episodes([episode], torch.zeros(1), processor.tokenizer.pad_token_id)
    with torch.no_grad():  # and the learner can read what was sampled
        completion_logprobs(model, batch, 1.0)
