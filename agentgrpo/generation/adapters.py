"""Adapter-only LoRA pushes to vLLM (`vllm_lora_push`): the adapter travels, not the merged model.

A PEFT LoRA policy trains only its `lora_A`/`lora_B` matrices; the base weights never change.
So vLLM keeps the base weights it started with, and each push writes the adapter alone (those
tensors in `adapter_model.safetensors`, its `adapter_config.json`) and loads it as a new vLLM
LoRA version (`rollout.backends.lora_versions`): colocated, into the in-process engine
(`enable_lora`); on a server, through `/v1/load_lora_adapter` (`agentgrpo vllm-serve
--enable-lora`). An asynchronous run keeps `max_staleness + 1` versions loaded, so its episodes
finish on the version they started with and a push pauses nothing.

`adapter_pushes` decides, once per run: `"merged"` always merges; `"adapter"` refuses a policy
without PEFT; `"auto"` (the default) and `"adapter"` push the adapter where vLLM can serve it
(`unservable`), else merged weights with a warning that names why.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rollout import Completion, GenerationBackend, Pictures, SamplingParams
from rollout.backends.lora_versions import Adapter, AdapterVersions

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig

# Why a vision-language policy is pushed merged: vLLM loads LoRA on the language model, and
# target modules such as `q_proj` match the vision tower's layers too.
VISION_REASON = "the policy reads images (vLLM serves LoRA on the language model only)"

# vLLM 0.32's allowed `max_lora_rank` values (`vllm.config.lora.MaxLoRARanks`).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoraLimits:
    """What a vLLM engine takes as adapters: the largest rank, and adapters in one batch."""

    max_lora_rank: int
    max_loras: int


def is_peft(policy: Any) -> bool:
    """Whether `policy` is a PEFT model (it has adapters to merge)."""
    return hasattr(policy, "peft_config") and hasattr(policy, "merge_adapter")


def lora_rank(policy: Any) -> int:
    """The largest LoRA rank of `policy`'s active adapter (`r`, or a `rank_pattern` value)."""
    config = policy.peft_config[policy.active_adapter]
    return max([config.r, *(config.rank_pattern or {}).values()])


def colocate_limits(policy: Any, adapters: int = 1) -> LoraLimits:
    """The LoRA limits a colocated engine is started with.

    The smallest rank vLLM allows that holds the adapter's (512, the largest, where none
    does: `unservable` then says so), and `adapters` in one batch: the policy's, and one per
    snapshot a game's seats play (`FrozenAdapter`).
    """
    rank = lora_rank(policy)
    ranks = next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])
    return LoraLimits(ranks, adapters)


def unservable(policy: Any, limits: LoraLimits | None) -> str | None:
    """Why vLLM cannot serve `policy`'s adapter as a LoRA, in words; None when it can.

    Args:
        policy: A PEFT model.
        limits: The engine's LoRA limits; None: it runs without LoRA (`--enable-lora`).
    """
    if limits is None:
        return (
            "the vLLM server runs without LoRA: start it with `agentgrpo vllm-serve --enable-lora`"
        )
    if len(policy.peft_config) != 1:
        return f"the policy holds {len(policy.peft_config)} adapters; vLLM serves one at a time"
    config = policy.peft_config[policy.active_adapter]
    reasons = {
        f"peft_type={config.peft_type} (vLLM serves LoRA only)": getattr(
            config.peft_type, "value", config.peft_type
        )
        != "LORA",
        "use_dora=True (vLLM has no DoRA)": getattr(config, "use_dora", False),
        f"modules_to_save={config.modules_to_save} (whole modules are trained, not low-rank)": bool(
            config.modules_to_save
        ),
        "trainable_token_indices is set (vLLM has no trainable tokens)": bool(
            getattr(config, "trainable_token_indices", None)
        ),
        "a LoRA bias (vLLM has none)": config.bias != "none" or getattr(config, "lora_bias", False),
        "target_parameters is set (vLLM loads LoRA on modules only)": bool(
            getattr(config, "target_parameters", None)
        ),
        f"rank {lora_rank(policy)} is over the engine's max_lora_rank {limits.max_lora_rank}": (
            lora_rank(policy) > limits.max_lora_rank
        ),
    }
    reason = next((why for why, applies in reasons.items() if applies), None)
    if reason is None:
        odd = _unsupported_targets(policy)
        reason = f"LoRA on {', '.join(odd)}: vLLM takes LoRA on linear layers only" if odd else None
    return reason


def _unsupported_targets(policy: Any) -> list[str]:
    """Names of the LoRA-wrapped modules vLLM cannot serve: not linear, or the output head."""
    return sorted(
        name.removeprefix("base_model.model.")
        for name, module in policy.named_modules()
        if hasattr(module, "lora_A") and hasattr(module, "get_base_layer")
        if not isinstance(module.get_base_layer(), torch.nn.Linear) or name.endswith("lm_head")
    )


def adapter_pushes(
    args: GRPOConfig, policy: Any, why_not: Callable[[], str | None], mode: str
) -> bool:
    """Whether this run pushes the adapter alone to vLLM (`vllm_lora_push`), decided once.

    Args:
        args: The run's config.
        policy: The policy, unwrapped.
        why_not: Why the engine cannot serve the policy's adapter, or None (`unservable`);
            called only for a PEFT policy that may push its adapter.
        mode: Where vLLM runs, for the messages ("colocate", "server").

    Raises:
        ValueError: `vllm_lora_push="adapter"` with a policy without PEFT.
    """
    push = args.vllm_lora_push
    if not is_peft(policy):
        if push == "adapter":
            raise ValueError(
                "vllm_lora_push='adapter' pushes a PEFT LoRA adapter, and this policy has none: "
                "pass peft_config=LoraConfig(...) to GRPOTrainer, or set vllm_lora_push='auto' "
                "(merged weights for a full model)."
            )
        return False
    if push == "merged":
        return False
    reason = why_not()
    if reason is None and args.vllm_enable_sleep_mode:
        reason = "vllm_enable_sleep_mode discards the engine's weights every round"
    if reason is None:
        return True
    warnings.warn(
        f"vllm_lora_push={push!r}: pushing merged weights to vLLM ({mode}) every step instead "
        f"of the adapter, because {reason}.",
        stacklevel=3,
    )
    return False


