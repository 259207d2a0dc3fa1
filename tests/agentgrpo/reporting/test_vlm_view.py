"""`agentgrpo view` shows the pictures a vision-language model saw in an episode."""

from __future__ import annotations

import base64

from PIL import Image

from agentgrpo.reporting.run_log import episode_file
from agentgrpo.reporting.view import RunView
from rollout import Episode, EpisodeRecord, EpisodeRow, EpisodeStats, Finish, record_line
from rollout.record import ImageFolder

RED = Image.new("RGB", (8, 8), (255, 0, 0))
BLUE = Image.new("RGB", (8, 8), (0, 0, 255))


def picture_record(messages) -> EpisodeRecord:
    episode = Episode(
        rows=(EpisodeRow([1, 2], [3], [1], [-0.5]),),
        messages=messages,
        finish=Finish.STOP,
        stats=EpisodeStats(1, 0, {}),
        row={"image": RED},
        group=0,
        index=0,
    )
    return EpisodeRecord(episode, {"r": 1.0}, 1.0, 0.0, 0)


def write_step(run_dir, records) -> None:
    path = episode_file(run_dir, 1)
    path.parent.mkdir(parents=True)
    images = ImageFolder(path.parent / "images", path.parent)
    path.write_text("".join(record_line(record, images) for record in records))


def png(image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_step_shows_each_picture_of_an_episode_inline_in_order(tmp_path):
    user = {
        "role": "user",
        "content": [{"type": "image", "image": RED}, {"type": "text", "text": "?"}],
    }
    tool = {"role": "tool", "name": "look", "content": [{"type": "image", "image": BLUE}]}
    write_step(tmp_path, [picture_record([user, {"role": "assistant", "content": "x"}, tool])])
    (episode,) = RunView(tmp_path).step(1)["episodes"]
    prefix = "data:image/png;base64,"
    assert [base64.b64decode(url.removeprefix(prefix)) for url in episode["images"]] == [
        png(RED),
        png(BLUE),
    ]
    assert (tmp_path / "episodes" / "images").is_dir()
    assert RunView(tmp_path).page(live=False).count(prefix) == 2  # the static page embeds them


def test_a_record_naming_a_file_outside_its_images_folder_shows_no_picture(tmp_path):
    user = {"role": "user", "content": [{"type": "image", "image": RED}]}
    write_step(tmp_path, [picture_record([user])])
    path = episode_file(tmp_path, 1)
    (tmp_path / "secret.png").write_bytes(png(BLUE))
    text = path.read_text()
    name = text.split('"path": "')[1].split('"')[0]
    path.write_text(text.replace(name, "../secret.png"))
    (episode,) = RunView(tmp_path).step(1)["episodes"]
    assert episode["images"] == []
