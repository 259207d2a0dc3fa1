"""Images from environments and tools: `reset` and tool results show a VLM pictures, mask 0."""

from __future__ import annotations

import random

import anyio
import pytest
import torch
from PIL import Image

from environments import ColourSquare, EnvironmentResetError
from environments.colour_square import COLOURS, draw_square
from rollout import RolloutEngine, ScriptedBackend, load_template
from rollout.template import images_of
from tests.support.trainer import colour_square_run
from tests.support.vlm_models import FAMILIES, image_token_of, tiny_vlm
from tools import as_tool, call_tool

GREEN = Image.new("RGB", (20, 20), (0, 200, 0))


class Camera:
    """An environment whose tool returns a picture and a caption."""

    def reset(self) -> str:
        self.shots = 0
        return "Take a photo."

    def photo(self) -> list:
        """Take a photo and return it with its caption."""
        self.shots += 1
        return ["A green square.", GREEN]


def test_a_tool_that_returns_an_image_gives_it_apart_from_its_text():
    camera_env = Camera()
    camera_env.reset()
    tools = {"photo": as_tool(camera_env.photo)}
    result = anyio.run(call_tool, tools, "photo", {}, None)
    assert (result.content, result.images, result.error) == ("A green square.", (GREEN,), None)


def test_reset_may_return_an_image_or_texts_and_images_but_nothing_else():
    from environments import reset_environment

    class Picture:
        def reset(self, kind: str):
            return {"image": GREEN, "list": ["Look:", GREEN], "bad": [GREEN, 3]}[kind]

    assert reset_environment(Picture(), {"kind": "image"}, None) == [GREEN]
    assert reset_environment(Picture(), {"kind": "list"}, None) == ["Look:", GREEN]
    with pytest.raises(EnvironmentResetError, match="an image or a list of texts and images"):
        reset_environment(Picture(), {"kind": "bad"}, None)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_image_is_rendered_through_the_template_as_image_tokens_with_mask_0(family):
    model, processor = tiny_vlm(family)
    call, answer, backend = photo_then_answer(processor)
    engine = RolloutEngine(
        backend, processor, environment_factory=Camera, chat_template="chatml_vision"
    )
    (episode,) = anyio.run(lambda: engine.run([{"prompt": "Hi"}]))
    (row,) = episode.rows
    image = image_token_of(model)
    tool_turn = len(row.completion_ids) - len(call) - len(answer)
    assert row.loss_mask == [1] * len(call) + [0] * tool_turn + [1] * len(answer)
    image_at = [i for i, token in enumerate(row.completion_ids) if token == image]
    assert len(image_at) == 4 and len(call) < image_at[0] and image_at[-1] < len(call) + tool_turn
    assert image not in row.prompt_ids
    assert row.images == (GREEN,) and "pixel_values" in row.vision_inputs
    # the answer was generated after the picture, with its tensors
    assert backend.visions[0] is None and "pixel_values" in backend.visions[1]
    assert backend.pictures == [(), (GREEN,)]
    assert images_of(episode.messages) == [GREEN]
    assert episode.tool_calls[0].result == "A green square."


class ImageReadingScript(ScriptedBackend):
    """The scripted double, taking (and recording) a row's image tensors and pictures."""

    reads_images = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.visions = []
        self.pictures = []

    async def generate(self, prompt_ids, params, pictures=None):
        self.visions.append(None if pictures is None else pictures.vision)
        self.pictures.append(() if pictures is None else pictures.images)
        return await super().generate(prompt_ids, params)


def photo_then_answer(processor) -> tuple[list[int], list[int], ImageReadingScript]:
    """A scripted model that calls Camera's `photo`, then answers "Green.".

    Returns the call's ids, the answer's ids and the model (an ImageReadingScript).
    """
    tokenizer = processor.tokenizer
    call = tokenizer.encode(
        '<tool_call>{"name": "photo", "arguments": {}}</tool_call><|im_end|>',
        add_special_tokens=False,
    )
    answer = tokenizer.encode("Green.<|im_end|>", add_special_tokens=False)
    turns = iter([call, answer])
    stop_ids = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return call, answer, ImageReadingScript(lambda _: next(turns), stop_ids)


def test_colour_square_draws_the_colour_it_asks_about_and_rewards_only_the_right_answer():
    env = ColourSquare()
    _, picture = env.reset(colour="blue", seed=3)
    assert COLOURS["blue"] in {colour for _, colour in picture.getcolors()}
    assert picture.tobytes() == draw_square(COLOURS["blue"], random.Random(3)).tobytes()
    env.answer("Blue ")
    assert env.done and env.reward() == 1.0
    env.reset(colour="red")
    env.answer("blue")
    assert env.reward() == 0.0
    rows = ColourSquare.dataset("train")
    assert set(rows["colour"]) == set(COLOURS) and "red" not in str(rows["prompt"][0])


