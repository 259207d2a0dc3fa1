"""How the policy's new weights reach a vLLM engine: colocated, or a server's workers.

- vLLM colocate (`ColocatedPush`): the engine runs in this process and reloads from the
  policy's tensors in place; its settings are TRL's (`colocate_engine_args`). With
  `vllm_enable_sleep_mode` it sleeps between rounds as TRL's does: weights and KV cache
  discarded, weights pushed on waking.
- vLLM server (`ServedWeights`): the trainer broadcasts the tensors to the server's workers
  (`ServerPush`: NCCL between GPUs, gloo on CPU; `rollout.backends.weight_transport`), which
  load them through agentgrpo's worker extension (`agentgrpo vllm-serve` installs it); then the
  server's prefix cache is reset. Under `async_grpo` a push pauses the server, which cuts the
  turns in flight short, and resumes it; the cut turns are continued with the new weights
  (`VLLMServerBackend.between_steps`), so a turn can hold two versions.

Sharded weights (DeepSpeed ZeRO-3, FSDP2) are gathered for a vLLM push and let go right after
it: the policy does not generate, so nothing holds them whole while vLLM does. A server push
gathers one tensor at a time, as it sends them.
PEFT models are pushed merged (base weights + adapter), under the base model's names, or as
the adapter alone (`generation.adapters`, `vllm_lora_push`): then vLLM holds the base weights
(`base_weights`) and loads each step's adapter as a LoRA version.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio
import torch

from agentgrpo.generation.adapters import AdapterPush, LoraLimits
from agentgrpo.generation.sampling import sampling_overrides
from agentgrpo.models.sharded import (
    fsdp_sharded,
    named_tensors,
    whole_one_at_a_time,
    whole_parameters,
    whole_specs,
)
from agentgrpo.precision import mixed_precision_dtype
from rollout.backends.vllm_colocate import VLLMColocateBackend, sleep_mode_available
from rollout.backends.vllm_server import ServerConnection, ServerRequestError, VLLMServerBackend
from rollout.backends.weight_transport import WeightGroup, backend_for, new_secret, tensor_specs

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig


@contextlib.contextmanager
def policy_weights(model: Any) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The policy's `(checkpoint name, tensor)` pairs, as vLLM loads them.

    A PEFT model is merged for the duration of the context (and unmerged after): the pairs
    are the merged base weights under the base model's names, without the adapter's own.
    """
    if not hasattr(model, "merge_adapter"):
        yield _named_tensors(model)
        return
    model.merge_adapter()
    try:
        yield [
            (_base_name(name), tensor)
            for name, tensor in _named_tensors(model)
            if "lora_" not in name and "original_module" not in name
        ]
    finally:
        model.unmerge_adapter()


def base_weights(model: Any) -> list[tuple[str, torch.Tensor]]:
    """A PEFT model's base weights as vLLM loads them, without merging its adapter.

    What an engine that takes the adapter as a LoRA holds (LoRA training leaves them as
    they are).
    """
    return [
        (_base_name(name), tensor)
        for name, tensor in _named_tensors(model)
        if "lora_" not in name and "original_module" not in name
    ]


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`model.state_dict()`'s names and tensors, as the modules hold them now.

    Under FSDP2 `state_dict()` gives each process's shards, also inside `fsdp2_unsharded`,
    where the modules hold the whole tensors: those are read from the modules instead.
    """
    if not fsdp_sharded(model):
        return list(model.state_dict().items())
    return [(name, tensor.detach()) for name, tensor in named_tensors(model)]


def _base_name(peft_name: str) -> str:
    """`base_model.model.x.q_proj.base_layer.weight` -> `x.q_proj.weight`."""
    name = peft_name.removeprefix("base_model.model.").replace(".base_layer", "")
    return name.replace("modules_to_save.default.", "")


class ColocatedPush:
    """Reload the in-process vLLM engine from the policy whenever the step changed.

    It takes new weights between rounds only: nothing pauses it mid-round, so it plays no
    rounds beside the learner (GRPOConfig refuses `async_grpo` with it).

    Args:
        backend: The colocated engine.
        sleeps: Put the engine to sleep after each round (`vllm_enable_sleep_mode`), freeing
            its accelerator memory for the optimizer step; it wakes before the next round.
        adapters: Push the adapter alone (the engine holds the base weights); None: merged.

    """

    def __init__(
        self, backend: VLLMColocateBackend, sleeps: bool, adapters: AdapterPush | None = None
    ):
        self.backend = backend
        self.sleeps = sleeps
        self.adapters = adapters
        self.version = -1  # the start-up's weights: the policy's, of no step yet

    @contextlib.contextmanager
    def generating(self, policy: torch.nn.Module, step: int) -> Iterator[None]:
        """Wake the engine, push if `step` is new, generate, and sleep again if configured.

        As TRL: the weights wake first and are always pushed (sleep discarded them), then the
        KV cache wakes.
        """
        if "weights" in self.backend.asleep:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # what the optimizer step freed, for vLLM to map
            self.backend.wake_up(["weights"])
            self.version = -1
        if step != self.version:
            self.load(policy, step)
        if self.backend.sleeping:
            self.backend.wake_up(["kv_cache"])
        try:
            yield
        finally:
            if self.sleeps:
                self.backend.sleep()

    def load(self, policy: torch.nn.Module, version: int) -> None:
        """Load `policy`'s weights (gathered whole where sharded) into the awake engine."""
        if self.adapters is not None:
            with whole_parameters(policy):
                self.adapters.push(policy, version)
        else:
            with whole_parameters(policy), policy_weights(policy) as weights:
                self.backend.load_weights(weights)
        self.version = version


