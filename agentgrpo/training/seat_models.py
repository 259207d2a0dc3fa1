"""Seats another model plays (``seat_players={"o": "model:PATH"}``): a fixed opponent from a folder.

A seat that `environments.seats.OtherModel` plays samples its turns from a model saved in a
folder (a checkpoint, an earlier run's model, a run's warm start; a PEFT adapter folder loads
its base model with the adapter on it). The model is loaded once, frozen (eval mode, no
gradients), on the policy's device in the policy's dtype, and generates through a
transformers backend of its own, which the match engine is handed as the seat's
``seat_backends`` entry, as a snapshot's is. It is never trained and its side of the game gives
no episode. Seats naming one folder share one model and backend.

The seat's conversation is rendered with the run's tokenizer and chat template, so the model
must share the policy's vocabulary: `check_vocabulary` compares the folder's saved tokenizer
with the run's (or, where the folder saved none, its embedding rows with the policy's) and
refuses a model whose tokens differ. vLLM and sharded weights (DeepSpeed ZeRO-3, FSDP) cannot
hold such a model here, and are refused by `SeatModels.of`. `agentgrpo eval` loads the seat's
model as it loads the model it evaluates (`model_seat_backends`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgrpo.generation.evaluation import evaluation_backend
from agentgrpo.generation.local import transformers_backend
from agentgrpo.models.attention import use_grouped_query_sdpa
from agentgrpo.placement import Placement
from environments.seats import OtherModel, Snapshot, is_seated, seat_players
from rollout import GenerationBackend, TransformersBackend

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig

#: Files any of which marks a folder that saved a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_seats(environment: Any, players: Mapping[str, Any] | None) -> dict[str, str]:
    """Each seat another model plays (``"model:PATH"``): seat to folder; {} for none.

    Raises:
        ValueError: As `environments.seats.seat_players`.
    """
    if not (isinstance(environment, type) and is_seated(environment)):
        return {}
    chosen = seat_players(environment, players)
    return {seat: p.path for seat, p in chosen.items() if isinstance(p, OtherModel)}


@dataclass
class SeatModels:
    """The other models a run's ``"model:PATH"`` seats play, and their backends.

    Attributes:
        models: Each folder's model, loaded once (frozen, in eval mode).
        backends: Each such seat's backend (seats naming one folder share it).
        folders: Each such seat's folder.
    """

    models: dict[str, torch.nn.Module] = field(default_factory=dict)
    backends: dict[str, TransformersBackend] = field(default_factory=dict)
    folders: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        args: GRPOConfig,
        placement: Placement,
        environment: Any,
        policy: torch.nn.Module,
        tokenizer: Any,
    ) -> SeatModels:
        """The models `args.seat_players` names, loaded beside `policy` (none: empty).

        Args:
            args: The run's config (its `seat_players`, sampling and precision).
            placement: Its launch.
            environment: The run's environment factory.
            policy: The policy (unwrapped): its device, dtype and vocabulary.
            tokenizer: The policy's tokenizer, which the seats render and decode with.

        Raises:
            ValueError: A model seat with vLLM generating or over sharded weights, a folder
                that does not load, or a model whose vocabulary is not the policy's.
        """
        chosen = model_seats(environment, args.seat_players)
        if not chosen:
            return cls()
        asked = {seat: args.seat_players[seat] for seat in chosen}  # type: ignore[index]
        if args.use_vllm:
            raise ValueError(
                f"seat_players {asked}: another model plays these seats through a transformers "
                "backend of its own, which vLLM cannot hold beside the policy yet; generate "
                "with transformers (use_vllm=False), or give the seat 'random' or a scripted "
                "player"
            )
        if placement.shards_weights:
            raise ValueError(
                f"seat_players {asked}: another model plays these seats whole on each process, "
                "and DeepSpeed ZeRO-3 or FSDP shards the weights; launch with DeepSpeed ZeRO-2 "
                "or without sharding, or give the seat 'random' or a scripted player"
            )
        folders = dict.fromkeys(chosen.values())  # each loaded once
        models = {path: load_seat_model(path, policy, tokenizer) for path in folders}
        backends = {path: transformers_backend(m, tokenizer, args) for path, m in models.items()}
        return cls(models, {seat: backends[path] for seat, path in chosen.items()}, chosen)

    def producer_backends(self, tokenizer: Any, args: GRPOConfig) -> dict[str, TransformersBackend]:
        """Each seat's backend for `async_grpo`'s producer: new ones over the same models.

        The producer plays on its own thread while the learner's rounds (evaluation) play on
        `backends`; a backend's caches serve one loop, while the frozen model's forward passes
        (no gradients, weights never written) are safe from both threads.
        """
        own = {path: transformers_backend(m, tokenizer, args) for path, m in self.models.items()}
        return {seat: own[path] for seat, path in self.folders.items()}

    def release_memory(self) -> None:
        """Free what each backend holds for generating (as the policy's, after each round)."""
        for backend in {id(b): b for b in self.backends.values()}.values():
            backend.release_memory()


def load_seat_model(path: str, policy: torch.nn.Module, tokenizer: Any) -> torch.nn.Module:
    """The model saved in `path`, frozen, on `policy`'s device in its dtype, vocabulary checked.

    Raises:
        ValueError: The folder does not load as a causal language model, or its vocabulary is
            not the policy's (`check_vocabulary`).
    """
    parameter = next(policy.parameters())
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=parameter.dtype)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"seat_players 'model:{path}' does not load as a causal language model: {error}; "
            "name a folder saved with save_pretrained (a model, or a PEFT adapter whose base "
            "model is on this machine)"
        ) from error
    model = model.to(parameter.device).eval().requires_grad_(False)
    use_grouped_query_sdpa(model)
    check_vocabulary(path, model, tokenizer, _embedding_rows(policy))
    return model