def test_a_vlm_trains_on_colour_square_and_its_episodes_read_the_picture(tmp_path):
    model, processor = tiny_vlm("qwen2_5_vl")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    # The untrained model never answers right (reward 0 in every group): a reward that ranks
    # the completions gives the step advantages, so it must move the weights.
    trainer = colour_square_run(model, processor, tmp_path, logging_steps=10)  # GRPOConfig's
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters())
    episodes = [episode for episode, _ in trainer.last_episodes]
    for episode in episodes:
        assert episode.rows[0].prompt_ids.count(image_token_of(model)) == 4
        assert len(episode.rows[0].images) == 1


def test_an_episode_that_forks_after_a_tool_picture_starts_its_new_row_with_the_picture():
    model, processor = tiny_vlm("idefics3")
    # A template that writes past tool calls differently once their results follow (as
    # templates that drop past reasoning do), so the episode forks at the tool turn.
    template = load_template(processor.tokenizer, "chatml_vision").replace(
        '<tool_call>{"name": {{',
        "{% if messages[-1].role == 'assistant' %}<tool_call>{% else %}<call>{% endif %}"
        '{"name": {{',
    )
    call, answer, backend = photo_then_answer(processor)
    engine = RolloutEngine(backend, processor, environment_factory=Camera, chat_template=template)
    (episode,) = anyio.run(lambda: engine.run([{"prompt": "Hi"}]))
    first, second = episode.rows
    assert first.images == () and first.loss_mask == [1] * len(call)
    assert second.prompt_ids.count(image_token_of(model)) == 4  # the fresh rendering
    assert second.images == (GREEN,) and second.loss_mask == [1] * len(answer)
    assert "pixel_values" in backend.visions[1]


@pytest.mark.parametrize(
    ("picture", "says"),
    [
        (Image.new("RGB", (0, 0)), "returned a 0x0 picture, which has no pixels"),
        (Image.new("1", (5000, 4000)), "returned a 5000x4000 picture, over the 16,777,216 pixels"),
    ],
)
def test_a_tool_picture_that_is_empty_or_oversized_is_a_tool_error_the_model_reads(picture, says):
    def photo() -> object:
        """Take a photo."""
        return picture

    tools = {"photo": as_tool(photo)}
    result = anyio.run(call_tool, tools, "photo", {}, None)
    assert result.error == "bad_picture" and says in result.content and result.images == ()


class Requests:
    """A loopback HTTP listener that counts the connections it gets."""

    def __init__(self):
        import socket

        self.socket = socket.create_server(("127.0.0.1", 0))
        self.socket.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}/cat.png"

    def count(self) -> int:
        connections = 0
        while True:
            try:
                connection, _ = self.socket.accept()
            except TimeoutError:
                return connections
            connection.close()
            connections += 1


def test_a_rows_image_given_as_a_url_or_a_path_is_refused_naming_the_row_and_never_read(tmp_path):
    _, processor = tiny_vlm("qwen2_5_vl")
    engine = RolloutEngine(ImageReadingScript(lambda _: [1], {1}), processor)
    listener = Requests()
    path = tmp_path / "cat.png"
    GREEN.save(path)
    for value, column in ((listener.url, "image"), ([str(path)], "images")):
        row = {"prompt": [{"role": "user", "content": "What is it?"}], column: value}
        with pytest.raises(ValueError, match=f"the row's '{column}' column holds a str") as error:
            anyio.run(lambda: engine.run([row]))  # noqa: B023 (run at once)
        assert "not a PIL image" in str(error.value) and "Row: {'prompt'" in str(error.value)
    assert listener.count() == 0  # nothing was fetched
    part = {"type": "image", "image": listener.url}
    row = {"prompt": [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}]}
    with pytest.raises(ValueError, match=r"an image part holds a str .*not a PIL image"):
        anyio.run(lambda: engine.run([row]))
    assert listener.count() == 0


def test_an_environment_picture_with_no_pixels_is_an_error_naming_the_row():
    _, processor = tiny_vlm("qwen2_5_vl")

    class Blank:
        def reset(self, **row):
            return ["Look:", Image.new("RGB", (0, 0))]

    engine = RolloutEngine(
        ImageReadingScript(lambda _: [1], {1}), processor, environment_factory=Blank
    )
    with pytest.raises(ValueError, match=r"a 0x0 picture, which has no pixels.*Row: \{'prompt'"):
        anyio.run(lambda: engine.run([{"prompt": "Hi"}]))