class ServedWeights:
    """A vLLM server's weights (`agentgrpo vllm-serve`), broadcast to it from the trainer.

    Between rounds (`generating`, `load`), only the main process sends (every process holds
    the same weights, whole or gathered for the push) and the others wait for it, so no process
    generates from stale weights. Beside the learner (`push`, `async_grpo`), new requests are
    held back and the server paused for the push (`VLLMServerBackend.between_steps`).

    With `adapters` the adapter alone is pushed (`generation.adapters`), and nothing pauses:
    the base weights go once, at the first push, and each push loads a new LoRA version beside
    the kept ones, so running episodes finish on theirs.

    Args:
        backend: The server's backend.
        transport: Sends the tensors (it holds the broadcast group).
        accelerator: The trainer's accelerator (main process, barrier).
        adapters: Push the adapter alone; None: merged weights.
    """

    def __init__(
        self,
        backend: VLLMServerBackend,
        transport: ServerPush,
        accelerator: Any,
        adapters: AdapterPush | None = None,
    ):
        self.backend, self.transport, self.accelerator = backend, transport, accelerator
        self.adapters = adapters
        self._base_sent = False
        self.version = -1  # the served model's own weights, until the first push
        self.paused_s = 0.0  # new requests held back for pushes since the last `take_paused_s`

    @contextlib.contextmanager
    def generating(self, policy: torch.nn.Module, step: int) -> Iterator[None]:
        """Push if `step` is new (every process takes part), then generate.

        Only the main process sends; every process takes part in gathering sharded weights,
        one tensor at a time (`whole_one_at_a_time`), so the push adds at most one whole tensor
        to what each process holds. A PEFT model is gathered whole (`whole_parameters`):
        merging its adapter needs every weight at once.
        """
        if step != self.version:
            device, sends = next(policy.parameters()).device, self.accelerator.is_main_process
            if self.adapters is not None:
                with whole_parameters(policy):
                    if sends:
                        self._send(policy, step)
            elif hasattr(policy, "merge_adapter"):
                with whole_parameters(policy):
                    if sends:
                        with policy_weights(policy) as weights:
                            self.transport.push(weights, device)
            else:
                named = named_tensors(policy)
                streamed = whole_one_at_a_time(named)
                if sends:
                    self.transport.push(streamed, device, whole_specs(named))
                else:
                    collections.deque(streamed, maxlen=0)  # each gather is a collective
            self.accelerator.wait_for_everyone()
            self.version = step
        yield

    async def push(self, policy: torch.nn.Module, version: int) -> None:
        """Pause the server (cutting the turns in flight), broadcast `policy`'s weights, resume.

        `take_paused_s` counts the whole time new requests were held back.
        """
        if self.adapters is not None and self._base_sent:  # nothing to pause for
            await anyio.to_thread.run_sync(self._send, policy, version)
            return
        started = time.perf_counter()
        await self.backend.between_steps(lambda: self._send(policy, version), version)
        self.paused_s += time.perf_counter() - started

    def load(self, policy: torch.nn.Module, version: int) -> None:
        """Broadcast `policy`'s weights (one process; nothing generates)."""
        self._send(policy, version)
        self.backend.set_weights_version(version)

    def _send(self, policy: torch.nn.Module, version: int) -> None:
        device = next(policy.parameters()).device
        if self.adapters is None:
            with policy_weights(policy) as weights:
                self.transport.push(weights, device)
        else:
            if not self._base_sent:  # the served model may not be the policy's base
                self.transport.push(base_weights(policy), device)
                self._base_sent = True
            self.adapters.push(policy, version)
        self.version = version

    def take_paused_s(self) -> float:
        """Seconds new requests waited for pushes since the last call."""
        paused, self.paused_s = self.paused_s, 0.0
        return paused


