"""Generation outside a training run: the ids that end a turn, and the backend of `agentgrpo eval`.

Only the generation room builds backends (`rollout.backends`); the command line asks it here, so
that `agentgrpo eval` and `agentgrpo doctor --generate` play with what a run plays with, and the
doctor checks the template against the stop ids a run stops on.
"""

from __future__ import annotations

import contextlib
import functools
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from agentgrpo.devices import describe_run_device
from agentgrpo.models.loading import load_for_generation
from agentgrpo.precision import autocast_kwargs
from environments.seats import Snapshot, is_seated, seat_adapters, seat_players
from rollout import GenerationBackend, TransformersBackend
from rollout.backends.vllm_colocate import default_stop_token_ids
from rollout.backends.vllm_server import ServerConnection, VLLMServerBackend


def stop_token_ids_of(tokenizer: Any, generation_config: Any = None) -> set[int]:
    """The ids that end a model's turn: its tokenizer's eos and its generation config's eos ids.

    A run's vLLM backends stop on these (with the policy's `generation_config`), and the
    transformers backend on the same ids (`TransformersBackend.from_tokenizer`).

    Args:
        tokenizer: The model's tokenizer.
        generation_config: The model's `GenerationConfig` (a loaded model's, or read from its
            folder without the weights), or None for the tokenizer's eos alone.

    Raises:
        ValueError: There is no eos id at all: generation would never end a turn.
    """
    return default_stop_token_ids(tokenizer, generation_config)


def evaluation_backend(
    path: str,
    tokenizer: Any,
    device: torch.device | None,
    *,
    seed: int | None,
    server_url: str | None = None,
    server_timeout_s: float = 240.0,
    processor: Any = None,
) -> tuple[GenerationBackend, str]:
    """The backend that plays a model folder's episodes without training, and where it runs.

    Args:
        path: The model's folder.
        tokenizer: Its tokenizer.
        device: Where the model is loaded, as a training run on that device holds it
            (`models.load_for_generation`: float32 weights under the device's autocast); None
            with `server_url`.
        seed: The sampling seed of the model loaded here (a server seeds each request itself).
        server_url: A vLLM server that serves the model (`agentgrpo vllm-serve`): it generates
            and nothing loads here. Its turns end on the tokenizer's eos.
        server_timeout_s: How long to wait for the server to answer, each call included.
        processor: A vision-language model's processor: the server is then sent the rows'
            pictures.

    Returns:
        The backend, and where it generates, for a start-up line: `the server at URL`, or the
        device and its precision (`devices.describe_run_device`).
    """
    if server_url:
        connection = ServerConnection(server_url, server_timeout_s)
        server = VLLMServerBackend.connect(
            connection, stop_token_ids=stop_token_ids_of(tokenizer), processor=processor
        )
        return server, f"the server at {server_url}"
    assert device is not None, "a model loaded here needs a device"
    model, autocast = load_for_generation(path, device)
    backend = TransformersBackend.from_tokenizer(
        model, tokenizer, seed=seed, **autocast_kwargs(autocast)
    )
    return backend, describe_run_device(device, autocast)


def adapter_seat_backends(
    environment: Any, players: dict[str, Any] | None, backend: GenerationBackend, seed: int
) -> dict[str, GenerationBackend] | None:
    """The backends of the seats that the policy's `backend` does not play as the policy.

    For `agentgrpo eval` of a game whose `players` (`seat_players`) name ``"adapter:NAME"``
    seats: each such seat is played by adapter NAME of the loaded `PeftModel` (saved beside
    the policy's, as a run with adapter seats saves them; `models.load_for_generation`), through
    a backend of its own that shares `backend`'s step lock and activates NAME for its steps
    only, as a training run's `training.seat_policies` does; it samples from `seed` plus a
    checksum of NAME. Snapshot seats are played by `backend` (evaluation's snapshot is the
    policy itself).

    Returns:
        Seat to backend for the match engine's ``seat_backends``; None where no seat is an
        adapter's (`rounds.wiring.build_engine` then gives the snapshot seats `backend`).

    Raises:
        ValueError: Adapter seats with a server generating, a model that is not a PEFT adapter
            folder, or an adapter the folder does not hold.
    """
    seated = isinstance(environment, type) and is_seated(environment)
    adapters = seat_adapters(environment, players) if seated else {}
    if not adapters:
        return None
    if not isinstance(backend, TransformersBackend):
        raise ValueError(
            f"--seat-players plays seats by adapters {sorted(set(adapters.values()))}, which "
            "load with the model here: leave out --server-url"
        )
    model: Any = backend.model  # a PeftModel where it holds the adapters
    held = sorted(getattr(model, "peft_config", {}))
    if missing := sorted(set(adapters.values()) - set(held)):
        raise ValueError(
            f"--seat-players names adapters {missing}, which --model does not hold (its "
            f"adapters: {held or 'none, it is not a PEFT adapter folder'}); give the model "
            "folder of a run that trained them (`agentgrpo run ... --use-peft --seat-players`)"
        )
    own: dict[str, GenerationBackend] = {
        name: TransformersBackend(
            model,
            backend.stop_token_ids,
            backend.pad_token_id,
            seed=seed + zlib.crc32(name.encode()),
            autocast_dtype=backend.autocast_dtype,
            step_lock=backend.step_lock,
            step_context=functools.partial(_adapter_active, model, name, model.active_adapter),
        )
        for name in dict.fromkeys(adapters.values())
    }
    snapshots = [
        s for s, p in seat_players(environment, players).items() if isinstance(p, Snapshot)
    ]
    return {seat: backend for seat in snapshots} | {
        seat: own[name] for seat, name in adapters.items()
    }


@contextlib.contextmanager
def _adapter_active(model: Any, name: str, policy_adapter: str) -> Iterator[None]:
    """`model` with adapter `name` active, the policy's again after."""
    model.set_adapter(name)
    try:
        yield
    finally:
        model.set_adapter(policy_adapter)
