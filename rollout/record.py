"""The episode record: an episode as trained on, with its scores, as one JSON line and back.

A training run writes one line per episode (`agentgrpo.reporting.run_log.EpisodeLog`); eval,
viewers and tests read them back with `read_records`. `record_from_dict(record_to_dict(r)) == r`
for every record whose values are JSON data, and the episode read back equals the one trained on
in every field but `environment` (a live object, not data: it reads back None).

Each line is a JSON object holding the episode's fields (`rows`: a list of
`{"prompt_ids", "completion_ids", "loss_mask", "sampler_logprobs"}` objects, one per training row,
with `"policy_versions"` too when the row has them (an asynchronous run's per-token versions);
`messages`, `tool_calls`, `finish`, `error`, `stats`, `row`, `group`, `index`, `env_reward`,
`agent_rewards`)
and its scores (`rewards` by function, `reward`, `advantage`),
`policy_version` and `process`. It is strict JSON, so any JSON reader takes it. Floats are
written as Python's shortest repr, which reads back bit for bit (float32 values included: they
are float64 values too). Values JSON cannot hold as they are get a tagged object,
`{"__agentgrpo__": KIND, ...}`:

- `float`: NaN and the infinities (`"value": "nan"`), read back as those floats;
- `int`: integers too long for Python's int-to-text limit, as hex, read back as the same int;
- `tuple`: tuples (JSON has only lists), read back as tuples;
- `dict`: mappings that use the tag's key themselves, read back as they were;
- `image`: a PIL image (in a message's image part, a row's `image` column): its `size`, and
  where the record was written with an image folder, the `path` of the PNG file holding it,
  relative to the record's file (`record_line(record, images)`); read back as that tagged dict,
  so a line never holds pixels;
- `repr`: anything else (a mapping with non-text keys, bytes, arrays, images, ...): its type
  and `repr()`, read back as that tagged dict, not as the original value.

Integers and reals of other types (numpy scalars) are written as JSON numbers and read back as
Python `int` and `float`, equal to the originals.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.types import (
    Compaction,
    Episode,
    EpisodeRow,
    EpisodeStats,
    Finish,
    ToolCallRecord,
    TurnRecord,
)
from tools import is_image

RECORD_FORMAT = 2  # bump when a field changes meaning; readers refuse formats they do not know
# Format 1 held one row's four token lists at the top level; it reads back as a one-row episode.
_READABLE_FORMATS = (1, RECORD_FORMAT)
TAG = "__agentgrpo__"
_MAX_INT_BITS = 13_000  # about 3,900 decimal digits: under Python's 4,300-digit text limit


@dataclass(frozen=True)
class EpisodeRecord:
    """An episode as trained on: the episode, its rewards and advantage, and its origin.

    Attributes:
        episode: The episode, token-exact.
        rewards: Each reward column's value by name (the reward functions', then the
            environment's own); None where the function returned None.
        reward: The combined reward the advantage was computed from.
        advantage: The episode's advantage, as the loss used it.
        policy_version: The global optimizer step whose weights generated the episode (0: the
            initial weights).
        process: The training process that played it; `episode.group` counts per process.
    """

    episode: Episode
    rewards: Mapping[str, float | None]
    reward: float
    advantage: float
    policy_version: int
    process: int = 0


def record_to_dict(record: EpisodeRecord, images: ImageFolder | None = None) -> dict[str, Any]:
    """The record as a dict of JSON values (see the module docstring for the tags).

    `images` saves the images of the row and the messages and names their files.
    """
    episode = record.episode
    stats = episode.stats
    return {
        "format": RECORD_FORMAT,
        "policy_version": record.policy_version,
        "process": record.process,
        "group": episode.group,
        "index": episode.index,
        "reward": encode_value(record.reward),
        "advantage": encode_value(record.advantage),
        "rewards": encode_value(dict(record.rewards)),
        "env_reward": encode_value(episode.env_reward),
        "agent_rewards": encode_value(episode.agent_rewards),
        "finish": str(episode.finish),
        "error": episode.error,
        "stats": {
            "turns": stats.turns,
            "tool_calls": stats.tool_calls,
            "tool_errors": encode_value(dict(stats.tool_errors)),
            "compactions": [dataclasses.asdict(c) for c in stats.compactions],
            "responses": stats.responses,
            "infra_retries": stats.infra_retries,
        },
        "row": encode_value(episode.row, images),
        "messages": encode_value(episode.messages, images),
        "tool_calls": [_call_to_dict(call) for call in episode.tool_calls],
        "rows": [_row_to_dict(row) for row in episode.rows],
        "turns": [dataclasses.asdict(turn) for turn in episode.turns],
    }


def record_from_dict(data: Mapping[str, Any]) -> EpisodeRecord:
    """The record `record_to_dict` wrote; the episode's `environment` is None.

    Raises:
        ValueError: The dict is not an episode record, or one of a format this version of
            agentgrpo does not know.
    """
    found = data.get("format") if isinstance(data, Mapping) else None
    if found not in _READABLE_FORMATS:
        raise ValueError(
            f"not an episode record of format {RECORD_FORMAT} (found format {found!r}); was it "
            "written by another version of agentgrpo?"
        )
    stats = data["stats"]
    rows = data["rows"] if found == RECORD_FORMAT else [data]
    episode = Episode(
        rows=tuple(_row_from_dict(row) for row in rows),
        messages=decode_value(data["messages"]),
        finish=Finish(data["finish"]),
        stats=EpisodeStats(
            stats["turns"],
            stats["tool_calls"],
            decode_value(stats["tool_errors"]),
            tuple(Compaction(**c) for c in stats.get("compactions", ())),
            stats.get("responses", 0),
            stats.get("infra_retries", 0),
        ),
        row=decode_value(data["row"]),
        group=data["group"],
        index=data["index"],
        env_reward=decode_value(data["env_reward"]),
        error=data["error"],
        tool_calls=tuple(_call_from_dict(call) for call in data["tool_calls"]),
        agent_rewards=decode_value(data.get("agent_rewards")),
        turns=tuple(TurnRecord(**turn) for turn in data.get("turns", ())),
    )
    return EpisodeRecord(
        episode=episode,
        rewards=decode_value(data["rewards"]),
        reward=decode_value(data["reward"]),
        advantage=decode_value(data["advantage"]),
        policy_version=data["policy_version"],
        process=data["process"],
    )


def record_line(record: EpisodeRecord, images: ImageFolder | None = None) -> str:
    """The record as one line of strict, ASCII-only JSON, newline included.

    `images`: where the record's images go, as PNG files the line names (without it, the line
    keeps only each image's size).
    """
    text = json.dumps(record_to_dict(record, images), ensure_ascii=True, allow_nan=False)
    return text + "\n"


class ImageFolder:
    """Saves images as PNG files named by their content, for records that refer to them.

    Args:
        folder: Where the files go (made when the first image comes).
        relative_to: The folder the returned paths are relative to (the records' folder).
    """

    def __init__(self, folder: str | Path, relative_to: str | Path):
        self.folder = Path(folder)
        self.relative_to = Path(relative_to)
        self._saved: dict[
            int, tuple[Any, str]
        ] = {}  # id(image) -> (image, path): group members share

    def __call__(self, image: Any) -> str:
        """Save `image` (once per content) and return its path, relative to `relative_to`."""
        known = self._saved.get(id(image))
        if known is not None and known[0] is image:
            return known[1]
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data = buffer.getvalue()
        path = self.folder / f"{hashlib.sha256(data).hexdigest()[:24]}.png"
        if not path.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        relative = os.path.relpath(path, self.relative_to)
        self._saved[id(image)] = (image, relative)
        return relative


def read_records(path: str | Path) -> list[EpisodeRecord]:
    """The records of a JSON-lines file, in file order.

    Raises:
        ValueError: A line is not a record, naming the file and the line.
    """
    records = []
    with Path(path).open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            try:
                records.append(record_from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}, line {number}: {error!r}") from error
    return records


def encode_value(value: Any, images: ImageFolder | None = None) -> Any:
    """A value as JSON data: as it is where JSON holds it exactly, else tagged.

    `images` saves the images met (`ImageFolder`); without it an image keeps only its size.

    >>> encode_value({"x": [1, 2.5, None], "t": (1, "a")})
    {'x': [1, 2.5, None], 't': {'__agentgrpo__': 'tuple', 'items': [1, 'a']}}
    >>> encode_value(float("-inf"))
    {'__agentgrpo__': 'float', 'value': '-inf'}
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, numbers.Integral):
        value = int(value)
        return value if value.bit_length() <= _MAX_INT_BITS else _tagged("int", value=hex(value))
    if isinstance(value, numbers.Real):
        return _encode_float(value)
    if isinstance(value, list):
        return [encode_value(item, images) for item in value]
    if isinstance(value, tuple):
        return _tagged("tuple", items=[encode_value(item, images) for item in value])
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        items = {key: encode_value(item, images) for key, item in value.items()}
        return _tagged("dict", items=items) if TAG in items else items
    if is_image(value):
        where = {"path": images(value)} if images is not None else {}
        return _tagged("image", size=list(value.size), **where)
    return _tagged("repr", type=_type_name(value), value=repr(value))