class ServerPush:
    """Sends tensors to the workers of an `agentgrpo vllm-serve` server.

    Args:
        connection: The server.
        group_port: Port of the broadcast group's store, on the server (`vllm_group_port`).

    """

    def __init__(self, connection: ServerConnection, group_port: int):
        self.connection = connection
        self.group_port = group_port
        self._group: WeightGroup | None = None

    def push(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        specs: list[list] | None = None,
    ) -> None:
        """Send `weights` to every server worker, then reset the server's caches.

        `specs` (`tensor_specs`: what the workers allocate) are read from `weights` when not
        given; give them when `weights` is an iterator that makes each tensor as it is sent.
        Its prefix cache holds KV and its encoder cache image features, both computed with the
        old weights (and without the encoder cache reset, vLLM 0.32's engine died with "Encoder
        cache miss" on the next request with a picture it had seen before the push).
        """
        if specs is None:
            weights = list(weights)
            specs = tensor_specs(weights)
        group = self._group or self._join(device)
        self._while_server_runs("agentgrpo_receive", json.dumps(specs), lambda: group.send(weights))
        self.connection.post("/reset_prefix_cache")
        self.connection.post("/reset_encoder_cache")

    def lora_limits(self) -> LoraLimits | None:
        """The server's LoRA limits (None: started without `--enable-lora`)."""
        [limits, *_] = self._rpc("agentgrpo_lora_limits")
        return None if limits in (None, "null") else LoraLimits(**json.loads(limits))

    def _join(self, device: torch.device) -> WeightGroup:
        """Form the broadcast group with the server's workers (first push only)."""
        workers = len(self._rpc("agentgrpo_ready"))
        world_size = workers + 1
        secret = new_secret()
        options = json.dumps(
            {
                "port": self.group_port,
                "secret": secret,
                "world_size": world_size,
                "timeout_s": self._timeout_s,
                "backend": backend_for(device),
            }
        )
        host = urlsplit(self.connection.base_url).hostname
        if host is None:
            raise ValueError(f"the vLLM server URL {self.connection.base_url} names no host")
        self._group = self._while_server_runs(
            "agentgrpo_join",
            options,
            lambda: WeightGroup(
                host, self.group_port, workers, world_size, device, self._timeout_s, secret
            ),
        )
        return self._group

    def _while_server_runs(self, method: str, argument: str, trainer_side: Any) -> Any:
        """Call `method` on the workers and run the trainer's side of it at the same time.

        An error of the trainer's side is raised at once: the workers' call, which waits for
        the tensors that will not come, is left to its daemon thread (it ends with the
        server's timeout, or with the process). Then the workers' error, if they had one.
        """
        server_side = _Call(self._rpc, method, argument)
        result = trainer_side()
        server_side.result()
        return result

    def _rpc(self, method: str, *args: str) -> list[Any]:
        try:
            reply = self.connection.post("/collective_rpc", {"method": method, "args": list(args)})
        except ServerRequestError as error:
            raise RuntimeError(
                f"the server at {self.connection.base_url} cannot take agentgrpo's weight "
                "pushes: start it with `agentgrpo vllm-serve` (it enables /collective_rpc and "
                f"loads agentgrpo's worker extension). The server said: {error}"
            ) from None
        return reply["results"] if reply else []

    @property
    def _timeout_s(self) -> float:
        return self.connection.timeout_s


