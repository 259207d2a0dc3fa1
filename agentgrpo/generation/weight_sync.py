"""Which backend generates, and how the policy's new weights reach it after each optimizer step.

`build_generator` reads the config once and returns the backend with its `WeightSync`. The
trainer wraps every generation round in `sync.generating(model, global_step)`, which pushes the
policy's weights when they changed since the last push (so after each optimizer step, and after
a warm start or a resume), and lets a colocated vLLM sleep between rounds.

- transformers: the backend reads the policy itself; nothing to push, but its prefix cache
  is emptied around every round. Under mixed precision it generates under the same autocast
  dtype as the trainer's forward passes.
- vLLM colocate: the engine runs in this process and reloads from the policy's tensors in place;
  its settings are TRL's (`colocate_engine_args`). With `vllm_enable_sleep_mode` it sleeps
  between rounds as TRL's does: weights and KV cache discarded, weights pushed on waking.
- vLLM server: the trainer broadcasts the tensors to the server's workers (NCCL between GPUs,
  gloo on CPU; `rollout.backends.weight_transport`), which load them through agentgrpo's worker
  extension (`agentgrpo vllm-serve` installs it); then the server's prefix cache is reset.

Sharded weights (DeepSpeed ZeRO-3, FSDP2) are gathered for a vLLM push and let go right after
it: the policy does not generate, so nothing holds them whole while vLLM does. A server push
gathers one tensor at a time, as it sends them.
PEFT models are pushed merged (base weights + adapter), under the base model's names.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import torch

from agentgrpo.learner.output_head import fsdp_sharded
from agentgrpo.models.sharded import (
    named_tensors,
    whole_one_at_a_time,
    whole_parameters,
    whole_specs,
)
from agentgrpo.precision import autocast_kwargs, mixed_precision_dtype
from rollout import GenerationBackend, TransformersBackend
from rollout.backends.vllm_colocate import (
    VLLMColocateBackend,
    default_stop_token_ids,
    sleep_mode_available,
)
from rollout.backends.vllm_server import (
    ServerConnection,
    ServerRequestError,
    VLLMServerBackend,
    server_url,
)
from rollout.backends.weight_transport import WeightGroup, backend_for, tensor_specs

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig


class WeightSync(Protocol):
    """Keeps a generation backend's weights equal to the policy's."""

    def generating(self, model: torch.nn.Module, step: int) -> contextlib.AbstractContextManager:
        """Context of one generation round with `model` at optimizer step `step`."""
        ...


def build_generator(
    model: Any, tokenizer: Any, args: GRPOConfig, accelerator: Any, processor: Any = None
) -> tuple[GenerationBackend, WeightSync]:
    """The backend `args` asks for (`use_vllm`, `vllm_mode`) and the sync that feeds it.

    `processor`: a vision-language model's; vLLM (colocated or a server) is then given the
    rows' images with their placeholders unexpanded (`rollout.images.unexpanded_ids`).
    """
    if not args.use_vllm:
        local = TransformersBackend.from_tokenizer(
            model,
            tokenizer,
            seed=args.seed,
            sampling_overrides=sampling_overrides(args),
            **autocast_kwargs(mixed_precision_dtype(args)),
        )
        return local, SharedWeights(local)
    stop = default_stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    if args.vllm_mode == "colocate":
        sleeps = _sleeps(args)
        colocated = _colocated_vllm(model, processor or tokenizer, args, stop, sleeps)
        if sleeps:  # as TRL: its memory is free until the first round
            colocated.sleep()
        return colocated, ColocatedPush(colocated, sleeps)
    connection = ServerConnection(
        server_url(args.vllm_server_base_url, args.vllm_server_host, args.vllm_server_port),
        args.vllm_server_timeout,
    )
    backend = VLLMServerBackend.connect(
        connection,
        stop_token_ids=stop,
        sampling_overrides=sampling_overrides(args),
        regex=args.vllm_structured_outputs_regex,
        max_concurrent_requests=args.max_concurrent_episodes,
        processor=processor,
    )
    return backend, ServerPush(connection, args.vllm_group_port, accelerator)


def sampling_overrides(args: GRPOConfig) -> dict[str, Any]:
    """Sampling fields beyond temperature, top-p and top-k, for either backend.

    `min_p` and `repetition_penalty` when set, then `generation_kwargs`, which win over
    everything else.
    """
    overrides: dict[str, Any] = {}
    if args.min_p is not None:
        overrides["min_p"] = args.min_p
    if args.repetition_penalty != 1.0:
        overrides["repetition_penalty"] = args.repetition_penalty
    generation_kwargs = args.generation_kwargs or {}
    assert isinstance(generation_kwargs, dict)  # GRPOConfig refuses any other kind
    return overrides | generation_kwargs


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


class SharedWeights:
    """The transformers backend generates with the policy's own tensors: nothing to push.

    Its prefix cache holds keys and values of the weights it was filled with, so every round
    starts with an empty one. Every round ends by freeing all the backend holds for generating
    (`release_memory`: the prefix cache, on a GPU the slot cache and the decoding step's CUDA
    graphs), so the learner has that memory; the next round allocates it and captures again.
    """

    def __init__(self, backend: TransformersBackend):
        self.backend = backend

    @contextlib.contextmanager
    def generating(self, model: torch.nn.Module, step: int) -> Iterator[None]:
        """Generate with the policy as it is."""
        self.backend.reset_prefix_cache()
        try:
            yield
        finally:
            self.backend.release_memory()


class ColocatedPush:
    """Reload the in-process vLLM engine from the policy whenever the step changed.

    Args:
        backend: The colocated engine.
        sleeps: Put the engine to sleep after each round (`vllm_enable_sleep_mode`), freeing
            its accelerator memory for the optimizer step; it wakes before the next round.

    """

    def __init__(self, backend: VLLMColocateBackend, sleeps: bool):
        self.backend = backend
        self.sleeps = sleeps
        self.pushed_step: int | None = None

    @contextlib.contextmanager
    def generating(self, model: torch.nn.Module, step: int) -> Iterator[None]:
        """Wake the engine, push if `step` is new, generate, and sleep again if configured.

        As TRL: the weights wake first and are always pushed (sleep discarded them), then the
        KV cache wakes.
        """
        if "weights" in self.backend.asleep:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # what the optimizer step freed, for vLLM to map
            self.backend.wake_up(["weights"])
            self.pushed_step = None
        if step != self.pushed_step:
            with whole_parameters(model), policy_weights(model) as weights:
                self.backend.load_weights(weights)
            self.pushed_step = step
        if self.backend.sleeping:
            self.backend.wake_up(["kv_cache"])
        try:
            yield
        finally:
            if self.sleeps:
                self.backend.sleep()


class ServerPush:
    """Broadcast the policy's weights to an `agentgrpo vllm-serve` server when the step changed.

    Only the main process pushes (every process holds the same weights, whole or gathered for
    the push); the others wait for it, so no process generates from stale weights.

    Args:
        connection: The server.
        group_port: Port of the broadcast group's store, on the server (`vllm_group_port`).
        accelerator: The trainer's accelerator (main process, barrier).

    """

    def __init__(self, connection: ServerConnection, group_port: int, accelerator: Any):
        self.connection = connection
        self.group_port = group_port
        self.accelerator = accelerator
        self.pushed_step: int | None = None
        self._group: WeightGroup | None = None

    @contextlib.contextmanager
    def generating(self, model: torch.nn.Module, step: int) -> Iterator[None]:
        """Push if `step` is new, then generate.

        Only the main process sends; every process takes part in gathering sharded weights,
        one tensor at a time (`whole_one_at_a_time`), so the push adds at most one whole tensor
        to what each process holds. A PEFT model is gathered whole (`whole_parameters`):
        merging its adapter needs every weight at once.
        """
        if step != self.pushed_step:
            device, sends = next(model.parameters()).device, self.accelerator.is_main_process
            if hasattr(model, "merge_adapter"):
                with whole_parameters(model):
                    if sends:
                        with policy_weights(model) as weights:
                            self.push(weights, device)
            else:
                named = named_tensors(model)
                streamed = whole_one_at_a_time(named)
                if sends:
                    self.push(streamed, device, whole_specs(named))
                else:
                    collections.deque(streamed, maxlen=0)  # each gather is a collective
            self.accelerator.wait_for_everyone()
            self.pushed_step = step
        yield

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

    def _join(self, device: torch.device) -> WeightGroup:
        """Form the broadcast group with the server's workers (first push only)."""
        workers = len(self._rpc("agentgrpo_ready"))
        world_size = workers + 1
        options = json.dumps(
            {
                "port": self.group_port,
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
                host, self.group_port, workers, world_size, device, self._timeout_s
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


def _colocated_vllm(
    model: Any, tokenizer: Any, args: GRPOConfig, stop: set[int], sleeps: bool
) -> VLLMColocateBackend:
    """Start vLLM in this process on the policy's config, with the policy's weights.

    `tokenizer`: the policy's, or a vision-language model's processor.
    """
    with policy_weights(model) as weights:
        return VLLMColocateBackend.start(
            model.config,
            tokenizer,
            weights,
            stop_token_ids=stop,
            sampling_overrides=sampling_overrides(args),
            regex=args.vllm_structured_outputs_regex,
            **colocate_engine_args(args, model.dtype, model.device, sleeps),
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
        sleeps: Whether the engine sleeps between rounds (`_sleeps`).
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


def _sleeps(args: GRPOConfig) -> bool:
    """`vllm_enable_sleep_mode`, where vLLM supports sleeping (a warning where it does not)."""
    if args.vllm_enable_sleep_mode and not sleep_mode_available():
        warnings.warn(
            "vllm_enable_sleep_mode=True, but vLLM cannot sleep on this platform (CPU): the "
            "engine keeps its memory between rounds",
            stacklevel=3,
        )
        return False
    return args.vllm_enable_sleep_mode