def check_vocabulary(
    path: str, model: torch.nn.Module, tokenizer: Any, policy_rows: int | None
) -> None:
    """Refuse a model in `path` whose tokens are not those of the run's `tokenizer`.

    The folder's saved tokenizer must have the run's vocabulary (every token and id) and its
    bos and eos tokens; where the folder saved none, the model's embedding rows must be the
    policy's `policy_rows` (None: not known, not compared). The model must have a row for
    every token of the tokenizer either way.

    Raises:
        ValueError: Which of these differs, and what to play instead.
    """
    rows = _embedding_rows(model)
    folder = Path(path)
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        saved = AutoTokenizer.from_pretrained(path)
        why = _tokenizer_difference(saved, tokenizer)
    elif policy_rows is not None and rows != policy_rows:
        why = f"it saved no tokenizer and embeds {rows} tokens, the policy {policy_rows}"
    else:
        why = None
    if why is None and rows < len(tokenizer):
        why = f"it embeds {rows} tokens, fewer than the run's tokenizer's {len(tokenizer)}"
    if why is not None:
        raise ValueError(
            f"seat_players 'model:{path}': its vocabulary is not the policy's ({why}); the "
            "seat renders and samples with the run's tokenizer and chat template, so play a "
            "model of the same tokenizer (a checkpoint of this model, its warm start, another "
            "fine-tune of its base), or give the seat 'random' or a scripted player"
        )


def _embedding_rows(model: Any) -> int:
    """How many tokens `model` embeds (its input embedding's rows)."""
    return int(model.get_input_embeddings().num_embeddings)


def _tokenizer_difference(saved: Any, tokenizer: Any) -> str | None:
    """How `saved` differs from `tokenizer` in tokens or bos/eos; None where it does not."""
    theirs, ours = saved.get_vocab(), tokenizer.get_vocab()
    if theirs != ours:
        changed = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda pair: pair[1])
        example = ", ".join(repr(token) for token, _ in changed[:3])
        return f"its tokenizer has {len(theirs)} tokens, the run's {len(ours)}; e.g. {example}"
    for name in ("bos_token", "eos_token"):
        if getattr(saved, name) != getattr(tokenizer, name):
            return f"its {name} is {getattr(saved, name)!r}, the run's {getattr(tokenizer, name)!r}"
    return None


def model_seat_backends(
    config: GRPOConfig,
    environment: Any,
    backend: GenerationBackend,
    tokenizer: Any,
    device: torch.device | None,
    seed: int | None,
    given: Mapping[str, GenerationBackend | Sequence[GenerationBackend]] | None = None,
) -> Mapping[str, GenerationBackend | Sequence[GenerationBackend]] | None:
    """`agentgrpo eval`'s ``seat_backends``: `given`, with each other model's seat added.

    Each ``"model:PATH"`` seat gets the model in PATH, loaded as the evaluated one is
    (`generation.evaluation.evaluation_backend`: same device and precision, same seed). The
    other seats keep `given`'s backends (e.g. adapter seats'); where `given` is None, the
    evaluated model (`backend`) plays the snapshot seats (it is its own snapshot).

    Returns:
        `given` as it is where no other model plays a seat (None: `rounds.wiring` then gives
        the snapshot seats `backend`).

    Raises:
        ValueError: Another model with no device to load it on (`--server-url`), or one whose
            vocabulary is not the evaluated model's tokenizer's.
    """
    chosen = model_seats(environment, config.seat_players)
    if not chosen:
        return given
    if device is None:
        raise ValueError(
            f"--seat-players plays {chosen} (seat: folder) with other models, loaded here, and "
            "with --server-url nothing loads here; evaluate without --server-url (on --device)"
        )
    evaluated = getattr(backend, "model", None)  # None: not loaded here (a scripted backend)
    rows = _embedding_rows(evaluated) if evaluated is not None else None
    loaded: dict[str, GenerationBackend] = {}
    for path in chosen.values():
        if path not in loaded:
            seat_backend, _ = evaluation_backend(path, tokenizer, device, seed=seed)
            assert isinstance(seat_backend, TransformersBackend)  # loaded here, on `device`
            check_vocabulary(path, seat_backend.model, tokenizer, rows)
            loaded[path] = seat_backend
    if given is None:
        players = seat_players(environment, config.seat_players)
        given = {s: backend for s, p in players.items() if type(p) is Snapshot}
    return {**given, **{seat: loaded[path] for seat, path in chosen.items()}}
