"""Untrusted text on its way to token ids: made encodable, bounded, and encoded once.

`valid_unicode` replaces what no tokenizer takes; `max_token_chars` bounds how many characters a
token can stand for, which lets `ChatRenderer.fit_tool_messages` cut a huge tool result before it
is tokenized; `EncodeCache` keeps the ids of recent texts within a size budget.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
# Normalizer and pre-tokenizer steps that never drop a character of the text.
_KEEPS_CHARACTERS = {
    "ByteLevel", "Digits", "Lowercase", "Metaspace", "NFC", "NFD", "NFKC", "NFKD", "Prepend",
    "Punctuation", "Replace", "Sequence", "Split",
}  # fmt: skip
# Steps that compose: up to 4 code points (a base and its marks) may become one character.
_COMPOSES = {"NFC", "NFKC"}


def valid_unicode(text: str) -> str:
    r"""`text` with each lone surrogate (not valid Unicode, so no tokenizer takes it) as U+FFFD.

    >>> valid_unicode("a\ud800b")
    'a�b'
    """
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, or None if that cannot be told.

    For a fast tokenizer whose BPE model reads any byte (byte-level, or byte fallback) and
    whose normalizer and pre-tokenizer never drop a character, every character of the text
    lands in the string of some token, so no token stands for more characters than the
    longest token string in the vocabulary (added tokens included), times 4 where
    normalization composes characters. Anything else (a slow tokenizer, an `<unk>` that may
    swallow a word, a normalizer that strips or collapses text) gives None.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    steps = _steps(backend.normalizer) + _steps(backend.pre_tokenizer)
    if not all(_keeps_characters(step) for step in steps):
        return None
    types = {step["type"] for step in steps}
    if "ByteLevel" not in types and not getattr(backend.model, "byte_fallback", False):
        return None
    longest = max(map(len, tokenizer.get_vocab()))
    return longest * 4 if types & _COMPOSES else longest


def _steps(component: Any) -> list[dict[str, Any]]:
    """A normalizer or pre-tokenizer as a flat list of its steps' settings."""
    if component is None:
        return []
    pending, steps = [json.loads(component.__getstate__())], []
    while pending:
        step = pending.pop()
        steps.append(step)
        pending.extend(step.get("normalizers") or step.get("pretokenizers") or [])
    return steps


def _keeps_characters(step: Mapping[str, Any]) -> bool:
    if step["type"] == "Replace":  # a plain string replaced by one at least as long
        pattern = step["pattern"].get("String")
        return pattern is not None and len(step["content"]) >= len(pattern)
    if step["type"] == "Split":
        return step.get("behavior") != "Removed"
    return step["type"] in _KEEPS_CHARACTERS


class EncodeCache:
    """Token ids of recently encoded texts, bounded by total size rather than entry count.

    The size of an entry is its characters plus its token ids; the least recently used
    entries go first once the total passes `max_size`. A text bigger than a sixteenth of
    `max_size` is encoded but not kept, so one huge tool result cannot push out every prompt.

    Args:
        encode: Text to token ids (the uncached encoder).
        max_size: Bound on the total size of the entries kept.

    >>> cache = EncodeCache(lambda text: tuple(map(ord, text)), max_size=64)
    >>> cache("ab"), cache.size
    ((97, 98), 4)

    """

    def __init__(self, encode: Callable[[str], tuple[int, ...]], max_size: int):
        self._encode = encode
        self.max_size = max_size
        self.size = 0
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        # Agent sessions encode in worker threads; the entries change under the lock, and the
        # encoding runs outside it, so a text encoded twice at once is still kept once.
        self._lock = threading.Lock()

    def __call__(self, text: str) -> tuple[int, ...]:
        """The ids of `text`, from the cache if it holds them."""
        with self._lock:
            ids = self._entries.get(text)
            if ids is not None:
                self._entries.move_to_end(text)
                return ids
        ids = self._encode(text)
        size = len(text) + len(ids)
        if size <= self.max_size // 16:
            with self._lock:
                if text not in self._entries:
                    self._entries[text] = ids
                    self.size += size
                while self.size > self.max_size:
                    old_text, old_ids = self._entries.popitem(last=False)
                    self.size -= len(old_text) + len(old_ids)
        return ids

    def __contains__(self, text: str) -> bool:
        """Whether the ids of `text` are kept."""
        return text in self._entries
