"""The LoRA adapter versions a vLLM engine holds, and which one each episode generates with.

With adapter-only pushes (`agentgrpo.generation.adapters`) every optimizer step's adapter is
loaded into vLLM beside the earlier ones, under a name and an id of its own, and the oldest are
evicted past `keep` versions. An episode generates all its turns with the version that was the
newest at its first turn, so an asynchronous run's episodes finish on the policy they started
with instead of being cut by a push; only an episode whose version was evicted (older than
`max_staleness`: its group is dropped anyway) moves on to the newest.

A frozen snapshot of the policy (a seat of a game, `agentgrpo.training.seat_snapshots`) is an
adapter loaded beside these versions but not one of them: pushes never evict it, and a request
made inside `AdapterVersions.pinned` generates with it.

An episode is its task: the engine plays each episode in a task of its own, and the version an
episode is pinned to lives in a context variable of that task (set at its first request). This
module never imports vllm.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Adapter:
    """One loaded adapter version.

    Attributes:
        version: The optimizer step it was trained to.
        name: Its vLLM name (a server's request `model`).
        lora_id: Its vLLM `lora_int_id` (>= 1, never reused within a run).
        path: The folder vLLM loaded it from (`adapter_config.json`, `adapter_model.safetensors`).
    """

    version: int
    name: str
    lora_id: int
    path: str


class AdapterVersions:
    """The adapters loaded in one engine, oldest first, at most `keep` of them.

    Args:
        keep: Versions kept loaded: `max_staleness + 1` for an asynchronous run, else 1.
    """

    def __init__(self, keep: int):
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest adapter version must stay loaded")
        self.keep = keep
        self._loaded: list[Adapter] = []
        self._lock = threading.Lock()  # pushes and requests come from different threads
        self._next_id = 1
        # A server outlives runs: a resumed or second run against it must not name an adapter
        # the same as one still loaded there (vLLM refuses a name it holds).
        self._run = secrets.token_hex(4)
        self._pinned: ContextVar[int | None] = ContextVar(f"agentgrpo_adapter_{id(self)}")
        self._frozen: ContextVar[Adapter | None] = ContextVar(f"agentgrpo_frozen_{id(self)}")

    def next_adapter(self, version: int, folder: str) -> Adapter:
        """A new adapter for `version`, with a name and id not used before.

        Its path is a folder of its own (named after it) inside `folder`. Its name carries a
        token of this `AdapterVersions`, so that no other run's adapter has it.
        """
        with self._lock:
            lora_id, self._next_id = self._next_id, self._next_id + 1
        name = f"agentgrpo-{self._run}-v{version}-{lora_id}"
        return Adapter(version, name, lora_id, os.path.join(folder, name))

    def add(self, adapter: Adapter) -> list[Adapter]:
        """Record `adapter` (just loaded) as the newest; return those to evict, oldest first."""
        with self._lock:
            self._loaded.append(adapter)
            evicted, self._loaded = self._loaded[: -self.keep], self._loaded[-self.keep :]
        return evicted

    @property
    def loaded(self) -> list[Adapter]:
        """The loaded adapters, oldest first."""
        with self._lock:
            return list(self._loaded)

    @property
    def newest(self) -> Adapter | None:
        """The adapter new episodes start with (None before the first push)."""
        with self._lock:
            return self._loaded[-1] if self._loaded else None

    @contextlib.contextmanager
    def pinned(self, frozen: Adapter) -> Iterator[None]:
        """Inside, the calling task's requests generate with `frozen` (a snapshot's adapter).

        The task's own version (`for_request`) is left as it was, so a game's policy seat and
        the snapshot seat it plays against, whose turns share one task, each keep theirs.
        """
        token = self._frozen.set(frozen)
        try:
            yield
        finally:
            self._frozen.reset(token)

    def for_request(self) -> Adapter | None:
        """The adapter the calling episode generates with (call it from the episode's task).

        The newest one at the episode's first request; the newest again where that one was
        evicted since. None before the first push: the engine's own weights. Inside `pinned`:
        the frozen adapter.
        """
        frozen = self._frozen.get(None)
        if frozen is not None:
            return frozen
        pinned = self._pinned.get(None)
        with self._lock:
            if not self._loaded:
                return None
            adapter = next((a for a in self._loaded if a.lora_id == pinned), self._loaded[-1])
        self._pinned.set(adapter.lora_id)
        return adapter