class _Call:
    """`function(*args)` run in a daemon thread: one the process need not wait for at exit."""

    def __init__(self, function: Any, *args: Any):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(function, args), daemon=True)
        self._thread.start()

    def _run(self, function: Any, args: tuple) -> None:
        try:
            self._value = function(*args)
        except BaseException as error:  # raised in the caller's thread by `result`
            self._error = error

    def result(self) -> Any:
        """Wait for the call to end; its value, or its error raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def colocated_vllm(
    model: Any,
    tokenizer: Any,
    args: GRPOConfig,
    stop: set[int],
    sleeps: bool,
    lora: LoraLimits | None = None,
) -> VLLMColocateBackend:
    """Start vLLM in this process on the policy's config, with the policy's weights.

    `tokenizer`: the policy's, or a vision-language model's processor. `lora`: the engine
    takes adapters within these limits, and starts with the base weights (unmerged); None:
    with the policy's weights, merged. Its CPU cache holds one adapter more than a batch, the
    version a push loads before the one it replaces is unloaded.
    """
    engine_args = colocate_engine_args(args, model.dtype, model.device, sleeps)
    if lora is not None:
        engine_args |= dict(
            enable_lora=True,
            max_lora_rank=lora.max_lora_rank,
            max_loras=lora.max_loras,
            max_cpu_loras=lora.max_loras + 1,
        )
    merged = policy_weights(model) if lora is None else contextlib.nullcontext(base_weights(model))
    with merged as weights:
        return VLLMColocateBackend.start(
            model.config,
            tokenizer,
            weights,
            stop_token_ids=stop,
            sampling_overrides=sampling_overrides(args),
            regex=args.vllm_structured_outputs_regex,
            **engine_args,
        )


# TRL's: vLLM v1's memory profiler is misled by its default (32768 tokens a step).
COLOCATE_BATCHED_TOKENS = 4096


def colocate_engine_args(
    args: GRPOConfig, weights_dtype: torch.dtype, device: torch.device, sleeps: bool
) -> dict[str, Any]:
    """The `vllm.LLM` arguments of colocate mode, as TRL 1.16 sets them.

    `gpu_memory_utilization`, `max_model_len`, `tensor_parallel_size` (always 1: GRPOConfig
    refuses more in colocate mode), `model_impl`, `enable_sleep_mode`, `trust_remote_code`,
    `max_num_seqs` (a round's episodes: `per_device_train_batch_size * steps_per_generation`,
    times the tensor-parallel size) and `max_num_batched_tokens`. The dtype is the run's
    mixed-precision one when there is one (generation in the dtype training computes in),
    else the weights'. On a CPU, `enforce_eager` (start-up in seconds rather than minutes).

    Args:
        args: The config.
        weights_dtype: The policy's parameter dtype.
        device: Where the policy is.
        sleeps: Whether the engine sleeps between rounds (`sleeps_between_rounds`).
    """
    dtype = mixed_precision_dtype(args) or weights_dtype
    tensor_parallel = args.vllm_tensor_parallel_size
    assert args.steps_per_generation is not None  # GRPOConfig resolves it
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "max_model_len": args.vllm_max_model_length,
        "gpu_memory_utilization": args.vllm_gpu_memory_utilization,
        "tensor_parallel_size": tensor_parallel,
        "max_num_seqs": args.per_device_train_batch_size
        * tensor_parallel
        * args.steps_per_generation,
        "max_num_batched_tokens": COLOCATE_BATCHED_TOKENS,
        "model_impl": args.vllm_model_impl,
        "enable_sleep_mode": sleeps,
        "enforce_eager": device.type == "cpu",
        "seed": args.seed,
        "trust_remote_code": args.trust_remote_code,
    }


def sleeps_between_rounds(args: GRPOConfig) -> bool:
    """`vllm_enable_sleep_mode`, where vLLM supports sleeping (a warning where it does not)."""
    if args.vllm_enable_sleep_mode and not sleep_mode_available():
        warnings.warn(
            "vllm_enable_sleep_mode=True, but vLLM cannot sleep on this platform (CPU): the "
            "engine keeps its memory between rounds",
            stacklevel=3,
        )
        return False
    return args.vllm_enable_sleep_mode