def save_adapter(policy: Any, folder: Path) -> int:
    """Write `policy`'s active adapter as vLLM loads it; return the bytes written.

    `adapter_model.safetensors` holds only the `lora_A`/`lora_B` tensors (PEFT's
    `get_peft_model_state_dict`, under PEFT's names) and `adapter_config.json` their config.
    Sharded weights must be whole (`whole_parameters`).
    """
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(policy, adapter_name=policy.active_adapter)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, folder / FILE)
    policy.peft_config[policy.active_adapter].save_pretrained(str(folder))
    return sum(path.stat().st_size for path in folder.iterdir())


FILE = "adapter_model.safetensors"


class LoadsAdapters(Protocol):
    """A vLLM backend that loads adapter versions (colocated or a server)."""

    adapters: AdapterVersions | None

    def load_adapter(self, adapter: Adapter, frozen: bool = False) -> list[Adapter]:
        """Load `adapter`; return the versions evicted past the kept ones (frozen: none)."""
        ...

    def unload_adapter(self, adapter: Adapter) -> None:
        """Unload `adapter`."""
        ...


class AdapterPush:
    """Writes the policy's adapter as a new version and has the backend load it.

    Each version gets a folder of its own in a temporary folder; an evicted version's folder is
    deleted one push later (a server may still read it for a request in flight).

    Args:
        backend: The vLLM backend.
        keep: Versions kept loaded (`max_staleness + 1` under `async_grpo`, else 1).
    """

    def __init__(self, backend: LoadsAdapters, keep: int):
        self.backend = backend
        backend.adapters = self.versions = AdapterVersions(keep)
        self.folder = tempfile.TemporaryDirectory(prefix="agentgrpo-lora-")
        self.pushed_bytes = 0  # of the latest push
        self._evicted: list[Adapter] = []

    def push(self, policy: torch.nn.Module, version: int) -> None:
        """Write `policy`'s adapter and load it as `version`.

        Sharded weights must be gathered whole first (`whole_parameters`).
        """
        adapter = self.versions.next_adapter(version, self.folder.name)
        self.pushed_bytes = save_adapter(policy, Path(adapter.path))
        for old in self._evicted:
            shutil.rmtree(old.path, ignore_errors=True)
        self._evicted = self.backend.load_adapter(adapter)


class FrozenAdapter:
    """A frozen snapshot of a LoRA policy on vLLM: its adapter, loaded beside the policy's.

    A snapshot seat's pool (`agentgrpo.training.seat_snapshots`) makes these in place of
    copies of the model when vLLM generates: the engine holds the base weights once, and each
    snapshot is one more LoRA adapter in it, which pushes never evict. `backend` generates with
    it (`PinnedAdapter`). `load` replaces it with the policy's adapter of a later step and
    unloads the old one, so it runs between rounds, when no request uses it.

    Args:
        pushes: The run's adapter pushes (its engine, versions and folder).
        policy: The PEFT policy whose active adapter is taken now.
        version: The optimizer step of that adapter.
    """

    def __init__(self, pushes: AdapterPush, policy: torch.nn.Module, version: int = 0):
        self.pushes = pushes
        self.adapter: Adapter | None = None
        self.backend = PinnedAdapter(pushes.backend, pushes.versions, self)
        self.load(policy, version)

    def load(self, policy: torch.nn.Module, version: int) -> None:
        """Take `policy`'s adapter (of step `version`) in place of the one held."""
        adapter = self.pushes.versions.next_adapter(version, self.pushes.folder.name)
        save_adapter(policy, Path(adapter.path))
        self.pushes.backend.load_adapter(adapter, frozen=True)
        old, self.adapter = self.adapter, adapter
        if old is not None:
            self.pushes.backend.unload_adapter(old)
            shutil.rmtree(old.path, ignore_errors=True)


class PinnedAdapter:
    """A `GenerationBackend`: `backend`'s requests, each made with `frozen`'s adapter.

    The engine's prefix cache is keyed by adapter and its memory is the policy's backend's, so
    `reset_prefix_cache` and `release_memory` (what a snapshot pool calls) have nothing to do.
    """

    def __init__(self, backend: Any, versions: AdapterVersions, frozen: FrozenAdapter):
        self.backend: GenerationBackend = backend
        self.versions = versions
        self.frozen = frozen
        self.context_limit = backend.context_limit
        self.stop_token_ids = backend.stop_token_ids

    @property
    def reads_images(self) -> bool:
        """`backend`'s."""
        return self.backend.reads_images

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, pictures: Pictures | None = None
    ) -> Completion:
        """`backend.generate`, with the frozen adapter."""
        assert self.frozen.adapter is not None  # loaded when it was made
        with self.versions.pinned(self.frozen.adapter):
            return await self.backend.generate(prompt_ids, params, pictures)

    def reset_prefix_cache(self) -> None:
        """Nothing: vLLM keys cached blocks by the adapter that computed them."""

    def release_memory(self) -> None:
        """Nothing: the engine's memory is released with the policy's backend."""
