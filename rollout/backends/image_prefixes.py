"""Prefix-cache keys for prompts with images: the same ids with other pictures never match.

A prompt's image-feature tokens are the same ids whatever the picture; their keys and values
are not. So the prefix cache keys such a prompt by its ids with each image-feature token
paired with a digest of its picture's pixels: prompts share a cached prefix only as far as
their ids and their pictures agree. Before the first picture the key is the plain ids, so a
text prefix serves text and image prompts alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Hashable, Sequence
from typing import Any


def picture_digest(image: Any) -> str:
    """A digest of a PIL image's mode, size and pixels."""
    content = hashlib.sha256(f"{image.mode}{image.size}".encode())
    content.update(image.tobytes())
    return content.hexdigest()


def prefix_key(
    ids: Sequence[int], images: Sequence[Any], feature_ids: Collection[int]
) -> tuple[Hashable, ...] | None:
    """`ids` with each image-feature token as `(digest of its picture, id)`.

    Each run of consecutive feature tokens is one picture, in the order of `images`. None:
    the runs are not one per picture (such a prompt is not cached).
    """
    digests = [picture_digest(image) for image in images]
    key: list[Hashable] = []
    picture, in_run = -1, False
    for token in ids:
        starts = token in feature_ids and not in_run
        in_run = token in feature_ids
        picture += starts
        if picture >= len(digests):
            return None
        key.append((digests[picture], token) if in_run else token)
    return tuple(key) if picture == len(digests) - 1 else None


def reusable_length(cached: int, ids: Sequence[int], feature_ids: Collection[int]) -> int:
    """How many leading positions of a cached prefix of `cached` tokens a prefill may reuse.

    At least the last prompt token is read again (its logits draw the first token). The rest
    of the prompt must hold all of its pictures' tokens or none, so that the prefill reads
    all of the prompt's image tensors or none: past the first picture, a prefix is reused
    only if it covers every picture.
    """
    reused = min(cached, len(ids) - 1)
    pictures = [at for at, token in enumerate(ids) if token in feature_ids]
    if pictures and pictures[-1] >= reused:
        reused = min(reused, pictures[0])
    return reused
