"""Server mode takes no pictures: a row with one stops with an error saying what to use."""

from __future__ import annotations

import anyio
import pytest
from PIL import Image

from rollout import RolloutEngine
from rollout.backends.vllm_server import ServerConnection, VLLMServerBackend
from tests.support.vlm_models import tiny_vlm


def test_a_row_with_a_picture_on_a_vllm_server_names_the_backends_that_read_pictures():
    _, processor = tiny_vlm("idefics3")
    eos = processor.tokenizer.eos_token_id
    # never contacted: the row is refused before any request is sent
    server = VLLMServerBackend(ServerConnection("http://127.0.0.1:9", timeout_s=1.0), "m", {eos})
    engine = RolloutEngine(server, processor, chat_template="chatml_vision")
    question = [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]
    row = {"prompt": [{"role": "user", "content": question}], "image": Image.new("RGB", (32, 32))}
    with pytest.raises(ValueError, match=r"use_vllm=False.*vllm_mode='colocate'.*server mode"):
        anyio.run(engine.run, [row])