def decode_value(value: Any) -> Any:
    """The value `encode_value` was given (a `repr` tag stays the tagged dict).

    >>> decode_value({"__agentgrpo__": "tuple", "items": [1, {"__agentgrpo__": "float",
    ...     "value": "nan"}]})
    (1, nan)
    """
    if isinstance(value, list):
        return [decode_value(item) for item in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind == "float":
        return float(value["value"])
    if kind == "int":
        return int(value["value"], 16)
    if kind == "tuple":
        return tuple(decode_value(item) for item in value["items"])
    if kind == "dict":
        return {key: decode_value(item) for key, item in value["items"].items()}
    if kind in ("repr", "image"):
        return value
    return {key: decode_value(item) for key, item in value.items()}


def _encode_float(value: Any) -> Any:
    value = float(value)
    return value if math.isfinite(value) else _tagged("float", value=repr(value))


def _tagged(kind: str, **fields: Any) -> dict[str, Any]:
    return {TAG: kind, **fields}


def _type_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def _row_to_dict(row: EpisodeRow) -> dict[str, Any]:
    data = {
        "prompt_ids": [int(t) for t in row.prompt_ids],
        "completion_ids": [int(t) for t in row.completion_ids],
        "loss_mask": [int(m) for m in row.loss_mask],
        "sampler_logprobs": [_encode_float(x) for x in row.sampler_logprobs],
    }
    if row.policy_versions is not None:
        data["policy_versions"] = [int(v) for v in row.policy_versions]
    return data


def _row_from_dict(data: Mapping[str, Any]) -> EpisodeRow:
    return EpisodeRow(
        list(data["prompt_ids"]),
        list(data["completion_ids"]),
        list(data["loss_mask"]),
        [decode_value(x) for x in data["sampler_logprobs"]],
        policy_versions=data.get("policy_versions"),
    )


def _call_to_dict(call: ToolCallRecord) -> dict[str, Any]:
    return {
        "name": call.name,
        "arguments": encode_value(call.arguments),
        "result": call.result,
        "error": call.error,
        "result_chars": call.result_chars,
    }


def _call_from_dict(data: Mapping[str, Any]) -> ToolCallRecord:
    return ToolCallRecord(
        data["name"],
        decode_value(data["arguments"]),
        data["result"],
        data["error"],
        data.get("result_chars"),  # absent from records written before results were cut
    )
